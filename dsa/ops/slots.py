"""Slot transform (SPEC §3): top-k token indices -> global paged-cache slots for sparse MLA.

For row ``t`` of request ``r = row_requests[t]``::

    slot = block_table[r, i // block_size] * block_size + i % block_size

``-1`` (and any negative index) stays ``-1``; an index whose block column is past the
table, whose block entry is negative, or whose request is outside ``[0, num_reqs)`` gives
``-1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsa.ops._checks import INDEX_DTYPES, check_block_table, check_int, check_size, check_tensor
from dsa.ops._registry import register
from dsa.ops._tokens import block_for
from dsa.ops.kcache import padded_block_table


def _indices_to_slots_out(indices: Tensor, block_table: Tensor, row_requests: Tensor,
                          block_size: int) -> Tensor:
    op = "indices_to_slots"
    check_tensor(op, "indices", indices, dtype=INDEX_DTYPES, ndim=2, contiguous=True)
    check_block_table(op, block_table, indices)
    check_tensor(op, "row_requests", row_requests, dtype=INDEX_DTYPES, ndim=1, contiguous=True,
                 like=indices)
    check_size(op, "row_requests", row_requests, 0, indices.shape[0], "rows = indices.shape[0]")
    check_int(op, "block_size", block_size, low=1)
    return torch.empty_like(indices)


def _indices_to_slots_cpu(indices: Tensor, block_table: Tensor, row_requests: Tensor,
                          block_size: int) -> Tensor:
    out = _indices_to_slots_out(indices, block_table, row_requests, block_size)
    num_reqs, width = block_table.shape
    req = row_requests.long()
    req = torch.where((req >= 0) & (req < num_reqs), req, num_reqs)
    i = indices.long()
    col = torch.where(i >= 0, i // block_size, width).clamp_(max=width)
    blk = padded_block_table(block_table)[req[:, None], col].long()
    return out.copy_(torch.where(blk >= 0, blk * block_size + i % block_size, -1))


@triton.jit
def _indices_to_slots_kernel(idx_ptr, bt_ptr, bt_stride, req_ptr, out_ptr, num_elems, k,
                             num_reqs, width, BS: tl.constexpr, BLOCK: tl.constexpr):
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = e < num_elems
    i = tl.load(idx_ptr + e, mask=in_range, other=-1)
    req = tl.load(req_ptr + e // k, mask=in_range, other=-1)
    col = i // BS
    ok = (i >= 0) & (req >= 0) & (req < num_reqs) & (col < width)
    blk = tl.load(bt_ptr + req.to(tl.int64) * bt_stride + col, mask=ok, other=-1)
    slot = blk * BS + i % BS
    tl.store(out_ptr + e, tl.where(ok & (blk >= 0), slot, -1), mask=in_range)


def _indices_to_slots_cuda(indices: Tensor, block_table: Tensor, row_requests: Tensor,
                           block_size: int) -> Tensor:
    out = _indices_to_slots_out(indices, block_table, row_requests, block_size)
    num_elems = indices.numel()
    if num_elems:
        block = block_for(num_elems)
        _indices_to_slots_kernel[(triton.cdiv(num_elems, block),)](
            indices, block_table, block_table.stride(0), row_requests, out, num_elems,
            indices.shape[1], block_table.shape[0], block_table.shape[1],
            BS=block_size, BLOCK=block,
        )
    return out


indices_to_slots = register(
    "indices_to_slots",
    cpu=_indices_to_slots_cpu,
    cuda=_indices_to_slots_cuda,
    fake=_indices_to_slots_out,
)
