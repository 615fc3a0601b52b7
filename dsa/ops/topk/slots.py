"""Slot transform (design §3): top-k key positions -> global paged-cache slots for sparse MLA.

For row ``t`` of request ``r = row_requests[t]``::

    slot = block_table[r, i // block_size] * block_size + i % block_size

``-1`` (and any negative index) stays ``-1``, and so does an index whose block column is
past the table, whose block entry is outside ``[0, num_blocks)``, or whose request is
outside ``[0, num_reqs)``: no slot ever points outside the cache. Slots are computed in
int64 and fit int32 because ``num_blocks * block_size`` must.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsa.ops._checks import INDEX_DTYPES, check_block_table, check_int, check_size, check_tensor
from dsa.ops._launch import launch_1d
from dsa.ops._registry import dsa_op
from dsa.ops.kcache import padded_block_table

INT32_MAX = 2**31 - 1


def check_slot_args(op: str, block_table: Tensor, row_requests: Tensor, rows: int,
                    like: Tensor, block_size: int, num_blocks: int) -> None:
    """The slot transform's arguments for ``rows`` rows on ``like``'s device."""
    check_block_table(op, block_table, like)
    check_tensor(op, "row_requests", row_requests, dtype=INDEX_DTYPES, ndim=1, contiguous=True,
                 like=like)
    check_size(op, "row_requests", row_requests, 0, rows, "one request per row")
    check_int(op, "block_size", block_size, low=1)
    check_int(op, "num_blocks", num_blocks, low=0)
    if num_blocks * block_size > INT32_MAX + 1:
        raise ValueError(f"dsa.{op}: the cache's slots must fit int32: num_blocks * block_size "
                         f"<= 2**31, got {num_blocks} * {block_size}")


@dsa_op("indices_to_slots")
def _indices_to_slots_out(indices: Tensor, block_table: Tensor, row_requests: Tensor,
                          block_size: int, num_blocks: int) -> Tensor:
    op = "indices_to_slots"
    check_tensor(op, "indices", indices, dtype=INDEX_DTYPES, ndim=2, contiguous=True)
    check_slot_args(op, block_table, row_requests, indices.shape[0], indices, block_size,
                    num_blocks)
    return torch.empty_like(indices)


@_indices_to_slots_out.cpu
def _indices_to_slots_cpu(indices: Tensor, block_table: Tensor, row_requests: Tensor,
                          block_size: int, num_blocks: int) -> Tensor:
    out = _indices_to_slots_out(indices, block_table, row_requests, block_size, num_blocks)
    num_reqs, width = block_table.shape
    req = row_requests.long()
    req = torch.where((req >= 0) & (req < num_reqs), req, num_reqs)
    i = indices.long()
    col = torch.where(i >= 0, i // block_size, width).clamp_(max=width)
    blk = padded_block_table(block_table)[req[:, None], col].long()
    ok = (blk >= 0) & (blk < num_blocks)
    return out.copy_(torch.where(ok, blk * block_size + i % block_size, -1))


@triton.jit
def slot_of(i, table_row, req_ok, width, num_blocks, BS: tl.constexpr):
    """Slot of position ``i`` through the block table row at ``table_row`` (read only where
    ``req_ok``, i.e. the row's request is in ``[0, num_reqs)``); -1 where there is none."""
    col = i // BS
    ok = (i >= 0) & req_ok & (col < width)
    blk = tl.load(table_row + col, mask=ok, other=-1)
    slot = blk.to(tl.int64) * BS + i % BS
    return tl.where(ok & (blk >= 0) & (blk < num_blocks), slot, -1)


@triton.jit
def request_row(table_ptr, table_stride, req, num_reqs):
    """(table row of request ``req``, whether ``req`` is in ``[0, num_reqs)``)."""
    req_ok = tl.where((req >= 0) & (req < num_reqs), True, False)  # int1 in the interpreter
    return table_ptr + tl.where(req_ok, req, 0).to(tl.int64) * table_stride, req_ok


@triton.jit
def _indices_to_slots_kernel(idx_ptr, bt_ptr, bt_stride, req_ptr, out_ptr, num_elems, k,
                             num_reqs, width, num_blocks, BS: tl.constexpr, BLOCK: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = e < num_elems
    i = tl.load(idx_ptr + e, mask=in_range, other=-1)
    table_row, req_ok = request_row(bt_ptr, bt_stride,
                                    tl.load(req_ptr + e // k, mask=in_range, other=-1), num_reqs)
    tl.store(out_ptr + e, slot_of(i, table_row, req_ok, width, num_blocks, BS), mask=in_range)


@_indices_to_slots_out.triton
def _indices_to_slots_cuda(indices: Tensor, block_table: Tensor, row_requests: Tensor,
                           block_size: int, num_blocks: int) -> Tensor:
    out = _indices_to_slots_out(indices, block_table, row_requests, block_size, num_blocks)
    num_reqs, width = block_table.shape
    launch_1d(_indices_to_slots_kernel, indices.numel(), indices, block_table,
              block_table.stride(0), row_requests, out, indices.numel(), indices.shape[1],
              num_reqs, width, num_blocks, BS=block_size)
    return out
