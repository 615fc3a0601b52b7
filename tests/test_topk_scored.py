"""dsa::topk_scored and dsa::dcp_merge_topk (design §3, §11): every face against the loop
reference, bit for bit (the order is total: score descending, ties to the lower position;
with sorted=False the same set, compared in position order), and the merge of per-shard
selections against the selection over the unsharded row."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from faces import (
    FACE_NAMES,
    KERNEL_MARK,
    face_tests,
    i32,
    opcheck_test,
    run_op,
    validation_test,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import topk_rows

from dsa.ops.dcp import global_positions, local_share, owned_indices
from dsa.ops.topk import scored
from dsa.ops.topk.indices import SEARCHES, launch_topk
from tests import reference_compute as ref

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")
NAN, INF = float("nan"), float("inf")
KINDS = ("normal", "ties", "equal", "special")


def values(gen: torch.Generator, rows: int, n: int, kind: str) -> torch.Tensor:
    if kind == "ties":  # few distinct values: ties decide most slots
        return torch.randint(-2, 3, (rows, n), generator=gen).float()
    if kind == "equal":
        return torch.full((rows, n), 0.25)
    if kind == "special":  # -0 < +0, NaN at both ends, infinities
        pool = torch.tensor([0.0, -0.0, NAN, -NAN, INF, -INF, 1.0, -1.0])
        return pool[torch.randint(len(pool), (rows, n), generator=gen)]
    return torch.randn(rows, n, generator=gen)


def with_junk(gen: torch.Generator, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``x`` in a row-strided view of a wider buffer, NaN and +inf past each row's length."""
    rows, n = x.shape
    buffer = torch.tensor([NAN, INF, 3e38])[torch.randint(3, (rows, n + 5), generator=gen)]
    view = buffer[:, :n]
    valid = torch.arange(n) < lengths.reshape(rows, 1).long()
    view.copy_(torch.where(valid, x, view))
    return view


