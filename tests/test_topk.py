"""dsa::topk_indices (design §3): both faces against a loop checker of the top-k contract.

Order inside a row and the choice among equal values are free, so outputs are checked by
properties, not compared: every selected index is a valid column (relative to the row's
start) and unique, exactly ``min(k, valid)`` are selected (-1 elsewhere), and the smallest
selected logit is >= the largest unselected valid one. Columns outside the valid range
hold junk (NaN, +inf, huge values) that must never be selected.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import reference_compute as ref
import torch
from faces import FACE_NAMES, HAS_CUDA, face_tests, i32, run_op, validation_test
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import topk_rows
from test_slots import slots_case

from dsa.ops import FACES
from dsa.ops.topk.indices import (
    SEARCHES,
    TUNING,
    SlotArgs,
    _regs,
    choose_block,
    choose_sample_groups,
    choose_select_cap,
    choose_select_warps,
    launch_topk,
)

# the interpreter runs fp32 math in numpy, which warns where the GPU silently saturates
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")
JUNK = (float("nan"), float("inf"), -float("inf"), 3.0e38, -3.0e38, 1.0e30)
SEARCH_NAMES = list(SEARCHES)  # Tuning.search: every k-th key search is exact


# --- checkers ------------------------------------------------------------------------------


def check_topk_loop(logits, lengths, k, starts, out) -> None:
    """The contract, one row at a time in plain Python (the slow reference)."""
    rows, n = logits.shape
    assert out.dtype == torch.int32 and tuple(out.shape) == (rows, k)
    values = logits.tolist()
    lens = lengths.reshape(-1).tolist()
    begins = [0] * rows if starts is None else starts.reshape(-1).tolist()
    for r, (got, s) in enumerate(zip(out.tolist(), begins)):
        valid = range(max(s, 0), min(s + max(lens[r], 0), n))
        picked = [v for v in got if v != -1]
        assert len(picked) == min(k, len(valid)), f"row {r}: {len(picked)} selected"
        cols = [v + s for v in picked]
        assert len(set(cols)) == len(cols), f"row {r}: repeated index"
        assert all(c in valid for c in cols), f"row {r}: index outside the valid range"
        if picked:
            ranked = sorted((values[r][c] for c in valid), reverse=True)
            kth = ranked[len(picked) - 1]
            assert all(values[r][c] >= kth for c in cols), f"row {r}: not the top-k"


def check_topk(logits, lengths, k, starts, out) -> None:
    """The same contract, vectorised (any device; for the GPU shapes and the benchmark)."""
    rows, n = logits.shape
    dev = logits.device
    assert out.dtype == torch.int32 and tuple(out.shape) == (rows, k)
    start = torch.zeros(rows, dtype=torch.long, device=dev) if starts is None \
        else starts.reshape(rows).long()
    end = start + lengths.reshape(rows).long().clamp(min=0)
    lo = start.clamp(0, n)
    hi = torch.maximum(end.clamp(0, n), lo)
    got = out.long()
    picked = got != -1
    assert torch.equal(picked.sum(1), (hi - lo).clamp(max=k)), "wrong number selected"
    if n == 0:
        return
    col = got + start[:, None]
    inside = (col >= lo[:, None]) & (col < hi[:, None])
    assert bool((inside | ~picked).all()), "index outside the valid range"
    marks = torch.zeros(rows, n + 1, dtype=torch.int32, device=dev)
    marks.scatter_add_(1, torch.where(picked, col, n), picked.int())
    assert int(marks[:, :n].max()) <= 1, "repeated index"
    smallest = torch.where(picked, logits.gather(1, torch.where(picked, col, 0)),
                           float("inf")).amin(1)
    cols = torch.arange(n, device=dev)
    rest = (cols >= lo[:, None]) & (cols < hi[:, None]) & (marks[:, :n] == 0)
    largest_rest = torch.where(rest, logits, -float("inf")).amax(1)
    assert bool((smallest >= largest_rest).all()), "a larger valid logit was left out"


def check_both(logits, lengths, k, starts, out) -> None:
    check_topk_loop(logits, lengths, k, starts, out)
    check_topk(logits, lengths, k, starts, out)


def slot_table(seed: int, rows: int, n: int, block_size: int):
    """(block_table, row_requests, block_size, num_blocks) covering a little more than n
    columns, with -1, out-of-cache and huge entries and requests outside the table."""
    gen = torch.Generator().manual_seed(seed)
    width = n // block_size + 2
    _, table, requests = slots_case(gen, 0, 1, 3, width, block_size, num_blocks=3 * width)
    requests = torch.randint(-1, 5, (rows,), generator=gen, dtype=torch.int32)
    return table, requests, block_size, 3 * width


def check_slots(indices, slots, table, requests, block_size, num_blocks) -> None:
    """The slots are ``indices_to_slots`` of the indices (the loop reference)."""
    assert slots.dtype == torch.int32 and slots.shape == indices.shape
    want = ref.indices_to_slots(indices.numpy(), table.numpy(), requests.numpy(), block_size,
                                num_blocks)
    np.testing.assert_array_equal(slots.numpy(), want)


# --- inputs --------------------------------------------------------------------------------

KINDS = ("normal", "ties", "equal", "positive", "neg_inf", "outliers", "negative")


def make_values(gen: torch.Generator, rows: int, n: int, kind: str) -> torch.Tensor:
    x = torch.randn(rows, n, generator=gen)
    if kind == "ties":  # few distinct values
        x = torch.randint(-3, 4, (rows, n), generator=gen).float()
    elif kind == "equal":
        x = torch.full((rows, n), 0.5)
    elif kind == "positive":  # one sign: binned on the key bits
        x = torch.exp(2 * x)
    elif kind == "neg_inf":
        x = torch.where(torch.rand(rows, n, generator=gen) < 0.5, -float("inf"), x)
    elif kind == "outliers":
        x = torch.where(torch.rand(rows, n, generator=gen) < 0.02, x * 1e6, x)
    elif kind == "negative":
        x = -torch.exp(x)
    return x


def make_logits(gen, values, lo, hi, *, pad: int = 256, offset: int = 0):
    """``values`` in a row-strided view of a junk-filled buffer; junk outside [lo, hi)."""
    rows, n = values.shape
    width = -(-(n + offset) // pad) * pad
    junk = torch.tensor(JUNK)[torch.randint(len(JUNK), (rows, width), generator=gen)]
    buffer = torch.where(torch.rand(rows, width, generator=gen) < 0.5, junk,
                         torch.randn(rows, width, generator=gen) * 1e3)
    logits = buffer.narrow(1, offset, n)
    cols = torch.arange(n)
    valid = (cols >= lo[:, None]) & (cols < hi[:, None])
    logits.copy_(torch.where(valid, values, logits))
    return logits


@st.composite
def topk_cases(draw, max_rows=4, max_cols=600, ks=(1, 8, 64, 100)):
    """(logits, lengths, k, starts): lengths around 0, k and N; optional starts."""
    rows, n, k, gen, lengths = draw(topk_rows(max_rows, max_cols, ks))
    starts = None
    if draw(st.booleans()):
        starts = torch.randint(-2, max(n // 3, 1), (rows,), generator=gen).to(torch.int32)
    begin = torch.zeros(rows, dtype=torch.long) if starts is None else starts.long()
    lo = begin.clamp(0, n)
    hi = torch.maximum((begin + lengths.long().clamp(min=0)).clamp(0, n), lo)
    values = make_values(gen, rows, n, draw(st.sampled_from(KINDS)))
    logits = make_logits(gen, values, lo, hi, offset=draw(st.sampled_from([0, 3])))
    if draw(st.booleans()) and rows % 2 == 0:  # lengths shaped [B, next_n]
        lengths = lengths.view(rows // 2, 2)
    return logits, lengths, k, starts


# --- both faces ----------------------------------------------------------------------------


def topk_indices(face: str, case: tuple) -> None:
    """The op with its default launch (rows this short are read whole by the CUDA face)."""
    logits, lengths, k, starts = case
    check_both(logits, lengths, k, starts, run_op(face, "topk_indices", *case))


def topk_indices_and_slots(face: str, case: tuple, bf16: bool, block_size: int) -> None:
    """Logits (bf16 too) select on their own values; the slots are those of the indices."""
    logits, lengths, k, starts = case
    if bf16:
        logits = logits.bfloat16()
    table = slot_table(k, logits.shape[0], logits.shape[1], block_size)
    out, slots = run_op(face, "topk_indices_and_slots", logits, lengths, k, *table, starts)
    check_both(logits.float(), lengths, k, starts, out)
    check_slots(out, slots, *table)


def topk_indices_and_slots_consume(face: str, case: tuple, block_size: int) -> None:
    """The consuming op selects as the plain one (its logits' contents are not checked:
    they are unspecified after it)."""
    logits, lengths, k, starts = case
    table = slot_table(k, logits.shape[0], logits.shape[1], block_size)
    out, slots = run_op(face, "topk_indices_and_slots_consume", logits.clone(), lengths, k,
                        *table, starts)
    check_both(logits, lengths, k, starts, out)
    check_slots(out, slots, *table)


test_topk_indices_cpu, test_topk_indices_kernel = face_tests(topk_indices, {"case": topk_cases()})
test_topk_indices_and_slots_cpu, test_topk_indices_and_slots_kernel = face_tests(
    topk_indices_and_slots,
    {"case": topk_cases(), "bf16": st.booleans(), "block_size": st.sampled_from([1, 16, 64])})
test_topk_indices_and_slots_consume_cpu, test_topk_indices_and_slots_consume_kernel = face_tests(
    topk_indices_and_slots_consume, {"case": topk_cases(), "block_size": st.sampled_from([1, 64])})


@pytest.mark.skipif(HAS_CUDA, reason="interpreter test: the GPU tests cover launch variants")
@pytest.mark.interpret
@pytest.mark.parametrize("search", SEARCH_NAMES)
@settings(max_examples=15)
@given(case=topk_cases(max_rows=3, max_cols=400), parts=st.sampled_from([1, 2, 4]),
       block=st.sampled_from([32, 128]), cap=st.sampled_from([16, 64, 128, 512]),
       margin=st.sampled_from([-100.0, 0.0, 4.0, 1e9]), bf16=st.booleans(),
       streamed=st.sampled_from([None, *SEARCH_NAMES]), unmasked=st.booleans())
def test_launch_variants_interpreted(search, case, parts, block, cap, margin, bf16, streamed,
                                     unmasked):
    """Rows read whole (valid <= cap), thresholded rows, and the streamed search when the
    threshold is too high (margin -100: fewer than k keys above it) or too low (1e9, or
    cap 16: more candidates than cap), with split parts and tiny blocks, the candidates'
    inner blocks masked or not; slots from every path."""
    logits, lengths, k, starts = case
    if bf16:
        logits = logits.bfloat16()
    table = slot_table(parts, logits.shape[0], logits.shape[1], 16)
    slots = torch.empty(logits.shape[0], k, dtype=torch.int32)
    out = launch_topk(logits, lengths, k, starts, slots=SlotArgs(slots, *table), parts=parts,
                      block=block, select_cap=cap, sample_groups=16, margin=margin,
                      finish_block=32, num_warps=1, select_warps=1, search=search,
                      streamed_search=streamed, unmasked_rows=(0, 2**31) if unmasked else None)
    check_both(logits.float(), lengths, k, starts, out)
    check_slots(out, slots, *table)


@pytest.mark.skipif(HAS_CUDA, reason="interpreter test")
@pytest.mark.interpret
@pytest.mark.parametrize("variant", [*({"search": s} for s in SEARCH_NAMES), {"early_load": False},
                                     {"sample_width": 4}, {"unmasked_rows": (3, 2**31)}],
                         ids=[*SEARCH_NAMES, "late_load", "sample_width4", "unmasked"])
@pytest.mark.parametrize("margin", [-100.0, 4.0, 1e9])
def test_sampled_threshold_paths(margin, variant):
    """Long rows through the candidates pass: kept (margin 4) or the streamed search
    (threshold too high / too low), with ties, -inf and a start offset."""
    gen = torch.Generator().manual_seed(4)
    values = torch.cat([torch.randn(1, 1000, generator=gen),
                        torch.randint(-3, 4, (1, 1000), generator=gen).float(),
                        make_values(gen, 1, 1000, "neg_inf")])
    starts, lengths = i32([0, 0, 37]), i32([1000, 900, 950])
    lo = starts.long()
    logits = make_logits(gen, values, lo, (lo + lengths.long()).clamp(max=1000))
    out = launch_topk(logits, lengths, 40, starts, parts=2, block=128, select_cap=256,
                      sample_groups=64, margin=margin, finish_block=64, **variant)
    check_both(logits, lengths, 40, starts, out)


def overflow_rows(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values [3, 600], starts, lengths) whose candidates, with 4 parts, select_cap 128 and
    k 40, number more than 128 but at most 128 in each part: 300 ones every other column
    under 20 larger values (the 40th largest key tied over every part), a normal row with
    a low threshold (margin 12: about 290), and the ties shifted by a start."""
    ties = torch.where(torch.arange(600) % 2 == 0, 1.0, -5.0 - torch.rand(600, generator=gen))
    ties[torch.randperm(600, generator=gen)[:20]] = 2.0 + torch.rand(20, generator=gen)
    values = torch.stack([ties, torch.randn(600, generator=gen), ties.roll(7)])
    return values, i32([0, 0, 7]), i32([600, 600, 593])


