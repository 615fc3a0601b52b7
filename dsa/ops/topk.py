"""Top-k selection of the indexer logits (SPEC §3): ``dsa::topk_indices``.

Row ``r`` of ``logits`` is valid on columns ``[s, s + len)`` clipped to ``[0, N)``, where
``s = starts[r]`` (0 without ``starts``) and ``len = max(lengths[r], 0)``. The output row
holds the positions ``column - s`` of the ``min(k, valid)`` largest valid logits, then -1.
Order inside a row and the choice among equal values are free; columns outside the valid
range may hold anything (junk, +inf, NaN) and are never selected.

CUDA face: an exact radix select on order-preserving int32 keys, in Triton, reading a
row twice.

1. window: from a sample of the row (``next_power_of_2(k)`` groups of up to
   ``sample_width`` consecutive columns, spread over it), the largest key ``U`` and a lower
   bound ``L`` of the k-th largest key: the smallest group maximum (at least k groups hold
   an element >= ``L``).
2. histogram (pass 1): ``2**hist_bits`` bins over ``[L, U]`` (keys above ``U`` share the top
   bin), linear in value when the window straddles 0 with finite ends, else on the key
   bits below the common prefix of ``L`` and ``U`` (log-like, robust to outliers). Both
   maps are monotone, so the threshold bin ``t`` splits the row: bins above ``t`` are
   selected, bin ``t`` holds the rest of the choice, elements below ``L`` never are.
3. collect (pass 2): elements in bins above ``t`` go straight to the output; those of bin
   ``t`` go to a candidate buffer of ``cap`` columns per row, or straight to the output
   when the whole bin is taken or it holds a single key.
4. finish: radix rounds of ``refine_bits`` over the candidates' keys find the exact
   threshold key; the keys above it and the first equal ones complete the row. When bin
   ``t`` overflowed the buffer, the rounds re-read the row instead (correct, slower).
   Rows with ``valid <= k`` are written directly (``0..valid-1`` then -1).

With ``parts == 1`` one program per row runs every step (one launch). Otherwise ``parts``
programs per row run the histogram and the collect passes (one launch each, exchanging the
window and the partial histograms through a per-call int32 scratch buffer) and one program
per row the finish. No host sync, no atomics, no data-dependent sizes: the op captures in a
CUDA graph.

``method="sample"`` of :func:`launch_topk` (sampled threshold) reads long rows once: each
of ``parts`` programs estimates from a sample of the row a key T a few standard deviations
below the k-th largest, then compacts its part's keys >= T (and their indices) into its
candidate region. One program per row then holds the candidates in registers (or, for rows
with ``valid <= select_cap``, the whole row, without the pass), bisects on the key for the
k-th largest and writes the larger keys and enough ties. Rows whose candidates are fewer
than k or more than ``select_cap`` fall back to the radix select above. ``DEFAULT_METHOD``
is the op's.
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
def _unkey(key):
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _flag(cond):
    """A scalar condition as a plain int1 (the 3.9 interpreter mistypes a broadcast compare)."""
    return tl.where(cond, True, False)


@triton.jit
def _inside(cols, a, b):
    """``a <= cols < b`` in one unsigned compare."""
    return (cols - a).to(tl.uint32, bitcast=True) < (b - a).to(tl.uint32, bitcast=True)


@triton.jit
def _bit_length(span):
    """Bits of a non-negative int64 below 2**32."""
    bits = (span > 0).to(tl.int32)
    for i in tl.static_range(1, 33):
        bits += ((span >> i) > 0).to(tl.int32)
    return bits


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
def _window(row_ptr, lo, hi, k, HB: tl.constexpr, G: tl.constexpr, W: tl.constexpr,
            GB: tl.constexpr):
    """The row's binning, from G groups of up to W consecutive columns spread over the row.

    Returns (lo_key, linear, lf, scale, shift): elements with key < lo_key are never
    selected; the bin of the others is ``(x - lf) * scale`` (linear) or
    ``(key - lo_key) >> shift``, clamped to the top bin.
    """
    stride = tl.maximum((hi - lo) // G, 1)
    width = tl.minimum(stride, W)
    member = tl.arange(0, W)[None, :]
    low = tl.full([], _INT_MAX, tl.int32)
    top = tl.full([], _INT_MIN, tl.int32)
    groups = tl.zeros([], tl.int32)
    for g0 in tl.static_range(0, G, GB):
        cols = lo + (g0 + tl.arange(0, GB))[:, None] * stride + member
        ok = (member < width) & (cols < hi)
        x = tl.load(row_ptr + cols, mask=ok, other=0.0)
        group_max = tl.max(tl.where(ok, _key(x), _INT_MIN), axis=1)
        seen = group_max > _INT_MIN
        low = tl.minimum(low, tl.min(tl.where(seen, group_max, _INT_MAX)))
        top = tl.maximum(top, tl.max(group_max))
        groups += tl.sum(seen.to(tl.int32))
    # >= k groups hold an element >= low, so the k-th largest key is >= low
    lo_key = tl.where(groups >= k, low, _INT_MIN)
    # linear when the window straddles 0 with finite ends (keys of -inf / +inf excluded)
    linear = _flag((lo_key < 0) & (lo_key > -0x7F800001) & (top > 0) & (top < 0x7F800000))
    lf = tl.where(linear, _unkey(lo_key), 0.0)
    half_span = tl.where(linear, 0.5 * _unkey(top) - 0.5 * lf, 1.0)  # no overflow
    scale = tl.where(linear, (1 << (HB - 1)) / tl.maximum(half_span, 1.0e-30), 0.0)
    shift = tl.maximum(_bit_length(top.to(tl.int64) - lo_key.to(tl.int64)) - HB, 0)
    return lo_key, linear, lf, scale, shift


@triton.jit
def _bins(x, key, inwin, lo_key, linear, lf, scale, shift, NB: tl.constexpr):
    """Bin of each in-window element (0 elsewhere); monotone in the key."""
    xs = tl.where(inwin & linear, x, lf)
    v = (xs - lf) * scale
    # +inf and NaN to the top bin (NaN before max/min, whose NaN rules differ by backend)
    lin = tl.maximum(tl.where(v < NB - 1.0, v, NB - 1.0), 0.0).to(tl.int32)
    rel = key.to(tl.uint32, bitcast=True) - lo_key.to(tl.uint32, bitcast=True)
    rad = tl.minimum(rel >> shift.to(tl.uint32), NB - 1).to(tl.int32)
    return tl.where(inwin, tl.where(linear, lin, rad), 0)


@triton.jit
def _histogram(row_ptr, n_cols, a, b, base, lo_key, linear, lf, scale, shift,
               NB: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram of the bins of the in-window elements of columns ``[a, b)``."""
    offs = tl.arange(0, BLOCK)
    hist = tl.zeros([NB], tl.int32)
    skipped = tl.zeros([BLOCK], tl.int32)
    for c in range(base, b, BLOCK):
        cols = c + offs
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=0.0)
        key = _key(x)
        inwin = _inside(cols, a, b) & (key >= lo_key)
        hist += tl.histogram(_bins(x, key, inwin, lo_key, linear, lf, scale, shift, NB), NB)
        skipped += tl.where(inwin, 0, 1)
    # elements outside the window were counted in bin 0
    return hist - tl.where(tl.arange(0, NB) == 0, tl.sum(skipped), 0)


