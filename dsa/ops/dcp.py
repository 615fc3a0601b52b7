"""Decode context parallelism: this rank's share of a sharded length.

design §6. The K cache of a request is dealt out over ``world`` ranks in runs of
``interleave`` entries; rank ``k`` owns entry ``c`` iff ``(c // interleave) % world == k``.
Its share of the first ``n`` entries is::

    base  = (n // interleave // world) * interleave
    rest  = n - base * world
    local = base + min(max(rest - k * interleave, 0), interleave)

Negative lengths count as 0. Interleave > 1 is rejected when ``world > 1`` (not validated
end to end); with ``world == 1`` every length is its own share.

With interleave 1, key ``c`` of a request is rank ``c % world``'s local key ``c // world``
(design §11): ``global_positions`` and ``owned_indices`` translate between the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsa.ops._checks import INDEX_DTYPES, check_dcp, check_tensor
from dsa.ops._launch import launch_1d
from dsa.ops._registry import dsa_op


def local_share(n: Tensor, world: int, rank: int, interleave: int) -> Tensor:
    """Torch: rank ``rank``'s share of each length in ``n`` (same dtype; negatives -> 0)."""
    n = n.clamp(min=0)
    base = n // interleave // world * interleave
    rest = n - base * world
    return base + (rest - rank * interleave).clamp(0, interleave)


def global_positions(local: Tensor, world: int, rank: int) -> Tensor:
    """Torch: the global position ``local * world + rank`` of each local key index of rank
    ``rank`` (interleave 1); negative entries stay -1."""
    return torch.where(local >= 0, local * world + rank, -1)


def owned_indices(positions: Tensor, world: int, rank: int) -> Tensor:
    """Torch: the local index ``c // world`` of each global position ``c`` that rank ``rank``
    owns (``c % world == rank``, interleave 1); -1 for the others and for negative entries."""
    return torch.where((positions >= 0) & (positions % world == rank), positions // world, -1)


@triton.jit
def local_share_tl(n, world, rank, interleave):
    """Triton: same as ``local_share`` for a block of lengths."""
    n = tl.maximum(n, 0)
    base = n // interleave // world * interleave
    rest = n - base * world
    return base + tl.minimum(tl.maximum(rest - rank * interleave, 0), interleave)


@dsa_op("dcp_local_lens")
def _dcp_local_lens_out(lens: Tensor, world: int, rank: int, interleave: int) -> Tensor:
    op = "dcp_local_lens"
    check_tensor(op, "lens", lens, dtype=INDEX_DTYPES)
    check_dcp(op, world, rank, interleave, prefix="")
    return lens.new_empty(lens.shape, dtype=torch.int32)


@_dcp_local_lens_out.cpu
def _dcp_local_lens_cpu(lens: Tensor, world: int, rank: int, interleave: int) -> Tensor:
    out = _dcp_local_lens_out(lens, world, rank, interleave)
    return out.copy_(local_share(lens, world, rank, interleave))


@triton.jit
def _dcp_local_lens_kernel(lens_ptr, out_ptr, numel, world, rank, interleave,
                           BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = i < numel
    n = tl.load(lens_ptr + i, mask=in_range, other=0)
    tl.store(out_ptr + i, local_share_tl(n, world, rank, interleave), mask=in_range)


@_dcp_local_lens_out.triton
def _dcp_local_lens_cuda(lens: Tensor, world: int, rank: int, interleave: int) -> Tensor:
    out = _dcp_local_lens_out(lens, world, rank, interleave)
    launch_1d(_dcp_local_lens_kernel, out.numel(), lens.contiguous(), out, out.numel(), world,
              rank, interleave)
    return out
