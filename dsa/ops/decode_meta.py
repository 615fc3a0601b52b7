"""Decode metadata: per-token context lengths, expanded block tables, row -> request ids.

SPEC §4. For the j-th query token of decode request r (decode_len tokens this step)::

    len(r, j) = max(seq_lens[r] - decode_len[r] + j + 1, 0)

The native layout ``[B, next_n]`` assumes every request has next_n tokens, right-aligned:
slot j has length ``max(seq_lens[b] - next_n + 1 + j, 0)``.

All outputs have the static capacity given as an int; rows past the real tokens are
defined (length 0, block-table row 0, request id ``num_reqs + k``).
"""

from __future__ import annotations

import torch
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
from dsa.ops._registry import register
from dsa.ops._tokens import block_for, request_of, search_steps, token_requests

# --- decode_token_lens -------------------------------------------------------------------


def _decode_token_lens_out(query_start_loc: Tensor, seq_lens: Tensor, num_tokens: int) -> Tensor:
    op = "decode_token_lens"
    num_reqs = check_query_start_loc(op, query_start_loc)
    check_seq_lens(op, seq_lens, query_start_loc, num_reqs)
    check_int(op, "num_tokens", num_tokens, low=0)
    return query_start_loc.new_empty(num_tokens, dtype=torch.int32)


def _decode_token_lens_cpu(query_start_loc: Tensor, seq_lens: Tensor, num_tokens: int) -> Tensor:
    out = _decode_token_lens_out(query_start_loc, seq_lens, num_tokens)
    num_reqs = seq_lens.numel()
    req = token_requests(query_start_loc, num_tokens)
    qsl = query_start_loc.long()
    seq = torch.cat([seq_lens.long(), seq_lens.new_zeros(1, dtype=torch.long)])
    start = qsl[req]
    decode_len = qsl[(req + 1).clamp_(max=num_reqs)] - start
    j = torch.arange(num_tokens, device=out.device) - start
    lens = (seq[req] - decode_len + j + 1).clamp_(min=0)
    return out.copy_(torch.where(req < num_reqs, lens, 0))


