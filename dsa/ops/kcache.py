"""The paged fp8 indexer K cache (design §2): its layout, the write, and the prefill gather.

``kv_cache`` is ``uint8[num_blocks, block_size, 1, D + 4]`` (the view DeepGEMM takes), but a
block is not interleaved per token: it holds ``block_size * D`` fp8 e4m3 value bytes
(token-major), then ``block_size`` fp32 scales. :func:`kcache_views` returns both parts as
views; everything that reads or writes the cache goes through that layout.

Ops: ``dsa::quantize_and_cache_k`` (mutates the cache, as the fused prologue's k op in
``prologue.py`` does, through this module's ``write_k_rows`` / ``store_k_rows``) and
``dsa::gather_k`` (a prefill chunk's K into a contiguous workspace).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from dsa.ops._checks import INDEX_DTYPES, check_block_table, check_int, check_size, check_tensor
from dsa.ops._launch import launch, row_tile, tile_warps
from dsa.ops._registry import dsa_op
from dsa.ops._tokens import request_of, search_steps, token_requests
from dsa.ops.quant import (
    FLOAT_DTYPES,
    fp8_e4m3_bits,
    fp8_scale_of,
    nan_to_num,
    quantize_rows,
    scaled_down,
)

SCALE_BYTES = 4


# --- layout --------------------------------------------------------------------------------


def check_kv_cache(op: str, kv_cache: object, *,
                   like: Tensor | None = None) -> tuple[int, int, int]:
    """Validates a paged K cache of at least one block; returns ``(num_blocks, block_size,
    head_dim)``."""
    check_tensor(op, "kv_cache", kv_cache, dtype=torch.uint8, ndim=4, contiguous=True, like=like)
    num_blocks, block_size, heads, width = kv_cache.shape
    head_dim = width - SCALE_BYTES
    if heads != 1 or head_dim < 4 or head_dim % 4 or block_size < 1:
        raise ValueError(
            f"dsa.{op}: `kv_cache` must be uint8[num_blocks, block_size >= 1, 1, head_dim + 4] "
            f"with head_dim a positive multiple of 4, got shape {tuple(kv_cache.shape)}"
        )
    if num_blocks < 1:
        raise ValueError(f"dsa.{op}: `kv_cache` must have at least one block, got shape "
                         f"{tuple(kv_cache.shape)}")
    if kv_cache.storage_offset() % SCALE_BYTES:
        raise ValueError(f"dsa.{op}: `kv_cache` must start at a byte offset that is a "
                         f"multiple of 4 in its storage (its fp32 scales), got offset "
                         f"{kv_cache.storage_offset()}")
    return num_blocks, block_size, head_dim


def kcache_views(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """(fp8 e4m3 values ``[num_blocks, block_size, D]``, fp32 scales ``[num_blocks,
    block_size]``): views of the cache, so writes through them land in it. Kernels take
    these views and their ``stride(0)`` (bytes resp. floats per block)."""
    num_blocks, block_size, _, width = kv_cache.shape
    head_dim = width - SCALE_BYTES
    blocks = kv_cache.view(num_blocks, block_size * width)
    values = blocks[:, : block_size * head_dim].view(num_blocks, block_size, head_dim)
    scales = blocks[:, block_size * head_dim:].view(torch.float32)
    return values.view(torch.float8_e4m3fn), scales


def padded_block_table(block_table: Tensor) -> Tensor:
    """``block_table`` with an extra row and column of -1: clamping a request id to ``rows``
    or a block index to ``width`` then reads an invalid (-1) entry."""
    return F.pad(block_table, (0, 1, 0, 1), value=-1)


# --- quantize_and_cache_k ------------------------------------------------------------------


def check_k_write(op: str, k: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                  ue8m0: bool) -> None:
    """k ``[T, D]`` (float, any strides) for a ``kv_cache`` of head_dim D, int64 slots ``[T]``."""
    check_tensor(op, "k", k, dtype=FLOAT_DTYPES, ndim=2)
    _, _, head_dim = check_kv_cache(op, kv_cache, like=k)
    check_size(op, "k", k, 1, head_dim, "head_dim = kv_cache.shape[3] - 4")
    check_write_args(op, slot_mapping, ue8m0, like=k,
                     tokens=(k.shape[0], "num_tokens = k.shape[0]"))


def check_write_args(op: str, slot_mapping: Tensor, ue8m0: bool, *, like: Tensor,
                     tokens: tuple[int, str]) -> None:
    """A K-cache write's int64 slots ``[T]`` on ``like``'s device and its scale format;
    ``tokens``: T, and what that count is."""
    check_tensor(op, "slot_mapping", slot_mapping, dtype=torch.int64, ndim=1, contiguous=True,
                 like=like)
    check_size(op, "slot_mapping", slot_mapping, 0, *tokens)
    if not isinstance(ue8m0, bool):
        raise TypeError(f"dsa.{op}: `ue8m0` must be a bool, got {type(ue8m0).__name__}")


@dsa_op("quantize_and_cache_k", mutates_args=("kv_cache",))
def _check_cache_write(k: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                       ue8m0: bool = False) -> None:
    check_k_write("quantize_and_cache_k", k, kv_cache, slot_mapping, ue8m0)


def write_k_rows(k: Tensor, kv_cache: Tensor, slot_mapping: Tensor, ue8m0: bool) -> None:
    """Torch face of the cache write: quantises ``k`` and writes token t at
    ``slot_mapping[t]``; slots outside the cache write nothing (design §2)."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    cache_values, scales = kcache_views(kv_cache)
    value_bytes = cache_values.view(torch.uint8)
    num_blocks, block_size = scales.shape
    values, scale = quantize_rows(k, ue8m0)
    ok = (slot_mapping >= 0) & (slot_mapping < num_blocks * block_size)
    # Tokens that must not write repeat the first valid token's write (same slot, same
    # bytes), so one static-shape index_put_ covers every token; with no valid token they
    # write slot 0's own bytes back.
    first = torch.argmax(ok.to(torch.int32))
    src = torch.where(ok, torch.arange(num_tokens, device=k.device), first)
    slot = torch.where(ok, slot_mapping, 0)[src]
    blk, off = slot // block_size, slot % block_size
    keep = ~ok[src]
    new_bytes = torch.where(keep[:, None], value_bytes[blk, off], values.view(torch.uint8)[src])
    new_scales = torch.where(keep, scales[blk, off], scale[src])
    value_bytes.index_put_((blk, off), new_bytes)
    scales.index_put_((blk, off), new_scales)