@triton.jit
def _threshold(hist, need, NB: tl.constexpr):
    """Largest bin t with count(bin >= t) >= need: (t, count(bin > t), count(bin == t))."""
    bins = tl.arange(0, NB)
    at_least = tl.sum(hist) - tl.cumsum(hist, 0) + hist
    t = tl.max(tl.where(at_least >= need, bins, -1))
    above = tl.sum(tl.where(bins > t, hist, 0))
    at = tl.sum(tl.where(bins == t, hist, 0))
    return t, above, at


@triton.jit
def _bin_keys(t, lo_key, linear, lf, scale, shift, NB: tl.constexpr):
    """Smallest and largest key of bin t (the map is monotone: bisect on the keys)."""
    target = t + tl.arange(0, 2)
    low = lo_key.to(tl.int64) + tl.zeros([2], tl.int64)
    high = low * 0 + _INT_MAX + 1  # the smallest key with bin >= target lies in [low, high]
    for _ in range(32):
        mid = low + ((high - low) >> 1)
        key = mid.to(tl.int32)
        inwin = key >= lo_key
        up = (low >= high) | (_bins(_unkey(key), key, inwin, lo_key, linear, lf, scale, shift,
                                    NB) >= target)
        high = tl.where(up, mid, high)
        low = tl.where(up, low, mid + 1)
    first = tl.arange(0, 2) == 0
    return tl.sum(tl.where(first, low, 0)).to(tl.int32), \
        (tl.sum(tl.where(first, 0, low)) - 1).to(tl.int32)


@triton.jit
def _in_bin(key, k_lo, k_top):
    """``k_lo <= key <= k_top`` in one unsigned compare."""
    return (key - k_lo).to(tl.uint32, bitcast=True) <= (k_top - k_lo).to(tl.uint32, bitcast=True)


@triton.jit
def _direct(at, need, k_lo, k_top):
    """Whether bin t needs no refining: all of it is taken, or it holds a single key."""
    return _flag((at == need) | (k_lo == k_top))