# (start, length) of rows of 300 columns; what a part's 32-column blocks are with 4 parts
# (part_span's arithmetic: inner blocks lie wholly inside the part; with one part, the row's
# blocks are its only part's)
PART_EDGE_ROWS = {
    "inner_and_tail": (0, 300),  # parts 0-2 inner blocks only, part 3 a tail alone
    "inner_then_tail": (0, 250),  # part 3 an inner block, then a tail
    "head_inner_tail": (5, 290),  # part 0 a head, then inner blocks (one part: and a tail)
    "one_block_head_and_tail": (40, 20),  # part 0 one block cut at both ends, 1-3 empty
    "aligned_inner_only": (64, 64),  # parts 0-1 one inner block each, 2-3 empty
    "past_the_row": (250, 100),  # a length past the row: the last block's end is the row's
}


@pytest.mark.skipif(HAS_CUDA, reason="interpreter test: the GPU tests cover launch variants")
@pytest.mark.interpret
@pytest.mark.parametrize("margin", [4.0, 1e9], ids=["kept", "overflowing"])
@pytest.mark.parametrize("parts", [1, 4])
@pytest.mark.parametrize("rows", list(PART_EDGE_ROWS))
def test_candidates_at_part_edges(rows, parts, margin):
    """The candidates pass at every arrangement of a part's blocks (inner, head, tail, one
    block cut at both ends, none), its candidates kept (margin 4) or more than its region
    holds (margin 1e9: every key a candidate; the row is then streamed)."""
    gen = torch.Generator().manual_seed(9)
    start, length = PART_EDGE_ROWS[rows]
    starts, lengths = i32([start, 0]), i32([length, 300])
    lo = starts.long()
    logits = make_logits(gen, torch.randn(2, 300, generator=gen), lo,
                         (lo + lengths.long()).clamp(max=300))
    out = launch_topk(logits, lengths, 8, starts, parts=parts, block=32, select_cap=16,
                      sample_groups=16, margin=margin, finish_block=32, num_warps=1,
                      select_warps=1)
    check_both(logits, lengths, 8, starts, out)