@st.composite
def scored_cases(draw, max_rows=4, max_cols=300, ks=(1, 5, 16, 64)):
    """(logits, lengths, k, sorted): lengths around 0, k and N, maybe shaped [B, 2]."""
    rows, n, k, gen, lengths = draw(topk_rows(max_rows, max_cols, ks))
    logits = with_junk(gen, values(gen, rows, n, draw(st.sampled_from(KINDS))), lengths)
    if rows % 2 == 0 and draw(st.booleans()):
        lengths = lengths.view(rows // 2, 2)
    return logits, lengths, k, draw(st.booleans())


# Cases for the kernel faces: the interpreter is slow.
KERNEL_SIZES = {"max_rows": 2, "max_cols": 120, "ks": (1, 5, 16)}


def check_against(want: list[list[tuple[int, float]]], got: tuple[torch.Tensor, torch.Tensor],
                  ordered: bool = True):
    """``got`` equals the reference's rows ``want``; unless ``ordered``, as sets."""
    indices, scores = got
    assert indices.dtype == torch.int32 and scores.dtype == torch.float32
    if not ordered:
        indices, scores = ref.in_position_order(indices, scores)
        want = [sorted(row, key=lambda entry: (entry[0] < 0, entry[0])) for row in want]
    want_indices = [[p for p, _ in row] for row in want]
    want_scores = np.array([[s for _, s in row] for row in want],
                           dtype=np.float32).reshape(scores.shape)
    assert indices.tolist() == want_indices
    # Bit for bit, NaN apart: numpy's list conversion may quiet a NaN's payload (the
    # selection itself orders NaNs by their bits, which the indices check).
    got_scores = scores.numpy()
    nan = np.isnan(want_scores)
    assert np.array_equal(np.isnan(got_scores), nan)
    assert np.array_equal(got_scores.view(np.int32)[~nan], want_scores.view(np.int32)[~nan])


def check_op(face: str, name: str, args: tuple, want: list[list[tuple[int, float]]],
             ordered: bool = True) -> tuple:
    """Op ``name`` on ``args`` (its fresh outputs poisoned) against the loop reference's
    ``want`` (as sets unless ``ordered``); returns the outputs."""
    with ref.poisoned_empty():
        got = run_op(face, name, *args)
    check_against(want, got, ordered)
    return got


def topk_scored(face: str, case: tuple[torch.Tensor, torch.Tensor, int, bool]) -> None:
    """The face against the loop reference on ``case = (logits, lengths, k, sorted)``."""
    logits, lengths, k, ordered = case
    check_op(face, "topk_scored", case, ref.topk_scored(logits.numpy(), lengths.numpy(), k),
             ordered)


test_topk_scored_cpu, test_topk_scored_kernel = face_tests(
    topk_scored, {"case": scored_cases()}, {"case": scored_cases(**KERNEL_SIZES)})


@pytest.mark.parametrize("face", FACE_NAMES)
def test_topk_scored_example(face):
    """Design §3's example, ordered, with scores; equal logits go to the lower positions."""
    logits = torch.tensor([[.1, .9, .5, .7, NAN], [3, 1, 2, 0, 0], [1, 2, 1, 2, 1]])
    indices, scores = run_op(face, "topk_scored", logits, i32([4, 2, 5]), 3)
    assert indices.tolist() == [[1, 3, 2], [0, 1, -1], [1, 3, 0]]
    assert torch.equal(scores, torch.tensor([[.9, .7, .5], [3, 1, -INF], [2, 2, 1]]))


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("face", FACE_NAMES)
def test_topk_scored_takes_the_lowest_equal_positions(face, ordered):
    """The k-th largest key is shared by many columns: the set takes the first ones."""
    n, k = 600, 40
    logits = torch.zeros(2, n)
    logits[0, 500:510] = 1.0  # 10 above the tie, 30 of 590 equal ones from column 0
    logits[1, ::7] = -1.0
    topk_scored(face, (logits, i32([n, n - 3]), k, ordered))


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("face", FACE_NAMES)
def test_topk_scored_ties_keep_their_sign(face, ordered):
    """A tie at -0.0 filled by the lowest columns: their score stays -0.0, bit for bit."""
    logits = torch.tensor([[1.0, -0.0, -0.0, -0.0, 2.0, 0.0]])
    topk_scored(face, (logits, i32([5]), 3, ordered))


@pytest.mark.parametrize("face", FACE_NAMES)
def test_topk_scored_empty(face):
    assert run_op(face, "topk_scored", torch.zeros(0, 5), i32([]), 4)[0].shape == (0, 4)
    indices, scores = run_op(face, "topk_scored", torch.zeros(2, 0), i32([3, 0]), 4)
    assert indices.tolist() == [[-1] * 4] * 2 and scores.tolist() == [[-INF] * 4] * 2


def check_scored_launch(logits: torch.Tensor, lengths: torch.Tensor, k: int, search: str,
                        **launch) -> None:
    """``topk_scored``'s selection as ``launch_topk`` makes it (``lowest``, ``scores``; small
    tiles for the interpreter, ``search`` in registers and streamed) against the loop
    reference, as sets; the outputs start poisoned."""
    rows = logits.shape[0]
    indices = torch.full((rows, k), 7, dtype=torch.int32)
    scores = torch.full((rows, k), 7.0)
    launch_topk(logits, lengths, k, out=indices, scores=scores, lowest=True, sample_groups=16,
                finish_block=32, num_warps=1, select_warps=1, search=search,
                streamed_search=search, **launch)
    check_against(ref.topk_scored(logits.numpy(), lengths.numpy(), k), (indices, scores),
                  ordered=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test")
@pytest.mark.interpret
@pytest.mark.parametrize("search", list(SEARCHES))
@pytest.mark.parametrize("margin", [-100.0, 4.0, 12.0, 1e9])
def test_topk_scored_through_every_path(margin, search):
    """``topk_scored``'s selection in each path of the top-k kernels: rows read whole
    (length <= select_cap), candidates in registers (margin 4), candidates streamed from
    their regions (12: more than select_cap, each part's within its region; the k-th
    largest tied, so a second streamed search picks the lowest positions), the row
    streamed (-100: fewer than k candidates; 1e9: a part's candidates overflow its
    region). Ties go to the lowest positions."""
    gen = torch.Generator().manual_seed(6)
    n, k = 600, 40
    ties = torch.where(torch.arange(n) % 2 == 0, 1.0, -5.0 - torch.rand(n, generator=gen))
    ties[torch.randperm(n, generator=gen)[:20]] = 2.0 + torch.rand(20, generator=gen)
    logits = torch.stack([ties, values(gen, 1, n, "ties")[0], ties.roll(7),
                          torch.full((n,), 0.25), torch.randn(n, generator=gen)])
    check_scored_launch(logits, i32([n, n - 9, 593, 500, 100]), k, search, parts=4, block=32,
                        select_cap=128, margin=margin)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test")
@pytest.mark.interpret
@pytest.mark.parametrize("margin", [-100.0, 1e9])
def test_lowest_ties_on_a_streamed_row_in_wide_tiles(margin):
    """A row streamed (too few candidates, or a region overflowing) in tiles of two rows
    (block 128 over 64 columns): of the keys tied at the k-th value, the lowest positions,
    not the first in the tile's column order."""
    n, k = 600, 40
    check_scored_launch(torch.zeros(1, n), i32([n]), k, "trisect", parts=2, block=128,
                        select_cap=64, margin=margin)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test")
@pytest.mark.interpret
@settings(max_examples=20)
@given(case=scored_cases(max_rows=3, max_cols=400), parts=st.sampled_from([1, 2, 4]),
       block=st.sampled_from([32, 128]), cap=st.sampled_from([16, 64, 128]),
       margin=st.sampled_from([-100.0, 4.0, 12.0, 1e9]), search=st.sampled_from(list(SEARCHES)))
def test_topk_scored_launch_variants(case, parts, block, cap, margin, search):
    """The same on random rows (ties, NaN, infinities, -0) under random launch shapes."""
    logits, lengths, k, _ = case
    check_scored_launch(logits, lengths, k, search, parts=parts, block=block, select_cap=cap,
                        margin=margin)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test")
@pytest.mark.interpret
def test_launch_scores_read_from_the_starts():
    """``launch_topk`` with ``starts`` and ``scores``: a score is the logit at ``start +
    index``, in rows written whole (``valid <= k``) as in rows searched; -inf and -1 past
    the valid ones."""
    gen = torch.Generator().manual_seed(9)
    n, k = 64, 8
    logits = torch.randn(3, n, generator=gen)
    lengths, starts = i32([5, 30, 8]), i32([20, 10, 50])
    indices = torch.full((3, k), 7, dtype=torch.int32)
    scores = torch.full((3, k), 7.0)
    launch_topk(logits, lengths, k, starts, out=indices, scores=scores, finish_block=32,
                num_warps=1, select_warps=1)
    for row, (length, start) in enumerate(zip(lengths.tolist(), starts.tolist(), strict=True)):
        valid = min(length, k)
        window = logits[row, start:start + length]
        assert sorted(indices[row, :valid].tolist()) == sorted(
            window.topk(valid).indices.tolist())
        taken = indices[row, :valid].long()
        assert torch.equal(scores[row, :valid], window[taken])
        assert (indices[row, valid:] == -1).all() and torch.isneginf(scores[row, valid:]).all()

@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "n"), [(8, 65536), (64, 131072)])
def test_gpu_topk_scored_at_dcp_shapes(rows, n):
    """A DCP rank's rows at 128K and 256K global keys: the CUDA face equals the CPU face
    (sorted, position for position; as a set, the same entries)."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randn(rows, n, device="cuda", generator=gen)
    lengths = torch.randint(n // 2, n + 1, (rows,), device="cuda", generator=gen,
                            dtype=torch.int32)
    want = torch.ops.dsa.topk_scored(logits.cpu(), lengths.cpu(), 2048)
    for ordered in (True, False):
        got = [t.cpu() for t in torch.ops.dsa.topk_scored(logits, lengths, 2048, ordered)]
        expect = want if ordered else ref.in_position_order(*want)
        if not ordered:
            got = ref.in_position_order(*got)
        assert torch.equal(got[0], expect[0])
        assert torch.equal(got[1].view(torch.int32), expect[1].view(torch.int32))


# --- merge ---------------------------------------------------------------------------------


def shard_selections(face: str, logits: torch.Tensor, lengths: torch.Tensor, k: int,
                     world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[W, T, k]`` scores and global positions: each rank's topk_scored over its shard
    (global column c is rank c % W's local column c // W)."""
    scores, positions = [], []
    for rank in range(world):
        local = logits[:, rank::world].contiguous()
        lens = local_share(lengths.view(-1), world, rank, 1).to(torch.int32)
        idx, sc = run_op(face, "topk_scored", local, lens, k)
        scores.append(sc)
        positions.append(global_positions(idx, world, rank))
    return torch.stack(scores), torch.stack(positions)


