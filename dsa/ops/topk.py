"""Top-k selection of the indexer logits (SPEC §3): ``dsa::topk_indices``.

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
from dsa.ops._registry import register

_INT_MIN = tl.constexpr(-(2**31))
_INT_MAX = tl.constexpr(2**31 - 1)


# --- validation, CPU face ----------------------------------------------------------------


def _check_rows(op: str, name: str, t: Tensor, logits: Tensor) -> None:
    check_tensor(op, name, t, dtype=INDEX_DTYPES, contiguous=True, like=logits)
    if t.numel() != logits.shape[0]:
        raise ValueError(
            f"dsa.{op}: `{name}` must have one entry per logits row ({logits.shape[0]}), "
            f"got shape {tuple(t.shape)}"
        )


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


# --- Triton building blocks --------------------------------------------------------------


@triton.jit
def _key(x):
    """fp32 -> int32 key with the same order (its own inverse on the bits)."""
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _flag(cond):
    """A scalar condition as a plain int1 (the 3.9 interpreter mistypes a broadcast compare)."""
    return tl.where(cond, True, False)


@triton.jit
def _inside(cols, a, b):
    """``a <= cols < b`` in one unsigned compare."""
    return (cols - a).to(tl.uint32, bitcast=True) < (b - a).to(tl.uint32, bitcast=True)


@triton.jit
def _row_range(lengths_ptr, starts_ptr, row, n_cols, HAS_STARTS: tl.constexpr):
    """Valid columns ``[lo, hi)`` of a row and ``off = lo - start`` (output = col - lo + off)."""
    length = tl.maximum(tl.load(lengths_ptr + row).to(tl.int64), 0)
    start = tl.load(starts_ptr + row).to(tl.int64) if HAS_STARTS else length * 0
    lo = tl.minimum(tl.maximum(start, 0), n_cols)
    hi = tl.maximum(tl.minimum(start + length, n_cols), lo)
    return lo.to(tl.int32), hi.to(tl.int32), (lo - start).to(tl.int32)


@triton.jit
def _part_span(lo, hi, part, PARTS: tl.constexpr, BLOCK: tl.constexpr):
    """Part ``part`` of a row: columns ``[a, b)``, streamed in BLOCK steps from ``base``."""
    q0 = lo // BLOCK
    q1 = (hi + BLOCK - 1) // BLOCK
    per = (q1 - q0 + PARTS - 1) // PARTS
    c0 = tl.minimum(q0 + part * per, q1)
    c1 = tl.minimum(c0 + per, q1)
    base = c0 * BLOCK
    return tl.maximum(base, lo), tl.minimum(c1 * BLOCK, hi), base


@triton.jit
def _tile(R: tl.constexpr, C: tl.constexpr):
    """Offsets ``0 .. R*C - 1`` as an ``[R, C]`` tile, rows contiguous. With C a multiple of
    the thread count, a thread's elements of a column are its register repeats."""
    return tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]


@triton.jit
def _slots(flags):
    """Exclusive prefix sums of an ``[R, C]`` tile in column-major order, and its total:
    the sums down a column stay in one thread, so one cross-thread scan of C values ranks
    R * C elements."""
    per_col = tl.sum(flags, axis=0)
    col_before = tl.cumsum(per_col, 0) - per_col
    return col_before[None, :] + tl.cumsum(flags, 0) - flags, tl.sum(per_col)


@triton.jit
def _scatter(ptrs, values, mask, N: tl.constexpr):
    """Masked store of an ``[R, C]`` tile (N elements) through scattered pointers, flattened
    first: a 2-D store with data-dependent addresses gets a column-major layout of its own,
    and converting the tile to it (through shared memory) costs more than the stores."""
    tl.store(tl.reshape(ptrs, [N]), tl.reshape(values, [N]), mask=tl.reshape(mask, [N]))


@triton.jit
def _gather(ptrs, mask, N: tl.constexpr):
    """Masked load (0 elsewhere) of an ``[R, C]`` tile through scattered pointers, flattened
    like :func:`_scatter`."""
    flat = tl.load(tl.reshape(ptrs, [N]), mask=tl.reshape(mask, [N]), other=0)
    return tl.reshape(flat, ptrs.shape)


