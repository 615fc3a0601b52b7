"""Top-k selection of the indexer logits (design §3): ``dsa::topk_indices``,
``dsa::topk_indices_and_slots`` and ``dsa::topk_indices_and_slots_consume``.

Row ``r`` of ``logits`` (fp32 or bf16) is valid on columns ``[s, s + len)`` clipped to
``[0, N)``, where ``s = starts[r]`` (0 without ``starts``) and ``len = max(lengths[r], 0)``.
The output row holds the positions ``column - s`` of the ``min(k, valid)`` largest valid
logits, then -1. Order inside a row and the choice among equal values are free; columns
outside the valid range may hold anything (junk, +inf, NaN) and are never selected.
``topk_indices_and_slots`` also returns the selection's K-cache slots, exactly
``indices_to_slots(indices, block_table, row_requests, block_size, num_blocks)``;
``topk_indices_and_slots_consume`` returns the same for logits that are dead after it (a
step's scratch): their contents are unspecified on return (declared as a mutation). On an
NVIDIA GPU it drops each row's lines from L2 unwritten once the row is selected, so a step
does not write the logits back to HBM under the next layer's reads (H200, BENCHMARKS.md,
"thirty-eighth": a layer step at (64, 64K) and (128, 32K) 3.4-4.4 µs shorter under
``bench_step.py``'s timer, 3.6-4.8 back to back; a 20-layer model 198.5 µs a layer against
202.6).

CUDA face: an exact selection on order-preserving int32 keys (from the fp32 value), in
Triton, two launches (one when no row can be longer than ``select_cap``).

1. candidates (rows longer than ``select_cap``; ``parts`` programs per row): each program
   estimates from a sample of the row (``sample_groups`` groups of ``sample_width``
   consecutive columns) a key T about ``margin`` standard deviations of the sample count
   below the k-th largest, then streams its part of the row once (the next block's load
   in flight while one is ranked) and stores the keys >= T with their output indices (one
   int64 each) in its region of ``select_cap`` entries, and their count.
2. select (one program per row): the row's candidates, or, for rows with ``valid <=
   select_cap``, the whole row, are held in registers; a search on the key (multisection
   or radix select, ``Tuning.search``; bf16 on 16-bit keys) finds the k-th largest, and
   the larger keys and enough equal ones are written. Rows with more than ``select_cap``
   candidates (T too low), each part's within its region, run a search
   (``Tuning.streamed_search``) over the stored candidates instead, reading them from the
   regions (L2) once per step. Rows whose candidates are fewer than k (T too high) or
   overflow a region run it over the whole row, streaming its logits once per step
   (exact, much slower).
   Rows with ``valid <= k`` are written directly (``0 .. valid - 1`` then -1). With slots,
   the program then reads its row of indices back and writes their slots.

Every step is deterministic (slots come from prefix sums in a fixed order); there is no
host sync, no atomic and no data-dependent size: the ops capture in a CUDA graph. Launch
parameters: :class:`Tuning` (defaults ``TUNING``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsa.ops._checks import INDEX_DTYPES, check_int, check_tensor
from dsa.ops._l2 import discard_lines
from dsa.ops._launch import (
    CHAIN_ROWS,
    chain_pdl,
    launch,
    on_nvidia_gpu,
    pdl_chain_wait,
    pdl_launch,
)
from dsa.ops._registry import dsa_op
from dsa.ops.topk.select import (
    INT_MIN,
    gather,
    in_span,
    kth_search,
    part_span,
    region_offsets,
    row_range,
    scatter,
    search_key,
    select_write,
    slots,
    streamed_kth,
    tie_position,
    tile,
    unaligned_offset,
    write_all,
    write_streamed,
)
from dsa.ops.topk.slots import _indices_to_slots_cpu, check_slot_args, request_row, slot_of

# --- validation, CPU face ----------------------------------------------------------------


def _check_rows(op: str, name: str, t: Tensor, logits: Tensor) -> None:
    check_tensor(op, name, t, dtype=INDEX_DTYPES, contiguous=True, like=logits)
    if t.numel() != logits.shape[0]:
        raise ValueError(
            f"dsa.{op}: `{name}` must have one entry per logits row ({logits.shape[0]}), "
            f"got shape {tuple(t.shape)}"
        )


def _check_topk(op: str, logits: Tensor, lengths: Tensor, k: int, starts: Tensor | None
                ) -> Tensor:
    check_tensor(op, "logits", logits, dtype=LOGITS_DTYPES, ndim=2)
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


LOGITS_DTYPES = (torch.float32, torch.bfloat16)


@dsa_op("topk_indices")
def _topk_out(logits: Tensor, lengths: Tensor, k: int, starts: Tensor | None = None) -> Tensor:
    return _check_topk("topk_indices", logits, lengths, k, starts)


def _check_topk_slots(op: str, logits: Tensor, lengths: Tensor, k: int, block_table: Tensor,
                      row_requests: Tensor, block_size: int, num_blocks: int,
                      starts: Tensor | None) -> tuple[Tensor, Tensor]:
    out = _check_topk(op, logits, lengths, k, starts)
    check_slot_args(op, block_table, row_requests, logits.shape[0], logits, block_size,
                    num_blocks)
    return out, torch.empty_like(out)


@dsa_op("topk_indices_and_slots")
def _topk_slots_out(logits: Tensor, lengths: Tensor, k: int, block_table: Tensor,
                    row_requests: Tensor, block_size: int, num_blocks: int,
                    starts: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return _check_topk_slots("topk_indices_and_slots", logits, lengths, k, block_table,
                             row_requests, block_size, num_blocks, starts)


@dsa_op("topk_indices_and_slots_consume", mutates_args=("logits",))
def _topk_slots_consume_out(logits: Tensor, lengths: Tensor, k: int, block_table: Tensor,
                            row_requests: Tensor, block_size: int, num_blocks: int,
                            starts: Tensor | None = None) -> tuple[Tensor, Tensor]:
    op = "topk_indices_and_slots_consume"
    outputs = _check_topk_slots(op, logits, lengths, k, block_table, row_requests, block_size,
                                num_blocks, starts)
    rows, n_cols = logits.shape
    if rows > 1 and logits.stride(0) < n_cols:  # a row's discard would reach the next row
        raise ValueError(f"dsa.{op}: `logits` rows must not overlap (stride(0) >= shape[1]), "
                         f"got shape {tuple(logits.shape)} and strides {logits.stride()}")
    return outputs


def order_keys(x: Tensor) -> Tensor:
    """int32 keys of fp32 or bf16 ``x`` whose signed order is the float order (-0 < +0)."""
    return flip_order(x.float().view(torch.int32))


def flip_order(bits: Tensor) -> Tensor:
    """int32 fp32 bits -> order keys, and back: the map is its own inverse."""
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


@_topk_slots_out.cpu
def _topk_slots_cpu(logits: Tensor, lengths: Tensor, k: int, block_table: Tensor,
                    row_requests: Tensor, block_size: int, num_blocks: int,
                    starts: Tensor | None = None) -> tuple[Tensor, Tensor]:
    _topk_slots_out(logits, lengths, k, block_table, row_requests, block_size, num_blocks,
                    starts)
    out = _topk_cpu(logits, lengths, k, starts)
    return out, _indices_to_slots_cpu(out, block_table, row_requests, block_size, num_blocks)


@_topk_slots_consume_out.cpu
def _topk_slots_consume_cpu(logits: Tensor, lengths: Tensor, k: int, block_table: Tensor,
                            row_requests: Tensor, block_size: int, num_blocks: int,
                            starts: Tensor | None = None) -> tuple[Tensor, Tensor]:
    args = (logits, lengths, k, block_table, row_requests, block_size, num_blocks, starts)
    _topk_slots_consume_out(*args)  # this op's checks first (its name, overlapping rows)
    return _topk_slots_cpu(*args)  # the logits left as they are: one of the allowed contents


@triton.jit
def _sample_threshold(row_ptr, lo, hi, k, margin, G: tl.constexpr, W: tl.constexpr,
                      RADIX: tl.constexpr, PIVOTS: tl.constexpr):
    """Key T with about ``k + margin * sqrt(k)`` (scaled to the sample) of the row's keys
    >= T, from G groups of up to W consecutive columns spread over the row."""
    valid = hi - lo
    stride = tl.maximum(valid // G, 1)
    width = tl.minimum(stride, W)
    i = tl.arange(0, G * W)
    member = i % W
    cols = lo + (i // W) * stride + member
    ok = (member < width) & (cols < hi)
    keys = tl.where(ok, search_key(tl.load(row_ptr + cols, mask=ok, other=0.0)), INT_MIN)
    n_s = tl.sum(ok.to(tl.int32))
    expect = n_s.to(tl.float32) * k / valid.to(tl.float32)  # sample keys >= the k-th largest
    spread = tl.sqrt(expect)
    rank = tl.minimum(tl.maximum((expect + margin * spread).to(tl.int32) + 2, 1), n_s)
    # any count in [rank, rank + spread] will do
    t, _, _ = kth_search(keys, ok, n_s, rank, rank + spread.to(tl.int32), RADIX, PIVOTS, False)
    return t


@triton.jit
def _keep_block(row_ptr, region, ahead, cols, a, b, t, lo, off, seen, INSIDE: tl.constexpr,
                BLOCK: tl.constexpr, CAP: tl.constexpr):
    """One block of the candidates stream: its keys >= T (``ahead``: the block's logits)
    into the region after the ``seen`` before; returns the next block's logits (its load in
    flight while this one is ranked and stored) and the new count. INSIDE: this block and
    the next lie wholly in ``[a, b)``: no masks."""
    key = search_key(ahead)
    if INSIDE:
        ahead = tl.load(row_ptr + cols + BLOCK)
        take = key >= t
    else:
        ahead = tl.load(row_ptr + cols + BLOCK, mask=cols + BLOCK < b, other=0.0)
        take = in_span(cols, a, b) & (key >= t)
    before, total = slots(take.to(tl.int32))
    pos = seen + before
    packed = (key.to(tl.int64) << 32) | ((cols - lo + off).to(tl.int64) & 0xFFFFFFFF)
    scatter(region + pos, packed, take & (pos < CAP), BLOCK)
    return ahead, seen + total


@triton.jit
def _candidates_kernel(logits_ptr, stride_row, lengths_ptr, starts_ptr, cand_ptr, count_ptr,
                       n_cols, k, margin, HAS_STARTS: tl.constexpr, PARTS: tl.constexpr,
                       G: tl.constexpr, W: tl.constexpr, CAP: tl.constexpr,
                       BLOCK: tl.constexpr, C: tl.constexpr, RADIX: tl.constexpr,
                       PIVOTS: tl.constexpr, EARLY_LOAD: tl.constexpr, UNMASKED: tl.constexpr,
                       PDL: tl.constexpr):
    """Program (row, part) of a row with ``valid > CAP``: the row's threshold T from a
    sample, then the part's keys >= T with their output indices (one int64: key in the
    high half) into its region of ``CAP`` entries, and their count (it may exceed CAP).
    EARLY_LOAD: the part's first block is loaded before the threshold is searched.
    UNMASKED: the blocks lying wholly in the part's span, their next block too, go without
    masks (a partial first block, the last whole one and a partial last one keep them)."""
    pdl_chain_wait(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    lo, hi, off = row_range(lengths_ptr, starts_ptr, row, n_cols, HAS_STARTS)
    if hi - lo > CAP:
        row_ptr = logits_ptr + unaligned_offset(row, stride_row)
        a, b, base = part_span(lo, hi, part, PARTS, BLOCK)
        offs = tile(BLOCK // C, C)
        if EARLY_LOAD:
            ahead = tl.load(row_ptr + base + offs, mask=base + offs < b, other=0.0)
        t = _sample_threshold(row_ptr, lo, hi, k, margin, G, W, RADIX, PIVOTS)
        if not EARLY_LOAD:
            ahead = tl.load(row_ptr + base + offs, mask=base + offs < b, other=0.0)
        region = cand_ptr + (row * PARTS + part).to(tl.int64) * CAP
        seen = tl.zeros([], tl.int32)
        if UNMASKED:
            # [base, inner): a partial first block; [inner, last): whole blocks followed by a
            # whole one; [last, b): the last whole block and a partial one
            inner = tl.where(a > base, base + BLOCK, base)
            last = inner + tl.maximum((b - inner) // BLOCK - 1, 0) * BLOCK
            for c in range(base, tl.minimum(inner, b), BLOCK):
                ahead, seen = _keep_block(row_ptr, region, ahead, c + offs, a, b, t, lo, off,
                                          seen, False, BLOCK, CAP)
            for c in range(inner, last, BLOCK):
                ahead, seen = _keep_block(row_ptr, region, ahead, c + offs, a, b, t, lo, off,
                                          seen, True, BLOCK, CAP)
            for c in range(last, b, BLOCK):
                ahead, seen = _keep_block(row_ptr, region, ahead, c + offs, a, b, t, lo, off,
                                          seen, False, BLOCK, CAP)
        else:
            for c in range(base, b, BLOCK):
                ahead, seen = _keep_block(row_ptr, region, ahead, c + offs, a, b, t, lo, off,
                                          seen, False, BLOCK, CAP)
        tl.store(count_ptr + row * PARTS + part, seen)


@triton.jit
def _select_kernel(logits_ptr, stride_row, lengths_ptr, starts_ptr, cand_ptr, count_ptr,
                   out_ptr, score_ptr, slots_ptr, table_ptr, table_stride, req_ptr, num_reqs,
                   width, num_blocks, n_cols, k, HAS_STARTS: tl.constexpr,
                   PARTS: tl.constexpr, CAP: tl.constexpr, C: tl.constexpr,
                   BLOCK: tl.constexpr, FINISH_BLOCK: tl.constexpr, PRELOAD: tl.constexpr,
                   SLOTS: tl.constexpr, BS: tl.constexpr, RADIX: tl.constexpr,
                   PIVOTS: tl.constexpr, STREAM_RADIX: tl.constexpr,
                   STREAM_PIVOTS: tl.constexpr, LOWEST: tl.constexpr, SCORES: tl.constexpr,
                   CANDIDATES: tl.constexpr, DISCARD: tl.constexpr, ELEM: tl.constexpr,
                   PDL: tl.constexpr):
    """Program per row: ``valid <= k``: all; ``valid <= CAP``: the row read whole into
    registers; else the parts' candidates: in registers (at most CAP), streamed from the
    parts' regions (more than CAP, each part's stored whole), or, when they are not all
    stored or fewer than k, the streamed search over the row. LOWEST: ties at the k-th
    largest go to the lowest positions (a second search, on the positions of the equal
    keys, where the candidates hold them out of order). SCORES: the selected
    logits (fp32) are written too, -inf past the valid ones. With SLOTS, the row's indices
    are then read back and written as cache slots (``indices_to_slots`` of the row).
    STREAM_RADIX, STREAM_PIVOTS: the streamed searches' RADIX and PIVOTS. CANDIDATES: rows
    may be longer than CAP (``n_cols > CAP``: the candidates pass ran). DISCARD: the row's
    logits (ELEM bytes each) are dropped from L2 at the end, unwritten (the caller's logits
    are dead: a step need not write them back to HBM)."""
    pdl_chain_wait(PDL)
    row = tl.program_id(0)
    row_ptr = logits_ptr + unaligned_offset(row, stride_row)
    j = tile(CAP // C, C)
    if PRELOAD:  # n_cols <= CAP and no starts: the row's load need not wait for its length
        whole = tl.load(row_ptr + j, mask=j < n_cols, other=0.0)
    if SLOTS:  # the row's request, read while the row is selected
        table_row, req_ok = request_row(table_ptr, table_stride, tl.load(req_ptr + row),
                                        num_reqs)
    lo, hi, off = row_range(lengths_ptr, starts_ptr, row, n_cols, HAS_STARTS)
    counts = count_ptr + row * PARTS
    if CANDIDATES:  # the regions' offsets, their counts read with the length (which decides)
        src, total, largest = region_offsets(counts, j, PARTS, CAP)
    else:
        src, total, largest = j, lo * 0, lo * 0
    out_row = out_ptr + row.to(tl.int64) * k
    score_row = score_ptr + row.to(tl.int64) * k
    if hi - lo <= k:
        write_all(out_row, score_row, row_ptr, lo, hi - lo, off, k, FINISH_BLOCK, SCORES)
    elif hi - lo <= CAP:
        member = j < hi - lo
        if PRELOAD:
            keys = search_key(whole)
        else:
            keys = search_key(tl.load(row_ptr + lo + j, mask=member, other=0.0))
        select_write(keys, j + off, member, hi - lo, k, out_row, score_row, CAP, RADIX,
                     PIVOTS, LOWEST, SCORES)
    else:
        cand_row = cand_ptr + row.to(tl.int64) * (PARTS * CAP)
        if (total >= k) & (total <= CAP):
            member = j < total
            packed = gather(cand_row + src, member, CAP)
            select_write((packed >> 32).to(tl.int32), packed.to(tl.int32), member, total, k,
                         out_row, score_row, CAP, RADIX, PIVOTS, LOWEST, SCORES)
        elif (total >= k) & (largest <= CAP):  # all stored, streamed from the regions
            t, c_lo, c_hi = streamed_kth(cand_row, counts, k, 0, total, CAP, C, STREAM_RADIX,
                                         STREAM_PIVOTS, PARTS)
            p = INT_MIN
            if LOWEST:  # noqa: SIM102 (a compile-time test, then a run-time one)
                if c_lo != k:  # a tie at the k-th largest: the lowest positions
                    p = tie_position(cand_row, counts, k, t, c_lo, c_hi, total, CAP, C, PARTS,
                                     STREAM_PIVOTS)
            write_streamed(cand_row, counts, out_row, score_row, k, t, c_lo, c_hi, p, 0, total,
                           0, CAP, C, PARTS, LOWEST, SCORES)
        else:
            t, c_lo, c_hi = streamed_kth(row_ptr, counts, k, lo, hi, BLOCK, C, STREAM_RADIX,
                                         STREAM_PIVOTS, 0)
            write_streamed(row_ptr, counts, out_row, score_row, k, t, c_lo, c_hi, INT_MIN, lo,
                           hi, off, BLOCK, C, 0, LOWEST, SCORES)
    # slots from the indices read back: a table gather per register-tile element costs more
    # (H200, the select kernel at 64x65536 10.3 us against 9.4; BENCHMARKS.md, "twenty-eighth")
    if SLOTS:
        tl.debug_barrier()  # the row's indices, scattered by every thread, are in memory
        slot_row = slots_ptr + row.to(tl.int64) * k
        for c in range(0, k, FINISH_BLOCK):
            i = c + tl.arange(0, FINISH_BLOCK)
            idx = tl.load(out_row + i, mask=i < k, other=-1)
            tl.store(slot_row + i, slot_of(idx, table_row, req_ok, width, num_blocks, BS),
                     mask=i < k)
    if DISCARD:
        tl.debug_barrier()  # every read of the row is done
        start = row_ptr.to(tl.int64)
        discard_lines(start, start + n_cols * ELEM, FINISH_BLOCK)


# --- launch ------------------------------------------------------------------------------


def choose_parts(rows: int, n_cols: int, *, target_programs: int, min_part_cols: int,
                 max_parts: int, max_parts_programs: int) -> int:
    """Programs per row of the candidates pass: enough to fill the GPU, each streaming >=
    ``min_part_cols``; ``max_parts`` a row only within ``max_parts_programs`` programs (the
    select kernel reads a row's candidates from that many regions)."""
    parts, rows = 1, max(rows, 1)
    while (2 * parts <= max_parts and 2 * parts * rows <= target_programs
           and 2 * parts * min_part_cols <= n_cols
           and (2 * parts < max_parts or 2 * parts * rows <= max_parts_programs)):
        parts *= 2
    return parts


def choose_block(parts: int) -> int:
    """Columns per step of the passes over a row: 4096, or 2048 with one candidates program
    per row (many rows: the GPU holds more programs of the smaller tile; H200, 4096
    causal rows: 0.37 ms vs 0.46 at 32K columns, 1.68 vs 1.91 at 128K)."""
    return 2048 if parts == 1 else 4096


def choose_select_cap(n_cols: int, k: int, *, row_cols: int) -> int:
    """Candidates held in registers by the select kernel: the whole row when ``n_cols <=
    row_cols`` (no candidates pass), else room for about twice k."""
    if n_cols <= row_cols:
        return max(16, triton.next_power_of_2(n_cols))
    return min(MAX_SELECT_CAP, max(4096, triton.next_power_of_2(2 * k)))


def choose_sample_groups(n_cols: int, k: int, *, groups: int, width: int, expect: int) -> int:
    """Groups of the threshold's sample: at least ``groups``, and enough for about
    ``expect`` of the sample's keys above the k-th largest of an ``n_cols`` row, up to
    ``MAX_SELECT_CAP`` keys. The count of a row's keys above the threshold (its
    candidates) spreads as ``1 / sqrt(expect)``; past ``select_cap`` (about 2k) the select
    kernel streams them from the candidates' regions, several times slower. For i.i.d.
    keys (ranks only: the count above the sample's r-th largest is Beta distributed) and
    the default margin, a row overflows 2k with probability 0.14 at 32 keys expected above
    the k-th (512 groups of 4 over 128K columns), 0.6 at 16 (256K), 0.97 at 4 (1M), 2e-3 at
    64 (64K) and below 1e-6 at 128."""
    enough = triton.next_power_of_2(max(1, -(-expect * n_cols // (k * width))))
    return max(groups, min(enough, MAX_SELECT_CAP // width))


def choose_select_warps(rows: int, n_cols: int, select_cap: int, *, many_rows: int,
                        scale_rows: int) -> int:
    """Warps of the select kernel: 4 when it reads many whole rows, or with at least
    ``scale_rows`` rows (more programs per SM), else 8 (shorter reductions for the few)."""
    return 4 if (n_cols <= select_cap and rows >= many_rows) or rows >= scale_rows else 8


# the search packs two counts below 2**16 into one int32
MAX_SELECT_CAP = 1 << 15
# Tuning.search -> (digit bits of the radix select (0: multisection), pivots per step)
SEARCHES = {"trisect": (0, 2), "quintisect": (0, 4), "radix": (8, 2), "radix4": (4, 2)}


# Tuning.candidates_regs / select_regs for None with at least Tuning.scale_rows rows
CANDIDATES_REGS, SELECT_REGS = 96, 80


def _regs(maxnreg: int | None, full: int, rows: int, scale_rows: int) -> dict[str, int]:
    """Triton's launch option capping a kernel's registers per thread: ``maxnreg``, or for
    None ``full`` with at least ``scale_rows`` rows and no cap below; 0: no cap."""
    if maxnreg is None:
        maxnreg = full if rows >= scale_rows else 0
    return {"maxnreg": maxnreg} if maxnreg else {}


def _power_of_two(**values: int) -> None:
    for name, value in values.items():
        if value < 1 or value & (value - 1):
            raise ValueError(f"launch_topk: `{name}` must be a power of two, got {value}")


class SlotArgs(NamedTuple):
    """What the slot transform needs (``indices_to_slots`` without the indices) and where
    its output goes."""

    out: Tensor
    block_table: Tensor
    row_requests: Tensor
    block_size: int
    num_blocks: int


@dataclass(frozen=True)
class Tuning:
    """Launch parameters of the Triton top-k (``TUNING``: the defaults, printed by
    ``benchmarks/bench_topk_sweep.py``).

    block: columns per step of the passes over a row (None: :func:`choose_block`).
        row_cols: rows of at most this many columns are read whole by the select kernel
        (no candidates pass); with at least ``scale_rows`` rows, ``scale_row_cols`` (there
        the GPU is full and the search's work per row counts, not its latency).
    sample_groups, sample_width: the threshold's sample (``sample_groups * sample_width <=
        2**15``), grown to about ``sample_expect`` keys above the k-th largest
        (:func:`choose_sample_groups`); margin: the threshold sits ``margin`` standard
        deviations of the sample count below the estimated k-th largest.
    num_warps: the candidates pass; early_load: its first block's load is issued before
        the threshold's search (in flight during it). target_programs, min_part_cols,
        max_parts, max_parts_programs: its programs per row (:func:`choose_parts`; H200,
        16x65536 N(0, 1) rows, 16.4 µs with 8 programs a row against 17.1 with 16, after
        256 MB read over; 8x65536: 16.0 with 16 against 17.1 with 8). many_rows: the select
        kernel takes 4 warps instead of 8 when it reads at least this many whole rows
        (:func:`choose_select_warps`).
    search: how the k-th largest key is found (:func:`~dsa.ops.topk.select.kth_search`):
        "trisect" (two pivots counted per block reduction: the bracket cut to a third),
        "quintisect" (four pivots, two reductions in one: to a fifth), "radix" (radix
        select, 8-bit digits: up to four histogram passes) or "radix4" (4-bit digits: up to
        eight cheaper passes); bf16 logits are searched on 16-bit keys. streamed_search:
        the same for the searches that stream the candidates or the row once per step
        (None: ``search``), where a pass costs reads and fewer passes win.
    candidates_regs, select_regs: registers per thread the compiler may use in the
        candidates pass and the select kernel (Triton's ``maxnreg``; 0: its own choice;
        None: 96 and 80 with at least ``scale_rows`` rows, its own choice below). Fewer
        registers leave room for more programs per SM, which a GPU full of rows (prefill)
        needs more than each program's speed. H200 (a9234ab, ms): 4096 causal rows of 128K
        columns, candidates 1.95 -> 1.41 (96); 16K causal rows of 8K, select 0.395 -> 0.295
        (128, 4 warps); 64 rows of 64K, candidates 0.017 -> 0.025 (128), select 0.020 ->
        0.037 (128, 4 warps), so not below ``scale_rows``. The select at 80 against 128
        (bench_prefill's chunks, top-k summed, ms): 1.00 / 1.11 at 4x8K, 1.82 / 1.96 at
        1x32K, 20.6 / 21.2 at 1x128K (64: 1.03, 1.93, 21.1; 96: 1.02, 1.83, 20.8).
        torch.compile keeps the caps (the launch keyword reaches the kernel: 1.41 ms
        compiled as eager, at 40a20ff).
    unmasked_rows: with rows in this closed range, the candidates pass streams the blocks
        lying wholly in a part's span without masks (None: never). H100 (launch_topk with
        slots, graph µs, two rounds): 22.6 -> 22.0 at 64x64K, 22.9 -> 22.3 at 128x32K, 23.9
        -> 22.7 at 64x64K with ragged lengths, 20.7 -> 20.4 at 16x64K; 20.0 -> 22.6 at
        2x128K and 416.6 -> 420.7 at 4096 causal prefill rows of 32K, hence the bounds.
    preload_rows: with at most this many rows read whole (and no starts), a row's load is
        issued before its length is known (the latency of one read fewer; more rows hide
        it anyway, and the load reads past short lengths). finish_block: step of the rows
        with ``valid <= k`` and of the slot transform (one step for k = 2048: each step
        waits for its reads).
    """

    block: int | None = None
    row_cols: int = 8192
    scale_rows: int = 1024
    scale_row_cols: int = 4096
    # 256 groups of 8 keys (a 32-byte sector a group for fp32; grown past 32K columns). H200
    # with early_load, fused op, mean of 4 cases (bench_topk_sweep): 22.5 µs at 64x64K, 21.1
    # at 128x32K, 20.8 at 2x128K against 23.3, 22.0, 22.8 with 512 groups of 4, late load
    sample_groups: int = 256
    sample_width: int = 8
    sample_expect: int = 128
    margin: float = 4.0
    num_warps: int = 4  # H200: 27.0 µs vs 28.5 at 64x64K, 28.6 vs 30.5 at 128x32K (8 warps)
    target_programs: int = 256
    min_part_cols: int = 4096
    max_parts: int = 16
    max_parts_programs: int = 128
    many_rows: int = 128
    preload_rows: int = 128
    finish_block: int = 2048
    candidates_regs: int | None = None
    select_regs: int | None = None
    search: str = "trisect"  # H200: quintisect 31.8 µs vs 28.5 at 64x64K (bench_topk_sweep)
    streamed_search: str | None = "quintisect"  # a row streamed: 207 µs vs 336 (trisect)
    early_load: bool = True  # H200, with width 8: 20.7 µs vs 22.2 at 2x128K (late load)
    unmasked_rows: tuple[int, int] | None = (16, 128)

    def parts(self, rows: int, n_cols: int) -> int:
        """Candidates programs a row of ``rows`` rows of ``n_cols`` columns (:func:`choose_parts`
        with these fields)."""
        return choose_parts(rows, n_cols, target_programs=self.target_programs,
                            min_part_cols=self.min_part_cols, max_parts=self.max_parts,
                            max_parts_programs=self.max_parts_programs)


TUNING = Tuning()


def _unmasked(bounds: tuple[int, int] | None, rows: int) -> bool:
    """Whether ``rows`` rows take the candidates pass's unmasked stream
    (``Tuning.unmasked_rows``)."""
    return bounds is not None and bounds[0] <= rows <= bounds[1]


def launch_topk(logits: Tensor, lengths: Tensor, k: int, starts: Tensor | None = None, *,
                out: Tensor | None = None, slots: SlotArgs | None = None,
                scores: Tensor | None = None, lowest: bool = False,
                parts: int | None = None, select_cap: int | None = None,
                select_warps: int | None = None, discard: bool = False,
                **tuning: Any) -> Tensor:
    """Runs the Triton top-k (arguments already validated) into ``out`` and returns it;
    with ``slots``, also writes the selection's cache slots into ``slots.out``; with
    ``scores`` (``[rows, k]`` fp32, fp32 logits only), the selected logits, -inf past the
    valid ones. lowest: of the logits equal to the k-th largest, those of the lowest
    positions are taken (else any).

    parts: programs per row of the candidates pass (power of two; None =
        :func:`choose_parts`). select_cap: candidates per row held in registers (power of
        two <= 2**15; None = :func:`choose_select_cap`): rows with ``valid <= select_cap``
        are read whole by the select kernel, longer ones pass the threshold first.
        select_warps: the select kernel's warps (None = :func:`choose_select_warps`).
        discard: the logits are dead after the call: on an NVIDIA GPU each row's L2 lines
        are dropped, unwritten, once the row is selected (its contents become undefined).
        tuning: fields of :class:`Tuning` replacing those of ``TUNING``.
    """
    if scores is not None and logits.dtype != torch.float32:
        raise ValueError(f"launch_topk: `scores` needs float32 logits, got {logits.dtype}")
    tune = replace(TUNING, **tuning)
    finish_block = tune.finish_block
    sample_groups, sample_width = tune.sample_groups, tune.sample_width
    rows, n_cols = logits.shape
    if out is None:
        out = logits.new_empty((rows, k), dtype=torch.int32)
    if rows == 0:
        return out
    if parts is None:
        parts = tune.parts(rows, n_cols)
    block = choose_block(parts) if tune.block is None else tune.block
    if select_cap is None:
        row_cols = tune.row_cols if rows < tune.scale_rows else tune.scale_row_cols
        select_cap = choose_select_cap(n_cols, k, row_cols=row_cols)
    sample_groups = choose_sample_groups(n_cols, k, groups=sample_groups,
                                         width=sample_width, expect=tune.sample_expect)
    if select_warps is None:
        select_warps = choose_select_warps(rows, n_cols, select_cap, many_rows=tune.many_rows,
                                           scale_rows=tune.scale_rows)
    _power_of_two(parts=parts, block=block, finish_block=finish_block, select_cap=select_cap,
                  sample_groups=sample_groups, sample_width=sample_width)
    if max(block, finish_block, select_cap, sample_groups * sample_width) > MAX_SELECT_CAP:
        raise ValueError(f"launch_topk: `block`, `finish_block`, `select_cap` and "
                         f"`sample_groups * sample_width` must be <= {MAX_SELECT_CAP}")
    streamed_search = tune.search if tune.streamed_search is None else tune.streamed_search
    for name, search in (("search", tune.search), ("streamed_search", streamed_search)):
        if search not in SEARCHES:
            raise ValueError(f"launch_topk: `{name}` must be one of {sorted(SEARCHES)}, "
                             f"got {search!r}")
    head = (logits, logits.stride(0), lengths, lengths if starts is None else starts)
    radix, pivots = SEARCHES[tune.search]
    stream_radix, stream_pivots = SEARCHES[streamed_search]
    pdl = chain_pdl(logits, rows <= CHAIN_ROWS, rows)
    flags = dict(HAS_STARTS=starts is not None, RADIX=radix, PIVOTS=pivots, PDL=pdl,
                 **pdl_launch(pdl > 0))
    # per (row, part): select_cap packed candidates, then the counts
    cand = torch.empty(rows * parts * select_cap, dtype=torch.int64, device=logits.device)
    counts = torch.empty(rows * parts, dtype=torch.int32, device=logits.device)
    if n_cols > select_cap:  # some rows may be longer than the candidates
        launch(_candidates_kernel, (rows, parts),
            *head, cand, counts, n_cols, k, min(max(float(tune.margin), -1e4), 1e4),
            PARTS=parts, G=sample_groups, W=sample_width, CAP=select_cap, BLOCK=block,
            C=min(block, 128 * tune.num_warps), EARLY_LOAD=bool(tune.early_load),
            UNMASKED=_unmasked(tune.unmasked_rows, rows),
            num_warps=tune.num_warps, **flags,
            **_regs(tune.candidates_regs, CANDIDATES_REGS, rows, tune.scale_rows),
        )
    if slots is None:  # placeholders, never read
        slot_args = (out, lengths, 0, lengths, 0, 0, 0)
        slot_flags = dict(SLOTS=False, BS=1)
    else:
        table = slots.block_table
        slot_args = (slots.out, table, table.stride(0), slots.row_requests, *table.shape,
                     slots.num_blocks)
        slot_flags = dict(SLOTS=True, BS=slots.block_size)
    launch(_select_kernel, (rows,),
        *head, cand, counts, out, logits if scores is None else scores, *slot_args, n_cols, k,
        PARTS=parts, CAP=select_cap, LOWEST=bool(lowest), SCORES=scores is not None,
        C=min(select_cap, block, 128 * select_warps), BLOCK=block, FINISH_BLOCK=finish_block,
        STREAM_RADIX=stream_radix, STREAM_PIVOTS=stream_pivots,
        PRELOAD=n_cols <= select_cap and starts is None and rows <= tune.preload_rows,
        CANDIDATES=n_cols > select_cap, DISCARD=discard and on_nvidia_gpu(logits),
        ELEM=logits.element_size(), num_warps=select_warps, **flags, **slot_flags,
        **_regs(tune.select_regs, SELECT_REGS, rows, tune.scale_rows),
    )
    return out


@_topk_out.triton
def _topk_cuda(logits: Tensor, lengths: Tensor, k: int, starts: Tensor | None = None) -> Tensor:
    out = _topk_out(logits, lengths, k, starts)
    return launch_topk(logits, lengths, k, starts, out=out)


@_topk_slots_out.triton
def _topk_slots_cuda(logits: Tensor, lengths: Tensor, k: int, block_table: Tensor,
                     row_requests: Tensor, block_size: int, num_blocks: int,
                     starts: Tensor | None = None) -> tuple[Tensor, Tensor]:
    out, slots = _topk_slots_out(logits, lengths, k, block_table, row_requests, block_size,
                                 num_blocks, starts)
    launch_topk(logits, lengths, k, starts, out=out,
                slots=SlotArgs(slots, block_table, row_requests, block_size, num_blocks))
    return out, slots


@_topk_slots_consume_out.cuda
def _topk_slots_consume_cuda(logits: Tensor, lengths: Tensor, k: int, block_table: Tensor,
                             row_requests: Tensor, block_size: int, num_blocks: int,
                             starts: Tensor | None = None) -> tuple[Tensor, Tensor]:
    out, slots = _topk_slots_consume_out(logits, lengths, k, block_table, row_requests,
                                         block_size, num_blocks, starts)
    launch_topk(logits, lengths, k, starts, out=out, discard=True,
                slots=SlotArgs(slots, block_table, row_requests, block_size, num_blocks))
    return out, slots