@st.composite
def merge_cases(draw, **kwargs):
    logits, lengths, k, ordered = draw(scored_cases(**kwargs))
    # shards see clean columns: junk past the length stays junk in every shard
    return logits.contiguous(), lengths.reshape(-1), k, draw(st.integers(1, 4)), ordered


def merge(face: str, case: tuple[torch.Tensor, torch.Tensor, int, int, bool]) -> None:
    """The merge of ``world`` shards' selections of ``case = (logits, lengths, k, world,
    sorted)`` against the loop reference; unsorted, the shards' selections are reversed
    (any candidate order will do)."""
    logits, lengths, k, world, ordered = case
    scores, positions = shard_selections("cpu", logits, lengths, k, world)
    if not ordered:
        scores, positions = scores.flip(-1).contiguous(), positions.flip(-1).contiguous()
    got = check_op(face, "dcp_merge_topk", (scores, positions, ordered),
                   ref.merge_topk(scores.numpy(), positions.numpy()), ordered)
    # exact: the merge of the shards' selections is the selection over the whole row
    check_against(ref.topk_scored(logits.numpy(), lengths.numpy(), k), got, ordered)


test_merge_cpu, test_merge_kernel = face_tests(
    merge, {"case": merge_cases()}, {"case": merge_cases(**KERNEL_SIZES)})