@pytest.mark.skipif(HAS_CUDA, reason="interpreter test: the GPU tests cover launch variants")
@pytest.mark.interpret
@pytest.mark.parametrize("search", SEARCH_NAMES)
@pytest.mark.parametrize("bf16", [False, True])
def test_candidates_over_capacity(search, bf16):
    """More candidates than select_cap, each part's within its region: the search streams
    them from the regions; the same values as torch.topk, with and without slots (there
    by the next search of the list)."""
    gen = torch.Generator().manual_seed(6)
    values, starts, lengths = overflow_rows(gen)
    lo = starts.long()
    logits = make_logits(gen, values, lo, lo + lengths.long())
    if bf16:
        logits = logits.bfloat16()
    table = slot_table(7, 3, 600, 16)
    slots = torch.empty(3, 40, dtype=torch.int32)
    launch = dict(parts=4, block=32, select_cap=128, sample_groups=16, margin=12.0,
                  finish_block=32, num_warps=1, select_warps=1, search=search,
                  select_regs=128, candidates_regs=96)
    streamed = SEARCH_NAMES[(SEARCH_NAMES.index(search) + 1) % len(SEARCH_NAMES)]
    for out in (launch_topk(logits, lengths, 40, starts, **launch),
                launch_topk(logits, lengths, 40, starts, slots=SlotArgs(slots, *table),
                            streamed_search=streamed, **launch)):
        check_both(logits.float(), lengths, 40, starts, out)
        picked = logits.float().gather(1, out.long() + starts.long()[:, None])
        for r, s in enumerate(starts.tolist()):
            want = values[r, s:].to(logits.dtype).float().topk(40).values
            assert torch.equal(picked[r].sort(descending=True).values, want)
    check_slots(out, slots, *table)