@triton.jit
def _next_pivots(lo, hi):
    """Two pivots ``lo < m1 <= m2 < hi`` cutting ``[lo, hi)`` (``hi - lo >= 2``) in thirds."""
    span = hi - lo
    m1 = lo + tl.maximum(span // 3, 1)
    return m1, tl.maximum(lo + (2 * span) // 3, m1)


@triton.jit
def _narrow(lo, hi, c_lo, m1, m2, c1, c2, need):
    """The bracket after counting both pivots: (lo, hi, c_lo) with count(lo) = c_lo >= need
    > count(hi)."""
    top = c2 >= need
    mid = c1 >= need
    return (tl.where(top, m2, tl.where(mid, m1, lo)), tl.where(top, hi, tl.where(mid, m2, m1)),
            tl.where(top, c2, tl.where(mid, c1, c_lo)))


@triton.jit
def _kth_search(keys, member, need, need_hi):
    """A key ``t`` with ``need <= count(key >= t) <= need_hi``, or, when no key has such a
    count, with ``count(key >= t) >= need > count(key > t)``; returns (t, count(key >= t)).
    Requires ``1 <= need <= count(member) <= 2**15``; non-member keys must be ``_INT_MIN``.

    Trisection of the key bracket ``[lo, hi)``: both pivots are counted by one block
    reduction (the counts packed in 16-bit halves), so a step costs what a bisection step
    does and cuts the bracket to a third."""
    lo = tl.min(tl.where(member, keys, _INT_MAX)).to(tl.int64)
    hi = tl.max(keys).to(tl.int64) + 1
    c_lo = tl.sum(member.to(tl.int32))
    while (hi - lo > 1) & ((c_lo < need) | (c_lo > need_hi)):
        m1, m2 = _next_pivots(lo, hi)
        packed = tl.sum((keys >= m1.to(tl.int32)).to(tl.int32)
                        + ((keys >= m2.to(tl.int32)).to(tl.int32) << 16))
        lo, hi, c_lo = _narrow(lo, hi, c_lo, m1, m2, packed & 0xFFFF, (packed >> 16) & 0xFFFF,
                               need)
    return lo.to(tl.int32), c_lo


@triton.jit
def _select_write(keys, idx, member, k, out_row, N: tl.constexpr):
    """Writes the output indices ``idx`` of the k largest member keys of an ``[R, C]`` tile
    (N elements, ``count(member) > k``; ties: the first in column-major order)."""
    keys = tl.where(member, keys, _INT_MIN)
    t, _ = _kth_search(keys, member, k, k)
    # keys > t are all taken (fewer than k), then keys == t up to k
    gt = member & (keys > t)
    eq = member & (keys == t)
    before, total = _slots(gt.to(tl.int32) + (eq.to(tl.int32) << 16))
    pos = tl.where(gt, before & 0xFFFF, (total & 0xFFFF) + (before >> 16))
    _scatter(out_row + pos, idx, (gt | eq) & (pos < k), N)


@triton.jit
def _write_all(out_row, valid, off, k, BLOCK: tl.constexpr):
    """A row with ``valid <= k``: ``off .. off + valid - 1`` then -1."""
    for c in range(0, k, BLOCK):
        j = c + tl.arange(0, BLOCK)
        tl.store(out_row + j, tl.where(j < valid, j + off, -1), mask=j < k)


@triton.jit
def _select_streamed(row_ptr, out_row, k, lo, hi, off, BLOCK: tl.constexpr, C: tl.constexpr):
    """The selection of a row with ``valid > k`` without candidates: the trisection counts
    over the whole row at each step, then one pass writes the keys above the k-th largest
    and the first equal ones."""
    offs = _tile(BLOCK // C, C)
    base = (lo // BLOCK) * BLOCK
    t_lo = tl.full([], _INT_MIN, tl.int64)
    t_hi = t_lo * 0 + _INT_MAX + 1
    c_lo = hi - lo
    c_hi = c_lo * 0
    while (t_hi - t_lo > 1) & (c_lo != k):
        m1, m2 = _next_pivots(t_lo, t_hi)
        n1 = tl.zeros([BLOCK // C, C], tl.int32)
        n2 = tl.zeros([BLOCK // C, C], tl.int32)
        for c in range(base, hi, BLOCK):
            cols = c + offs
            inside = _inside(cols, lo, hi)
            key = _key(tl.load(row_ptr + cols, mask=inside, other=0.0))
            n1 += (inside & (key >= m1.to(tl.int32))).to(tl.int32)
            n2 += (inside & (key >= m2.to(tl.int32))).to(tl.int32)
        c1 = tl.sum(n1)
        c2 = tl.sum(n2)
        c_hi = tl.where(c2 >= k, c_hi, tl.where(c1 >= k, c2, c1))
        t_lo, t_hi, c_lo = _narrow(t_lo, t_hi, c_lo, m1, m2, c1, c2, k)
    # c_lo == k: every key >= t is taken; else the c_hi keys > t, then the first equal ones
    t = t_lo.to(tl.int32)
    exact = _flag(c_lo == k)
    n_above = tl.where(exact, k, c_hi)
    seen_gt = tl.zeros([], tl.int32)
    seen_eq = tl.zeros([], tl.int32)
    for c in range(base, hi, BLOCK):
        cols = c + offs
        inside = _inside(cols, lo, hi)
        key = _key(tl.load(row_ptr + cols, mask=inside, other=0.0))
        gt = inside & ((key > t) | (exact & (key == t)))
        eq = inside & (key == t) & (~exact)
        before, total = _slots(gt.to(tl.int32) + (eq.to(tl.int32) << 16))
        pos = tl.where(gt, seen_gt + (before & 0xFFFF), n_above + seen_eq + (before >> 16))
        _scatter(out_row + pos, cols - lo + off, (gt | eq) & (pos < k), BLOCK)
        seen_gt += total & 0xFFFF
        seen_eq += total >> 16


# --- kernels -----------------------------------------------------------------------------


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
    keys = tl.where(ok, _key(tl.load(row_ptr + cols, mask=ok, other=0.0)), _INT_MIN)
    n_s = tl.sum(ok.to(tl.int32))
    expect = n_s.to(tl.float32) * k / valid.to(tl.float32)  # sample keys >= the k-th largest
    spread = tl.sqrt(expect)
    rank = tl.minimum(tl.maximum((expect + margin * spread).to(tl.int32) + 2, 1), n_s)
    # any count in [rank, rank + spread] will do
    t, _ = _kth_search(keys, ok, rank, rank + spread.to(tl.int32))
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
    lo, hi, off = _row_range(lengths_ptr, starts_ptr, row, n_cols, HAS_STARTS)
    if hi - lo > CAP:
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        t = _sample_threshold(row_ptr, lo, hi, k, margin, G, W)
        a, b, base = _part_span(lo, hi, part, PARTS, BLOCK)
        region = cand_ptr + (row * PARTS + part).to(tl.int64) * CAP
        offs = _tile(BLOCK // C, C)
        seen = tl.zeros([], tl.int32)
        for c in range(base, b, BLOCK):
            cols = c + offs
            key = _key(tl.load(row_ptr + cols, mask=cols < n_cols, other=0.0))
            take = _inside(cols, a, b) & (key >= t)
            before, total = _slots(take.to(tl.int32))
            pos = seen + before
            packed = (key.to(tl.int64) << 32) | ((cols - lo + off).to(tl.int64) & 0xFFFFFFFF)
            _scatter(region + pos, packed, take & (pos < CAP), BLOCK)
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
    lo, hi, off = _row_range(lengths_ptr, starts_ptr, row, n_cols, HAS_STARTS)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    out_row = out_ptr + row.to(tl.int64) * k
    j = _tile(CAP // C, C)
    if hi - lo <= k:
        _write_all(out_row, hi - lo, off, k, FINISH_BLOCK)
    elif hi - lo <= CAP:
        member = j < hi - lo
        keys = _key(tl.load(row_ptr + lo + j, mask=member, other=0.0))
        _select_write(keys, j + off, member, k, out_row, CAP)
    else:
        total = tl.zeros([], tl.int32)
        src = j
        for p in tl.static_range(PARTS):
            count = tl.load(count_ptr + row * PARTS + p)
            src = tl.where((j >= total) & (j - total < count), p * CAP + j - total, src)
            total += count
        if (total >= k) & (total <= CAP):
            member = j < total
            packed = _gather(cand_ptr + row.to(tl.int64) * (PARTS * CAP) + src, member, CAP)
            _select_write((packed >> 32).to(tl.int32), packed.to(tl.int32), member, k,
                          out_row, CAP)
        else:
            _select_streamed(row_ptr, out_row, k, lo, hi, off, BLOCK, C)


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
        _candidates_kernel[(rows, parts)](
            *head, cand, counts, n_cols, k, min(max(float(margin), -1e4), 1e4), PARTS=parts,
            G=sample_groups, W=sample_width, CAP=select_cap, BLOCK=block,
            C=min(block, 128 * num_warps), num_warps=num_warps, **flags,
        )
    _select_kernel[(rows,)](
        *head, cand, counts, out, n_cols, k, PARTS=parts, CAP=select_cap,
        C=min(select_cap, block, 128 * select_warps), BLOCK=block, FINISH_BLOCK=finish_block,
        num_warps=select_warps, **flags,
    )
    return out


def _topk_cuda(logits: Tensor, lengths: Tensor, k: int, starts: Tensor | None = None) -> Tensor:
    out = _topk_out(logits, lengths, k, starts)
    return launch_topk(logits, lengths, k, starts, out=out)


topk_indices = register(
    "topk_indices",
    cpu=_topk_cpu,
    cuda=_topk_cuda,
    fake=_topk_out,
)