@_check_cache_write.cpu
def _quantize_and_cache_k_cpu(k: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                              ue8m0: bool = False) -> None:
    _check_cache_write(k, kv_cache, slot_mapping, ue8m0)
    write_k_rows(k, kv_cache, slot_mapping, ue8m0)


@triton.jit
def store_k_rows(x, slot, ok, value_ptr, scale_ptr, VALUE_STRIDE: tl.constexpr,
                 SCALE_STRIDE: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                 BLOCK_D: tl.constexpr, UE8M0: tl.constexpr):
    """Quantises fp32 ``x`` ``[BLOCK_T, BLOCK_D]`` (zero past ``D`` and where not ``ok``)
    and writes the ``ok`` rows to their cache slots."""
    d = tl.arange(0, BLOCK_D)
    x = nan_to_num(x)
    scale = fp8_scale_of(tl.max(tl.abs(x), axis=1), UE8M0)
    slot = tl.where(ok, slot, 0)
    blk = slot // BS
    off = slot % BS
    dst = blk * VALUE_STRIDE + off * D
    tl.store(value_ptr + dst[:, None] + d[None, :], fp8_e4m3_bits(scaled_down(x, scale, UE8M0)),
             mask=ok[:, None] & (d < D)[None, :])
    tl.store(scale_ptr + blk * SCALE_STRIDE + off, scale, mask=ok)


