"""Decode metadata: per-token context lengths, expanded block tables, row -> request ids.

design §4. For the j-th query token of decode request r (decode_len tokens this step)::

    len(r, j) = max(seq_lens[r] - decode_len[r] + j + 1, 0)

The native layout ``[B, next_n]`` assumes every request has next_n tokens, right-aligned:
slot j has length ``max(seq_lens[b] - next_n + 1 + j, 0)``.

All outputs have the static capacity given as an int; rows past the real tokens are
defined (length 0, block-table row 0, request id ``num_reqs + k``).

``cap_context_lens`` keeps every row inside its block table and the cache: a row's length
is cut at its first block-table column whose entry is outside ``[0, num_blocks)`` (or past
the table's width) and at the logits width, so no kernel reads, and no top-k selects, a
key on an invalid block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from dsa.ops._checks import (
    INDEX_DTYPES,
    check_block_table,
    check_int,
    check_query_start_loc,
    check_seq_lens,
    check_tensor,
)
from dsa.ops._launch import block_for, launch, launch_1d
from dsa.ops._registry import dsa_op
from dsa.ops._tokens import request_of, search_steps, token_offset, token_offsets, token_requests

# --- decode_token_lens -------------------------------------------------------------------


@dsa_op("decode_token_lens")
def _decode_token_lens_out(query_start_loc: Tensor, seq_lens: Tensor, num_tokens: int) -> Tensor:
    op = "decode_token_lens"
    num_reqs = check_query_start_loc(op, query_start_loc)
    check_seq_lens(op, seq_lens, query_start_loc, num_reqs)
    check_int(op, "num_tokens", num_tokens, low=0)
    return query_start_loc.new_empty(num_tokens, dtype=torch.int32)


def token_lens(query_start_loc: Tensor, seq_lens: Tensor, num_tokens: int) -> Tensor:
    """Torch: int64 ``[num_tokens]`` context length of each token (0 for padding tokens)."""
    num_reqs = seq_lens.numel()
    req, back = token_offsets(query_start_loc, num_tokens)
    seq = torch.cat([seq_lens.long(), seq_lens.new_zeros(1, dtype=torch.long)])
    lens = (seq[req] + back + 1).clamp_(min=0)
    return torch.where(req < num_reqs, lens, 0)


@triton.jit
def token_lens_tl(qsl_ptr, seq_lens_ptr, t, in_range, num_reqs, SEARCH_STEPS: tl.constexpr,
                  REQS: tl.constexpr = 0):
    """Triton: same as ``token_lens`` for the tokens ``t``; also their requests and whether
    they are real (REQS: see ``request_of``). In int64, as the torch face: a length near
    -2**31 must not wrap to a long one."""
    req, real, back = token_offset(qsl_ptr, t, in_range, num_reqs, SEARCH_STEPS, REQS)
    seq = tl.load(seq_lens_ptr + req, mask=real, other=0).to(tl.int64)
    return tl.where(real, tl.maximum(seq + back + 1, 0), 0).to(tl.int32), req, real


@_decode_token_lens_out.cpu
def _decode_token_lens_cpu(query_start_loc: Tensor, seq_lens: Tensor, num_tokens: int) -> Tensor:
    out = _decode_token_lens_out(query_start_loc, seq_lens, num_tokens)
    return out.copy_(token_lens(query_start_loc, seq_lens, num_tokens))


@triton.jit
def _decode_token_lens_kernel(qsl_ptr, seq_lens_ptr, out_ptr, num_tokens, num_reqs,
                              SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = t < num_tokens
    lens, _, _ = token_lens_tl(qsl_ptr, seq_lens_ptr, t, in_range, num_reqs, SEARCH_STEPS)
    tl.store(out_ptr + t, lens, mask=in_range)


@_decode_token_lens_out.triton
def _decode_token_lens_cuda(query_start_loc: Tensor, seq_lens: Tensor, num_tokens: int) -> Tensor:
    out = _decode_token_lens_out(query_start_loc, seq_lens, num_tokens)
    num_reqs = seq_lens.numel()
    launch_1d(_decode_token_lens_kernel, num_tokens, query_start_loc, seq_lens, out, num_tokens,
              num_reqs, SEARCH_STEPS=search_steps(num_reqs))
    return out


# --- native_decode_lens ------------------------------------------------------------------


@dsa_op("native_decode_lens")
def _native_decode_lens_out(seq_lens: Tensor, next_n: int) -> Tensor:
    op = "native_decode_lens"
    check_tensor(op, "seq_lens", seq_lens, dtype=INDEX_DTYPES, ndim=1, contiguous=True)
    check_int(op, "next_n", next_n, low=1)
    return seq_lens.new_empty((seq_lens.numel(), next_n), dtype=torch.int32)


def native_lens(seq_lens: Tensor, next_n: int) -> Tensor:
    """Torch: int64 ``[B, next_n]`` lengths of the right-aligned native slots."""
    j = torch.arange(next_n, device=seq_lens.device, dtype=torch.long)
    return (seq_lens.long().unsqueeze(1) - next_n + 1 + j).clamp_(min=0)


@triton.jit
def native_lens_tl(seq, j, next_n):
    """Triton: same as ``native_lens`` for slots ``j`` of requests of length ``seq`` (int64
    inside, as the torch face)."""
    return tl.maximum(seq.to(tl.int64) - next_n + 1 + j, 0).to(tl.int32)


@_native_decode_lens_out.cpu
def _native_decode_lens_cpu(seq_lens: Tensor, next_n: int) -> Tensor:
    out = _native_decode_lens_out(seq_lens, next_n)
    return out.copy_(native_lens(seq_lens, next_n))


@triton.jit
def _native_decode_lens_kernel(seq_lens_ptr, out_ptr, num_slots, next_n, BLOCK: tl.constexpr):
    slot = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = slot < num_slots
    seq = tl.load(seq_lens_ptr + slot // next_n, mask=in_range, other=0)
    tl.store(out_ptr + slot, native_lens_tl(seq, slot % next_n, next_n), mask=in_range)


@_native_decode_lens_out.triton
def _native_decode_lens_cuda(seq_lens: Tensor, next_n: int) -> Tensor:
    out = _native_decode_lens_out(seq_lens, next_n)
    launch_1d(_native_decode_lens_kernel, out.numel(), seq_lens, out, out.numel(), next_n)
    return out


# --- expand_block_table ------------------------------------------------------------------


@dsa_op("expand_block_table")
def _expand_block_table_out(query_start_loc: Tensor, block_table: Tensor,
                            num_tokens: int) -> Tensor:
    op = "expand_block_table"
    num_reqs = check_query_start_loc(op, query_start_loc)
    check_block_table(op, block_table, query_start_loc, num_reqs)
    check_int(op, "num_tokens", num_tokens, low=0)
    return block_table.new_empty((num_tokens, block_table.shape[1]), dtype=torch.int32)


def expanded_table(query_start_loc: Tensor, block_table: Tensor, num_tokens: int) -> Tensor:
    """Torch: ``[num_tokens, W]`` block-table row of each token's request (0 for padding)."""
    padded = torch.cat([block_table, block_table.new_zeros((1, block_table.shape[1]))])
    return padded[token_requests(query_start_loc, num_tokens)]


