"""Building blocks of an exact top-k on order-preserving int32 keys, in Triton.

Keys (:func:`order_key`, :func:`search_key`) order like the logits they encode. A row's
keys live in an ``[R, C]`` register tile (:func:`tile`); :func:`kth_search` finds the k-th
largest key, by multisection with two or four pivots counted per block reduction or by a
radix select (a histogram of one digit per pass, ``RADIX`` bits at a time),
:func:`select_positions` takes the larger keys and enough equal ones (the lowest
positions on request), and :func:`streamed_kth` and :func:`write_streamed` do the same
for a row, or for candidates, too many for registers, streaming them once per step
(:func:`streamed_block`). Stores and gathers go
through flattened tiles (:func:`scatter`, :func:`gather`) so Triton keeps one layout for
them."""

import triton
import triton.language as tl

INT_MIN = tl.constexpr(-(2**31))
INT_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def order_key(x):
    """fp32 or bf16 -> int32 key with the same order (from the fp32 bits, where the map is
    its own inverse)."""
    b = x.to(tl.float32).to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def search_key(x):
    """The key the top-k searches: :func:`order_key`, narrowed to its top 16 bits for bf16
    (the others are constant there, and a search would spend steps on them). Same order;
    equal exactly for equal values."""
    key = order_key(x)
    if x.dtype == tl.bfloat16:
        key = key >> 16
    return key


@triton.jit
def key_value(key):
    """The fp32 value of an ``order_key`` (the same map applied again)."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def flag(cond):
    """A scalar condition as a plain int1 (the 3.9 interpreter mistypes a broadcast compare)."""
    return tl.where(cond, True, False)


@triton.jit
def in_span(cols, a, b):
    """``a <= cols < b`` in one unsigned compare."""
    return (cols - a).to(tl.uint32, bitcast=True) < (b - a).to(tl.uint32, bitcast=True)


@triton.jit
def row_range(lengths_ptr, starts_ptr, row, n_cols, HAS_STARTS: tl.constexpr):
    """Valid columns ``[lo, hi)`` of a row and ``off = lo - start`` (output = col - lo + off)."""
    length = tl.maximum(tl.load(lengths_ptr + row).to(tl.int64), 0)
    start = tl.load(starts_ptr + row).to(tl.int64) if HAS_STARTS else length * 0
    lo = tl.minimum(tl.maximum(start, 0), n_cols)
    hi = tl.maximum(tl.minimum(start + length, n_cols), lo)
    return lo.to(tl.int32), hi.to(tl.int32), (lo - start).to(tl.int32)


@triton.jit
def part_span(lo, hi, part, PARTS: tl.constexpr, BLOCK: tl.constexpr):
    """Part ``part`` of a row: columns ``[a, b)``, streamed in BLOCK steps from ``base``."""
    q0 = lo // BLOCK
    q1 = (hi + BLOCK - 1) // BLOCK
    per = (q1 - q0 + PARTS - 1) // PARTS
    c0 = tl.minimum(q0 + part * per, q1)
    c1 = tl.minimum(c0 + per, q1)
    base = c0 * BLOCK
    return tl.maximum(base, lo), tl.minimum(c1 * BLOCK, hi), base


@triton.jit
def tile(R: tl.constexpr, C: tl.constexpr):
    """Offsets ``0 .. R*C - 1`` as an ``[R, C]`` tile, rows contiguous. With C a multiple of
    the thread count, a thread's elements of a column are its register repeats."""
    return tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]


@triton.jit
def slots(flags):
    """Exclusive prefix sums of an ``[R, C]`` tile in column-major order, and its total:
    the sums down a column stay in one thread, so one cross-thread scan of C values ranks
    R * C elements."""
    per_col = tl.sum(flags, axis=0)
    col_before = tl.cumsum(per_col, 0) - per_col
    return col_before[None, :] + tl.cumsum(flags, 0) - flags, tl.sum(per_col)


@triton.jit
def unaligned_offset(row, stride):
    """``row * stride`` (int64) through fp64, where the compiler cannot follow its
    divisibility (exact below 2**53). Not knowing a row's alignment, it keeps the row's tiles
    one column a thread, and a :func:`scatter` of a tile needs no conversion to a layout of
    its own through shared memory. Knowing it (a stride divisible by 16), it loads four
    columns a thread and converts the scatter's pointers, values and mask (sm_90, Triton
    3.6, the select kernel at 1x4096: 49 barriers against 31, 16 KB of shared memory
    against 128 bytes)."""
    return (row.to(tl.float64) * stride).to(tl.int64)