@triton.jit
def load_slots(slot_ptr, tok, num_tokens, num_slots):
    """(slots, whether each writes): ``tok``'s slots, inside ``[0, num_slots)``."""
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1)
    return slot, (slot >= 0) & (slot < num_slots)


@triton.jit
def _cache_write_kernel(k_ptr, k_stride0, k_stride1, slot_ptr, value_ptr, scale_ptr, num_tokens,
                        num_slots, VALUE_STRIDE: tl.constexpr, SCALE_STRIDE: tl.constexpr,
                        BS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_T: tl.constexpr, UE8M0: tl.constexpr):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    slot, ok = load_slots(slot_ptr, tok, num_tokens, num_slots)
    mask = ok[:, None] & (d < D)[None, :]
    x = tl.load(k_ptr + tok.to(tl.int64)[:, None] * k_stride0 + d[None, :] * k_stride1,
                mask=mask, other=0.0)
    store_k_rows(x.to(tl.float32), slot, ok, value_ptr, scale_ptr, VALUE_STRIDE=VALUE_STRIDE,
                 SCALE_STRIDE=SCALE_STRIDE, BS=BS, D=D, BLOCK_D=BLOCK_D, UE8M0=UE8M0)


def launch_k_rows(kernel: Any, k: Tensor, kv_cache: Tensor, slot_mapping: Tensor, *args: Any,
                  block_t: int | None = None, num_warps: int | None = None,
                  max_block_t: int | None = None, **constexprs: Any) -> None:
    """Launches a kernel writing k rows to the cache with ``store_k_rows``: ``kernel(k,
    k strides, slots, value bytes, scales, num_tokens, num_slots, *args)`` with the
    layout's, the block's and ``constexprs``; ``block_t`` tokens a program (default:
    ``row_tile``: 16 of D = 128 or ``max_block_t``, down to 1 for a few tokens) in
    ``num_warps`` warps (default: ``tile_warps``). Nothing with no tokens."""
    num_tokens, head_dim = k.shape
    if num_tokens == 0:
        return
    values, scales = kcache_views(kv_cache)
    num_blocks, block_size = scales.shape
    block_d = triton.next_power_of_2(head_dim)
    block_t = block_t or row_tile(num_tokens, block_d, max_rows=max_block_t)
    launch(kernel, (triton.cdiv(num_tokens, block_t),),
        k, k.stride(0), k.stride(1), slot_mapping, values.view(torch.uint8), scales, num_tokens,
        num_blocks * block_size, *args, VALUE_STRIDE=values.stride(0),
        SCALE_STRIDE=scales.stride(0), BS=block_size, D=head_dim, BLOCK_D=block_d,
        BLOCK_T=block_t, num_warps=num_warps or tile_warps(block_t, block_d), **constexprs,
    )


@_check_cache_write.cuda
def _quantize_and_cache_k_cuda(k: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                               ue8m0: bool = False) -> None:
    _check_cache_write(k, kv_cache, slot_mapping, ue8m0)
    launch_k_rows(_cache_write_kernel, k, kv_cache, slot_mapping, UE8M0=ue8m0)


# --- gather_k ------------------------------------------------------------------------------


@dsa_op("gather_k")
def _gather_k_out(kv_cache: Tensor, block_table: Tensor, cu_seq_lens: Tensor,
                  num_rows: int) -> tuple[Tensor, Tensor]:
    op = "gather_k"
    _, _, head_dim = check_kv_cache(op, kv_cache)
    num_reqs, _ = check_block_table(op, block_table, kv_cache)
    check_tensor(op, "cu_seq_lens", cu_seq_lens, dtype=INDEX_DTYPES, ndim=1, contiguous=True,
                 like=kv_cache)
    check_size(op, "cu_seq_lens", cu_seq_lens, 0, num_reqs + 1,
               "num_reqs + 1 = block_table.shape[0] + 1")
    check_int(op, "num_rows", num_rows, low=0)
    k_fp8 = torch.empty(num_rows, head_dim, dtype=torch.float8_e4m3fn, device=kv_cache.device)
    k_scale = torch.empty(num_rows, dtype=torch.float32, device=kv_cache.device)
    return k_fp8, k_scale