@triton.jit
def _decode_token_lens_kernel(qsl_ptr, seq_lens_ptr, out_ptr, num_tokens, num_reqs,
                              SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = t < num_tokens
    req = request_of(qsl_ptr, t, num_reqs, SEARCH_STEPS)
    real = in_range & (req < num_reqs)
    start = tl.load(qsl_ptr + req, mask=real, other=0)
    end = tl.load(qsl_ptr + req + 1, mask=real, other=0)
    seq = tl.load(seq_lens_ptr + req, mask=real, other=0)
    lens = tl.maximum(seq - (end - start) + (t - start) + 1, 0)
    tl.store(out_ptr + t, tl.where(real, lens, 0), mask=in_range)


def _decode_token_lens_cuda(query_start_loc: Tensor, seq_lens: Tensor, num_tokens: int) -> Tensor:
    out = _decode_token_lens_out(query_start_loc, seq_lens, num_tokens)
    if num_tokens:
        num_reqs = seq_lens.numel()
        block = block_for(num_tokens)
        _decode_token_lens_kernel[(triton.cdiv(num_tokens, block),)](
            query_start_loc, seq_lens, out, num_tokens, num_reqs,
            SEARCH_STEPS=search_steps(num_reqs), BLOCK=block,
        )
    return out


decode_token_lens = register(
    "decode_token_lens",
    cpu=_decode_token_lens_cpu,
    cuda=_decode_token_lens_cuda,
    fake=_decode_token_lens_out,
)


# --- native_decode_lens ------------------------------------------------------------------


def _native_decode_lens_out(seq_lens: Tensor, next_n: int) -> Tensor:
    op = "native_decode_lens"
    check_tensor(op, "seq_lens", seq_lens, dtype=INDEX_DTYPES, ndim=1, contiguous=True)
    check_int(op, "next_n", next_n, low=1)
    return seq_lens.new_empty((seq_lens.numel(), next_n), dtype=torch.int32)


def _native_decode_lens_cpu(seq_lens: Tensor, next_n: int) -> Tensor:
    out = _native_decode_lens_out(seq_lens, next_n)
    j = torch.arange(next_n, device=seq_lens.device, dtype=torch.long)
    lens = seq_lens.long().unsqueeze(1) - next_n + 1 + j
    return out.copy_(lens.clamp_(min=0))


@triton.jit
def _native_decode_lens_kernel(seq_lens_ptr, out_ptr, num_slots, next_n, BLOCK: tl.constexpr):
    slot = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = slot < num_slots
    seq = tl.load(seq_lens_ptr + slot // next_n, mask=in_range, other=0)
    lens = tl.maximum(seq - next_n + 1 + slot % next_n, 0)
    tl.store(out_ptr + slot, lens, mask=in_range)


def _native_decode_lens_cuda(seq_lens: Tensor, next_n: int) -> Tensor:
    out = _native_decode_lens_out(seq_lens, next_n)
    num_slots = out.numel()
    if num_slots:
        block = block_for(num_slots)
        _native_decode_lens_kernel[(triton.cdiv(num_slots, block),)](
            seq_lens, out, num_slots, next_n, BLOCK=block
        )
    return out


native_decode_lens = register(
    "native_decode_lens",
    cpu=_native_decode_lens_cpu,
    cuda=_native_decode_lens_cuda,
    fake=_native_decode_lens_out,
)


# --- expand_block_table ------------------------------------------------------------------


def _expand_block_table_out(query_start_loc: Tensor, block_table: Tensor,
                            num_tokens: int) -> Tensor:
    op = "expand_block_table"
    num_reqs = check_query_start_loc(op, query_start_loc)
    check_block_table(op, block_table, query_start_loc, num_reqs)
    check_int(op, "num_tokens", num_tokens, low=0)
    return block_table.new_empty((num_tokens, block_table.shape[1]), dtype=torch.int32)


def _expand_block_table_cpu(query_start_loc: Tensor, block_table: Tensor,
                            num_tokens: int) -> Tensor:
    out = _expand_block_table_out(query_start_loc, block_table, num_tokens)
    padded = torch.cat([block_table, block_table.new_zeros((1, block_table.shape[1]))])
    return out.copy_(padded[token_requests(query_start_loc, num_tokens)])


@triton.jit
def _expand_block_table_kernel(qsl_ptr, block_table_ptr, table_stride, out_ptr, num_tokens,
                               num_reqs, width, SEARCH_STEPS: tl.constexpr,
                               BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    col = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    in_range = t < num_tokens
    req = request_of(qsl_ptr, t, num_reqs, SEARCH_STEPS)
    real = in_range & (req < num_reqs)
    col_ok = (col < width)[None, :]
    src = block_table_ptr + req.to(tl.int64)[:, None] * table_stride + col[None, :]
    row = tl.load(src, mask=real[:, None] & col_ok, other=0)
    dst = out_ptr + t.to(tl.int64)[:, None] * width + col[None, :]
    tl.store(dst, row, mask=in_range[:, None] & col_ok)


def _expand_block_table_cuda(query_start_loc: Tensor, block_table: Tensor,
                             num_tokens: int) -> Tensor:
    out = _expand_block_table_out(query_start_loc, block_table, num_tokens)
    width = block_table.shape[1]
    if out.numel():
        num_reqs = block_table.shape[0]
        block_w = block_for(width, cap=256)
        block_t = max(1, 1024 // block_w)
        grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(width, block_w))
        _expand_block_table_kernel[grid](
            query_start_loc, block_table, block_table.stride(0), out, num_tokens, num_reqs,
            width, SEARCH_STEPS=search_steps(num_reqs), BLOCK_T=block_t, BLOCK_W=block_w,
        )
    return out


expand_block_table = register(
    "expand_block_table",
    cpu=_expand_block_table_cpu,
    cuda=_expand_block_table_cuda,
    fake=_expand_block_table_out,
)


# --- decode_row_requests -----------------------------------------------------------------


def _decode_row_requests_out(query_start_loc: Tensor, num_tokens: int) -> Tensor:
    op = "decode_row_requests"
    check_query_start_loc(op, query_start_loc)
    check_int(op, "num_tokens", num_tokens, low=0)
    return query_start_loc.new_empty(num_tokens, dtype=torch.int32)


def _decode_row_requests_cpu(query_start_loc: Tensor, num_tokens: int) -> Tensor:
    out = _decode_row_requests_out(query_start_loc, num_tokens)
    num_reqs = query_start_loc.numel() - 1
    req = token_requests(query_start_loc, num_tokens).long()
    t = torch.arange(num_tokens, device=out.device)
    padding = num_reqs + t - query_start_loc[num_reqs].long()
    return out.copy_(torch.where(req < num_reqs, req, padding))


@triton.jit
def _decode_row_requests_kernel(qsl_ptr, out_ptr, num_tokens, num_reqs,
                                SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = t < num_tokens
    req = request_of(qsl_ptr, t, num_reqs, SEARCH_STEPS)
    total = tl.load(qsl_ptr + num_reqs)
    rows = tl.where(req < num_reqs, req, num_reqs + t - total)
    tl.store(out_ptr + t, rows, mask=in_range)


def _decode_row_requests_cuda(query_start_loc: Tensor, num_tokens: int) -> Tensor:
    out = _decode_row_requests_out(query_start_loc, num_tokens)
    if num_tokens:
        num_reqs = query_start_loc.numel() - 1
        block = block_for(num_tokens)
        _decode_row_requests_kernel[(triton.cdiv(num_tokens, block),)](
            query_start_loc, out, num_tokens, num_reqs,
            SEARCH_STEPS=search_steps(num_reqs), BLOCK=block,
        )
    return out


decode_row_requests = register(
    "decode_row_requests",
    cpu=_decode_row_requests_cpu,
    cuda=_decode_row_requests_cuda,
    fake=_decode_row_requests_out,
)
