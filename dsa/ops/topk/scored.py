"""Top-k with scores in one total order (design §3, §11): ``dsa::topk_scored`` and
``dsa::dcp_merge_topk``.

The order: a higher score first, ties to the lower position. Scores compare as their
order-preserving int32 keys (the float order, with -0 < +0, +NaN above +inf and -NaN below
-inf), so every face ranks every bit pattern the same way.

- ``topk_scored(logits, lengths, k, sorted=True)``: row ``r`` is valid on columns
  ``[0, min(max(lengths[r], 0), N))``; the output holds the ``min(k, valid)`` first valid
  columns in the order and their logits, then -1 and -inf. Columns past the length are
  never selected.
- ``dcp_merge_topk(scores, indices, sorted=True)``: ``[W, T, k]`` candidates (an index < 0
  is no candidate; the last dimension contiguous) -> the first k per token in the same
  order, as ``[T, k]`` indices and scores, -1 / -inf padded. With each rank's
  ``topk_scored`` over its shard, in global positions, this is the top-k of the unsharded
  row (a global winner also wins within its shard).

``sorted=False`` selects the same set (the tie rule included) and leaves its order inside a
row free, as ``topk_indices`` does; each face's order is deterministic. The CUDA faces then
skip the sort, which costs more than the selection (the exact cross-rank top-k needs the
set only). The CPU faces always sort.

CUDA faces: ``topk_scored`` is ``topk_indices``' selection with the lowest positions taken
among logits equal to the k-th largest (a second search, on the positions, only on such a
tie) and the selected logits written with the indices, in one launch; sorted, a second one
sorts each row. ``dcp_merge_topk`` takes one program per token: sorted, its ``W * k``
candidates sorted; else the same selection as ``topk_scored``'s, on the candidates. The
sorts are on one int64 per entry: the key in the high half, ``2**31 - 1 - position`` in
the low half.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsa.ops._checks import INDEX_DTYPES, check_int, check_tensor
from dsa.ops._launch import launch
from dsa.ops._registry import dsa_op
from dsa.ops.topk.indices import (
    MAX_SELECT_CAP,
    SEARCHES,
    TUNING,
    flip_order,
    launch_topk,
    order_keys,
)
from dsa.ops.topk.select import (
    INT_MIN,
    key_value,
    order_key,
    scatter,
    select_positions,
    slots,
    tile,
    unaligned_offset,
)

MAX_POSITION = 2**31 - 1
NO_ENTRY = -(2**63)  # sorts after every entry
MERGE_WARPS = 8  # the merge kernels' warps
# Candidates one program sorts in shared memory (8 bytes each: 128 KB); a sorted merge of
# more first selects its k unsorted, then sorts those.
MAX_SORT = 1 << 14


def _check_logits(op: str, logits: Tensor) -> None:
    check_tensor(op, "logits", logits, dtype=torch.float32, ndim=2)
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError(f"dsa.{op}: `logits` must have unit column stride (stride(1) == 1), "
                         f"got strides {logits.stride()}")


def _ordered(keys: Tensor, positions: Tensor, valid: Tensor) -> Tensor:
    """Torch: int64 entries whose descending order is the module's order (NO_ENTRY where
    not ``valid``)."""
    return torch.where(valid, (keys.long() << 32) | (MAX_POSITION - positions.long()), NO_ENTRY)


def _first_k(entries: Tensor, k: int, indices: Tensor, scores: Tensor) -> tuple[Tensor, Tensor]:
    """Torch: writes the first k entries of each row (valid ones first) as indices and
    scores, -1 / -inf past the valid ones."""
    indices.fill_(-1)
    scores.fill_(float("-inf"))
    width = min(k, entries.shape[1])
    if entries.shape[0] and width:
        top = entries.topk(width, dim=1).values
        taken = top != NO_ENTRY
        keys = (top >> 32).int()
        indices[:, :width] = torch.where(taken, MAX_POSITION - (top & 0xFFFFFFFF), -1).int()
        scores[:, :width] = torch.where(taken, flip_order(keys).view(torch.float32),
                                        float("-inf"))
    return indices, scores


# --- topk_scored -------------------------------------------------------------------------


@dsa_op("topk_scored")
def _topk_scored_out(logits: Tensor, lengths: Tensor, k: int, sorted: bool = True
                     ) -> tuple[Tensor, Tensor]:
    op = "topk_scored"
    _check_logits(op, logits)
    check_tensor(op, "lengths", lengths, dtype=INDEX_DTYPES, contiguous=True, like=logits)
    if lengths.numel() != logits.shape[0]:
        raise ValueError(f"dsa.{op}: `lengths` must have one entry per logits row "
                         f"({logits.shape[0]}), got shape {tuple(lengths.shape)}")
    check_int(op, "k", k, low=1)
    rows = logits.shape[0]
    return (logits.new_empty((rows, k), dtype=torch.int32),
            logits.new_empty((rows, k), dtype=torch.float32))


@_topk_scored_out.cpu
def _topk_scored_cpu(logits: Tensor, lengths: Tensor, k: int, sorted: bool = True
                     ) -> tuple[Tensor, Tensor]:
    indices, scores = _topk_scored_out(logits, lengths, k, sorted)
    rows, n = logits.shape
    cols = torch.arange(n)
    valid = cols < lengths.long().view(rows, 1).clamp(min=0)
    return _first_k(_ordered(order_keys(logits), cols.expand(rows, n), valid), k, indices,
                    scores)


@triton.jit
def _sorted_pairs(key, pos, real):
    """The ``real`` (order key, position) pairs sorted by key, descending, equal keys by
    lowest position, the others last: their positions (-1 past the real ones) and values
    (-inf there)."""
    entry = tl.where(real, (key.to(tl.int64) << 32) | (2147483647 - pos).to(tl.int64),
                     -9223372036854775808)
    entry = tl.sort(entry, descending=True)
    taken = entry != -9223372036854775808
    return (tl.where(taken, (2147483647 - (entry & 0xFFFFFFFF)).to(tl.int32), -1),
            tl.where(taken, key_value((entry >> 32).to(tl.int32)), float("-inf")))


@triton.jit
def _sort_rows_kernel(idx_ptr, score_ptr, k, KP: tl.constexpr):
    """Program per row: its k (index, score) pairs sorted in place into the module's order
    (-1 indices last)."""
    out = tl.program_id(0).to(tl.int64) * k
    j = tl.arange(0, KP)
    idx = tl.load(idx_ptr + out + j, mask=j < k, other=-1)
    key = order_key(tl.load(score_ptr + out + j, mask=j < k, other=0.0))
    idx, score = _sorted_pairs(key, idx, idx >= 0)
    tl.store(idx_ptr + out + j, idx, mask=j < k)
    tl.store(score_ptr + out + j, score, mask=j < k)


def launch_topk_scored(logits: Tensor, lengths: Tensor, k: int, sorted: bool, indices: Tensor,
                       scores: Tensor) -> tuple[Tensor, Tensor]:
    """Runs the Triton ``topk_scored`` (arguments already validated) into ``indices`` and
    ``scores`` and returns them."""
    rows = logits.shape[0]
    if rows == 0:
        return indices, scores
    launch_topk(logits, lengths, k, out=indices, scores=scores, lowest=True)
    if sorted:
        launch(_sort_rows_kernel, (rows,), indices, scores, k, KP=triton.next_power_of_2(k),
               num_warps=8)
    return indices, scores


@_topk_scored_out.triton
def _topk_scored_cuda(logits: Tensor, lengths: Tensor, k: int, sorted: bool = True
                      ) -> tuple[Tensor, Tensor]:
    indices, scores = _topk_scored_out(logits, lengths, k, sorted)
    return launch_topk_scored(logits, lengths, k, sorted, indices, scores)


# --- dcp_merge_topk ----------------------------------------------------------------------


def check_merge_size(op: str, world: int, k: int, sorted: bool) -> None:
    """The merge's limits: ``world * k`` candidates per token (the DCP ranks' top-k each) at
    most ``MAX_SELECT_CAP``, and sorted, ``k`` at most ``MAX_SORT``."""
    if world * k > MAX_SELECT_CAP:
        raise ValueError(f"dsa.{op}: the merge across DCP ranks takes W * k <= "
                         f"{MAX_SELECT_CAP} candidates per token (dcp_world * topk), got "
                         f"{world} * {k}")
    if sorted and k > MAX_SORT:
        raise ValueError(f"dsa.{op}: a sorted merge takes k <= {MAX_SORT}, got {k}")


@dsa_op("dcp_merge_topk")
def _dcp_merge_out(scores: Tensor, indices: Tensor, sorted: bool = True
                   ) -> tuple[Tensor, Tensor]:
    op = "dcp_merge_topk"
    check_tensor(op, "scores", scores, dtype=torch.float32, ndim=3)
    check_tensor(op, "indices", indices, dtype=INDEX_DTYPES, ndim=3, like=scores)
    if indices.shape != scores.shape:
        raise ValueError(f"dsa.{op}: `indices` must have the shape of `scores` "
                         f"{tuple(scores.shape)} ([W, T, k]), got {tuple(indices.shape)}")
    world, tokens, k = scores.shape
    if k < 1:
        raise ValueError(f"dsa.{op}: `scores` must have k >= 1 candidates per rank and token "
                         f"(dimension 2), got shape {tuple(scores.shape)}")
    for name, t in (("scores", scores), ("indices", indices)):
        if k > 1 and t.stride(2) != 1:
            raise ValueError(f"dsa.{op}: `{name}` must have unit stride in dimension 2, got "
                             f"strides {t.stride()}")
    check_merge_size(op, world, k, sorted)
    return (indices.new_empty((tokens, k)), scores.new_empty((tokens, k)))


@_dcp_merge_out.cpu
def _dcp_merge_cpu(scores: Tensor, indices: Tensor, sorted: bool = True
                   ) -> tuple[Tensor, Tensor]:
    out_indices, out_scores = _dcp_merge_out(scores, indices, sorted)
    world, tokens, k = scores.shape
    keys = order_keys(scores).permute(1, 0, 2).reshape(tokens, world * k)
    positions = indices.permute(1, 0, 2).reshape(tokens, world * k)
    return _first_k(_ordered(keys, positions, positions >= 0), k, out_indices, out_scores)


@triton.jit
def _candidates(score_ptr, idx_ptr, token, s_rank, s_token, i_rank, i_token, k, n, e):
    """Candidates ``e`` (rank-major: ``e // k`` the rank) of a token: (position, key, real);
    keys of no candidate are INT_MIN."""
    rank = (e // k).to(tl.int64)
    col = e % k
    member = e < n
    pos = tl.load(idx_ptr + rank * i_rank + unaligned_offset(token, i_token) + col,
                  mask=member, other=-1)
    score = tl.load(score_ptr + rank * s_rank + unaligned_offset(token, s_token) + col,
                    mask=member, other=0.0)
    real = member & (pos >= 0)
    return pos, tl.where(real, order_key(score), INT_MIN), real


@triton.jit
def _dcp_merge_kernel(score_ptr, idx_ptr, out_idx_ptr, out_score_ptr, s_rank, s_token,
                      i_rank, i_token, k, n, NP: tl.constexpr):
    """Program per token: its ``n = W * k`` candidates sorted, the first k written."""
    token = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, NP)
    pos, key, real = _candidates(score_ptr, idx_ptr, token, s_rank, s_token, i_rank, i_token,
                                 k, n, e)
    idx, score = _sorted_pairs(key, pos, real)
    out = token * k + e
    tl.store(out_idx_ptr + out, idx, mask=e < k)
    tl.store(out_score_ptr + out, score, mask=e < k)


@triton.jit
def _dcp_select_kernel(score_ptr, idx_ptr, out_idx_ptr, out_score_ptr, s_rank, s_token,
                       i_rank, i_token, k, n, NP: tl.constexpr, C: tl.constexpr,
                       KP: tl.constexpr, RADIX: tl.constexpr, PIVOTS: tl.constexpr):
    """Program per token, unsorted: of its ``n = W * k`` candidates (an ``[NP // C, C]``
    tile) the keys above the k-th largest and, of the equal ones, the lowest positions."""
    token = tl.program_id(0).to(tl.int64)
    pos, key, take = _candidates(score_ptr, idx_ptr, token, s_rank, s_token, i_rank,
                                 i_token, k, n, tile(NP // C, C))
    count = tl.sum(take.to(tl.int32))
    if count > k:
        take, at = select_positions(key, pos, take, count, k, RADIX, PIVOTS, True)
    else:
        at, _ = slots(take.to(tl.int32))
    out = token * k
    scatter(out_idx_ptr + out + at, pos, take, NP)
    scatter(out_score_ptr + out + at, key_value(key), take, NP)
    j = tl.arange(0, KP)
    pad = (j >= count) & (j < k)
    tl.store(out_idx_ptr + out + j, tl.full([KP], -1, tl.int32), mask=pad)
    tl.store(out_score_ptr + out + j, tl.full([KP], float("-inf"), tl.float32), mask=pad)


def launch_dcp_merge(scores: Tensor, indices: Tensor, sorted: bool, out_indices: Tensor,
                     out_scores: Tensor) -> tuple[Tensor, Tensor]:
    """Runs the Triton ``dcp_merge_topk`` (arguments already validated) into ``out_indices``
    and ``out_scores`` and returns them; the unsorted merge searches as ``Tuning.search``."""
    world, tokens, k = scores.shape
    if tokens == 0 or world == 0:
        out_indices.fill_(-1)
        out_scores.fill_(float("-inf"))
        return out_indices, out_scores
    strides = (*scores.stride()[:2], *indices.stride()[:2])
    n = world * k
    np_ = triton.next_power_of_2(n)
    if sorted and np_ > MAX_SORT:  # the k selected unsorted, then sorted: the same rows
        launch_dcp_merge(scores, indices, False, out_indices, out_scores)
        return launch_dcp_merge(out_scores[None].clone(), out_indices[None].clone(), True,
                                out_indices, out_scores)
    if sorted:
        launch(_dcp_merge_kernel, (tokens,), scores, indices, out_indices, out_scores,
               *strides, k, n, NP=np_, num_warps=MERGE_WARPS)
    else:
        radix, pivots = SEARCHES[TUNING.search]
        launch(_dcp_select_kernel, (tokens,), scores, indices, out_indices, out_scores,
               *strides, k, n, NP=np_, C=min(np_, 128 * MERGE_WARPS),
               KP=triton.next_power_of_2(k), RADIX=radix, PIVOTS=pivots, num_warps=MERGE_WARPS)
    return out_indices, out_scores


@_dcp_merge_out.triton
def _dcp_merge_cuda(scores: Tensor, indices: Tensor, sorted: bool = True
                    ) -> tuple[Tensor, Tensor]:
    out_indices, out_scores = _dcp_merge_out(scores, indices, sorted)
    return launch_dcp_merge(scores, indices, sorted, out_indices, out_scores)
