"""The top-k's building blocks (dsa/ops/topk/select.py) on their own: ``select_positions``,
the k largest member keys of a tile and their output slots, for every search, with ties
broken either way, down to ``count == k`` (every member taken) and members whose key is the
smallest int32 (the key of a NaN with every bit set), which non-members share;
``region_offsets``, where the candidates of the parts' regions lie read as one sequence; and
``pivot``, the cut points of a key range (each strictly above its low end, so a search always
moves)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from faces import HAS_CUDA, KERNEL_MARK

from dsa.ops.topk.indices import SEARCHES
from dsa.ops.topk.select import pivot, region_offsets, select_positions, tile

R, C = 2, 32
N = R * C
DEVICE = "cuda" if HAS_CUDA else "cpu"
INT_MIN = -(2**31)  # the key non-members get


@triton.jit
def _pivots_kernel(lo_ptr, top_ptr, out_ptr, n, PIVOTS: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.arange(0, BLOCK)
    ok = j < n
    lo = tl.load(lo_ptr + j, mask=ok, other=0)
    top = tl.load(top_ptr + j, mask=ok, other=1)
    tl.store(out_ptr + j * 4, pivot(lo, top, 1, PIVOTS), mask=ok)
    tl.store(out_ptr + j * 4 + 1, pivot(lo, top, 2, PIVOTS), mask=ok)
    if PIVOTS == 4:
        tl.store(out_ptr + j * 4 + 2, pivot(lo, top, 3, PIVOTS), mask=ok)
        tl.store(out_ptr + j * 4 + 3, pivot(lo, top, 4, PIVOTS), mask=ok)


@KERNEL_MARK
@pytest.mark.parametrize("pivots", [2, 4])
def test_pivots_cut_every_range_above_its_low_end(pivots):
    """``lo < pivot 1 <= ... <= pivot PIVOTS <= top`` for ranges of width 1 and 2 (where a
    fraction of the width rounds to 0), mid-sized ones and the whole int32 range."""
    ranges = [(0, 1), (-5, -4), (7, 9), (INT_MIN, INT_MIN + 1), (2**31 - 2, 2**31 - 1),
              (-100, 100), (0, 1000), (INT_MIN, 2**31 - 1), (INT_MIN, 0), (-1, 2**31 - 1)]
    lo, top = (torch.tensor(v, dtype=torch.int32, device=DEVICE) for v in zip(*ranges))
    out = torch.zeros(len(ranges), 4, dtype=torch.int32, device=DEVICE)
    _pivots_kernel[(1,)](lo, top, out, len(ranges), PIVOTS=pivots, BLOCK=16)
    for (a, b), cuts in zip(ranges, out[:, :pivots].cpu().tolist(), strict=True):
        assert a < cuts[0] and cuts == sorted(cuts) and cuts[-1] <= b, (a, b, cuts)

@triton.jit
def _select_positions_kernel(keys_ptr, count, k, taken_ptr, pos_ptr, R: tl.constexpr,
                             C: tl.constexpr, RADIX: tl.constexpr, PIVOTS: tl.constexpr,
                             LOWEST: tl.constexpr):
    j = tile(R, C)
    member = j < count
    keys = tl.load(keys_ptr + j)
    taken, pos = select_positions(keys, j, member, count, k, RADIX, PIVOTS, LOWEST)
    tl.store(taken_ptr + j, taken.to(tl.int32))
    tl.store(pos_ptr + j, tl.where(taken, pos, -1))


def tile_cases() -> list:
    """(member keys, k) per case; the tile's other entries are non-members (INT_MIN)."""
    gen = torch.Generator().manual_seed(3)
    distinct = torch.randperm(1000, generator=gen)[:50].tolist()
    ties = torch.randint(0, 4, (50,), generator=gen).tolist()
    cases = {
        "distinct": (distinct, 20),
        "ties at the k-th": (ties, 20),
        "all equal": ([7] * 40, 13),
        "count == k": (distinct[:20], 20),
        "count == k, smallest key": ([INT_MIN, *distinct[:19]], 20),
        "smallest keys tie at the k-th": ([INT_MIN] * 10 + distinct[:10], 15),
        "full tile": (torch.randint(-(2**31), 2**31 - 1, (N,), generator=gen).tolist(), 31),
    }
    return [pytest.param(*case, id=name) for name, case in cases.items()]


@KERNEL_MARK
@pytest.mark.parametrize("lowest", [False, True])
@pytest.mark.parametrize("search", list(SEARCHES))
@pytest.mark.parametrize(("members", "k"), tile_cases())
def test_select_positions(members, k, search, lowest):
    count = len(members)
    keys = torch.full((N,), INT_MIN, dtype=torch.int32)
    keys[:count] = torch.tensor(members, dtype=torch.int64).to(torch.int32)
    taken = torch.empty(N, dtype=torch.int32, device=DEVICE)
    pos = torch.empty(N, dtype=torch.int32, device=DEVICE)
    radix, pivots = SEARCHES[search]
    _select_positions_kernel[(1,)](keys.to(DEVICE), count, k, taken, pos, R=R, C=C, RADIX=radix,
                                   PIVOTS=pivots, LOWEST=lowest)
    taken, pos = taken.cpu().bool(), pos.cpu()
    assert not taken[count:].any(), "a non-member taken"
    assert sorted(pos[taken].tolist()) == list(range(k)), "slots not 0 .. k - 1"
    member_keys = keys[:count].long()
    kth = member_keys.sort(descending=True).values[k - 1]
    assert (member_keys[taken[:count]] >= kth).all() and (member_keys[~taken[:count]] <= kth).all()
    if lowest:  # of the keys equal to the k-th, the lowest positions
        tied = (member_keys == kth).nonzero().view(-1)
        n_tied_taken = int(taken[:count][tied].sum())
        assert taken[:count][tied[:n_tied_taken]].all()


@triton.jit
def _region_offsets_kernel(counts_ptr, src_ptr, sums_ptr, REGIONS: tl.constexpr,
                           CAP: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    j = tile(R, C)
    src, total, largest = region_offsets(counts_ptr, j, REGIONS, CAP)
    tl.store(src_ptr + j, src)
    tl.store(sums_ptr + tl.arange(0, 2), tl.where(tl.arange(0, 2) == 0, total, largest))


@KERNEL_MARK
@pytest.mark.parametrize("counts", [[5], [0, 7, 0, 3], [8, 8, 8, 8], [0, 0, 0, 0],
                                    [3, 0, 8, 1, 0, 0, 2, 8, 5, 0, 0, 1, 7, 0, 4, 6]],
                         ids=["one region", "empty regions", "full regions", "none",
                              "sixteen regions"])
def test_region_offsets(counts):
    """Entry ``i`` of the sequence lies at ``p * CAP + i - (the counts before region p)`` in
    its region ``p``; entries past the total keep their own index."""
    cap = 8
    n = 2 * C
    src = torch.empty(n, dtype=torch.int32, device=DEVICE)
    sums = torch.empty(2, dtype=torch.int32, device=DEVICE)
    _region_offsets_kernel[(1,)](torch.tensor(counts, dtype=torch.int32, device=DEVICE), src,
                                 sums, REGIONS=len(counts), CAP=cap, R=2, C=C)
    expected = [p * cap + e for p, count in enumerate(counts) for e in range(count)]
    expected += list(range(len(expected), n))
    assert src.cpu().tolist() == expected[:n]
    assert sums.cpu().tolist() == [sum(counts), max(counts)]