@triton.jit
def scatter(ptrs, values, mask, N: tl.constexpr):
    """Masked store of an ``[R, C]`` tile (N elements) through scattered pointers, flattened
    first: a 2-D store with data-dependent addresses gets a column-major layout of its own,
    and converting the tile to it (through shared memory) costs more than the stores."""
    tl.store(tl.reshape(ptrs, [N]), tl.reshape(values, [N]), mask=tl.reshape(mask, [N]))


@triton.jit
def gather(ptrs, mask, N: tl.constexpr):
    """Masked load (0 elsewhere) of an ``[R, C]`` tile through scattered pointers, flattened
    like :func:`scatter`."""
    flat = tl.load(tl.reshape(ptrs, [N]), mask=tl.reshape(mask, [N]), other=0)
    return tl.reshape(flat, ptrs.shape)


@triton.jit
def pivot(lo, top, i: tl.constexpr, PIVOTS: tl.constexpr):
    """Pivot ``i`` (1 .. PIVOTS) cutting the int32 key range ``[lo, top]`` (``lo < top``)
    into PIVOTS + 1 near-equal sections: ``lo < pivot 1 <= ... <= pivot PIVOTS <= top``.
    All in 32 bits but one 32 x 16-bit product: the range's width ``top - lo`` as uint32
    (it may pass 2**31), the fraction ``i / (PIVOTS + 1)`` in 16-bit fixed point (rounded
    down), the offset added with int32 wrap-around (the pivot itself is in range)."""
    fraction: tl.constexpr = i * 65536 // (PIVOTS + 1)
    width = (top - lo).to(tl.uint32, bitcast=True)
    offset = ((width.to(tl.uint64) * fraction) >> 16).to(tl.uint32)
    return lo + tl.maximum(offset, 1).to(tl.int32, bitcast=True)


@triton.jit
def raise_bracket(lo, top, c_lo, c_hi, m, m_top, c, c_next, need):
    """The bracket ``[m, m_top]`` (counts c, c_next) when ``c = count(key >= m) >= need``;
    applied to the pivots in rising order, the last such one wins."""
    take = c >= need
    return (tl.where(take, m, lo), tl.where(take, m_top, top), tl.where(take, c, c_lo),
            tl.where(take, c_next, c_hi))


@triton.jit
def narrow(lo, top, c_lo, c_hi, m1, m2, m3, m4, c1, c2, c3, c4, need, PIVOTS: tl.constexpr):
    """The bracket after counting the pivots (``m3, m4, c3, c4`` unused when PIVOTS = 2):
    (lo, top, c_lo, c_hi) with ``c_lo = count(key >= lo) >= need > count(key > top) =
    c_hi``."""
    if PIVOTS == 2:
        up, up_c = top, c_hi
    else:
        up, up_c = m3 - 1, c3
    lo2, top2, c_lo2, c_hi2 = raise_bracket(lo, m1 - 1, c_lo, c1, m1, m2 - 1, c1, c2, need)
    lo2, top2, c_lo2, c_hi2 = raise_bracket(lo2, top2, c_lo2, c_hi2, m2, up, c2, up_c, need)
    if PIVOTS == 4:
        lo2, top2, c_lo2, c_hi2 = raise_bracket(lo2, top2, c_lo2, c_hi2, m3, m4 - 1, c3, c4,
                                                need)
        lo2, top2, c_lo2, c_hi2 = raise_bracket(lo2, top2, c_lo2, c_hi2, m4, top, c4, c_hi,
                                                need)
    return lo2, top2, c_lo2, c_hi2


@triton.jit
def packed_counts(keys, a, b, SELECTS: tl.constexpr = True):
    """``count(key >= a) | count(key >= b) << 16`` over a tile, per element (sum it), for
    ``a <= b``. SELECTS: as nested selects (a key >= b is >= a too: fewer instructions; H200,
    ``topk_indices`` 1x4096 5.6 against 6.1 us), else as two shifted compares (what the
    candidates kernel's sample search uses: with selects there, prefill rows of 128K took
    1.09 ms against 1.02; the streamed searches use them too, the two forms timed alike
    there)."""
    if SELECTS:
        counts = tl.where(keys >= b, 65537, tl.where(keys >= a, 1, 0))
    else:
        counts = (keys >= a).to(tl.int32) + ((keys >= b).to(tl.int32) << 16)
    return counts


