"""Top-k selection of the indexer logits (design §3): ``dsa::topk_indices``.

Row ``r`` of ``logits`` is valid on columns ``[s, s + len)`` clipped to ``[0, N)``, where
``s = starts[r]`` (0 without ``starts``) and ``len = max(lengths[r], 0)``. The output row
holds the positions ``column - s`` of the ``min(k, valid)`` largest valid logits, then -1.
Order inside a row and the choice among equal values are free; columns outside the valid
range may hold anything (junk, +inf, NaN) and are never selected.

CUDA face: an exact selection on order-preserving int32 keys, in Triton, two launches.

1. candidates (rows longer than ``select_cap``; ``parts`` programs per row): each program
   estimates from a sample of the row (``sample_groups`` groups of ``sample_width``
   consecutive columns) a key T about ``margin`` standard deviations of the sample count
   below the k-th largest, then streams its part of the row once and stores the keys >= T
   with their output indices (one int64 each) and their count.
2. select (one program per row): the row's candidates, or, for rows with ``valid <=
   select_cap``, the whole row, are held in registers; a trisection on the key finds the
   k-th largest, and the larger keys and enough equal ones are written. Rows whose
   candidates are fewer than k (T too high) or more than ``select_cap`` (too low) run the
   same search over the whole row instead, streaming it once per step (exact, slower).
   Rows with ``valid <= k`` are written directly (``0 .. valid - 1`` then -1).

Every step is deterministic (slots come from prefix sums in a fixed order); there is no
host sync, no atomic and no data-dependent size: the op captures in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsa.ops._checks import INDEX_DTYPES, check_int, check_tensor
from dsa.ops._launch import launch
from dsa.ops._registry import dsa_op
from dsa.ops.topk.select import (
    INT_MIN,
    gather,
    in_span,
    kth_search,
    order_key,
    part_span,
    row_range,
    scatter,
    select_streamed,
    select_write,
    slots,
    tile,
    write_all,
)

# --- validation, CPU face ----------------------------------------------------------------


def _check_rows(op: str, name: str, t: Tensor, logits: Tensor) -> None:
    check_tensor(op, name, t, dtype=INDEX_DTYPES, contiguous=True, like=logits)
    if t.numel() != logits.shape[0]:
        raise ValueError(
            f"dsa.{op}: `{name}` must have one entry per logits row ({logits.shape[0]}), "
            f"got shape {tuple(t.shape)}"
        )


@dsa_op("topk_indices")
def _topk_out(logits: Tensor, lengths: Tensor, k: int, starts: Tensor | None = None) -> Tensor:
    op = "topk_indices"
    check_tensor(op, "logits", logits, dtype=torch.float32, ndim=2)
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError(
            f"dsa.{op}: `logits` must have unit column stride (stride(1) == 1), "
            f"got strides {logits.stride()}"
        )
    _check_rows(op, "lengths", lengths, logits)
    check_int(op, "k", k, low=1)
    if starts is not None:
        _check_rows(op, "starts", starts, logits)
    return logits.new_empty((logits.shape[0], k), dtype=torch.int32)


def order_keys(x: Tensor) -> Tensor:
    """int32 keys of fp32 ``x`` whose signed order is the float order (-0 < +0)."""
    bits = x.view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@_topk_out.cpu
def _topk_cpu(logits: Tensor, lengths: Tensor, k: int, starts: Tensor | None = None) -> Tensor:
    out = _topk_out(logits, lengths, k, starts)
    rows, n = logits.shape
    start = torch.zeros(rows, dtype=torch.long) if starts is None else starts.long().view(rows)
    end = start + lengths.long().view(rows).clamp(min=0)
    lo = start.clamp(0, n)
    hi = torch.maximum(end.clamp(0, n), lo)
    cols = torch.arange(n)
    valid = (cols >= lo[:, None]) & (cols < hi[:, None])
    keys = torch.where(valid, order_keys(logits).long(), -(2**40))
    width = min(k, n)
    out.fill_(-1)
    if rows and width:
        picked = keys.topk(width, dim=1).indices
        count = (hi - lo).clamp(max=k)
        slot = torch.arange(width)
        out[:, :width] = torch.where(slot < count[:, None], picked - start[:, None], -1)
    return out


@triton.jit
def _sample_threshold(row_ptr, lo, hi, k, margin, G: tl.constexpr, W: tl.constexpr):
    """Key T with about ``k + margin * sqrt(k)`` (scaled to the sample) of the row's keys
    >= T, from G groups of up to W consecutive columns spread over the row."""
    valid = hi - lo
    stride = tl.maximum(valid // G, 1)
    width = tl.minimum(stride, W)
    i = tl.arange(0, G * W)
    member = i % W
    cols = lo + (i // W) * stride + member
    ok = (member < width) & (cols < hi)
    keys = tl.where(ok, order_key(tl.load(row_ptr + cols, mask=ok, other=0.0)), INT_MIN)
    n_s = tl.sum(ok.to(tl.int32))
    expect = n_s.to(tl.float32) * k / valid.to(tl.float32)  # sample keys >= the k-th largest
    spread = tl.sqrt(expect)
    rank = tl.minimum(tl.maximum((expect + margin * spread).to(tl.int32) + 2, 1), n_s)
    # any count in [rank, rank + spread] will do
    t, _ = kth_search(keys, ok, rank, rank + spread.to(tl.int32))
    return t


@triton.jit
def _candidates_kernel(logits_ptr, stride_row, lengths_ptr, starts_ptr, cand_ptr, count_ptr,
                       n_cols, k, margin, HAS_STARTS: tl.constexpr, PARTS: tl.constexpr,
                       G: tl.constexpr, W: tl.constexpr, CAP: tl.constexpr,
                       BLOCK: tl.constexpr, C: tl.constexpr):
    """Program (row, part) of a row with ``valid > CAP``: the row's threshold T from a
    sample, then the part's keys >= T with their output indices (one int64: key in the
    high half) into its region of ``CAP`` entries, and their count (it may exceed CAP)."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    lo, hi, off = row_range(lengths_ptr, starts_ptr, row, n_cols, HAS_STARTS)
    if hi - lo > CAP:
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        t = _sample_threshold(row_ptr, lo, hi, k, margin, G, W)
        a, b, base = part_span(lo, hi, part, PARTS, BLOCK)
        region = cand_ptr + (row * PARTS + part).to(tl.int64) * CAP
        offs = tile(BLOCK // C, C)
        seen = tl.zeros([], tl.int32)
        for c in range(base, b, BLOCK):
            cols = c + offs
            key = order_key(tl.load(row_ptr + cols, mask=cols < n_cols, other=0.0))
            take = in_span(cols, a, b) & (key >= t)
            before, total = slots(take.to(tl.int32))
            pos = seen + before
            packed = (key.to(tl.int64) << 32) | ((cols - lo + off).to(tl.int64) & 0xFFFFFFFF)
            scatter(region + pos, packed, take & (pos < CAP), BLOCK)
            seen += total
        tl.store(count_ptr + row * PARTS + part, seen)


@triton.jit
def _select_kernel(logits_ptr, stride_row, lengths_ptr, starts_ptr, cand_ptr, count_ptr,
                   out_ptr, n_cols, k, HAS_STARTS: tl.constexpr, PARTS: tl.constexpr,
                   CAP: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr,
                   FINISH_BLOCK: tl.constexpr):
    """Program per row: ``valid <= k``: all; ``valid <= CAP``: the row read whole into
    registers; else the parts' candidates, or the streamed search when they are not
    usable (fewer than k, or more than CAP)."""
    row = tl.program_id(0)
    lo, hi, off = row_range(lengths_ptr, starts_ptr, row, n_cols, HAS_STARTS)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    out_row = out_ptr + row.to(tl.int64) * k
    j = tile(CAP // C, C)
    if hi - lo <= k:
        write_all(out_row, hi - lo, off, k, FINISH_BLOCK)
    elif hi - lo <= CAP:
        member = j < hi - lo
        keys = order_key(tl.load(row_ptr + lo + j, mask=member, other=0.0))
        select_write(keys, j + off, member, k, out_row, CAP)
    else:
        total = tl.zeros([], tl.int32)
        src = j
        for p in tl.static_range(PARTS):
            count = tl.load(count_ptr + row * PARTS + p)
            src = tl.where((j >= total) & (j - total < count), p * CAP + j - total, src)
            total += count
        if (total >= k) & (total <= CAP):
            member = j < total
            packed = gather(cand_ptr + row.to(tl.int64) * (PARTS * CAP) + src, member, CAP)
            select_write((packed >> 32).to(tl.int32), packed.to(tl.int32), member, k,
                          out_row, CAP)
        else:
            select_streamed(row_ptr, out_row, k, lo, hi, off, BLOCK, C)


# --- launch ------------------------------------------------------------------------------


def choose_parts(rows: int, n_cols: int, *, target_programs: int = 256,
                 min_part_cols: int = 4096, max_parts: int = 16) -> int:
    """Programs per row of the candidates pass: enough to fill the GPU, each streaming >=
    ``min_part_cols``."""
    parts = 1
    while (parts < max_parts and 2 * parts * max(rows, 1) <= target_programs
           and 2 * parts * min_part_cols <= n_cols):
        parts *= 2
    return parts


def choose_select_cap(n_cols: int, k: int, *, row_cols: int = 8192) -> int:
    """Candidates held in registers by the select kernel: the whole row when ``n_cols <=
    row_cols`` (no candidates pass), else room for about twice k."""
    if n_cols <= row_cols:
        return max(16, triton.next_power_of_2(n_cols))
    return min(MAX_SELECT_CAP, max(4096, triton.next_power_of_2(2 * k)))


def choose_select_warps(rows: int, n_cols: int, select_cap: int) -> int:
    """Warps of the select kernel: 4 when it reads many whole rows (more programs per SM),
    else 8 (shorter reductions for the few)."""
    return 4 if n_cols <= select_cap and rows >= 128 else 8


# the search packs two counts below 2**16 into one int32
MAX_SELECT_CAP = 1 << 15


def _power_of_two(**values: int) -> None:
    for name, value in values.items():
        if value < 1 or value & (value - 1):
            raise ValueError(f"launch_topk: `{name}` must be a power of two, got {value}")


def launch_topk(logits: Tensor, lengths: Tensor, k: int, starts: Tensor | None = None, *,
                out: Tensor | None = None, parts: int | None = None, block: int = 4096,
                select_cap: int | None = None, row_cols: int = 8192,
                sample_groups: int = 1024, sample_width: int = 4, margin: float = 4.0,
                num_warps: int = 8, select_warps: int | None = None,
                target_programs: int = 256, min_part_cols: int = 4096,
                finish_block: int = 1024) -> Tensor:
    """Runs the Triton top-k (arguments already validated) into ``out`` and returns it.

    parts: programs per row of the candidates pass (power of two; None =
        :func:`choose_parts` with ``target_programs`` and ``min_part_cols``).
    block: columns per step of the passes over a row. select_cap: candidates per row held
        in registers (power of two <= 2**15; None = :func:`choose_select_cap` with
        ``row_cols``): rows with ``valid <= select_cap`` are read whole by the select
        kernel, longer ones pass the threshold first.
    sample_groups, sample_width: the threshold's sample (``sample_groups * sample_width <=
        2**15``); margin: the threshold sits ``margin`` standard deviations of the sample
        count below the estimated k-th largest. num_warps: the candidates pass;
        select_warps: the select kernel (None = :func:`choose_select_warps`).
        finish_block: step of the rows with ``valid <= k``.
    """
    rows, n_cols = logits.shape
    if out is None:
        out = logits.new_empty((rows, k), dtype=torch.int32)
    if rows == 0:
        return out
    if parts is None:
        parts = choose_parts(rows, n_cols, target_programs=target_programs,
                             min_part_cols=min_part_cols)
    if select_cap is None:
        select_cap = choose_select_cap(n_cols, k, row_cols=row_cols)
    if select_warps is None:
        select_warps = choose_select_warps(rows, n_cols, select_cap)
    _power_of_two(parts=parts, block=block, finish_block=finish_block, select_cap=select_cap,
                  sample_groups=sample_groups, sample_width=sample_width)
    if max(block, finish_block, select_cap, sample_groups * sample_width) > MAX_SELECT_CAP:
        raise ValueError(f"launch_topk: `block`, `finish_block`, `select_cap` and "
                         f"`sample_groups * sample_width` must be <= {MAX_SELECT_CAP}")
    head = (logits, logits.stride(0), lengths, lengths if starts is None else starts)
    flags = dict(HAS_STARTS=starts is not None)
    # per (row, part): select_cap packed candidates, then the counts
    cand = torch.empty(rows * parts * select_cap, dtype=torch.int64, device=logits.device)
    counts = torch.empty(rows * parts, dtype=torch.int32, device=logits.device)
    if n_cols > select_cap:  # some rows may be longer than the candidates
        launch(_candidates_kernel, (rows, parts),
            *head, cand, counts, n_cols, k, min(max(float(margin), -1e4), 1e4), PARTS=parts,
            G=sample_groups, W=sample_width, CAP=select_cap, BLOCK=block,
            C=min(block, 128 * num_warps), num_warps=num_warps, **flags,
        )
    launch(_select_kernel, (rows,),
        *head, cand, counts, out, n_cols, k, PARTS=parts, CAP=select_cap,
        C=min(select_cap, block, 128 * select_warps), BLOCK=block, FINISH_BLOCK=finish_block,
        num_warps=select_warps, **flags,
    )
    return out


@_topk_out.triton
def _topk_cuda(logits: Tensor, lengths: Tensor, k: int, starts: Tensor | None = None) -> Tensor:
    out = _topk_out(logits, lengths, k, starts)
    return launch_topk(logits, lengths, k, starts, out=out)