@triton.jit
def _collect(row_ptr, out_row, cand_row, n_cols, k, a, b, base, lo, off, k_lo, k_top, above,
             at, base_above, base_at, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Writes the elements above bin t (keys > k_top) to the output, those of bin t to the
    output (direct) or the candidate buffer. ``base_above``, ``base_at``: such elements in
    earlier parts of the row."""
    need = k - above
    direct = _direct(at, need, k_lo, k_top)
    keep = _flag((~direct) & (at <= CAP))
    offs = tl.arange(0, BLOCK)
    seen_above = tl.zeros([], tl.int32)
    seen_at = tl.zeros([], tl.int32)
    for c in range(base, b, BLOCK):
        cols = c + offs
        key = _key(tl.load(row_ptr + cols, mask=cols < n_cols, other=0.0))
        inside = _inside(cols, a, b)
        hi_bin = inside & (key > k_top)
        in_bin = inside & _in_bin(key, k_lo, k_top)
        # one scan ranks both sets: above-t counts in the low 16 bits, bin-t counts above
        flags = hi_bin.to(tl.int32) + (in_bin.to(tl.int32) << 16)
        before = tl.cumsum(flags, 0) - flags
        rank_at = base_at + seen_at + (before >> 16)
        pos = tl.where(hi_bin, base_above + seen_above + (before & 0xFFFF), above + rank_at)
        # one store per element: the output, or bin t's slot in the candidate buffer
        to_out = hi_bin | (in_bin & direct)
        ptr = tl.where(to_out, out_row + pos, cand_row + rank_at)
        ok = tl.where(to_out, pos < k, in_bin & keep & (rank_at < CAP))
        tl.store(ptr, cols - lo + off, mask=ok)
        total = tl.sum(flags)
        seen_above += total & 0xFFFF
        seen_at += total >> 16


@triton.jit
def _source(i, row_ptr, cand_row, lo, hi, off, first, spill, at, k_lo, k_top,
            BLOCK: tl.constexpr):
    """Step i over bin t's elements: the columns in the candidate buffer, or the row itself
    when the bin spilled. Returns (key, output index, member mask)."""
    j = i * BLOCK + tl.arange(0, BLOCK)
    buffered = (~spill) & (j < at)
    idx = tl.load(cand_row + j, mask=buffered, other=0)
    cols = tl.where(spill, first + j, idx + lo - off)
    listed = _inside(cols, lo, hi) & (spill | buffered)
    key = _key(tl.load(row_ptr + cols, mask=listed, other=0.0))
    member = listed & ((~spill) | _in_bin(key, k_lo, k_top))
    return key, cols - lo + off, member


@triton.jit
def _finish(row_ptr, out_row, cand_row, k, lo, hi, off, k_lo, k_top, above, at,
            CAP: tl.constexpr, RB: tl.constexpr, BLOCK: tl.constexpr):
    """Picks the ``k - above`` largest elements of bin t (ties: the first ones met)."""
    need = k - above
    if not _direct(at, need, k_lo, k_top):
        spill = _flag(at > CAP)
        first = (lo // BLOCK) * BLOCK
        steps = tl.where(spill, (hi - first + BLOCK - 1) // BLOCK, (at + BLOCK - 1) // BLOCK)
        kmin = tl.full([BLOCK], _INT_MAX, tl.int32)
        kmax = tl.full([BLOCK], _INT_MIN, tl.int32)
        for i in range(steps):
            key, idx, member = _source(i, row_ptr, cand_row, lo, hi, off, first, spill, at,
                                       k_lo, k_top, BLOCK)
            kmin = tl.minimum(kmin, tl.where(member, key, _INT_MAX))
            kmax = tl.maximum(kmax, tl.where(member, key, _INT_MIN))
        base_key = tl.min(kmin)
        # radix rounds over rel = key - base_key from the top bit of its span: prefix holds
        # the threshold's bits above `low_bit`, left the elements still to take at it; the
        # rounds stop once all of them are taken
        bits = _bit_length(tl.max(kmax).to(tl.int64) - base_key.to(tl.int64))
        left = need
        prefix = tl.zeros([], tl.uint32)
        low_bit = tl.zeros([], tl.int32)
        while bits > 0:
            low_bit = tl.maximum(bits - RB, 0)
            width = bits - low_bit
            hist = tl.zeros([1 << RB], tl.int32)
            skipped = tl.zeros([BLOCK], tl.int32)
            for i in range(steps):
                key, idx, member = _source(i, row_ptr, cand_row, lo, hi, off, first, spill,
                                           at, k_lo, k_top, BLOCK)
                rel = key.to(tl.uint32, bitcast=True) - base_key.to(tl.uint32, bitcast=True)
                high = rel >> tl.minimum(bits, 31).to(tl.uint32)
                member = member & (_flag(bits >= 32) | (high == prefix))
                digit = ((rel >> low_bit.to(tl.uint32)) & ((1 << width) - 1)).to(tl.int32)
                hist += tl.histogram(tl.where(member, digit, 0), 1 << RB)
                skipped += tl.where(member, 0, 1)
            hist -= tl.where(tl.arange(0, 1 << RB) == 0, tl.sum(skipped), 0)
            d, d_above, d_at = _threshold(hist, left, 1 << RB)
            left -= d_above
            prefix = (prefix << width.to(tl.uint32)) | d.to(tl.uint32)
            bits = tl.where(d_at == left, 0, low_bit)
        # elements whose rel >> low_bit is above prefix, then the first `left` equal to it
        taken_above = need - left
        seen_gt = tl.zeros([], tl.int32)
        seen_eq = tl.zeros([], tl.int32)
        for i in range(steps):
            key, idx, member = _source(i, row_ptr, cand_row, lo, hi, off, first, spill, at,
                                       k_lo, k_top, BLOCK)
            rel = key.to(tl.uint32, bitcast=True) - base_key.to(tl.uint32, bitcast=True)
            high = rel >> low_bit.to(tl.uint32)
            gt = member & (high > prefix)
            eq = member & (high == prefix)
            flags = gt.to(tl.int32) + (eq.to(tl.int32) << 16)
            before = tl.cumsum(flags, 0) - flags
            rank_gt = seen_gt + (before & 0xFFFF)
            rank_eq = seen_eq + (before >> 16)
            pos = tl.where(gt, rank_gt, taken_above + rank_eq)
            ok = tl.where(gt, rank_gt < taken_above, eq & (rank_eq < left))
            tl.store(out_row + above + pos, idx, mask=ok)
            total = tl.sum(flags)
            seen_gt += total & 0xFFFF
            seen_eq += total >> 16


@triton.jit
def _write_all(out_row, valid, off, k, BLOCK: tl.constexpr):
    """A row with ``valid <= k``: ``off .. off + valid - 1`` then -1."""
    for c in range(0, k, BLOCK):
        j = c + tl.arange(0, BLOCK)
        tl.store(out_row + j, tl.where(j < valid, j + off, -1), mask=j < k)


@triton.jit
def _row_hist(hist_ptr, row, part, k, PARTS: tl.constexpr, NB: tl.constexpr):
    """Threshold of a row from its parts' histograms, and the counts above / at it in the
    parts before ``part``: (t, above, at, base_above, base_at)."""
    parts = tl.arange(0, PARTS)[:, None]
    bins = tl.arange(0, NB)[None, :]
    hists = tl.load(hist_ptr + (row * PARTS + parts) * NB + bins)
    t, above, at = _threshold(tl.sum(hists, axis=0), k, NB)
    earlier = parts < part
    base_above = tl.sum(tl.where(earlier & (bins > t), hists, 0))
    base_at = tl.sum(tl.where(earlier & (bins == t), hists, 0))
    return t, above, at, base_above, base_at


# --- kernels -----------------------------------------------------------------------------

# Split launches keep per row, in a slot of 8 int32 of the scratch buffer: the window
# (lo_key, linear, lf bits, scale bits, shift), written by the histogram kernel's part 0,
# then the threshold bin (first key, last key), written by the collect kernel's part 0.
SLOT = 8


@triton.jit
def _radix_row(row_ptr, out_row, cand_row, n_cols, k, lo, hi, off, G: tl.constexpr,
               W: tl.constexpr, GB: tl.constexpr, HB: tl.constexpr, RB: tl.constexpr,
               CAP: tl.constexpr, BLOCK: tl.constexpr, FINISH_BLOCK: tl.constexpr):
    """Every step of the radix select for one row with ``valid > k`` (one program)."""
    lo_key, linear, lf, scale, shift = _window(row_ptr, lo, hi, k, HB, G, W, GB)
    base = (lo // BLOCK) * BLOCK
    hist = _histogram(row_ptr, n_cols, lo, hi, base, lo_key, linear, lf, scale, shift,
                      1 << HB, BLOCK)
    t, above, at = _threshold(hist, k, 1 << HB)
    k_lo, k_top = _bin_keys(t, lo_key, linear, lf, scale, shift, 1 << HB)
    _collect(row_ptr, out_row, cand_row, n_cols, k, lo, hi, base, lo, off, k_lo, k_top,
             above, at, 0, 0, CAP, BLOCK)
    tl.debug_barrier()  # the candidate buffer is read back by other threads
    _finish(row_ptr, out_row, cand_row, k, lo, hi, off, k_lo, k_top, above, at, CAP, RB,
            FINISH_BLOCK)


@triton.jit
def _topk_fused_kernel(logits_ptr, stride_row, lengths_ptr, starts_ptr, out_ptr, cand_ptr,
                       n_cols, k, HAS_STARTS: tl.constexpr, G: tl.constexpr, W: tl.constexpr,
                       GB: tl.constexpr, HB: tl.constexpr, RB: tl.constexpr,
                       CAP: tl.constexpr, BLOCK: tl.constexpr, FINISH_BLOCK: tl.constexpr):
    """One program per row: every step."""
    row = tl.program_id(0)
    lo, hi, off = _row_range(lengths_ptr, starts_ptr, row, n_cols, HAS_STARTS)
    out_row = out_ptr + row.to(tl.int64) * k
    if hi - lo <= k:
        _write_all(out_row, hi - lo, off, k, FINISH_BLOCK)
    else:
        _radix_row(logits_ptr + row.to(tl.int64) * stride_row, out_row,
                   cand_ptr + row.to(tl.int64) * CAP, n_cols, k, lo, hi, off, G, W, GB, HB,
                   RB, CAP, BLOCK, FINISH_BLOCK)


@triton.jit
def _topk_hist_kernel(logits_ptr, stride_row, lengths_ptr, starts_ptr, slots_ptr, hist_ptr,
                      n_cols, k, HAS_STARTS: tl.constexpr, PARTS: tl.constexpr,
                      G: tl.constexpr, W: tl.constexpr, GB: tl.constexpr,
                      HB: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, part): the row's window (part 0 keeps it), the part's histogram."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    lo, hi, _ = _row_range(lengths_ptr, starts_ptr, row, n_cols, HAS_STARTS)
    if hi - lo > k:
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        lo_key, linear, lf, scale, shift = _window(row_ptr, lo, hi, k, HB, G, W, GB)
        if part == 0:
            slot = slots_ptr + row * 8
            tl.store(slot, lo_key)
            tl.store(slot + 1, linear.to(tl.int32))
            tl.store(slot + 2, lf.to(tl.int32, bitcast=True))
            tl.store(slot + 3, scale.to(tl.int32, bitcast=True))
            tl.store(slot + 4, shift)
        a, b, base = _part_span(lo, hi, part, PARTS, BLOCK)
        hist = _histogram(row_ptr, n_cols, a, b, base, lo_key, linear, lf, scale, shift,
                          1 << HB, BLOCK)
        tl.store(hist_ptr + (row * PARTS + part) * (1 << HB) + tl.arange(0, 1 << HB), hist)


@triton.jit
def _topk_collect_kernel(logits_ptr, stride_row, lengths_ptr, starts_ptr, slots_ptr,
                         hist_ptr, out_ptr, cand_ptr, n_cols, k, HAS_STARTS: tl.constexpr,
                         PARTS: tl.constexpr, HB: tl.constexpr, CAP: tl.constexpr,
                         BLOCK: tl.constexpr):
    """Program (row, part): the threshold bin's keys (part 0 keeps them), the collect pass
    over the part."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    lo, hi, off = _row_range(lengths_ptr, starts_ptr, row, n_cols, HAS_STARTS)
    if hi - lo > k:
        slot = slots_ptr + row * 8
        t, above, at, base_above, base_at = _row_hist(hist_ptr, row, part, k, PARTS, 1 << HB)
        k_lo, k_top = _bin_keys(t, tl.load(slot), _flag(tl.load(slot + 1) != 0),
                                tl.load(slot + 2).to(tl.float32, bitcast=True),
                                tl.load(slot + 3).to(tl.float32, bitcast=True),
                                tl.load(slot + 4), 1 << HB)
        if part == 0:
            tl.store(slot + 5, k_lo)
            tl.store(slot + 6, k_top)
        a, b, base = _part_span(lo, hi, part, PARTS, BLOCK)
        _collect(logits_ptr + row.to(tl.int64) * stride_row, out_ptr + row.to(tl.int64) * k,
                 cand_ptr + row.to(tl.int64) * CAP, n_cols, k, a, b, base, lo, off, k_lo,
                 k_top, above, at, base_above, base_at, CAP, BLOCK)


@triton.jit
def _topk_finish_kernel(logits_ptr, stride_row, lengths_ptr, starts_ptr, slots_ptr,
                        hist_ptr, out_ptr, cand_ptr, n_cols, k, HAS_STARTS: tl.constexpr,
                        PARTS: tl.constexpr, HB: tl.constexpr, RB: tl.constexpr,
                        CAP: tl.constexpr, FINISH_BLOCK: tl.constexpr):
    """Program per row: rows with ``valid <= k``, else the finish."""
    row = tl.program_id(0)
    lo, hi, off = _row_range(lengths_ptr, starts_ptr, row, n_cols, HAS_STARTS)
    out_row = out_ptr + row.to(tl.int64) * k
    if hi - lo <= k:
        _write_all(out_row, hi - lo, off, k, FINISH_BLOCK)
    else:
        slot = slots_ptr + row * 8
        _, above, at, _, _ = _row_hist(hist_ptr, row, 0, k, PARTS, 1 << HB)
        _finish(logits_ptr + row.to(tl.int64) * stride_row, out_row,
                cand_ptr + row.to(tl.int64) * CAP, k, lo, hi, off, tl.load(slot + 5),
                tl.load(slot + 6), above, at, CAP, RB, FINISH_BLOCK)


# --- sampled threshold: one pass over long rows, the selection on registers -------------


@triton.jit
def _kth_bracket(keys, member, need):
    """Bisection on the key towards the ``need``-th largest member key (``1 <= need <=
    count(member)``): (t, c) with ``c = count(key >= t) >= need`` and ``count(key > t) <
    need`` or ``c == need`` (an early exit). Non-member keys must be ``_INT_MIN`` (never
    counted: every probe lies above the smallest member key)."""
    lo = tl.min(tl.where(member, keys, _INT_MAX)).to(tl.int64)
    hi = tl.max(keys).to(tl.int64) + 1  # count(key >= hi) == 0 < need
    c_lo = tl.sum(member.to(tl.int32))
    while (hi - lo > 1) & (c_lo != need):
        mid = lo + ((hi - lo) >> 1)
        c = tl.sum((keys >= mid.to(tl.int32)).to(tl.int32))
        up = c >= need
        lo = tl.where(up, mid, lo)
        c_lo = tl.where(up, c, c_lo)
        hi = tl.where(up, hi, mid)
    return lo.to(tl.int32), c_lo


@triton.jit
def _select_write(keys, idx, member, k, out_row):
    """Writes the output indices ``idx`` of the k largest member keys (``count(member) >
    k``; ties: the first ones) to ``out_row[0:k]``."""
    keys = tl.where(member, keys, _INT_MIN)
    t, _ = _kth_bracket(keys, member, k)
    # keys > t are all taken (fewer than k), then keys == t up to k
    gt = member & (keys > t)
    eq = member & (keys == t)
    flags = gt.to(tl.int32) + (eq.to(tl.int32) << 16)
    before = tl.cumsum(flags, 0) - flags
    n_gt = tl.sum(gt.to(tl.int32))
    pos = tl.where(gt, before & 0xFFFF, n_gt + (before >> 16))
    tl.store(out_row + pos, idx, mask=(gt | eq) & (pos < k))


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
    rank = (expect + margin * tl.sqrt(expect)).to(tl.int32) + 2
    t, _ = _kth_bracket(keys, ok, tl.minimum(tl.maximum(rank, 1), n_s))
    return t


@triton.jit
def _sample_pass_kernel(logits_ptr, stride_row, lengths_ptr, starts_ptr, cand_ptr, count_ptr,
                        n_cols, k, margin, HAS_STARTS: tl.constexpr, PARTS: tl.constexpr,
                        G: tl.constexpr, W: tl.constexpr, CAP: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Program (row, part) of a row with ``valid > CAP``: the row's threshold T from a
    sample, then the part's keys >= T and their output indices into its candidate region
    (``CAP`` keys, then ``CAP`` indices), and their count."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    lo, hi, off = _row_range(lengths_ptr, starts_ptr, row, n_cols, HAS_STARTS)
    if hi - lo > CAP:
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        t = _sample_threshold(row_ptr, lo, hi, k, margin, G, W)
        a, b, base = _part_span(lo, hi, part, PARTS, BLOCK)
        region = cand_ptr + (row * PARTS + part).to(tl.int64) * (2 * CAP)
        offs = tl.arange(0, BLOCK)
        seen = tl.zeros([], tl.int32)
        for c in range(base, b, BLOCK):
            cols = c + offs
            key = _key(tl.load(row_ptr + cols, mask=cols < n_cols, other=0.0))
            take = (_inside(cols, a, b) & (key >= t)).to(tl.int32)
            pos = seen + tl.cumsum(take, 0) - take
            ok = (take != 0) & (pos < CAP)
            tl.store(region + pos, key, mask=ok)
            tl.store(region + CAP + pos, cols - lo + off, mask=ok)
            seen += tl.sum(take)
        tl.store(count_ptr + row * PARTS + part, seen)


@triton.jit
def _sample_finish_kernel(logits_ptr, stride_row, lengths_ptr, starts_ptr, cand_ptr,
                          count_ptr, out_ptr, n_cols, k, HAS_STARTS: tl.constexpr,
                          PARTS: tl.constexpr, CAP: tl.constexpr, G: tl.constexpr,
                          W: tl.constexpr, GB: tl.constexpr, HB: tl.constexpr,
                          RB: tl.constexpr, BLOCK: tl.constexpr, FINISH_BLOCK: tl.constexpr):
    """Program per row: ``valid <= k``: all; ``valid <= CAP``: the row read whole into
    registers; else the parts' candidates, or the radix select when they are not usable
    (fewer than k: the threshold was too high; more than CAP: too low)."""
    row = tl.program_id(0)
    lo, hi, off = _row_range(lengths_ptr, starts_ptr, row, n_cols, HAS_STARTS)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    out_row = out_ptr + row.to(tl.int64) * k
    j = tl.arange(0, CAP)
    if hi - lo <= k:
        _write_all(out_row, hi - lo, off, k, FINISH_BLOCK)
    elif hi - lo <= CAP:
        member = j < hi - lo
        keys = _key(tl.load(row_ptr + lo + j, mask=member, other=0.0))
        _select_write(keys, j + off, member, k, out_row)
    else:
        region = cand_ptr + row.to(tl.int64) * (PARTS * 2 * CAP)
        total = tl.zeros([], tl.int32)
        src = j
        for p in tl.static_range(PARTS):
            count = tl.load(count_ptr + row * PARTS + p)
            src = tl.where((j >= total) & (j - total < count), p * 2 * CAP + j - total, src)
            total += count
        if (total >= k) & (total <= CAP):
            member = j < total
            keys = tl.load(region + src, mask=member, other=0)
            idx = tl.load(region + CAP + src, mask=member, other=0)
            _select_write(keys, idx, member, k, out_row)
        else:
            _radix_row(row_ptr, out_row, region, n_cols, k, lo, hi, off, G, W, GB, HB, RB,
                       CAP, BLOCK, FINISH_BLOCK)


# --- launch ------------------------------------------------------------------------------

# groups of the window's sample; for k above it the window is the whole key range (slower)
MAX_GROUPS = 4096


def choose_parts(rows: int, n_cols: int, *, target_programs: int = 256,
                 min_part_cols: int = 4096, max_parts: int = 64) -> int:
    """Programs per row: enough to fill the GPU, each streaming >= ``min_part_cols``."""
    parts = 1
    while (parts < max_parts and 2 * parts * max(rows, 1) <= target_programs
           and 2 * parts * min_part_cols <= n_cols):
        parts *= 2
    return parts


def choose_select_cap(n_cols: int, k: int, *, row_cols: int = 8192) -> int:
    """Candidates held in registers by the sampled-threshold finish: the whole row when
    ``n_cols <= row_cols`` (no pass over the row), else room for about twice k."""
    if n_cols <= row_cols:
        return max(16, triton.next_power_of_2(n_cols))
    return min(MAX_SELECT_CAP, max(4096, triton.next_power_of_2(2 * k)))


# the finish packs two counts below 2**16 into one int32
MAX_SELECT_CAP = 1 << 15
METHODS = ("radix", "sample")
# the method of the op's CUDA face: faster at 7 of the 8 H200 benchmark shapes, within 1 µs at
# the eighth (BENCHMARKS.md)
DEFAULT_METHOD = "sample"


def _power_of_two(**values: int) -> None:
    for name, value in values.items():
        if value < 1 or value & (value - 1):
            raise ValueError(f"launch_topk: `{name}` must be a power of two, got {value}")


def launch_topk(logits: Tensor, lengths: Tensor, k: int, starts: Tensor | None = None, *,
                out: Tensor | None = None, method: str = "radix", parts: int | None = None,
                block: int = 4096, hist_bits: int = 8, refine_bits: int = 8, cap: int = 4096,
                sample_width: int = 4, window_block: int = 2048, finish_block: int = 1024,
                num_warps: int = 8, finish_warps: int = 4, target_programs: int = 256,
                min_part_cols: int = 4096, select_cap: int | None = None,
                row_cols: int = 8192, sample_groups: int = 1024, margin: float = 4.0,
                select_warps: int = 8) -> Tensor:
    """Runs the Triton top-k (arguments already validated) into ``out`` and returns it.

    method: "radix" (window, histogram and collect passes, radix finish) or "sample"
        (sampled threshold: one pass keeps the keys above a threshold estimated from a
        sample, one program per row selects among them in registers; rows whose
        candidates are too few or too many fall back to the radix select).
    parts: programs per row for the passes over the row (power of two; 1 = one fused
        kernel for "radix"; None = :func:`choose_parts` with ``target_programs``,
        ``min_part_cols``, at most 16 for "sample").
    block: columns per step of those passes. hist_bits / refine_bits: bits of the row
        histogram / of each refining round (>= 5). cap: candidate buffer entries per row.
    sample_width: columns per group of the window's sample (``next_power_of_2(k)`` groups);
        window_block: its step. finish_block: step of the finish and of rows with
        ``valid <= k``. num_warps: row passes; finish_warps: the split finish kernel.
    "sample" only: select_cap: candidates per row held in registers (power of two <= 2**15;
        None = :func:`choose_select_cap` with ``row_cols``): rows with ``valid <= select_cap``
        are read whole by the finish, longer ones pass the threshold first.
        sample_groups: groups of ``sample_width`` columns in the threshold's sample.
        margin: the threshold sits ``margin`` standard deviations of the sample count
        below the estimated k-th largest. select_warps: warps of the finish.
    """
    rows, n_cols = logits.shape
    if out is None:
        out = logits.new_empty((rows, k), dtype=torch.int32)
    if rows == 0:
        return out
    if method not in METHODS:
        raise ValueError(f"launch_topk: `method` must be one of {METHODS}, got {method!r}")
    if parts is None:
        parts = choose_parts(rows, n_cols, target_programs=target_programs,
                             min_part_cols=min_part_cols,
                             max_parts=16 if method == "sample" else 64)
    _power_of_two(parts=parts, block=block, window_block=window_block,
                  finish_block=finish_block, sample_width=sample_width,
                  sample_groups=sample_groups)
    if not 5 <= min(hist_bits, refine_bits) <= max(hist_bits, refine_bits) <= 12:
        raise ValueError("launch_topk: `hist_bits` and `refine_bits` must be in [5, 12]")
    if max(block, finish_block) > 1 << 15:
        raise ValueError("launch_topk: `block` and `finish_block` must be <= 32768")
    groups = max(16, min(MAX_GROUPS, triton.next_power_of_2(k)))
    window = dict(G=groups, W=sample_width,
                  GB=max(1, min(groups, window_block // sample_width)))
    flags = dict(HAS_STARTS=starts is not None)
    head = (logits, logits.stride(0), lengths, lengths if starts is None else starts)
    if method == "sample":
        if select_cap is None:
            select_cap = choose_select_cap(n_cols, k, row_cols=row_cols)
        _power_of_two(select_cap=select_cap)
        if select_cap > MAX_SELECT_CAP:
            raise ValueError(f"launch_topk: `select_cap` must be <= {MAX_SELECT_CAP}")
        scratch = torch.empty(rows * parts * (2 * select_cap + 1), dtype=torch.int32,
                              device=logits.device)
        cand, counts = scratch[rows * parts:], scratch[: rows * parts]
        if n_cols > select_cap:  # some rows may be longer than the candidates
            _sample_pass_kernel[(rows, parts)](
                *head, cand, counts, n_cols, k, min(max(float(margin), -1e4), 1e4),
                PARTS=parts, G=sample_groups, W=sample_width, CAP=select_cap, BLOCK=block,
                num_warps=num_warps, **flags,
            )
        _sample_finish_kernel[(rows,)](
            *head, cand, counts, out, n_cols, k, PARTS=parts, CAP=select_cap, HB=hist_bits,
            RB=refine_bits, BLOCK=block, FINISH_BLOCK=finish_block, num_warps=select_warps,
            **window, **flags,
        )
        return out
    nb = 1 << hist_bits
    split = rows * (SLOT + parts * nb) if parts > 1 else 0
    scratch = torch.empty(rows * cap + split, dtype=torch.int32, device=logits.device)
    cand = scratch[: rows * cap]
    if parts == 1:
        _topk_fused_kernel[(rows,)](
            *head, out, cand, n_cols, k, HB=hist_bits, RB=refine_bits, CAP=cap, BLOCK=block,
            FINISH_BLOCK=finish_block, num_warps=num_warps, **window, **flags,
        )
        return out
    slots = scratch[rows * cap: rows * (cap + SLOT)]
    hist = scratch[rows * (cap + SLOT):]
    _topk_hist_kernel[(rows, parts)](
        *head, slots, hist, n_cols, k, PARTS=parts, HB=hist_bits, BLOCK=block,
        num_warps=num_warps, **window, **flags,
    )
    _topk_collect_kernel[(rows, parts)](
        *head, slots, hist, out, cand, n_cols, k, PARTS=parts, HB=hist_bits, CAP=cap,
        BLOCK=block, num_warps=num_warps, **flags,
    )
    _topk_finish_kernel[(rows,)](
        *head, slots, hist, out, cand, n_cols, k, PARTS=parts, HB=hist_bits, RB=refine_bits,
        CAP=cap, FINISH_BLOCK=finish_block, num_warps=finish_warps, **flags,
    )
    return out


def _topk_cuda(logits: Tensor, lengths: Tensor, k: int, starts: Tensor | None = None) -> Tensor:
    out = _topk_out(logits, lengths, k, starts)
    return launch_topk(logits, lengths, k, starts, out=out, method=DEFAULT_METHOD)


topk_indices = register(
    "topk_indices",
    cpu=_topk_cpu,
    cuda=_topk_cuda,
    fake=_topk_out,
)