@pytest.mark.skipif(HAS_CUDA, reason="interpreter test: the GPU tests cover launch variants")
@pytest.mark.interpret
@pytest.mark.parametrize("search", [name for name, (radix, _) in SEARCHES.items() if not radix])
def test_row_streamed_past_two_to_the_16(search):
    """A row of more than 2**16 valid keys streamed whole (its threshold too high): the
    multisection counts past 2**16 (two counts packed in one int32 wrapped there, to fewer
    than k, and the search went astray)."""
    n = 66500  # all keys above the first pivot: its count wraps to 964 when packed
    logits = 1.0 + torch.rand(1, n, generator=torch.Generator().manual_seed(8))
    lengths = i32([n])
    out = launch_topk(logits, lengths, 1024, parts=1, margin=-100.0, streamed_search=search)
    check_both(logits, lengths, 1024, None, out)


def test_choose_block():
    assert choose_block(1) == 2048 and choose_block(2) == choose_block(16) == 4096


def test_choose_sample_groups():
    """The sample grows with the row (about 128 keys above the k-th largest), up to 2**15
    keys, whatever the candidates programs per row (their candidates meet in one
    select_cap)."""
    sizes = dict(groups=512, width=4, expect=128)
    assert choose_sample_groups(131072, 2048, **sizes) == 2048
    assert choose_sample_groups(65536, 2048, **sizes) == 1024
    assert choose_sample_groups(32768, 2048, **sizes) == 512
    assert choose_sample_groups(4096, 2048, **sizes) == 512
    assert choose_sample_groups(1 << 24, 2048, **sizes) == 8192
    assert choose_sample_groups(1 << 20, 16, **sizes) == 8192