@_gather_k_out.cpu
def _gather_k_cpu(kv_cache: Tensor, block_table: Tensor, cu_seq_lens: Tensor,
                  num_rows: int) -> tuple[Tensor, Tensor]:
    k_fp8, k_scale = _gather_k_out(kv_cache, block_table, cu_seq_lens, num_rows)
    values, scales = kcache_views(kv_cache)
    num_blocks, block_size = scales.shape
    width = block_table.shape[1]
    req = token_requests(cu_seq_lens, num_rows)
    i = torch.arange(num_rows, device=kv_cache.device) - cu_seq_lens.long()[req]
    col = torch.where(i >= 0, i // block_size, width).clamp_(max=width)
    blk = padded_block_table(block_table)[req, col].long()
    ok = (blk >= 0) & (blk < num_blocks)
    blk, off = torch.where(ok, blk, 0), i % block_size
    k_fp8.view(torch.uint8).copy_(torch.where(ok[:, None], values.view(torch.uint8)[blk, off], 0))
    k_scale.copy_(torch.where(ok, scales[blk, off], 0.0))
    return k_fp8, k_scale


@triton.jit
def _gather_k_kernel(value_ptr, scale_ptr, bt_ptr, bt_stride, cu_ptr, out_ptr, out_scale_ptr,
                     num_rows, num_reqs, width, num_blocks, VALUE_STRIDE: tl.constexpr,
                     SCALE_STRIDE: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    in_range = rows < num_rows
    req = request_of(cu_ptr, rows, num_reqs, SEARCH_STEPS)
    i = rows - tl.load(cu_ptr + req)
    col = i // BS
    ok = in_range & (req < num_reqs) & (i >= 0) & (col < width)
    blk = tl.load(bt_ptr + req.to(tl.int64) * bt_stride + col, mask=ok, other=-1)
    ok = ok & (blk >= 0) & (blk < num_blocks)
    blk = blk.to(tl.int64)  # masked loads below never touch a row that is not ok
    off = i % BS
    d_ok = (d < D)[None, :]
    src = blk * VALUE_STRIDE + off * D
    vals = tl.load(value_ptr + src[:, None] + d[None, :], mask=ok[:, None] & d_ok, other=0)
    dst = rows.to(tl.int64)[:, None] * D + d[None, :]
    tl.store(out_ptr + dst, vals, mask=in_range[:, None] & d_ok)
    scale = tl.load(scale_ptr + blk * SCALE_STRIDE + off, mask=ok, other=0.0)
    tl.store(out_scale_ptr + rows, scale, mask=in_range)


@_gather_k_out.triton
def _gather_k_cuda(kv_cache: Tensor, block_table: Tensor, cu_seq_lens: Tensor,
                   num_rows: int) -> tuple[Tensor, Tensor]:
    k_fp8, k_scale = _gather_k_out(kv_cache, block_table, cu_seq_lens, num_rows)
    if num_rows:
        values, scales = kcache_views(kv_cache)
        num_blocks, block_size, head_dim = values.shape
        num_reqs, width = block_table.shape
        block_d = triton.next_power_of_2(head_dim)
        block_r = max(1, min(64, 4096 // block_d))
        launch(_gather_k_kernel, (triton.cdiv(num_rows, block_r),),
            values.view(torch.uint8), scales, block_table, block_table.stride(0), cu_seq_lens,
            k_fp8.view(torch.uint8), k_scale, num_rows, num_reqs, width, num_blocks,
            VALUE_STRIDE=values.stride(0), SCALE_STRIDE=scales.stride(0), BS=block_size,
            D=head_dim, BLOCK_D=block_d, BLOCK_R=block_r, SEARCH_STEPS=search_steps(num_reqs),
        )
    return k_fp8, k_scale
