"""Write slots: which paged-cache row each query token writes (int64, ``-1`` = none).

design §7.

- ``compressed_slot_mapping`` (DeepSeek V4, ratio R): query token i of request r sits at
  ``pos = seq_len - query_len + i`` and writes compressed state ``cpos = pos // R`` only
  when ``(pos + 1) % R == 0``. Under DCP (world W, rank k, interleave I) the states are
  dealt over virtual blocks of ``block_size * W`` states and only this rank's share is
  written, packed into its own block.
- ``kpool_tail_slot_mapping`` (GLM kpool tail): every real token writes into its request's
  single circular block: ``block_table[r, 0] * kpool + positions[t] % kpool``.

Tokens that write nothing get -1: padding tokens, negative positions, states of other
ranks, blocks past the table width and negative block-table entries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsa.ops._checks import (
    POSITION_DTYPES,
    check_block_table,
    check_dcp,
    check_int,
    check_paged_requests,
    check_query_start_loc,
    check_tensor,
)
from dsa.ops._launch import launch_1d
from dsa.ops._registry import dsa_op
from dsa.ops._tokens import (
    request_of,
    search_steps,
    token_offset,
    token_offsets,
    token_requests,
)

# --- compressed_slot_mapping -------------------------------------------------------------


@dsa_op("compressed_slot_mapping")
def _compressed_slot_mapping_out(
    query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor, num_tokens: int,
    block_size: int, compress_ratio: int, dcp_world: int, dcp_rank: int,
    dcp_interleave: int = 1,
) -> Tensor:
    op = "compressed_slot_mapping"
    check_paged_requests(op, query_start_loc, seq_lens, block_table)
    check_int(op, "num_tokens", num_tokens, low=0)
    check_int(op, "block_size", block_size, low=1)
    check_int(op, "compress_ratio", compress_ratio, low=1)
    check_dcp(op, dcp_world, dcp_rank, dcp_interleave)
    return query_start_loc.new_empty(num_tokens, dtype=torch.int64)


@_compressed_slot_mapping_out.cpu
def _compressed_slot_mapping_cpu(
    query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor, num_tokens: int,
    block_size: int, compress_ratio: int, dcp_world: int, dcp_rank: int,
    dcp_interleave: int = 1,
) -> Tensor:
    out = _compressed_slot_mapping_out(
        query_start_loc, seq_lens, block_table, num_tokens, block_size, compress_ratio,
        dcp_world, dcp_rank, dcp_interleave,
    )
    width = block_table.shape[1]
    req, back = token_offsets(query_start_loc, num_tokens)
    seq = torch.cat([seq_lens.long(), seq_lens.new_zeros(1, dtype=torch.long)])[req]
    pos = seq + back
    cpos = pos.clamp(min=0) // compress_ratio
    blk = cpos // (block_size * dcp_world)
    v = cpos - blk * (block_size * dcp_world)
    mine = (v // dcp_interleave) % dcp_world == dcp_rank
    offset = v // (dcp_world * dcp_interleave) * dcp_interleave + v % dcp_interleave
    # A row of -1 for padding tokens, a column of -1 for blocks past the table width.
    table = torch.nn.functional.pad(block_table.long(), (0, 1, 0, 1), value=-1)
    entry = table[req, blk.clamp(max=width)]
    ok = (pos >= 0) & ((pos + 1) % compress_ratio == 0) & mine & (entry >= 0)
    return out.copy_(torch.where(ok, entry * block_size + offset, -1))


@triton.jit
def _compressed_slot_mapping_kernel(
    qsl_ptr, seq_lens_ptr, block_table_ptr, table_stride, out_ptr, num_tokens, num_reqs,
    width, block_size, ratio, world, rank, interleave,
    SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = t < num_tokens
    req, real, back = token_offset(qsl_ptr, t, in_range, num_reqs, SEARCH_STEPS)
    seq = tl.load(seq_lens_ptr + req, mask=real, other=0)
    pos = seq.to(tl.int64) + back  # int64 first: a length near -2**31 must not wrap
    writes = real & (pos >= 0) & ((pos + 1) % ratio == 0)
    # Lanes with pos < 0 are masked off; clamping keeps every division non-negative.
    cpos = tl.maximum(pos, 0) // ratio
    blk = cpos // block_size // world
    v = cpos - blk * block_size * world
    mine = (v // interleave) % world == rank
    offset = v // interleave // world * interleave + v % interleave
    ok = writes & mine & (blk < width)
    entry = tl.load(block_table_ptr + req.to(tl.int64) * table_stride + blk, mask=ok, other=-1)
    ok = ok & (entry >= 0)
    slot = entry.to(tl.int64) * block_size + offset
    tl.store(out_ptr + t, tl.where(ok, slot, -1), mask=in_range)


@_compressed_slot_mapping_out.triton
def _compressed_slot_mapping_cuda(
    query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor, num_tokens: int,
    block_size: int, compress_ratio: int, dcp_world: int, dcp_rank: int,
    dcp_interleave: int = 1,
) -> Tensor:
    out = _compressed_slot_mapping_out(
        query_start_loc, seq_lens, block_table, num_tokens, block_size, compress_ratio,
        dcp_world, dcp_rank, dcp_interleave,
    )
    num_reqs, width = block_table.shape
    launch_1d(_compressed_slot_mapping_kernel, num_tokens, query_start_loc, seq_lens, block_table,
              block_table.stride(0), out, num_tokens, num_reqs, width, block_size,
              compress_ratio, dcp_world, dcp_rank, dcp_interleave,
              SEARCH_STEPS=search_steps(num_reqs))
    return out


# --- kpool_tail_slot_mapping -------------------------------------------------------------


@dsa_op("kpool_tail_slot_mapping")
def _kpool_tail_slot_mapping_out(query_start_loc: Tensor, block_table: Tensor,
                                 positions: Tensor, kpool: int) -> Tensor:
    op = "kpool_tail_slot_mapping"
    num_reqs = check_query_start_loc(op, query_start_loc)
    check_block_table(op, block_table, query_start_loc, num_reqs)
    if block_table.shape[1] < 1:
        raise ValueError(f"dsa.{op}: `block_table` needs at least 1 column (the tail block), "
                         f"got shape {tuple(block_table.shape)}")
    check_tensor(op, "positions", positions, dtype=POSITION_DTYPES, ndim=1, contiguous=True,
                 like=query_start_loc)
    check_int(op, "kpool", kpool, low=1)
    return positions.new_empty(positions.shape, dtype=torch.int64)


@_kpool_tail_slot_mapping_out.cpu
def _kpool_tail_slot_mapping_cpu(query_start_loc: Tensor, block_table: Tensor,
                                 positions: Tensor, kpool: int) -> Tensor:
    out = _kpool_tail_slot_mapping_out(query_start_loc, block_table, positions, kpool)
    req = token_requests(query_start_loc, positions.numel())
    # Padding tokens (req == num_reqs) read the appended -1.
    entry = torch.nn.functional.pad(block_table[:, 0].long(), (0, 1), value=-1)[req]
    pos = positions.long()
    return out.copy_(torch.where((entry >= 0) & (pos >= 0), entry * kpool + pos % kpool, -1))


@triton.jit
def _kpool_tail_slot_mapping_kernel(qsl_ptr, block_table_ptr, table_stride, positions_ptr,
                                    out_ptr, num_tokens, num_reqs, kpool,
                                    SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = t < num_tokens
    req = request_of(qsl_ptr, t, num_reqs, SEARCH_STEPS)
    real = in_range & (req < num_reqs)
    entry = tl.load(block_table_ptr + req.to(tl.int64) * table_stride, mask=real, other=-1)
    pos = tl.load(positions_ptr + t, mask=real, other=-1).to(tl.int64)
    slot = entry.to(tl.int64) * kpool + pos % kpool
    tl.store(out_ptr + t, tl.where(real & (entry >= 0) & (pos >= 0), slot, -1), mask=in_range)


@_kpool_tail_slot_mapping_out.triton
def _kpool_tail_slot_mapping_cuda(query_start_loc: Tensor, block_table: Tensor,
                                  positions: Tensor, kpool: int) -> Tensor:
    out = _kpool_tail_slot_mapping_out(query_start_loc, block_table, positions, kpool)
    num_tokens, num_reqs = positions.numel(), block_table.shape[0]
    launch_1d(_kpool_tail_slot_mapping_kernel, num_tokens, query_start_loc, block_table,
              block_table.stride(0), positions, out, num_tokens, num_reqs, kpool,
              SEARCH_STEPS=search_steps(num_reqs))
    return out
