"""Layout changes of per-step tensors: block-table coarsening, native decode packing.

- ``compress_block_table`` (design §7): when the kernel block is ``factor`` times smaller
  than the cache block, the indexer's table is ``block_table[:, ::factor] // factor``
  (negative entries stay -1).
- ``pack_decode_rows`` / ``unpack_decode_rows`` (design §4): the native decode layout
  ``[B, next_n, ...]`` right-aligns each request's tokens, so token i of a request with
  decode_len d sits in slot ``next_n - d + i`` (where ``native_decode_lens`` gives it its own
  length). Packing drops tokens whose slot would be negative and zero-fills the rest;
  unpacking gives ``fill`` to rows with no slot and to graph padding rows.

Packing moves raw bits (any dtype, fp8 included, is viewed as a same-width integer), so
values come back bit for bit.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from dsa.ops._checks import (
    check_block_table,
    check_int,
    check_query_start_loc,
    check_size,
    check_tensor,
)
from dsa.ops._launch import block_for, launch
from dsa.ops._registry import dsa_op
from dsa.ops._tokens import search_steps, token_offset, token_offsets

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _check_element_size(op: str, name: str, t: Tensor) -> None:
    if t.element_size() not in _BITS:
        raise TypeError(f"dsa.{op}: `{name}` must have 1, 2, 4 or 8-byte elements, "
                        f"got {t.dtype}")


def _as_bits(t: Tensor) -> Tensor:
    """``t`` viewed as the signed integer dtype of its element width (a view, no copy)."""
    return t.view(_BITS[t.element_size()])


def _tile(rows: int, width: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) of a 2-D tile: the row width, then enough rows for ~2K elements."""
    block_c = block_for(width, cap=1024)
    return max(1, min(block_for(rows), 2048 // block_c)), block_c


# --- compress_block_table ----------------------------------------------------------------


@dsa_op("compress_block_table")
def _compress_block_table_out(block_table: Tensor, factor: int) -> Tensor:
    op = "compress_block_table"
    check_block_table(op, block_table)
    check_int(op, "factor", factor, low=1)
    width = -(-block_table.shape[1] // factor)
    return block_table.new_empty((block_table.shape[0], width), dtype=torch.int32)


@_compress_block_table_out.cpu
def _compress_block_table_cpu(block_table: Tensor, factor: int) -> Tensor:
    out = _compress_block_table_out(block_table, factor)
    kept = block_table[:, ::factor]
    return out.copy_(torch.where(kept >= 0, kept // factor, -1))


@triton.jit
def _compress_block_table_kernel(block_table_ptr, table_stride, out_ptr, num_rows, width,
                                 factor, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (row < num_rows)[:, None] & (col < width)[None, :]
    src = block_table_ptr + row.to(tl.int64)[:, None] * table_stride
    entry = tl.load(src + col.to(tl.int64)[None, :] * factor, mask=mask, other=-1)
    coarse = tl.where(entry >= 0, entry // factor, -1)
    tl.store(out_ptr + row.to(tl.int64)[:, None] * width + col[None, :], coarse, mask=mask)


@_compress_block_table_out.triton
def _compress_block_table_cuda(block_table: Tensor, factor: int) -> Tensor:
    out = _compress_block_table_out(block_table, factor)
    if out.numel():
        num_rows, width = out.shape
        block_r, block_c = _tile(num_rows, width)
        grid = (triton.cdiv(num_rows, block_r), triton.cdiv(width, block_c))
        launch(_compress_block_table_kernel, grid,
            block_table, block_table.stride(0), out, num_rows, width, factor,
            BLOCK_R=block_r, BLOCK_C=block_c,
        )
    return out


# --- pack_decode_rows --------------------------------------------------------------------


@dsa_op("pack_decode_rows")
def _pack_decode_rows_out(x: Tensor, query_start_loc: Tensor, next_n: int) -> Tensor:
    op = "pack_decode_rows"
    check_tensor(op, "x", x, contiguous=True)
    if x.dim() < 1:
        raise ValueError(f"dsa.{op}: `x` must have a token dimension, got a 0-d tensor")
    _check_element_size(op, "x", x)
    num_reqs = check_query_start_loc(op, query_start_loc)
    check_tensor(op, "query_start_loc", query_start_loc, like=x)
    check_int(op, "next_n", next_n, low=1)
    return x.new_empty((num_reqs, next_n, *x.shape[1:]))


@_pack_decode_rows_out.cpu
def _pack_decode_rows_cpu(x: Tensor, query_start_loc: Tensor, next_n: int) -> Tensor:
    out = _pack_decode_rows_out(x, query_start_loc, next_n)
    num_tokens, width = x.shape[0], math.prod(x.shape[1:])
    rows = _as_bits(x).reshape(num_tokens, width)
    # Slots without a token read an appended zero row.
    rows = torch.cat([rows, rows.new_zeros((1, width))])
    qsl = query_start_loc.long()
    start, decode_len = qsl[:-1, None], (qsl[1:] - qsl[:-1])[:, None]
    i = torch.arange(next_n, device=x.device) - next_n + decode_len
    src = start + i
    src = torch.where((i >= 0) & (src >= 0) & (src < num_tokens), src, num_tokens)
    _as_bits(out).view(out.shape[0] * next_n, width).copy_(rows[src.view(-1)])
    return out


@triton.jit
def _pack_decode_rows_kernel(x_ptr, qsl_ptr, out_ptr, num_slots, next_n, num_tokens, width,
                             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    slot = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    is_slot = slot < num_slots
    req = slot // next_n
    start = tl.load(qsl_ptr + req, mask=is_slot, other=0).to(tl.int64)  # as the torch face
    end = tl.load(qsl_ptr + req + 1, mask=is_slot, other=0)
    i = slot % next_n - next_n + (end - start)
    src = start + i
    has_token = is_slot & (i >= 0) & (src >= 0) & (src < num_tokens)
    col_ok = (col < width)[None, :]
    src_ptr = x_ptr + src.to(tl.int64)[:, None] * width + col[None, :]
    vals = tl.load(src_ptr, mask=has_token[:, None] & col_ok, other=0)
    dst_ptr = out_ptr + slot.to(tl.int64)[:, None] * width + col[None, :]
    tl.store(dst_ptr, vals, mask=is_slot[:, None] & col_ok)


@_pack_decode_rows_out.triton
def _pack_decode_rows_cuda(x: Tensor, query_start_loc: Tensor, next_n: int) -> Tensor:
    out = _pack_decode_rows_out(x, query_start_loc, next_n)
    num_slots, width = out.shape[0] * next_n, math.prod(x.shape[1:])
    if out.numel():
        block_r, block_c = _tile(num_slots, width)
        grid = (triton.cdiv(num_slots, block_r), triton.cdiv(width, block_c))
        launch(_pack_decode_rows_kernel, grid,
            _as_bits(x), query_start_loc, _as_bits(out), num_slots, next_n, x.shape[0], width,
            BLOCK_R=block_r, BLOCK_C=block_c,
        )
    return out


# --- unpack_decode_rows ------------------------------------------------------------------


@dsa_op("unpack_decode_rows")
def _unpack_decode_rows_out(y: Tensor, query_start_loc: Tensor, num_tokens: int,
                            fill: int = -1) -> Tensor:
    op = "unpack_decode_rows"
    check_tensor(op, "y", y, contiguous=True)
    if y.dim() < 2:
        raise ValueError(f"dsa.{op}: `y` must be [num_reqs, next_n, ...], "
                         f"got shape {tuple(y.shape)}")
    _check_element_size(op, "y", y)
    num_reqs = check_query_start_loc(op, query_start_loc)
    check_tensor(op, "query_start_loc", query_start_loc, like=y)
    check_size(op, "y", y, 0, num_reqs, "num_reqs = len(query_start_loc) - 1")
    check_int(op, "num_tokens", num_tokens, low=0)
    check_int(op, "fill", fill)
    low, high = _dtype_range(y.dtype)
    if not low <= fill <= high:
        raise ValueError(f"dsa.{op}: `fill` must be representable in y's {y.dtype}, in "
                         f"[{low}, {high}], got {fill}")
    return y.new_empty((num_tokens, *y.shape[2:]))


def _dtype_range(dtype: torch.dtype) -> tuple[float, float]:
    """The finite range of ``dtype`` (0 and 1 for bool)."""
    if dtype == torch.bool:
        return 0, 1
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    return info.min, info.max


def _fill_bits(fill: int, dtype: torch.dtype, width: int, device: torch.device | str) -> Tensor:
    """``[1, width]``: the bits of ``fill`` cast to ``dtype``."""
    return _as_bits(torch.full((1, width), fill, dtype=dtype, device=device))


@functools.cache
def _host_fill_bits(fill: int, dtype: torch.dtype) -> int:
    """The bits of ``fill`` cast to ``dtype``, as a host int: computed on the CPU outside any
    tracing mode (this face is traced as a ``triton_op``), so no device read and no fake."""
    with _disable_current_modes():
        return int(_fill_bits(fill, dtype, 1, "cpu").item())


@_unpack_decode_rows_out.cpu
def _unpack_decode_rows_cpu(y: Tensor, query_start_loc: Tensor, num_tokens: int,
                            fill: int = -1) -> Tensor:
    out = _unpack_decode_rows_out(y, query_start_loc, num_tokens, fill)
    (num_reqs, next_n), width = y.shape[:2], math.prod(y.shape[2:])
    # Tokens without a slot read an appended row of `fill`.
    rows = _as_bits(y).reshape(num_reqs * next_n, width)
    rows = torch.cat([rows, _fill_bits(fill, y.dtype, width, y.device)])
    req, back = token_offsets(query_start_loc, num_tokens)
    slot = next_n + back
    src = torch.where((req < num_reqs) & (slot >= 0), req * next_n + slot, num_reqs * next_n)
    _as_bits(out).view(num_tokens, width).copy_(rows[src])
    return out


@triton.jit
def _unpack_decode_rows_kernel(y_ptr, qsl_ptr, out_ptr, num_tokens, num_reqs, next_n, width,
                               fill_bits, SEARCH_STEPS: tl.constexpr, BLOCK_R: tl.constexpr,
                               BLOCK_C: tl.constexpr):
    t = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_range = t < num_tokens
    req, real, back = token_offset(qsl_ptr, t, in_range, num_reqs, SEARCH_STEPS)
    slot = next_n + back
    has_slot = real & (slot >= 0)
    col_ok = (col < width)[None, :]
    src = (req.to(tl.int64) * next_n + slot)[:, None] * width + col[None, :]
    vals = tl.load(y_ptr + src, mask=has_slot[:, None] & col_ok, other=fill_bits)
    tl.store(out_ptr + t.to(tl.int64)[:, None] * width + col[None, :], vals,
             mask=in_range[:, None] & col_ok)


@_unpack_decode_rows_out.triton
def _unpack_decode_rows_cuda(y: Tensor, query_start_loc: Tensor, num_tokens: int,
                             fill: int = -1) -> Tensor:
    out = _unpack_decode_rows_out(y, query_start_loc, num_tokens, fill)
    (num_reqs, next_n), width = y.shape[:2], math.prod(y.shape[2:])
    if out.numel():
        fill_bits = _host_fill_bits(fill, y.dtype)
        block_r, block_c = _tile(num_tokens, width)
        grid = (triton.cdiv(num_tokens, block_r), triton.cdiv(width, block_c))
        launch(_unpack_decode_rows_kernel, grid,
            _as_bits(y), query_start_loc, _as_bits(out), num_tokens, num_reqs, next_n, width,
            fill_bits, SEARCH_STEPS=search_steps(num_reqs), BLOCK_R=block_r, BLOCK_C=block_c,
        )
    return out