@KERNEL_MARK
def test_sorted_merge_of_more_candidates_than_one_sort_holds(monkeypatch):
    """Past ``MAX_SORT`` candidates (W = 16, k = 2048 on a GPU: 256 KB to sort) the kernel
    face selects the k unsorted, then sorts them: the rows of the CPU face's full sort."""
    monkeypatch.setattr(scored, "MAX_SORT", 64)
    gen = torch.Generator().manual_seed(11)
    scores = torch.randint(-3, 4, (4, 3, 40), generator=gen).float()
    positions = torch.randperm(480, generator=gen).view(4, 3, 40).int()
    positions[2, 1, ::3] = -1
    want = torch.ops.dsa.dcp_merge_topk(scores, positions, True)
    got = run_op("kernel", "dcp_merge_topk", scores, positions, True)
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))


@pytest.mark.gpu
@pytest.mark.parametrize(("world", "k"), [(16, 2048), (4, 4096)])
def test_sorted_merge_of_sixteen_ranks_of_2048_on_the_gpu(world, k):
    """W * k = 32768 candidates, sorted (256 KB to sort in one program): the GPU's two
    stages give the CPU face's rows."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(-50, 50, (world, 3, k), generator=gen).float()
    positions = torch.randperm(world * 3 * k, generator=gen).view(world, 3, k).int()
    positions[1, 1, ::5] = -1
    want = torch.ops.dsa.dcp_merge_topk(scores, positions, True)
    got = torch.ops.dsa.dcp_merge_topk(scores.cuda(), positions.cuda(), True)
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))


@pytest.mark.parametrize("face", FACE_NAMES)
def test_merge_example(face):
    """Design §11's example: W = 2, k = 3; the tie at .9 goes to the lower position."""
    scores = torch.tensor([[[.9, .5, .5]], [[.9, .7, -INF]]])
    indices, merged = run_op(face, "dcp_merge_topk", scores, i32([[[4, 0, 2]], [[1, 3, -1]]]))
    assert indices.tolist() == [[1, 4, 3]]
    assert torch.equal(merged, torch.tensor([[.9, .9, .7]]))


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("face", FACE_NAMES)
def test_merge_takes_any_candidate_order(face, ordered):
    """Candidates need not be sorted; -1 entries are no candidates, wherever they are."""
    gen = torch.Generator().manual_seed(7)
    scores = torch.randint(-2, 3, (3, 4, 6), generator=gen).float()
    positions = torch.randperm(72, generator=gen).view(3, 4, 6).int()
    positions[0, 1] = -1
    positions[:, 2, ::2] = -1
    positions[:, 3] = -1
    got = check_op(face, "dcp_merge_topk", (scores, positions, ordered),
                   ref.merge_topk(scores.numpy(), positions.numpy()), ordered)
    assert got[0][3].tolist() == [-1] * 6


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("face", FACE_NAMES)
def test_merge_ties_take_the_lowest_positions(face, ordered):
    """More candidates share the k-th largest score than slots are left: the lowest
    positions win, whatever rank and column they come in."""
    gen = torch.Generator().manual_seed(9)
    scores = torch.full((3, 2, 8), 0.5)
    scores[1, :, 5] = 2.0  # one key above the tie per token
    positions = torch.randperm(48, generator=gen).view(3, 2, 8).int()
    got = check_op(face, "dcp_merge_topk", (scores, positions, ordered),
                   ref.merge_topk(scores.numpy(), positions.numpy()), ordered)
    for token in range(2):
        equal = positions[:, token][scores[:, token] == 0.5].sort().values[:7]
        assert set(got[0][token].tolist()) == {int(positions[1, token, 5]), *equal.tolist()}


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("face", FACE_NAMES)
def test_merge_reads_the_gathered_pairs_in_place(face, ordered):
    """Scores and positions as views of the all-gathered ``[W, T, 2k]`` pairs (row stride
    2k): no copy needed."""
    gen = torch.Generator().manual_seed(8)
    logits, lengths, k = values(gen, 3, 90, "ties"), i32([90, 41, 3]), 16
    scores, positions = shard_selections("cpu", logits, lengths, k, 2)
    pairs = torch.cat([scores.view(torch.int32), positions], dim=-1)
    got = check_op(face, "dcp_merge_topk", (pairs[..., :k].view(torch.float32),
                                            pairs[..., k:], ordered),
                   ref.merge_topk(scores.numpy(), positions.numpy()), ordered)
    check_against(ref.topk_scored(logits.numpy(), lengths.numpy(), k), got, ordered)


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("face", FACE_NAMES)
def test_merge_empty(face, ordered):
    assert run_op(face, "dcp_merge_topk", torch.zeros(2, 0, 3), torch.zeros(2, 0, 3,
                  dtype=torch.int32), ordered)[0].shape == (0, 3)
    indices, scores = run_op(face, "dcp_merge_topk", torch.zeros(0, 2, 3),
                             torch.zeros(0, 2, 3, dtype=torch.int32), ordered)
    assert indices.tolist() == [[-1] * 3] * 2 and scores.tolist() == [[-INF] * 3] * 2