def test_choose_select_cap():
    assert choose_select_cap(4096, 2048, row_cols=TUNING.row_cols) == 4096
    assert choose_select_cap(5000, 2048, row_cols=TUNING.row_cols) == 8192
    assert choose_select_cap(65536, 2048, row_cols=TUNING.row_cols) == 4096
    assert choose_select_cap(100, 8, row_cols=TUNING.row_cols) == 128
    assert choose_select_cap(1 << 20, 1 << 15, row_cols=TUNING.row_cols) == 1 << 15


def test_choose_select_warps():
    warps = {"many_rows": TUNING.many_rows, "scale_rows": TUNING.scale_rows}
    assert choose_select_warps(256, 8192, 8192, **warps) == 4
    assert choose_select_warps(64, 8192, 8192, **warps) == 8
    assert choose_select_warps(256, 65536, 4096, **warps) == 8
    assert choose_select_warps(4096, 32768, 4096, **warps) == 4  # prefill: a GPU full of rows


def test_register_caps_apply_to_many_rows():
    assert _regs(None, 96, 4096, 1024) == {"maxnreg": 96}
    assert _regs(None, 96, 64, 1024) == {}
    assert _regs(0, 96, 4096, 1024) == {}
    assert _regs(80, 96, 64, 1024) == {"maxnreg": 80}


EDGE_CASES = {
    "all equal": (torch.full((2, 300), 1.5), [300, 200], 64),
    "ties at the threshold": (torch.tensor([[3.0] * 10 + [2.0] * 200 + [1.0] * 90] * 2),
                              [300, 150], 100),
    "fill with -inf": (torch.tensor([[-float("inf")] * 250 + [1.0] * 5]), [255], 100),
    "zeros of both signs": (torch.tensor([[0.0, -0.0] * 100]), [200], 8),
    "k above N": (torch.randn(2, 50), [50, 20], 100),
    # the window samples 4 columns every 37: the outliers at offset 5 lie above its maximum
    "outliers outside the sample": (torch.arange(600.0).remainder(37).eq(5).float() * 1e3
                                    + torch.rand(1, 600), [600], 8),
    "one column": (torch.randn(3, 1), [1, 0, -1], 1),
}


@pytest.mark.parametrize("face", FACE_NAMES)
@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_edge_cases(face, name):
    values, lens, k = EDGE_CASES[name]
    lengths = i32(lens)
    gen = torch.Generator().manual_seed(1)
    hi = lengths.long().clamp(0, values.shape[1])
    logits = make_logits(gen, values, torch.zeros_like(hi), hi)
    check_both(logits, lengths, k, None, run_op(face, "topk_indices", logits, lengths, k))


@pytest.mark.skipif(HAS_CUDA, reason="interpreter test: the GPU tests cover launch variants")
@pytest.mark.interpret
@pytest.mark.parametrize("search", SEARCH_NAMES)
@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_edge_cases_searches(search, name):
    """Each search on the edge cases, rows read whole and (cap 16: too many candidates)
    streamed."""
    values, lens, k = EDGE_CASES[name]
    lengths = i32(lens)
    gen = torch.Generator().manual_seed(1)
    hi = lengths.long().clamp(0, values.shape[1])
    logits = make_logits(gen, values, torch.zeros_like(hi), hi)
    for variant in (dict(), dict(parts=2, block=64, select_cap=16, sample_groups=16)):
        out = launch_topk(logits, lengths, k, search=search, **variant)
        check_both(logits, lengths, k, None, out)


def test_unknown_search():
    with pytest.raises(ValueError, match="`search` must be one of"):
        launch_topk(X, LENS, 4, search="bisect")
    with pytest.raises(ValueError, match="`streamed_search` must be one of"):
        launch_topk(X, LENS, 4, streamed_search="bisect")


@pytest.mark.parametrize("face", FACE_NAMES)
def test_starts_shift_the_window(face):
    """Indices are relative to the row's start; junk before it is never selected."""
    gen = torch.Generator().manual_seed(2)
    values = torch.randn(3, 400, generator=gen)
    starts, lengths = i32([0, 100, 390]), i32([150, 250, 50])
    lo = starts.long()
    hi = (lo + lengths.long()).clamp(max=400)
    logits = make_logits(gen, values, lo, hi)
    out = run_op(face, "topk_indices", logits, lengths, 64, starts)
    check_both(logits, lengths, 64, starts, out)
    assert sorted(out[2].tolist()[:10]) == list(range(10))  # 10 valid columns: all of them


