"""Ragged MQA logits of prefill rows (design §3): ``dsa::mqa_logits`` (dsa's kernel: Triton
on CUDA, plain torch on the CPU) and ``dsa::mqa_logits_deepgemm``.

Query row i scores the keys ``[ks[i], ke[i])`` of a contiguous K workspace (``gather_k``);
column j of the ``[num_q, max_seqlen_k]`` output is key ``ks[i] + j``. A row's valid span is
``ke - ks`` clamped to ``[0, max_seqlen_k]``: no face reads a key outside the workspace or
writes past its row. dsa's kernel writes -inf past the span; DeepGEMM leaves it unspecified
(top-k masks by length). :func:`ragged_logits` picks an implementation by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsa.ops._checks import INDEX_DTYPES, check_heads, check_int, check_size, check_tensor
from dsa.ops._launch import launch
from dsa.ops._registry import dsa_op
from dsa.ops.logits import deepgemm
from dsa.ops.logits.common import (
    alloc_logits,
    choose_backend,
    fp8_rows,
    relu_nan_zero,
    tile_logits,
)


@dataclass(frozen=True)
class MqaLogitsConfig:
    """Launch parameters of the Triton ragged-logits kernel: a program handles
    ``block_q`` queries and ``tiles_per_program`` tiles of ``tile`` output columns."""

    block_q: int = 2
    tile: int = 128
    tiles_per_program: int = 1
    num_warps: int = 8
    num_stages: int = 3


def mqa_logits_config(num_q: int, num_heads: int, max_seqlen_k: int,
                      device: torch.device) -> MqaLogitsConfig:
    """Default launch parameters: up to 256 (query, head) columns per dot (at most 4
    queries) against 64 keys, 4 warps, at most 4096 columns a program and about 8 programs
    per SM. H200, H 64, causal prefill chunks (BENCHMARKS.md, ninth and tenth sessions): 4
    queries, 64 keys, 4 warps 783-849 TFLOP/s against 2 queries, 128 keys, 8 warps 559-650;
    4096 columns a program 815-865 against 786-850 for 2048."""
    block_q = max(1, min(4, 256 // triton.next_power_of_2(num_heads)))
    tile = 64
    q_tiles = triton.cdiv(num_q, block_q)
    splits = max(1, triton.cdiv(8 * deepgemm.num_sms(device), max(q_tiles, 1)))
    tiles_per_program = max(1, min(4096 // tile,
                                   triton.cdiv(triton.cdiv(max_seqlen_k, tile), splits)))
    return MqaLogitsConfig(block_q=block_q, tile=tile, tiles_per_program=tiles_per_program,
                           num_warps=4)


def _check_mqa(op: str, q_fp8: Tensor, k_fp8: Tensor, k_scale: Tensor, weights: Tensor,
               ks: Tensor, ke: Tensor, max_seqlen_k: int) -> None:
    check_tensor(op, "q_fp8", q_fp8, dtype=torch.float8_e4m3fn, ndim=3, contiguous=True)
    num_q, num_heads, head_dim = q_fp8.shape
    check_heads(op, "q_fp8", q_fp8, 1)
    check_tensor(op, "k_fp8", k_fp8, dtype=torch.float8_e4m3fn, ndim=2, contiguous=True,
                 like=q_fp8)
    check_size(op, "k_fp8", k_fp8, 1, head_dim, "head_dim = q_fp8.shape[2]")
    check_tensor(op, "k_scale", k_scale, dtype=torch.float32, ndim=1, contiguous=True, like=q_fp8)
    check_size(op, "k_scale", k_scale, 0, k_fp8.shape[0], "num_keys = k_fp8.shape[0]")
    check_tensor(op, "weights", weights, dtype=torch.float32, ndim=2, like=q_fp8)
    check_size(op, "weights", weights, 0, num_q, "num_queries = q_fp8.shape[0]")
    check_size(op, "weights", weights, 1, num_heads, "num_heads = q_fp8.shape[1]")
    for name, t in (("ks", ks), ("ke", ke)):
        check_tensor(op, name, t, dtype=INDEX_DTYPES, ndim=1, contiguous=True, like=q_fp8)
        check_size(op, name, t, 0, num_q, "num_queries = q_fp8.shape[0]")
    check_int(op, "max_seqlen_k", max_seqlen_k, low=0)


# --- dsa::mqa_logits -------------------------------------------------------------------------


@dsa_op("mqa_logits")
def _mqa_logits_out(q_fp8: Tensor, k_fp8: Tensor, k_scale: Tensor, weights: Tensor, ks: Tensor,
                    ke: Tensor, max_seqlen_k: int) -> Tensor:
    _check_mqa("mqa_logits", q_fp8, k_fp8, k_scale, weights, ks, ke, max_seqlen_k)
    return alloc_logits(q_fp8.shape[0], max_seqlen_k, q_fp8.device)


@_mqa_logits_out.cpu
def _mqa_logits_cpu(q_fp8: Tensor, k_fp8: Tensor, k_scale: Tensor, weights: Tensor, ks: Tensor,
                    ke: Tensor, max_seqlen_k: int) -> Tensor:
    args = (q_fp8, k_fp8, k_scale, weights, ks, ke)
    return _mqa_logits_torch(*args, _mqa_logits_out(*args, max_seqlen_k))


def _mqa_logits_torch(q_fp8: Tensor, k_fp8: Tensor, k_scale: Tensor, weights: Tensor,
                      ks: Tensor, ke: Tensor, out: Tensor, rows_per_step: int = 16) -> Tensor:
    num_keys = k_fp8.shape[0]
    if num_keys == 0:
        return out.fill_(float("-inf"))
    key_bytes = k_fp8.view(torch.uint8)
    j = torch.arange(out.shape[1], device=out.device)
    for start in range(0, q_fp8.shape[0], rows_per_step):
        rows = slice(start, start + rows_per_step)
        key = ks[rows, None].long() + j
        ok = (j < (ke[rows].long() - ks[rows].long())[:, None]) & (key >= 0) & (key < num_keys)
        key = torch.where(ok, key, 0)
        scores = torch.einsum("mhd,mjd->mhj", q_fp8[rows].float(), fp8_rows(key_bytes[key]))
        logits = (relu_nan_zero(scores) * weights[rows, :, None]).sum(dim=1) * k_scale[key]
        out[rows] = torch.where(ok, logits, float("-inf"))
    return out


@triton.jit(do_not_specialize=["num_q", "num_keys", "max_seqlen_k", "tiles_per_program"])
def _mqa_logits_kernel(q_ptr, k_ptr, k_scale_ptr, w_ptr, w_stride0, w_stride1, ks_ptr, ke_ptr,
                       out_ptr, out_stride, num_q, num_keys, max_seqlen_k, tiles_per_program,
                       H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, BM: tl.constexpr,
                       BLOCK_D: tl.constexpr, TILE: tl.constexpr):
    split = tl.program_id(0)
    m0 = tl.program_id(1) * BM
    qi = tl.arange(0, BM)
    q_ok = m0 + qi < num_q
    ks = tl.load(ks_ptr + m0 + qi, mask=q_ok, other=0)
    lens = tl.load(ke_ptr + m0 + qi, mask=q_ok, other=0).to(tl.int64) - ks  # int64: no wrap
    lens = tl.minimum(tl.maximum(lens, 0), max_seqlen_k).to(tl.int32)
    t_begin = split * tiles_per_program
    t_end = tl.minimum(t_begin + tiles_per_program, tl.cdiv(max_seqlen_k, TILE))
    out_rows = out_ptr + (m0 + qi).to(tl.int64) * out_stride
    cols = tl.arange(0, TILE)

    r = tl.arange(0, BM * HP)
    row_ok = (m0 + r // HP < num_q) & (r % HP < H)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + ((m0 + r // HP) * H + r % HP).to(tl.int64)[:, None] * D + d[None, :],
                mask=row_ok[:, None] & (d < D)[None, :], other=0.0)
    q_t = tl.trans(q)  # before the loops: q is staged in shared memory once
    w = tl.load(w_ptr + (m0 + r // HP).to(tl.int64) * w_stride0 + (r % HP) * w_stride1,
                mask=row_ok, other=0.0)

    # Queries of the tile that share a key start share K tiles: one pass per distinct ks,
    # led by its first query; a pass stores only its own queries' rows.
    for g in tl.static_range(BM):
        ks_g = tl.sum(tl.where(qi == g, ks, 0), axis=0)
        member = q_ok & (ks == ks_g)
        if tl.min(tl.where(member, qi, BM), axis=0) == g:
            longest = tl.max(tl.where(member, lens, 0), axis=0)
            t_mid = tl.maximum(tl.minimum(tl.cdiv(longest, TILE), t_end), t_begin)
            # Tiles every query of the pass sees whole, their keys inside the workspace: no
            # masks (they cost a fifth of a tile's instructions).
            whole = tl.minimum(tl.min(tl.where(member, lens, max_seqlen_k), axis=0),
                               num_keys - ks_g)
            t_whole = tl.maximum(tl.minimum(tl.where(ks_g >= 0, whole, 0) // TILE, t_mid),
                                 t_begin)
            for t in range(t_begin, t_whole):
                j = t * TILE + cols
                key = (ks_g + j).to(tl.int64)
                if BLOCK_D == D:
                    k = tl.load(k_ptr + key[:, None] * D + d[None, :])
                else:
                    k = tl.load(k_ptr + key[:, None] * D + d[None, :], mask=(d < D)[None, :],
                                other=0.0)
                logits = tile_logits(k, tl.load(k_scale_ptr + key), q_t, w, TILE, BM, HP)
                tl.store(out_rows[None, :] + j[:, None], logits, mask=member[None, :])
            for t in range(t_whole, t_mid):
                j = t * TILE + cols
                key = ks_g + j
                ok = (j < longest) & (key >= 0) & (key < num_keys)
                # Invalid columns load nothing (0) and are masked to -inf below; the keys of
                # a tile are consecutive, so its loads are contiguous.
                k = tl.load(k_ptr + key.to(tl.int64)[:, None] * D + d[None, :],
                            mask=ok[:, None] & (d < D)[None, :], other=0.0)
                k_scale = tl.load(k_scale_ptr + key, mask=ok, other=0.0)
                logits = tile_logits(k, k_scale, q_t, w, TILE, BM, HP)
                tl.store(out_rows[None, :] + j[:, None],
                         tl.where(ok[:, None] & (j[:, None] < lens[None, :]), logits,
                                  float("-inf")),
                         mask=member[None, :] & (j < max_seqlen_k)[:, None])
            for t in range(t_mid, t_end):
                j = t * TILE + cols
                tl.store(out_rows[None, :] + j[:, None],
                         tl.full((TILE, BM), float("-inf"), tl.float32),
                         mask=member[None, :] & (j < max_seqlen_k)[:, None])


def _mqa_logits_launch(q_fp8: Tensor, k_fp8: Tensor, k_scale: Tensor, weights: Tensor,
                       ks: Tensor, ke: Tensor, out: Tensor,
                       config: MqaLogitsConfig | None) -> Tensor:
    num_q, num_heads, head_dim = q_fp8.shape
    max_seqlen_k = out.shape[1]
    if out.numel() == 0:
        return out
    if k_fp8.shape[0] == 0:
        return out.fill_(float("-inf"))
    if config is None:
        config = mqa_logits_config(num_q, num_heads, max_seqlen_k, q_fp8.device)
    hp = max(triton.next_power_of_2(num_heads), triton.cdiv(16, config.block_q))
    num_tiles = triton.cdiv(max_seqlen_k, config.tile)
    grid = (triton.cdiv(num_tiles, config.tiles_per_program), triton.cdiv(num_q, config.block_q))
    launch(_mqa_logits_kernel, grid,
        q_fp8, k_fp8, k_scale, weights, weights.stride(0), weights.stride(1), ks, ke, out,
        out.stride(0), num_q, k_fp8.shape[0], max_seqlen_k, config.tiles_per_program,
        H=num_heads, D=head_dim, HP=hp, BM=config.block_q,
        BLOCK_D=max(32, triton.next_power_of_2(head_dim)), TILE=config.tile,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


@_mqa_logits_out.triton
def _mqa_logits_cuda(q_fp8: Tensor, k_fp8: Tensor, k_scale: Tensor, weights: Tensor, ks: Tensor,
                     ke: Tensor, max_seqlen_k: int) -> Tensor:
    args = (q_fp8, k_fp8, k_scale, weights, ks, ke)
    return _mqa_logits_launch(*args, _mqa_logits_out(*args, max_seqlen_k), None)


def mqa_logits_triton(q_fp8: Tensor, k_fp8: Tensor, k_scale: Tensor, weights: Tensor,
                      ks: Tensor, ke: Tensor, max_seqlen_k: int,
                      config: MqaLogitsConfig | None = None) -> Tensor:
    """The Triton kernel with explicit launch parameters (None: :func:`mqa_logits_config`),
    for benchmark sweeps; validates like the op."""
    args = (q_fp8, k_fp8, k_scale, weights, ks, ke)
    return _mqa_logits_launch(*args, _mqa_logits_out(*args, max_seqlen_k), config)


# --- dsa::mqa_logits_deepgemm ----------------------------------------------------------------


@dsa_op("mqa_logits_deepgemm")
def _mqa_deepgemm_out(q_fp8: Tensor, k_fp8: Tensor, k_scale: Tensor, weights: Tensor,
                      ks: Tensor, ke: Tensor, max_seqlen_k: int) -> Tensor:
    op = "mqa_logits_deepgemm"
    _check_mqa(op, q_fp8, k_fp8, k_scale, weights, ks, ke, max_seqlen_k)
    reason = deepgemm.mqa_unsupported_reason(q_fp8.device, q_fp8.shape[1], q_fp8.shape[2])
    if reason is not None:
        raise ValueError(f"dsa.{op}: DeepGEMM cannot run this call: {reason}")
    return alloc_logits(q_fp8.shape[0], max_seqlen_k, q_fp8.device)


@_mqa_deepgemm_out.cpu
def _mqa_deepgemm_cpu(q_fp8: Tensor, k_fp8: Tensor, k_scale: Tensor, weights: Tensor,
                      ks: Tensor, ke: Tensor, max_seqlen_k: int) -> Tensor:
    # Raises: DeepGEMM needs CUDA tensors.
    return _mqa_deepgemm_out(q_fp8, k_fp8, k_scale, weights, ks, ke, max_seqlen_k)


@_mqa_deepgemm_out.cuda
def _mqa_deepgemm_cuda(q_fp8: Tensor, k_fp8: Tensor, k_scale: Tensor, weights: Tensor,
                       ks: Tensor, ke: Tensor, max_seqlen_k: int) -> Tensor:
    out = _mqa_deepgemm_out(q_fp8, k_fp8, k_scale, weights, ks, ke, max_seqlen_k)
    num_keys = k_fp8.shape[0]
    if out.numel() == 0:
        return out
    if num_keys == 0:
        return out.fill_(float("-inf"))
    # DeepGEMM writes ke - ks columns from each row's start: keep the span inside the
    # workspace and the row (it trusts both).
    start = ks.clamp(0, num_keys)
    end = torch.minimum(torch.maximum(ke, start), (start + max_seqlen_k).clamp(max=num_keys))
    return deepgemm.call("fp8_fp4_mqa_logits", q=(q_fp8, None), kv=(k_fp8, k_scale),
                         weights=deepgemm.tma_weights(weights), cu_seq_len_k_start=start,
                         cu_seq_len_k_end=end, max_seqlen_k=max_seqlen_k)


# --- choosing ------------------------------------------------------------------------------


def ragged_backend(backend: str, device: torch.device, num_heads: int, head_dim: int, *,
                   op: str = "mqa_logits", arg: str = "backend") -> str:
    """"deepgemm" or "triton": the implementation ``backend`` runs for this shape (``op``
    and ``arg`` name the caller and its argument in errors)."""
    return choose_backend(op, arg, backend,
                          lambda: deepgemm.mqa_unsupported_reason(device, num_heads, head_dim))


def ragged_logits(q_fp8: Tensor, k_fp8: Tensor, k_scale: Tensor, weights: Tensor, ks: Tensor,
                  ke: Tensor, max_seqlen_k: int, *, backend: str = "auto") -> Tensor:
    """Ragged logits on the implementation :func:`ragged_backend` picks."""
    args = (q_fp8, k_fp8, k_scale, weights, ks, ke, max_seqlen_k)
    if ragged_backend(backend, q_fp8.device, q_fp8.shape[1], q_fp8.shape[2]) == "deepgemm":
        return torch.ops.dsa.mqa_logits_deepgemm(*args)
    return torch.ops.dsa.mqa_logits(*args)