def test_ownership():
    """Interleave 1: rank c % W owns c as its local c // W; the ranks' shares partition."""
    positions = i32([[0, 5, 6, -1], [7, 2, -1, -1]])
    assert owned_indices(positions, 3, 2).tolist() == [[-1, 1, -1, -1], [-1, 0, -1, -1]]
    union = torch.full_like(positions, -1)
    for rank in range(3):
        local = owned_indices(positions, 3, rank)
        mine = global_positions(local, 3, rank)
        assert bool(((mine < 0) | (union < 0)).all())
        union = torch.where(mine >= 0, mine, union)
    assert torch.equal(union, positions)


# --- opcheck and validation ----------------------------------------------------------------


def _cases():
    gen = torch.Generator().manual_seed(3)
    lengths = i32([300, 10, 0, 200])
    logits = with_junk(gen, values(gen, 4, 300, "ties"), lengths)
    scores, positions = shard_selections("cpu", logits.contiguous(), lengths, 16, 2)
    return [("topk_scored", (logits, lengths, 16)),
            ("topk_scored", (logits, lengths, 16, False)),
            ("topk_scored", (logits, lengths.view(2, 2), 64)),
            ("topk_scored", (torch.zeros(0, 8), i32([]), 4)),
            ("dcp_merge_topk", (scores, positions)),
            ("dcp_merge_topk", (scores, positions, False)),
            ("dcp_merge_topk", (scores[:, :0].contiguous(), positions[:, :0].contiguous()))]