@pytest.mark.parametrize("face", FACE_NAMES)
def test_negative_starts_clip_at_column_zero(face):
    """A window starting before column 0 keeps its columns from 0 on (indices column -
    start): nothing before the row is read or selected."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    starts, lengths = i32([-2, -5]), i32([1, 10])
    out = run_op(face, "topk_indices", logits, lengths, 8, starts)
    check_both(logits, lengths, 8, starts, out)
    assert out[0].tolist() == [-1] * 8
    assert sorted(out[1].tolist()) == [-1, -1, -1, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("face", FACE_NAMES)
def test_empty(face):
    assert run_op(face, "topk_indices", torch.zeros(0, 5), i32([]), 4).shape == (0, 4)
    out = run_op(face, "topk_indices", torch.zeros(2, 0), i32([3, 0]), 4)
    assert out.tolist() == [[-1] * 4] * 2


def test_choose_parts():
    assert TUNING.parts(1, 4096) == 1
    assert TUNING.parts(1, 65536) == 16
    assert TUNING.parts(1, 1 << 20) == 16
    assert TUNING.parts(64, 65536) == 4
    assert TUNING.parts(8, 65536) == 16
    assert TUNING.parts(16, 65536) == 8  # 16 parts a row only within 128 programs
    assert replace(TUNING, max_parts_programs=256).parts(16, 65536) == 16
    assert TUNING.parts(256, 8192) == 1
    assert TUNING.parts(0, 0) == 1


# --- opcheck and validation ----------------------------------------------------------------


def _opcheck_args():
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(4, 300, generator=gen)
    lengths = i32([300, 10, 0, 200])
    logits = make_logits(gen, values, torch.zeros(4, dtype=torch.long), lengths.long())
    return [(logits, lengths, 64), (logits, lengths.view(2, 2), 64, i32([0, 5, 7, 50]))]


@pytest.mark.parametrize("args", _opcheck_args())
def test_opcheck(args):
    torch.library.opcheck(torch.ops.dsa.topk_indices, args)
    table = slot_table(0, 4, 300, 16)
    torch.library.opcheck(torch.ops.dsa.topk_indices_and_slots,
                          (*args[:3], *table, *args[3:]))
    torch.library.opcheck(torch.ops.dsa.topk_indices_and_slots_consume,
                          (args[0].clone(), *args[1:3], *table, *args[3:]))
    torch.library.opcheck(torch.ops.dsa.topk_indices, (args[0].bfloat16(), *args[1:]))


X, LENS = torch.zeros(2, 8), i32([8, 8])
ERROR_CASES = [
    ((X.half(), LENS, 4), TypeError, "`logits` must be torch.float32 or torch.bfloat16"),
    ((X[0], LENS, 4), ValueError, "`logits` must have 2 dimension"),
    ((torch.zeros(8, 2).t(), LENS, 4), ValueError, "`logits` must have unit column stride"),
    ((X, LENS.long(), 4), TypeError, "`lengths` must be torch.int32"),
    ((X, i32([8, 8, 8]), 4), ValueError, "`lengths` must have one entry per logits row"),
    ((X, LENS, 0), ValueError, "`k` must be >= 1"),
    ((X, LENS, 4, i32([0])), ValueError, "`starts` must have one entry per logits row"),
    ((X, LENS, 4, LENS.float()), TypeError, "`starts` must be torch.int32"),
]


@pytest.mark.parametrize("face", ["cpu", "cuda", "fake"])
@pytest.mark.parametrize(("args", "error", "match"), ERROR_CASES)
def test_validation(face, args, error, match):
    with pytest.raises(error, match=match):
        getattr(FACES["topk_indices"], face)(*args)


def test_validation_through_the_dispatcher():
    with pytest.raises(ValueError, match="`k` must be >= 1"):
        torch.ops.dsa.topk_indices(X, LENS, 0)


TABLE, REQS = i32([[0, 1]]), i32([0, 0])
test_topk_slots_validation = validation_test([
    ((X.half(), LENS, 4, TABLE, REQS, 64, 4), TypeError, "`logits` must be torch.float32"),
    ((X, LENS, 0, TABLE, REQS, 64, 4), ValueError, "`k` must be >= 1"),
    ((X, LENS, 4, TABLE[0], REQS, 64, 4), ValueError, "`block_table` must have 2"),
    ((X, LENS, 4, TABLE, i32([0]), 64, 4), ValueError, "`row_requests` must have size 2"),
    ((X, LENS, 4, TABLE, REQS.long(), 64, 4), TypeError, "`row_requests` must be torch.int32"),
    ((X, LENS, 4, TABLE, REQS, 0, 4), ValueError, "`block_size` must be >= 1"),
    ((X, LENS, 4, TABLE, REQS, 64, -1), ValueError, "`num_blocks` must be >= 0"),
    ((X, LENS, 4, TABLE, REQS, 64, 2**25 + 1), ValueError, "slots must fit int32"),
    ((X, LENS, 4, TABLE, REQS, 64, 4, i32([0])), ValueError,
     "`starts` must have one entry per logits row"),
], op="topk_indices_and_slots")
test_topk_consume_validation = validation_test([
    ((X, LENS, 0, TABLE, REQS, 64, 4), ValueError, "topk_indices_and_slots_consume: `k`"),
    ((torch.zeros(16).as_strided((2, 8), (4, 1)), LENS, 4, TABLE, REQS, 64, 4), ValueError,
     "rows must not overlap"),
], op="topk_indices_and_slots_consume")


# --- GPU: realistic shapes (k = 2048) ------------------------------------------------------

# (rows, N) = (B * next_n, L): the benchmark shapes
GPU_SHAPES = [(1, 4096), (1, 65536), (8, 32768), (32, 32768), (64, 65536), (128, 32768),
              (256, 8192), (2048, 8192)]


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "n"), [(64, 65536), (5, 1000), (3, 4097), (2, 9000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_consume_drops_only_its_rows(rows, n, dtype):
    """The consuming op selects the top-k of the logits it was given, and its discard of the
    rows' L2 lines reaches no byte outside them: the logits sit in a buffer with guard words
    around every row (rows not 128-byte aligned), all of it dirty in L2 over older contents
    in HBM; a guard line dropped would read back the older contents."""
    logits, lengths = gpu_case(rows, n, seed=rows + n)
    logits = logits.to(dtype)
    gen = torch.Generator(device="cuda").manual_seed(rows)
    width = -(-n // 64)
    table = torch.randint(0, rows * width, (rows, width), device="cuda", generator=gen,
                          dtype=torch.int32)
    args = (lengths, 2048, table, torch.arange(rows, device="cuda", dtype=torch.int32), 64,
            rows * width)
    stride = n + 7
    buffer = torch.full((rows * stride + 64,), 7.0, device="cuda", dtype=dtype)
    torch.empty(256 << 20, dtype=torch.uint8, device="cuda").fill_(1)  # 7.0 reaches HBM
    buffer.fill_(-5.0)  # dirty in L2 over the 7.0 in HBM
    view = buffer[3:3 + rows * stride].view(rows, stride)[:, :n]
    view.copy_(logits)
    out, slots = torch.ops.dsa.topk_indices_and_slots_consume(view, *args)
    torch.cuda.synchronize()
    check_topk(logits.float(), lengths, 2048, None, out)
    assert torch.equal(slots, torch.ops.dsa.indices_to_slots(out, *args[2:]))
    guards = torch.ones_like(buffer, dtype=torch.bool)
    guards[3:3 + rows * stride].view(rows, stride)[:, :n] = False
    assert bool((buffer[guards] == -5.0).all())


def gpu_case(rows, n, *, full=False, seed=0, kind="normal", next_n=1):
    """DeepGEMM-like logits: a [rows, n] view of a 256-aligned buffer, junk past each row's
    length; lengths ~ U[n/2, n] (or all n), shaped [B, next_n]."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    width = -(-n // 256) * 256
    buffer = torch.randn(rows, width, device="cuda", generator=gen)
    if kind == "positive":
        buffer = buffer.exp()
    lengths = torch.full((rows,), n, device="cuda") if full else \
        torch.randint(n // 2, n + 1, (rows,), device="cuda", generator=gen)
    cols = torch.arange(width, device="cuda")
    junk = torch.tensor(JUNK, device="cuda")[cols % len(JUNK)]
    buffer = torch.where(cols < lengths[:, None], buffer, junk)
    return buffer.narrow(1, 0, n), lengths.to(torch.int32).view(-1, next_n)


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "n"), GPU_SHAPES)
@pytest.mark.parametrize("full", [False, True])
def test_gpu_shapes(rows, n, full):
    logits, lengths = gpu_case(rows, n, full=full, seed=rows + n)
    out = torch.ops.dsa.topk_indices(logits, lengths, 2048)
    check_topk(logits, lengths, 2048, None, out)
    for search in SEARCH_NAMES:
        check_topk(logits, lengths, 2048, None, launch_topk(logits, lengths, 2048,
                                                            search=search))