@triton.jit
def table_rows_tl(table_ptr, table_stride, req, real, col, width):
    """Triton: rows ``req`` of a block table at columns ``col`` (0 where not ``real``)."""
    src = table_ptr + req.to(tl.int64)[:, None] * table_stride + col[None, :]
    return tl.load(src, mask=real[:, None] & (col < width)[None, :], other=0)


@_expand_block_table_out.cpu
def _expand_block_table_cpu(query_start_loc: Tensor, block_table: Tensor,
                            num_tokens: int) -> Tensor:
    out = _expand_block_table_out(query_start_loc, block_table, num_tokens)
    return out.copy_(expanded_table(query_start_loc, block_table, num_tokens))


@triton.jit
def _expand_block_table_kernel(qsl_ptr, block_table_ptr, table_stride, out_ptr, num_tokens,
                               num_reqs, width, SEARCH_STEPS: tl.constexpr,
                               BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    col = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    in_range = t < num_tokens
    req = request_of(qsl_ptr, t, num_reqs, SEARCH_STEPS)
    row = table_rows_tl(block_table_ptr, table_stride, req, in_range & (req < num_reqs), col,
                        width)
    dst = out_ptr + t.to(tl.int64)[:, None] * width + col[None, :]
    tl.store(dst, row, mask=in_range[:, None] & (col < width)[None, :])


@_expand_block_table_out.triton
def _expand_block_table_cuda(query_start_loc: Tensor, block_table: Tensor,
                             num_tokens: int) -> Tensor:
    out = _expand_block_table_out(query_start_loc, block_table, num_tokens)
    width = block_table.shape[1]
    if out.numel():
        num_reqs = block_table.shape[0]
        block_w = block_for(width, cap=256)
        block_t = max(1, 1024 // block_w)
        grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(width, block_w))
        launch(_expand_block_table_kernel, grid,
            query_start_loc, block_table, block_table.stride(0), out, num_tokens, num_reqs,
            width, SEARCH_STEPS=search_steps(num_reqs), BLOCK_T=block_t, BLOCK_W=block_w,
        )
    return out


# --- decode_row_requests -----------------------------------------------------------------


@dsa_op("decode_row_requests")
def _decode_row_requests_out(query_start_loc: Tensor, num_tokens: int) -> Tensor:
    op = "decode_row_requests"
    check_query_start_loc(op, query_start_loc)
    check_int(op, "num_tokens", num_tokens, low=0)
    return query_start_loc.new_empty(num_tokens, dtype=torch.int32)


def row_requests(query_start_loc: Tensor, num_tokens: int) -> Tensor:
    """Torch: int64 ``[num_tokens]`` request of each token, ``num_reqs + k`` for the k-th
    padding token."""
    num_reqs = query_start_loc.numel() - 1
    req = token_requests(query_start_loc, num_tokens).long()
    t = torch.arange(num_tokens, device=query_start_loc.device)
    padding = num_reqs + t - query_start_loc[num_reqs].long()
    return torch.where(req < num_reqs, req, padding)


@triton.jit
def row_requests_tl(qsl_ptr, t, num_reqs, SEARCH_STEPS: tl.constexpr, REQS: tl.constexpr = 0):
    """Triton: same as ``row_requests`` for the tokens ``t`` (REQS: see ``request_of``)."""
    req = request_of(qsl_ptr, t, num_reqs, SEARCH_STEPS, REQS)
    total = tl.load(qsl_ptr + num_reqs)
    return tl.where(req < num_reqs, req, num_reqs + t - total)


@_decode_row_requests_out.cpu
def _decode_row_requests_cpu(query_start_loc: Tensor, num_tokens: int) -> Tensor:
    out = _decode_row_requests_out(query_start_loc, num_tokens)
    return out.copy_(row_requests(query_start_loc, num_tokens))


@triton.jit
def _decode_row_requests_kernel(qsl_ptr, out_ptr, num_tokens, num_reqs,
                                SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + t, row_requests_tl(qsl_ptr, t, num_reqs, SEARCH_STEPS),
             mask=t < num_tokens)


@_decode_row_requests_out.triton
def _decode_row_requests_cuda(query_start_loc: Tensor, num_tokens: int) -> Tensor:
    out = _decode_row_requests_out(query_start_loc, num_tokens)
    num_reqs = query_start_loc.numel() - 1
    launch_1d(_decode_row_requests_kernel, num_tokens, query_start_loc, out, num_tokens,
              num_reqs, SEARCH_STEPS=search_steps(num_reqs))
    return out


# --- cap_context_lens --------------------------------------------------------------------


@dsa_op("cap_context_lens")
def _cap_context_lens_out(context_lens: Tensor, block_table: Tensor, num_blocks: int,
                          block_size: int, max_context_len: int) -> Tensor:
    op = "cap_context_lens"
    check_tensor(op, "context_lens", context_lens, dtype=INDEX_DTYPES, ndim=2, contiguous=True)
    check_block_table(op, block_table, context_lens)
    if block_table.shape[0] != context_lens.shape[0]:
        raise ValueError(f"dsa.{op}: `block_table` must have one row per row of "
                         f"`context_lens` ({context_lens.shape[0]}), got shape "
                         f"{tuple(block_table.shape)}")
    check_int(op, "num_blocks", num_blocks, low=0)
    check_int(op, "block_size", block_size, low=1)
    check_int(op, "max_context_len", max_context_len, low=0)
    return torch.empty_like(context_lens)


def capped_lens(context_lens: Tensor, block_table: Tensor, num_blocks: int, block_size: int,
                max_context_len: int) -> Tensor:
    """Torch: int64 lengths cut as ``cap_context_lens`` cuts them."""
    # A column of "outside" appended past the table: the first one found is the cut.
    outside = F.pad((block_table < 0) | (block_table >= num_blocks), (0, 1), value=True)
    cap = (outside.int().argmax(dim=1).long() * block_size).clamp(max=max_context_len)
    return torch.minimum(context_lens.long().clamp(min=0), cap[:, None])


# Block-table entries a step of capped_lens_tl reads: a row's blocks in one to a few steps
# (H200, decode_metadata at 4d3d64d, graphs, us with 256 / 2048: 1x1M 19.5 / 5.6, 8x128K
# 4.4 / 3.2, 64x64K 4.2 / 3.8, 1x4K 2.1 either way; BENCHMARKS.md, "eighteenth").
TABLE_SCAN_COLS = 2048


def table_scan_block(width: int) -> int:
    """``BLOCK_W`` of :func:`capped_lens_tl` for block-table rows of ``width`` entries."""
    return block_for(width, cap=TABLE_SCAN_COLS)


@triton.jit
def capped_lens_tl(lens, row_ptr, width, num_blocks, max_context_len, BS: tl.constexpr,
                   BLOCK_W: tl.constexpr):
    """Triton: same as ``capped_lens`` for the lengths ``lens`` of one row whose block-table
    row starts at ``row_ptr`` (read only as far as the longest length needs)."""
    lens = tl.minimum(tl.maximum(lens, 0), max_context_len)
    longest = tl.max(lens, axis=0)
    span = longest // BS + (longest % BS != 0).to(longest.dtype)  # cdiv without overflow
    needed = tl.minimum(span, width)
    first = needed
    cols = tl.arange(0, BLOCK_W)
    for c in range(0, needed, BLOCK_W):
        col = c + cols
        inside = col < needed
        entry = tl.load(row_ptr + col, mask=inside, other=0)
        outside = inside & ((entry < 0) | (entry >= num_blocks))
        first = tl.minimum(first, tl.min(tl.where(outside, col, needed), axis=0))
    cap = tl.where(first < span, first * BS, max_context_len)
    return tl.minimum(lens, cap)


@_cap_context_lens_out.cpu
def _cap_context_lens_cpu(context_lens: Tensor, block_table: Tensor, num_blocks: int,
                          block_size: int, max_context_len: int) -> Tensor:
    out = _cap_context_lens_out(context_lens, block_table, num_blocks, block_size,
                                max_context_len)
    return out.copy_(capped_lens(context_lens, block_table, num_blocks, block_size,
                                 max_context_len))


@triton.jit(do_not_specialize=["table_stride", "width", "num_blocks", "max_context_len"])
def _cap_context_lens_kernel(lens_ptr, table_ptr, table_stride, out_ptr, width, num_blocks,
                             max_context_len, N: tl.constexpr, NP: tl.constexpr,
                             BS: tl.constexpr, BLOCK_W: tl.constexpr):
    row = tl.program_id(0)
    j = tl.arange(0, NP)
    lens = tl.load(lens_ptr + row * N + j, mask=j < N, other=0)
    lens = capped_lens_tl(lens, table_ptr + row.to(tl.int64) * table_stride, width,
                          num_blocks, max_context_len, BS, BLOCK_W)
    tl.store(out_ptr + row * N + j, lens, mask=j < N)


@_cap_context_lens_out.triton
def _cap_context_lens_cuda(context_lens: Tensor, block_table: Tensor, num_blocks: int,
                           block_size: int, max_context_len: int) -> Tensor:
    out = _cap_context_lens_out(context_lens, block_table, num_blocks, block_size,
                                max_context_len)
    rows, next_n = context_lens.shape
    if out.numel():
        launch(_cap_context_lens_kernel, (rows,),
            context_lens, block_table, block_table.stride(0), out, block_table.shape[1],
            num_blocks, max_context_len, N=next_n, NP=triton.next_power_of_2(next_n),
            BS=block_size, BLOCK_W=table_scan_block(block_table.shape[1]),
        )
    return out