@triton.jit
def wide_counts(keys, m1, m2, m3, m4, SELECTS: tl.constexpr = True):
    """The four counts ``count(key >= m_i)`` (each <= 2**15) of a tile, 16 bits each in one
    int64, summed by one block reduction (a thread's elements of an ``[R, C]`` tile's
    column first, in int32)."""
    p12 = packed_counts(keys, m1, m2, SELECTS)
    p34 = packed_counts(keys, m3, m4, SELECTS)
    if len(keys.shape) == 2:
        p12 = tl.sum(p12, axis=0)
        p34 = tl.sum(p34, axis=0)
    return tl.sum(p12.to(tl.int64) | (p34.to(tl.int64) << 32))


@triton.jit
def _add_pairs(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _min_max(a_lo, a_hi, b_lo, b_hi):
    return tl.minimum(a_lo, b_lo), tl.maximum(a_hi, b_hi)


@triton.jit
def radix_narrow(hist, need, prefix, above, shift, RADIX: tl.constexpr):
    """One radix pass: from ``hist``, the histogram of the digit at ``shift`` of the keys in
    the bracket (``prefix`` on the higher bits, ``above`` keys above it), the bracket of the
    ``need``-th largest key one digit narrower: (prefix, count(key >= prefix), above)."""
    ge = tl.cumsum(hist, 0, reverse=True)
    gt = ge - hist
    hit = (ge >= need - above) & (gt < need - above)
    # one bin hits: its digit, its counts (fields of 8, 28 and 28 bits: counts < 2**27)
    packed = tl.sum(tl.where(hit, tl.arange(0, 1 << RADIX).to(tl.int64)
                             | (gt.to(tl.int64) << 8) | (ge.to(tl.int64) << 36), 0))
    digit = (packed & 0xFF).to(tl.int32)
    return (prefix | (digit << shift), above + (packed >> 36).to(tl.int32),
            above + ((packed >> 8) & 0xFFFFFFF).to(tl.int32))


@triton.jit
def digit_histogram(bits, member, prefix, shift, RADIX: tl.constexpr):
    """Histogram of the digit at ``shift`` of the 1-D unsigned-order ``bits`` of the members
    whose higher bits are ``prefix``."""
    high = (tl.full([], -1, tl.int64) << (shift + RADIX)).to(tl.int32)
    return tl.histogram((bits >> shift) & ((1 << RADIX) - 1), 1 << RADIX,
                        mask=member & ((bits & high) == prefix))


@triton.jit
def radix_search(keys, member, count, need, need_hi, RADIX: tl.constexpr):
    """:func:`kth_search` by radix select: a pass per ``RADIX``-bit digit, from the top."""
    bits = tl.ravel(keys ^ INT_MIN)  # unsigned order
    inside = tl.ravel(member)
    prefix = tl.zeros([], tl.int32)
    above = tl.zeros([], tl.int32)
    c_lo = count + above
    shift = above + 32 - RADIX
    while (shift >= 0) & ((c_lo < need) | (c_lo > need_hi)):
        hist = digit_histogram(bits, inside, prefix, shift, RADIX)
        prefix, c_lo, above = radix_narrow(hist, need, prefix, above, shift, RADIX)
        shift -= RADIX
    return prefix ^ INT_MIN, c_lo, above


@triton.jit
def multisect_search(keys, member, count, need, need_hi, PIVOTS: tl.constexpr,
                     SELECTS: tl.constexpr = True):
    """:func:`kth_search` by multisection of the key bracket ``[lo, top]`` (from one
    reduction of both ends): the PIVOTS (2 or 4) pivots of a step are counted by one block
    reduction (two counts packed per int32, or four per int64), so a step costs about what
    a bisection step does and cuts the bracket to a third (a fifth)."""
    lo, top = tl.reduce((tl.ravel(tl.where(member, keys, INT_MAX)), tl.ravel(keys)), 0,
                        _min_max)
    c_lo = count
    c_hi = count * 0
    while (top > lo) & ((c_lo < need) | (c_lo > need_hi)):
        m1 = pivot(lo, top, 1, PIVOTS)
        m2 = pivot(lo, top, 2, PIVOTS)
        if PIVOTS == 2:
            m3, m4 = m2, m2
            p12 = tl.sum(packed_counts(keys, m1, m2, SELECTS))
            p34 = p12
        else:
            m3 = pivot(lo, top, 3, PIVOTS)
            m4 = pivot(lo, top, 4, PIVOTS)
            both = wide_counts(keys, m1, m2, m3, m4, SELECTS)
            p12 = both.to(tl.int32)
            p34 = (both >> 32).to(tl.int32)
        lo, top, c_lo, c_hi = narrow(lo, top, c_lo, c_hi, m1, m2, m3, m4, p12 & 0xFFFF,
                                     (p12 >> 16) & 0xFFFF, p34 & 0xFFFF, (p34 >> 16) & 0xFFFF,
                                     need, PIVOTS)
    return lo, c_lo, c_hi


@triton.jit
def kth_search(keys, member, count, need, need_hi, RADIX: tl.constexpr,
               PIVOTS: tl.constexpr, SELECTS: tl.constexpr = True):
    """A key ``t`` with ``need <= count(key >= t) <= need_hi``, or, when no key has such a
    count, with ``count(key >= t) >= need > count(key > t)``; returns (t, count(key >= t),
    and in that second case count(key > t)). Requires ``1 <= need <= count =
    count(member) <= 2**15``; non-member keys must be ``INT_MIN``. RADIX: 0 for
    :func:`multisect_search` with PIVOTS pivots per step, else the digit bits of
    :func:`radix_search` (4 or 8)."""
    if RADIX:
        t, c_ge, c_gt = radix_search(keys, member, count, need, need_hi, RADIX)
    else:
        t, c_ge, c_gt = multisect_search(keys, member, count, need, need_hi, PIVOTS, SELECTS)
    return t, c_ge, c_gt


@triton.jit
def select_positions(keys, idx, member, count, k, RADIX: tl.constexpr,
                     PIVOTS: tl.constexpr, LOWEST: tl.constexpr):
    """The k largest member keys of a tile (``count = count(member) >= k``): (taken, their
    output slots ``0 .. k - 1``). Of the keys equal to the k-th largest, LOWEST: those of
    the lowest ``idx`` (a second search, on ``-idx``; ``idx >= 0``), else the first in
    column-major order. When exactly k keys are >= the searched key (no tie to break), one
    flag per key is ranked, and the counts come from the search, not from the ranks (H200,
    ``topk_indices`` 1x4096: 5.3 us against 5.6 ranking two flags)."""
    keys = tl.where(member, keys, INT_MIN)
    t, c_ge, c_gt = kth_search(keys, member, count, k, k, RADIX, PIVOTS)
    if c_ge == k:  # every key >= t
        taken = member & (keys >= t)
        pos, _ = slots(taken.to(tl.int32))
    else:  # the c_gt keys > t, then k - c_gt of those equal to t
        gt = keys > t
        eq = member & (keys == t)
        if LOWEST:
            lowest = tl.where(eq, -idx.to(tl.int32), INT_MIN)
            p, _, _ = kth_search(lowest, eq, c_ge - c_gt, k - c_gt, k - c_gt, RADIX, PIVOTS)
            eq = eq & (lowest >= p)
        before, _ = slots(gt.to(tl.int32) + (eq.to(tl.int32) << 16))
        pos = tl.where(gt, before & 0xFFFF, c_gt + (before >> 16))
        taken = (gt | eq) & (pos < k)
    return taken, pos


@triton.jit
def select_write(keys, idx, member, count, k, out_row, score_row, N: tl.constexpr,
                 RADIX: tl.constexpr, PIVOTS: tl.constexpr, LOWEST: tl.constexpr,
                 SCORES: tl.constexpr):
    """Writes the output indices ``idx`` of the k largest member keys of an ``[R, C]`` tile
    (N elements, ``count = count(member) > k``; ties as in :func:`select_positions`) and,
    with SCORES, their values (fp32 keys) at ``score_row``."""
    taken, pos = select_positions(keys, idx, member, count, k, RADIX, PIVOTS, LOWEST)
    scatter(out_row + pos, idx, taken, N)
    if SCORES:
        scatter(score_row + pos, key_value(keys), taken, N)


@triton.jit
def write_all(out_row, score_row, row_ptr, lo, valid, off, k, BLOCK: tl.constexpr,
              SCORES: tl.constexpr):
    """A row with ``valid <= k``: ``off .. off + valid - 1`` then -1; with SCORES, its
    logits from column ``lo`` then -inf."""
    for c in range(0, k, BLOCK):
        j = c + tl.arange(0, BLOCK)
        tl.store(out_row + j, tl.where(j < valid, j + off, -1), mask=j < k)
        if SCORES:
            score = tl.load(row_ptr + lo + j, mask=j < valid, other=float("-inf"))
            tl.store(score_row + j, score, mask=j < k)


@triton.jit
def region_offsets(counts_ptr, i, REGIONS: tl.constexpr, CAP: tl.constexpr):
    """Candidates stored in REGIONS regions of CAP entries (``counts_ptr``: their counts,
    each at most CAP where the entries are read), read as one sequence: the offsets of
    entries ``i`` (themselves past the last), the total and the largest count. Entry ``i``
    of region ``p`` (``i`` at least the counts before it, ``before[p]``) lies at ``p * CAP
    + i - before[p]``: ``i`` plus, for each region it is past, that region's unused room
    (one compare and one select a region and entry)."""
    count = tl.load(counts_ptr)
    src = i
    total = count
    largest = count
    for p in tl.static_range(1, REGIONS):
        src += tl.where(i >= total, CAP - count, 0)
        count = tl.load(counts_ptr + p)
        total += count
        largest = tl.maximum(largest, count)
    return tl.where(i < total, src, i), total, largest


@triton.jit
def streamed_block(src_ptr, counts_ptr, i, lo, hi, off, BLOCK: tl.constexpr,
                   REGIONS: tl.constexpr):
    """Entries ``i`` (a block) of a streamed source: (keys, output indices, membership).
    REGIONS = 0: the row's logits, valid on columns ``[lo, hi)``; else its ``hi``
    candidates (``lo = 0``) in REGIONS regions of BLOCK entries (:func:`region_offsets`),
    one int64 each: the key in the high half, the output index in the low one."""
    if REGIONS:
        inside = i < hi
        src, _, _ = region_offsets(counts_ptr, i, REGIONS, BLOCK)
        packed = gather(src_ptr + src, inside, BLOCK)
        key = (packed >> 32).to(tl.int32)
        idx = packed.to(tl.int32)
    else:
        inside = in_span(i, lo, hi)
        key = search_key(tl.load(src_ptr + i, mask=inside, other=0.0))
        idx = i - lo + off
    return key, idx, inside


@triton.jit
def search_block(src_ptr, counts_ptr, i, lo, hi, tie, BLOCK: tl.constexpr,
                 REGIONS: tl.constexpr, TIE: tl.constexpr):
    """Entries ``i`` of a streamed source as searched: (key, or INT_MIN outside, member);
    TIE: only the keys equal to ``tie``, keyed by their negated output index (the largest
    key: the lowest position)."""
    key, idx, inside = streamed_block(src_ptr, counts_ptr, i, lo, hi, 0, BLOCK, REGIONS)
    if TIE:
        inside = inside & (key == tie)
        key = -idx
    return tl.where(inside, key, INT_MIN), inside


@triton.jit
def streamed_multisect(src_ptr, counts_ptr, k, count, lo, hi, base, tie,
                       BLOCK: tl.constexpr, C: tl.constexpr, REGIONS: tl.constexpr,
                       PIVOTS: tl.constexpr, TIE: tl.constexpr):
    """The multisection of :func:`multisect_search` over a streamed source (``count > k``
    members; see :func:`streamed_block` and, for TIE, :func:`search_block`), once per step:
    (t, count(key >= t), count(key > t)) with ``count(key >= t) == k`` or ``t`` the k-th
    largest key."""
    offs = tile(BLOCK // C, C)
    if REGIONS or TIE:  # candidates span a few bits: a pass for [min, max] saves steps
        k_min = tl.full([BLOCK // C, C], INT_MAX, tl.int32)
        k_max = tl.full([BLOCK // C, C], INT_MIN, tl.int32)
        for c in range(base, hi, BLOCK):
            key, inside = search_block(src_ptr, counts_ptr, c + offs, lo, hi, tie, BLOCK,
                                       REGIONS, TIE)
            k_min = tl.minimum(k_min, tl.where(inside, key, INT_MAX))
            k_max = tl.maximum(k_max, key)
        t_lo = tl.min(k_min)
        t_top = tl.max(k_max)
    else:  # the domain of the row's search keys
        bits: tl.constexpr = 16 if src_ptr.dtype.element_ty == tl.bfloat16 else 32
        t_lo = tl.full([], -(2 ** (bits - 1)), tl.int32)
        t_top = t_lo * 0 + (2 ** (bits - 1) - 1)
    c_lo = count
    c_hi = c_lo * 0
    while (t_top > t_lo) & (c_lo != k):
        m1 = pivot(t_lo, t_top, 1, PIVOTS)
        m2 = pivot(t_lo, t_top, 2, PIVOTS)
        m3, m4 = m2, m2
        if PIVOTS == 4:
            m3 = pivot(t_lo, t_top, 3, PIVOTS)
            m4 = pivot(t_lo, t_top, 4, PIVOTS)
        if (REGIONS > 0) & (REGIONS * BLOCK < 65536):  # < 2**16 candidates: two counts per int32
            n12 = tl.zeros([BLOCK // C, C], tl.int32)
            n34 = tl.zeros([BLOCK // C, C], tl.int32)
            for c in range(base, hi, BLOCK):
                key, _ = search_block(src_ptr, counts_ptr, c + offs, lo, hi, tie, BLOCK,
                                      REGIONS, TIE)
                n12 += packed_counts(key, m1, m2, False)
                if PIVOTS == 4:
                    n34 += packed_counts(key, m3, m4, False)
            p12 = tl.sum(n12)
            p34 = p12
            if PIVOTS == 4:
                p34 = tl.sum(n34)
            c1, c2 = p12 & 0xFFFF, (p12 >> 16) & 0xFFFF
            c3, c4 = p34 & 0xFFFF, (p34 >> 16) & 0xFFFF
        else:  # a row, or many candidates: 2**16 keys or more, a count per pivot
            n1 = tl.zeros([BLOCK // C, C], tl.int32)
            n2 = tl.zeros([BLOCK // C, C], tl.int32)
            n3 = tl.zeros([BLOCK // C, C], tl.int32)
            n4 = tl.zeros([BLOCK // C, C], tl.int32)
            for c in range(base, hi, BLOCK):
                key, _ = search_block(src_ptr, counts_ptr, c + offs, lo, hi, tie, BLOCK,
                                      REGIONS, TIE)
                n1 += (key >= m1).to(tl.int32)
                n2 += (key >= m2).to(tl.int32)
                if PIVOTS == 4:
                    n3 += (key >= m3).to(tl.int32)
                    n4 += (key >= m4).to(tl.int32)
            c1, c2 = tl.reduce((tl.ravel(n1), tl.ravel(n2)), 0, _add_pairs)
            c3, c4 = c2, c2
            if PIVOTS == 4:
                c3, c4 = tl.reduce((tl.ravel(n3), tl.ravel(n4)), 0, _add_pairs)
        t_lo, t_top, c_lo, c_hi = narrow(t_lo, t_top, c_lo, c_hi, m1, m2, m3, m4, c1, c2, c3,
                                         c4, k, PIVOTS)
    return t_lo, c_lo, c_hi


@triton.jit
def streamed_radix(src_ptr, counts_ptr, k, lo, hi, base, BLOCK: tl.constexpr,
                   RADIX: tl.constexpr, REGIONS: tl.constexpr):
    """:func:`streamed_multisect` by radix select: the source streamed once per digit."""
    offs = tl.arange(0, BLOCK)
    prefix = tl.zeros([], tl.int32)
    above = tl.zeros([], tl.int32)
    c_lo = hi - lo
    shift = above + 32 - RADIX
    while (shift >= 0) & (c_lo != k):
        hist = tl.zeros([1 << RADIX], tl.int32)
        for c in range(base, hi, BLOCK):
            key, _, inside = streamed_block(src_ptr, counts_ptr, c + offs, lo, hi, 0, BLOCK,
                                            REGIONS)
            hist += digit_histogram(key ^ INT_MIN, inside, prefix, shift, RADIX)
        prefix, c_lo, above = radix_narrow(hist, k, prefix, above, shift, RADIX)
        shift -= RADIX
    return prefix ^ INT_MIN, c_lo, above


@triton.jit
def streamed_kth(src_ptr, counts_ptr, k, lo, hi, BLOCK: tl.constexpr, C: tl.constexpr,
                 RADIX: tl.constexpr, PIVOTS: tl.constexpr, REGIONS: tl.constexpr):
    """The k-th largest key of a streamed source with ``valid > k`` (:func:`streamed_block`:
    the whole row, or candidates too many for registers), counting over the whole source
    at each step (RADIX and PIVOTS as in :func:`kth_search`): (t, count(key >= t),
    count(key > t)), with ``count(key >= t) == k`` or ``t`` the k-th largest key."""
    base = (lo // BLOCK) * BLOCK
    if RADIX:
        t, c_lo, c_hi = streamed_radix(src_ptr, counts_ptr, k, lo, hi, base, BLOCK, RADIX,
                                       REGIONS)
    else:
        t, c_lo, c_hi = streamed_multisect(src_ptr, counts_ptr, k, hi - lo, lo, hi, base, 0,
                                           BLOCK, C, REGIONS, PIVOTS, False)
    return t, c_lo, c_hi


@triton.jit
def write_streamed(src_ptr, counts_ptr, out_row, score_row, k, t, c_lo, c_hi, p, lo, hi, off,
                   BLOCK: tl.constexpr, C: tl.constexpr, REGIONS: tl.constexpr,
                   LOWEST: tl.constexpr, SCORES: tl.constexpr):
    """One pass over a streamed source writing the selection of :func:`streamed_kth`'s
    ``(t, c_lo, c_hi)``: every key >= t when ``c_lo == k``, else the keys > t and enough
    equal ones; with LOWEST those of the lowest positions: for a row (in position order)
    the first ones, for candidates those whose negated output index is >= ``p``
    (:func:`tie_position`). Else the first ones block by block in column-major order.
    SCORES: as in :func:`select_write`."""
    offs = tile(BLOCK // C, C)
    base = (lo // BLOCK) * BLOCK
    exact = flag(c_lo == k)
    n_above = tl.where(exact, k, c_hi)
    seen_gt = tl.zeros([], tl.int32)
    seen_eq = tl.zeros([], tl.int32)
    for c in range(base, hi, BLOCK):
        key, idx, inside = streamed_block(src_ptr, counts_ptr, c + offs, lo, hi, off, BLOCK,
                                          REGIONS)
        gt = inside & ((key > t) | (exact & (key == t)))
        eq = inside & (key == t) & (~exact)
        if LOWEST & (REGIONS > 0):
            eq = eq & (-idx >= p)
        before, total = slots(gt.to(tl.int32) + (eq.to(tl.int32) << 16))
        eq_before = before >> 16
        if LOWEST & (REGIONS == 0):  # ranked in row-major order: the row's
            flat = tl.ravel(eq.to(tl.int32))
            eq_before = tl.reshape(tl.cumsum(flat, 0) - flat, [BLOCK // C, C])
        pos = tl.where(gt, seen_gt + (before & 0xFFFF), n_above + seen_eq + eq_before)
        taken = (gt | eq) & (pos < k)
        scatter(out_row + pos, idx, taken, BLOCK)
        if SCORES:
            scatter(score_row + pos, key_value(key), taken, BLOCK)
        seen_gt += total & 0xFFFF
        seen_eq += total >> 16


@triton.jit
def tie_position(src_ptr, counts_ptr, k, t, c_lo, c_hi, hi, BLOCK: tl.constexpr,
                 C: tl.constexpr, REGIONS: tl.constexpr, PIVOTS: tl.constexpr):
    """For ``hi`` candidates in regions with ``c_lo > k`` keys >= t (the k-th largest) and
    ``c_hi`` above it: the bound ``p`` such that the ``k - c_hi`` equal keys of the lowest
    positions are those whose negated output index is >= p (a streamed search on them)."""
    p, _, _ = streamed_multisect(src_ptr, counts_ptr, k - c_hi, c_lo - c_hi, 0, hi, 0, t,
                                 BLOCK, C, REGIONS, PIVOTS, True)
    return p


# --- kernels -----------------------------------------------------------------------------