@pytest.mark.gpu
@pytest.mark.parametrize("parts", [1, 2, 8, 16])
@pytest.mark.parametrize("kind", ["normal", "positive"])
def test_gpu_launch_variants(parts, kind):
    logits, lengths = gpu_case(64, 65536, seed=parts, kind=kind, next_n=2)
    starts = torch.randint(0, 1000, (64,), device="cuda", dtype=torch.int32)
    lengths = (lengths - starts.view_as(lengths)).clamp(min=0)  # junk stays past the end
    for variant in (dict(parts=parts), dict(parts=parts, block=2048, num_warps=4),
                    dict(parts=parts, margin=-100.0), dict(parts=parts, select_cap=2048),
                    dict(parts=parts, sample_groups=256, select_warps=4),
                    dict(parts=parts, row_cols=65536, select_cap=32768),
                    *(dict(parts=parts, search=search) for search in SEARCH_NAMES),
                    *(dict(parts=parts, margin=-100.0, search=search) for search in SEARCH_NAMES),
                    dict(parts=parts, early_load=False), dict(parts=parts, margin=12.0),
                    dict(parts=parts, unmasked_rows=None), dict(parts=parts, block=2048,
                                                                unmasked_rows=None),
                    dict(parts=parts, sample_width=4),
                    dict(parts=parts, select_warps=4, select_regs=128, candidates_regs=96),
                    *(dict(parts=parts, select_cap=2048, streamed_search=search)
                      for search in SEARCH_NAMES)):
        out = launch_topk(logits, lengths, 2048, starts, **variant)
        check_topk(logits, lengths, 2048, starts, out)