test_opcheck = opcheck_test(_cases())

X, LENS = torch.zeros(2, 8), i32([8, 8])
S, P = torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, dtype=torch.int32)
test_validation = validation_test([
    ("topk_scored", (X.half(), LENS, 4), TypeError, "`logits` must be torch.float32"),
    ("topk_scored", (torch.zeros(8, 2).t(), LENS, 4), ValueError, "unit column stride"),
    ("topk_scored", (X, i32([8]), 4), ValueError, "`lengths` must have one entry per"),
    ("topk_scored", (X, LENS.long(), 4), TypeError, "`lengths` must be torch.int32"),
    ("topk_scored", (X, LENS, 0), ValueError, "`k` must be >= 1"),
    ("dcp_merge_topk", (S.double(), P), TypeError, "`scores` must be torch.float32"),
    ("dcp_merge_topk", (S[0], P[0]), ValueError, "`scores` must have 3 dimension"),
    ("dcp_merge_topk", (S, P.long()), TypeError, "`indices` must be torch.int32"),
    ("dcp_merge_topk", (S, P[:, :2].contiguous()), ValueError, "`indices` must have the shape of"),
    ("dcp_merge_topk", (S[..., :0], P[..., :0]), ValueError, "k >= 1 candidates"),
    ("dcp_merge_topk", (S.transpose(1, 2), P.transpose(1, 2)), ValueError,
     "`scores` must have unit stride in dimension 2"),
    ("dcp_merge_topk", (S, P.transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
     "`indices` must have unit stride in dimension 2"),
    ("dcp_merge_topk", (torch.zeros(9, 1, 4096), torch.zeros(9, 1, 4096, dtype=torch.int32),
                        False), ValueError, "takes W \\* k <= 32768 candidates"),
    ("dcp_merge_topk", (torch.zeros(9, 1, 4096), torch.zeros(9, 1, 4096, dtype=torch.int32),
                        True), ValueError, "takes W \\* k <= 32768 candidates"),
    ("dcp_merge_topk", (torch.zeros(1, 1, 16385), torch.zeros(1, 1, 16385, dtype=torch.int32),
                        True), ValueError, "a sorted merge takes k <= 16384, got 16385"),
])



def test_no_rank_owns_a_negative_position():
    """Every negative entry, not only -1, is owned by no rank (floor division alone would
    give -4 to rank 2 of 3 as its local -2)."""
    positions = i32([[-1, -3, -4, -7, 5]])
    for rank in range(3):
        assert owned_indices(positions, 3, rank)[0, :4].tolist() == [-1] * 4
