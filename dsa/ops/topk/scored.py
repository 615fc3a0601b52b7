"""Top-k with scores in one total order (design §3, §11): ``dsa::topk_scored`` and
``dsa::dcp_merge_topk``.

The order: a higher score first, ties to the lower position. Scores compare as their
order-preserving int32 keys (the float order, with -0 < +0, +NaN above +inf and -NaN below
-inf), so every face ranks every bit pattern the same way.

- ``topk_scored(logits, lengths, k)``: row ``r`` is valid on columns ``[0, min(max(
  lengths[r], 0), N))``; the output holds the ``min(k, valid)`` first valid columns in the
  order and their logits, then -1 and -inf. Columns past the length are never selected.
- ``dcp_merge_topk(scores, indices)``: ``[W, T, k]`` candidates (an index < 0 is no
  candidate) -> the first k per token in the same order, as ``[T, k]`` indices and scores,
  -1 / -inf padded. With each rank's ``topk_scored`` over its shard, in global positions,
  this is the top-k of the unsharded row (a global winner also wins within its shard).

CUDA faces: ``topk_scored`` takes an exact top-(k + 1) set from ``topk_indices``' kernels;
with m its smallest key (the (k + 1)-th largest of the row), its keys above m are sorted;
only when they are fewer than k (m is also the k-th largest: a tie at the threshold) one
pass over the row, up to the last column of m in the set, fills the remaining slots with
the lowest columns holding m. ``dcp_merge_topk``
sorts each token's ``W * k`` candidates in one program. Both sort on one int64 per entry:
the key in the high half, ``2**31 - 1 - position`` in the low half.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsa.ops._checks import INDEX_DTYPES, check_int, check_tensor
from dsa.ops._launch import launch
from dsa.ops._registry import dsa_op
from dsa.ops.topk.indices import flip_order, launch_topk, order_keys
from dsa.ops.topk.select import INT_MAX, key_value, order_key

MAX_POSITION = 2**31 - 1
NO_ENTRY = -(2**63)  # sorts after every entry


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
def _topk_scored_out(logits: Tensor, lengths: Tensor, k: int) -> tuple[Tensor, Tensor]:
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
def _topk_scored_cpu(logits: Tensor, lengths: Tensor, k: int) -> tuple[Tensor, Tensor]:
    indices, scores = _topk_scored_out(logits, lengths, k)
    rows, n = logits.shape
    cols = torch.arange(n)
    valid = cols < lengths.long().view(rows, 1).clamp(min=0)
    return _first_k(_ordered(order_keys(logits), cols.expand(rows, n), valid), k, indices,
                    scores)


@triton.jit
def _topk_scored_kernel(logits_ptr, stride_row, sel_ptr, idx_ptr, score_ptr, k,
                        KP: tl.constexpr, BLOCK: tl.constexpr):
    """Program per row: ``sel`` holds an exact top-(k + 1) set (ties free), its last entry
    apart. With m the smallest of its keys, the keys above m are written sorted; when they
    are fewer than k, the k-th largest key is m and the remaining slots take the lowest
    columns holding m, found by one pass up to the last such column of the set."""
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    sel_row = sel_ptr + row.to(tl.int64) * (k + 1)
    out = row.to(tl.int64) * k
    j = tl.arange(0, KP)
    idx = tl.load(sel_row + j, mask=j < k, other=-1)
    taken = idx >= 0
    key = order_key(tl.load(row_ptr + idx, mask=taken, other=0.0))
    extra = tl.load(sel_row + k)
    full = extra >= 0  # more than k valid columns
    extra_key = order_key(tl.load(row_ptr + tl.maximum(extra, 0), mask=full, other=0.0))
    kept = tl.where(taken, key, INT_MAX)
    m = tl.minimum(tl.min(kept), tl.where(full, extra_key, INT_MAX))
    # the extra entry takes the place of one entry holding m when it is larger
    swap = (j == tl.argmin(kept, 0)) & full & (extra_key > m)
    last = tl.max(tl.where(taken & (key == m), idx, -1))
    last = tl.maximum(last, tl.where(full & (extra_key == m), extra, -1))
    idx = tl.where(swap, extra, idx)
    key = tl.where(swap, extra_key, key)
    above = taken & ((key > m) | (extra < 0))
    n_above = tl.sum(above.to(tl.int32))
    count = tl.where(full, k, tl.sum(taken.to(tl.int32)))
    entry = tl.where(above, (key.to(tl.int64) << 32) | (2147483647 - idx).to(tl.int64),
                     -9223372036854775808)
    entry = tl.sort(entry, descending=True)
    first = (entry >> 32).to(tl.int32)
    score = key_value(first)
    tl.store(idx_ptr + out + j, (2147483647 - (entry & 0xFFFFFFFF)).to(tl.int32),
             mask=j < n_above)
    tl.store(score_ptr + out + j, score, mask=j < n_above)
    pad = (j >= count) & (j < k)
    tl.store(idx_ptr + out + j, tl.full([KP], -1, tl.int32), mask=pad)
    tl.store(score_ptr + out + j, tl.full([KP], float("-inf"), tl.float32), mask=pad)
    # slots n_above .. count - 1: the first columns holding m (none when count == n_above)
    need = count - n_above
    last = tl.where(need > 0, last, -1)
    m_score = key_value(m)
    seen = tl.zeros([], tl.int32)
    for c in range(0, last + 1, BLOCK):
        cols = c + tl.arange(0, BLOCK)
        inside = cols <= last
        equal = inside & (order_key(tl.load(row_ptr + cols, mask=inside, other=0.0)) == m)
        flags = equal.to(tl.int32)
        rank = seen + tl.cumsum(flags, 0) - flags
        write = equal & (rank < need)
        tl.store(idx_ptr + out + n_above + rank, cols, mask=write)
        tl.store(score_ptr + out + n_above + rank, tl.zeros([BLOCK], tl.float32) + m_score,
                 mask=write)
        seen += tl.sum(flags)


def launch_topk_scored(logits: Tensor, lengths: Tensor, k: int, *, indices: Tensor | None = None,
                       scores: Tensor | None = None, block: int = 1024) -> tuple[Tensor, Tensor]:
    """Runs the Triton ``topk_scored`` (arguments already validated) into ``indices`` and
    ``scores`` and returns them. block: columns per step of the pass over equal keys."""
    rows = logits.shape[0]
    if indices is None:
        indices = logits.new_empty((rows, k), dtype=torch.int32)
    if scores is None:
        scores = logits.new_empty((rows, k), dtype=torch.float32)
    if rows == 0:
        return indices, scores
    selected = launch_topk(logits, lengths, k + 1)
    launch(_topk_scored_kernel, (rows,), logits, logits.stride(0), selected, indices, scores, k,
           KP=triton.next_power_of_2(k), BLOCK=block, num_warps=8)
    return indices, scores


@_topk_scored_out.triton
def _topk_scored_cuda(logits: Tensor, lengths: Tensor, k: int) -> tuple[Tensor, Tensor]:
    indices, scores = _topk_scored_out(logits, lengths, k)
    return launch_topk_scored(logits, lengths, k, indices=indices, scores=scores)


# --- dcp_merge_topk ----------------------------------------------------------------------


@dsa_op("dcp_merge_topk")
def _dcp_merge_out(scores: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
    op = "dcp_merge_topk"
    check_tensor(op, "scores", scores, dtype=torch.float32, ndim=3, contiguous=True)
    check_tensor(op, "indices", indices, dtype=INDEX_DTYPES, ndim=3, contiguous=True,
                 like=scores)
    if indices.shape != scores.shape:
        raise ValueError(f"dsa.{op}: `indices` must have the shape of `scores` "
                         f"{tuple(scores.shape)} ([W, T, k]), got {tuple(indices.shape)}")
    _, tokens, k = scores.shape
    if k < 1:
        raise ValueError(f"dsa.{op}: `scores` must have k >= 1 candidates per rank and token "
                         f"(dimension 2), got shape {tuple(scores.shape)}")
    return (indices.new_empty((tokens, k)), scores.new_empty((tokens, k)))


@_dcp_merge_out.cpu
def _dcp_merge_cpu(scores: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
    out_indices, out_scores = _dcp_merge_out(scores, indices)
    world, tokens, k = scores.shape
    keys = order_keys(scores).permute(1, 0, 2).reshape(tokens, world * k)
    positions = indices.permute(1, 0, 2).reshape(tokens, world * k)
    return _first_k(_ordered(keys, positions, positions >= 0), k, out_indices, out_scores)


@triton.jit
def _dcp_merge_kernel(score_ptr, idx_ptr, out_idx_ptr, out_score_ptr, tokens, k,
                      WORLD: tl.constexpr, NP: tl.constexpr):
    """Program per token: its ``WORLD * k`` candidates sorted, the first k written."""
    token = tl.program_id(0)
    e = tl.arange(0, NP)
    member = e < WORLD * k
    src = (e // k).to(tl.int64) * tokens * k + token.to(tl.int64) * k + e % k
    pos = tl.load(idx_ptr + src, mask=member, other=-1)
    key = order_key(tl.load(score_ptr + src, mask=member, other=0.0))
    real = member & (pos >= 0)
    count = tl.sum(real.to(tl.int32))
    entry = tl.where(real, (key.to(tl.int64) << 32) | (2147483647 - pos).to(tl.int64),
                     -9223372036854775808)
    entry = tl.sort(entry, descending=True)
    first = (entry >> 32).to(tl.int32)
    taken = e < count
    out = token.to(tl.int64) * k + e
    tl.store(out_idx_ptr + out,
             tl.where(taken, (2147483647 - (entry & 0xFFFFFFFF)).to(tl.int32), -1), mask=e < k)
    tl.store(out_score_ptr + out,
             tl.where(taken, key_value(first), float("-inf")), mask=e < k)


@_dcp_merge_out.triton
def _dcp_merge_cuda(scores: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
    out_indices, out_scores = _dcp_merge_out(scores, indices)
    world, tokens, k = scores.shape
    if tokens and world:
        launch(_dcp_merge_kernel, (tokens,), scores, indices, out_indices, out_scores, tokens,
               k, WORLD=world, NP=triton.next_power_of_2(world * k), num_warps=8)
    else:
        out_indices.fill_(-1)
        out_scores.fill_(float("-inf"))
    return out_indices, out_scores