@pytest.mark.gpu
@pytest.mark.parametrize("search", SEARCH_NAMES)
def test_gpu_ties_and_spills(search):
    """All-equal rows, few distinct values, -inf filling: exact counts on the GPU (the
    first two rows take the streamed search)."""
    logits, lengths = gpu_case(8, 32768, seed=5)
    logits[0].fill_(2.0)
    logits[1].copy_(torch.randint(0, 3, (32768,), device="cuda").float())
    logits[2, ::2] = -float("inf")
    logits[3].copy_(torch.linspace(0, 1, 32768, device="cuda") ** 8)
    check_topk(logits, lengths, 2048, None, launch_topk(logits, lengths, 2048, search=search))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("search", SEARCH_NAMES)
@pytest.mark.parametrize("variant", [dict(select_cap=2048), dict(margin=12.0)],
                         ids=["cap2048", "margin12"])
def test_gpu_candidates_over_capacity(variant, search, dtype):
    """More candidates than select_cap (about 3100 > 2048; margin 12: 4300-5200 > 4096),
    streamed from the parts' regions: torch.topk's values, and the slots of the indices."""
    logits, lengths = gpu_case(64, 65536, full=True, seed=21)
    logits = logits.to(dtype)
    table = torch.randperm(64 * 1024, device="cuda").to(torch.int32).view(64, 1024)
    requests = torch.arange(64, device="cuda", dtype=torch.int32)
    slots = torch.empty(64, 2048, dtype=torch.int32, device="cuda")
    out = launch_topk(logits, lengths, 2048, slots=SlotArgs(slots, table, requests, 64,
                                                            64 * 1024),
                      streamed_search=search, **variant)
    check_topk(logits.float(), lengths, 2048, None, out)
    picked = logits.float().gather(1, out.long()).sort(1, descending=True).values
    assert torch.equal(picked, logits.float().topk(2048).values)
    assert torch.equal(slots, torch.ops.dsa.indices_to_slots(out, table, requests, 64,
                                                              64 * 1024))


@pytest.mark.gpu
def test_gpu_compile_fullgraph():
    logits, lengths = gpu_case(16, 32768, seed=3, next_n=2)
    fn = torch.compile(lambda x, lens: torch.ops.dsa.topk_indices(x, lens, 2048),
                       fullgraph=True)
    check_topk(logits, lengths, 2048, None, fn(logits, lengths))


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "n"), [(2, 65536), (128, 32768)])
def test_gpu_cuda_graph_replay(rows, n):
    """Captured once, replayed with new logits and new lengths in the same buffers."""
    logits, lengths = gpu_case(rows, n, seed=11)
    torch.ops.dsa.topk_indices(logits, lengths, 2048)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.dsa.topk_indices(logits, lengths, 2048)
    for seed in (12, 13):
        new_logits, new_lengths = gpu_case(rows, n, seed=seed)
        logits.copy_(new_logits)
        lengths.copy_(new_lengths)
        graph.replay()
        torch.cuda.synchronize()
        check_topk(logits, lengths, 2048, None, out)


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "n"), [(1, 4096), (64, 65536), (128, 32768), (256, 8192)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_slots_and_bf16(rows, n, dtype):
    """The fused op at the benchmark shapes: the top-k of the (bf16) values, and exactly
    ``indices_to_slots`` of its indices; eager and replayed from a CUDA graph."""
    logits, lengths = gpu_case(rows, n, seed=rows + 7)
    logits = logits.to(dtype)
    gen = torch.Generator(device="cuda").manual_seed(rows)
    width = n // 64
    table = torch.randint(-1, rows * width, (rows, width), device="cuda", generator=gen,
                          dtype=torch.int32)
    requests = torch.randint(-1, rows + 1, (rows,), device="cuda", generator=gen,
                             dtype=torch.int32)
    args = (logits, lengths, 2048, table, requests, 64, rows * width - 5)

    def check(out, slots):
        check_topk(logits.float(), lengths, 2048, None, out)
        assert torch.equal(slots, torch.ops.dsa.indices_to_slots(out, *args[3:]))

    check(*torch.ops.dsa.topk_indices_and_slots(*args))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, slots = torch.ops.dsa.topk_indices_and_slots(*args)
    new_logits, new_lengths = gpu_case(rows, n, seed=rows + 8)
    logits.copy_(new_logits)
    lengths.copy_(new_lengths)
    graph.replay()
    torch.cuda.synchronize()
    check(out, slots)
