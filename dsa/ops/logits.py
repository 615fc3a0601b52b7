"""Indexer logits (SPEC §3): paged decode logits, ragged prefill logits, DeepGEMM schedule.

For query row t, key s (``w`` already folds q's scale, see :mod:`dsa.ops.quant`)::

    logits[t, s] = k_scale[s] * sum_h w[t, h] * relu(dot(q[t, h], k[s]))

Backends (``backend=``): ``"torch"`` (plain torch, float32 math on the dequantised fp8
values), ``"triton"`` (fp8 ``tl.dot``; CUDA tensors, or CPU tensors under
TRITON_INTERPRET=1), ``"deepgemm"`` (DeepGEMM 2.8.2 SM90 kernels) and ``"auto"``: DeepGEMM
where it supports the call, else Triton, on CUDA; torch on CPU. Columns past a row's
valid length are -inf on torch and Triton and unspecified on DeepGEMM (top-k masks by
length). An explicit ``"deepgemm"`` that cannot run raises a ValueError saying why.

Outputs are ``[rows, cols]`` views of buffers whose row stride is ``align(cols, 256)``
floats, as DeepGEMM allocates them; :func:`alloc_logits` makes them for every face.

Torch and Triton take any lengths and block tables (entries outside the table or the cache
give -inf). DeepGEMM trusts its caller: context lengths <= ``max_context_len`` and block
tables covering them (paged), ``ke - ks <= max_seqlen_k`` (ragged); it must be warmed up
(JIT) before CUDA-graph capture.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsa.ops import _deepgemm
from dsa.ops._checks import (
    INDEX_DTYPES,
    check_block_table,
    check_choice,
    check_int,
    check_nonnegative,
    check_size,
    check_tensor,
)
from dsa.ops._registry import register
from dsa.ops.kcache import check_kv_cache, kcache_views, padded_block_table

BACKENDS = ("auto", "torch", "triton", "deepgemm")
LOGITS_ALIGN = 256


def _align(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def alloc_logits(rows: int, cols: int, device: torch.device) -> Tensor:
    """fp32 ``[rows, cols]`` view of a ``[rows, align(cols, 256)]`` buffer (DeepGEMM's layout)."""
    buffer = torch.empty(rows, _align(cols, LOGITS_ALIGN), dtype=torch.float32, device=device)
    return buffer.narrow(1, 0, cols)


def _triton_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _resolve_backend(op: str, backend: str, device: torch.device,
                     deepgemm_reason: str | None) -> str:
    """The backend that runs the call; raises when an explicit request cannot be honoured."""
    check_choice(op, "backend", backend, BACKENDS)
    if backend == "deepgemm" and deepgemm_reason is not None:
        raise ValueError(f"dsa.{op}: backend='deepgemm' cannot run this call: {deepgemm_reason}")
    if backend == "triton" and not _triton_runs_on(device):
        raise ValueError(f"dsa.{op}: backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1), "
                         f"got {device.type} tensors")
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        return "deepgemm" if deepgemm_reason is None else "triton"
    return backend


def _fp8_rows(value_bytes: Tensor) -> Tensor:
    """float32 values of fp8 e4m3 bytes."""
    return value_bytes.view(torch.float8_e4m3fn).float()


def _weights_for_deepgemm(weights: Tensor) -> Tensor:
    """DeepGEMM loads weight rows by TMA: unit column stride, 16-byte aligned row stride."""
    if weights.stride(1) == 1 and (weights.stride(0) * weights.element_size()) % 16 == 0:
        return weights
    return weights.contiguous()


# --- paged_mqa_logits (decode) --------------------------------------------------------------


@dataclass(frozen=True)
class PagedLogitsConfig:
    """Launch parameters of the Triton paged-logits kernel.

    A program handles one request and ``tiles_per_program`` consecutive tiles of ``tile``
    KV tokens (a power of two >= 16; it may span several cache blocks or part of one).
    """

    tile: int = 64
    tiles_per_program: int = 1
    num_warps: int = 4
    num_stages: int = 3


def paged_logits_config(batch: int, next_n: int, num_heads: int,
                        max_context_len: int) -> PagedLogitsConfig:
    """Default launch parameters for a shape, from the H200 sweep
    (``benchmarks/bench_logits_sweep.py``): 64-token tiles, two pipeline stages, and about
    512 programs or more, each taking at most 16 tiles of its request's context."""
    tile = 64
    tiles = batch * max(1, triton.cdiv(max_context_len, tile))
    rows = triton.next_power_of_2(next_n) * triton.next_power_of_2(num_heads)
    return PagedLogitsConfig(
        tile=tile,
        tiles_per_program=max(1, min(16, tiles // 512)),
        num_warps=8 if rows >= 256 else 4,
        num_stages=2,
    )


def _check_paged(q_fp8: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor,
                 block_table: Tensor, max_context_len: int, backend: str,
                 schedule: Tensor | None) -> str:
    """Validates a paged_mqa_logits call; returns the backend that runs it."""
    op = "paged_mqa_logits"
    check_tensor(op, "q_fp8", q_fp8, dtype=torch.float8_e4m3fn, ndim=4, contiguous=True)
    batch, next_n, num_heads, head_dim = q_fp8.shape
    num_blocks, block_size, _ = check_kv_cache(op, kv_cache, like=q_fp8)
    check_size(op, "kv_cache", kv_cache, 3, head_dim + 4, "head_dim + 4 = q_fp8.shape[3] + 4")
    if num_blocks < 1:
        raise ValueError(f"dsa.{op}: `kv_cache` must have at least one block, got shape "
                         f"{tuple(kv_cache.shape)}")
    check_tensor(op, "weights", weights, dtype=torch.float32, ndim=2, like=q_fp8)
    check_size(op, "weights", weights, 0, batch * next_n, "batch * next_n of q_fp8")
    check_size(op, "weights", weights, 1, num_heads, "num_heads = q_fp8.shape[2]")
    check_tensor(op, "context_lens", context_lens, dtype=INDEX_DTYPES, ndim=2, contiguous=True,
                 like=q_fp8)
    check_size(op, "context_lens", context_lens, 0, batch, "batch = q_fp8.shape[0]")
    check_size(op, "context_lens", context_lens, 1, next_n, "next_n = q_fp8.shape[1]")
    check_nonnegative(op, "context_lens", context_lens)
    check_block_table(op, block_table, q_fp8)
    check_size(op, "block_table", block_table, 0, batch, "batch = q_fp8.shape[0]")
    check_int(op, "max_context_len", max_context_len, low=0)
    if schedule is not None:
        check_tensor(op, "schedule", schedule, dtype=INDEX_DTYPES, ndim=2, contiguous=True,
                     like=q_fp8)
        check_size(op, "schedule", schedule, 0, _deepgemm.num_sms(q_fp8.device) + 1,
                   "num_sms + 1, as dsa.paged_mqa_schedule makes it")
        check_size(op, "schedule", schedule, 1, 2, "DeepGEMM's schedule layout")
    reason = _deepgemm.paged_unsupported_reason(q_fp8.device, num_heads, head_dim, block_size,
                                                next_n)
    return _resolve_backend(op, backend, q_fp8.device, reason)


def _paged_mqa_logits_out(q_fp8: Tensor, kv_cache: Tensor, weights: Tensor,
                          context_lens: Tensor, block_table: Tensor, max_context_len: int,
                          backend: str = "auto", schedule: Tensor | None = None) -> Tensor:
    _check_paged(q_fp8, kv_cache, weights, context_lens, block_table, max_context_len, backend,
                 schedule)
    return alloc_logits(q_fp8.shape[0] * q_fp8.shape[1], max_context_len, q_fp8.device)


def _paged_logits_torch(q_fp8: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor,
                        block_table: Tensor, out: Tensor) -> Tensor:
    batch, next_n, num_heads, _ = q_fp8.shape
    values, scales = kcache_views(kv_cache)
    value_bytes = values.view(torch.uint8)  # indexed as bytes: fp8 indexing is not everywhere
    num_blocks, block_size = scales.shape
    pos = torch.arange(out.shape[1], device=out.device)
    col = (pos // block_size).clamp_(max=block_table.shape[1])
    table = padded_block_table(block_table)
    w = weights.view(batch, next_n, num_heads, 1)
    for b in range(batch):
        blk = table[b, col].long()
        ok = (blk >= 0) & (blk < num_blocks)
        blk, off = torch.where(ok, blk, 0), pos % block_size
        scores = torch.einsum("nhd,ld->nhl", q_fp8[b].float(), _fp8_rows(value_bytes[blk, off]))
        logits = (scores.relu_() * w[b]).sum(dim=1) * scales[blk, off]
        valid = ok & (pos < context_lens[b, :, None])
        out[b * next_n:(b + 1) * next_n] = torch.where(valid, logits, float("-inf"))
    return out


# Runtime ints that vary with the batch stay unspecialised: one compile per config and shape
# family, not one per context length.
@triton.jit(do_not_specialize=["bt_stride", "width", "num_blocks", "max_context_len",
                               "tiles_per_program"])
def _paged_logits_kernel(q_ptr, value_ptr, scale_ptr, w_ptr, w_stride0, w_stride1, ctx_ptr,
                         bt_ptr, bt_stride, out_ptr, out_stride, width, num_blocks,
                         max_context_len, tiles_per_program,
                         N: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                         VALUE_STRIDE: tl.constexpr, SCALE_STRIDE: tl.constexpr,
                         NP: tl.constexpr, HP: tl.constexpr, BLOCK_D: tl.constexpr,
                         TILE: tl.constexpr):
    split = tl.program_id(0)
    b = tl.program_id(1)
    # The request's next_n rows: context lengths (clamped to the output width).
    jn = tl.arange(0, NP)
    ctx = tl.load(ctx_ptr + b * N + jn, mask=jn < N, other=0)
    ctx = tl.minimum(tl.maximum(ctx, 0), max_context_len)
    longest = tl.max(ctx, axis=0)
    t_begin = split * tiles_per_program
    t_end = tl.minimum(t_begin + tiles_per_program, tl.cdiv(max_context_len, TILE))
    t_mid = tl.maximum(tl.minimum(tl.cdiv(longest, TILE), t_end), t_begin)
    out_rows = out_ptr + (b * N + jn).to(tl.int64) * out_stride
    store_rows = (jn < N)[None, :]
    cols = tl.arange(0, TILE)

    # q and weights of all (row, head) pairs, padded to NP * HP rows, loaded once.
    r = tl.arange(0, NP * HP)
    row_ok = (r // HP < N) & (r % HP < H)
    qrow = b * N + r // HP
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + (qrow * H + r % HP).to(tl.int64)[:, None] * D + d[None, :],
                mask=row_ok[:, None] & (d < D)[None, :], other=0.0)
    w = tl.load(w_ptr + qrow.to(tl.int64) * w_stride0 + (r % HP) * w_stride1, mask=row_ok,
                other=0.0)

    for t in range(t_begin, t_mid):
        pos = t * TILE + cols
        bt_col = pos // BS
        ok = (pos < longest) & (bt_col < width)
        blk = tl.load(bt_ptr + b.to(tl.int64) * bt_stride + bt_col, mask=ok, other=-1)
        ok = ok & (blk >= 0) & (blk < num_blocks)
        # Invalid tokens read block 0 (always present) and are masked to -inf below.
        blk = tl.where(ok, blk, 0).to(tl.int64)
        off = pos % BS
        src = blk * VALUE_STRIDE + off * D
        if BLOCK_D == D:
            k = tl.load(value_ptr + src[:, None] + d[None, :])
        else:
            k = tl.load(value_ptr + src[:, None] + d[None, :], mask=(d < D)[None, :], other=0.0)
        k_scale = tl.load(scale_ptr + blk * SCALE_STRIDE + off)
        s = tl.maximum(tl.dot(k, tl.trans(q)), 0.0)
        for j in tl.static_range(N):
            # Row j's heads are the columns [j * HP, j * HP + H) of s.
            w_j = tl.where(r // HP == j, w, 0.0)
            logits = tl.sum(s * w_j[None, :], axis=1) * k_scale
            ctx_j = tl.sum(tl.where(jn == j, ctx, 0), axis=0)
            tl.store(out_ptr + (b * N + j).to(tl.int64) * out_stride + pos,
                     tl.where(ok & (pos < ctx_j), logits, float("-inf")),
                     mask=pos < max_context_len)
    for t in range(t_mid, t_end):
        pos = t * TILE + cols
        tl.store(out_rows[None, :] + pos[:, None],
                 tl.full((TILE, NP), float("-inf"), tl.float32),
                 mask=store_rows & (pos < max_context_len)[:, None])


def _paged_logits_launch(q_fp8: Tensor, kv_cache: Tensor, weights: Tensor,
                         context_lens: Tensor, block_table: Tensor, out: Tensor,
                         config: PagedLogitsConfig | None) -> Tensor:
    batch, next_n, num_heads, head_dim = q_fp8.shape
    max_context_len = out.shape[1]
    if out.numel() == 0:
        return out
    if config is None:
        config = paged_logits_config(batch, next_n, num_heads, max_context_len)
    if config.tile < 16 or config.tile & (config.tile - 1) or config.tiles_per_program < 1:
        raise ValueError(f"dsa.paged_mqa_logits: bad Triton launch config {config}")
    values, scales = kcache_views(kv_cache)
    num_blocks, block_size = scales.shape
    np_ = triton.next_power_of_2(next_n)
    hp = max(triton.next_power_of_2(num_heads), triton.cdiv(16, np_))
    num_tiles = triton.cdiv(max_context_len, config.tile)
    grid = (triton.cdiv(num_tiles, config.tiles_per_program), batch)
    _paged_logits_kernel[grid](
        q_fp8, values, scales, weights, weights.stride(0), weights.stride(1), context_lens,
        block_table, block_table.stride(0), out, out.stride(0), block_table.shape[1],
        num_blocks, max_context_len, config.tiles_per_program,
        N=next_n, H=num_heads, D=head_dim, BS=block_size, VALUE_STRIDE=values.stride(0),
        SCALE_STRIDE=scales.stride(0), NP=np_, HP=hp,
        BLOCK_D=max(32, triton.next_power_of_2(head_dim)), TILE=config.tile,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def paged_logits_triton(q_fp8: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor,
                        block_table: Tensor, max_context_len: int,
                        config: PagedLogitsConfig | None = None) -> Tensor:
    """The Triton backend with explicit launch parameters (None: :func:`paged_logits_config`),
    for benchmark sweeps; validates like the op."""
    args = (q_fp8, kv_cache, weights, context_lens, block_table)
    _check_paged(*args, max_context_len, "triton", None)
    out = alloc_logits(q_fp8.shape[0] * q_fp8.shape[1], max_context_len, q_fp8.device)
    return _paged_logits_launch(*args, out, config)


def _paged_logits_deepgemm(q_fp8: Tensor, kv_cache: Tensor, weights: Tensor,
                           context_lens: Tensor, block_table: Tensor, max_context_len: int,
                           schedule: Tensor | None) -> Tensor:
    dg = _deepgemm.deep_gemm()
    # Lengths of 0 make the kernel read out of bounds; the schedule and the kernel must see
    # the same lengths (dsa.paged_mqa_schedule clamps the same way).
    lens = context_lens.clamp(min=1)
    if schedule is None:
        schedule = dg.get_paged_mqa_logits_metadata(lens, kv_cache.shape[1], dg.get_num_sms())
    return dg.fp8_fp4_paged_mqa_logits((q_fp8, None), kv_cache, _weights_for_deepgemm(weights),
                                       lens, block_table, schedule, max_context_len)


def _paged_mqa_logits(q_fp8: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor,
                      block_table: Tensor, max_context_len: int, backend: str = "auto",
                      schedule: Tensor | None = None) -> Tensor:
    """Both real faces: the device and ``backend`` pick the implementation."""
    args = (q_fp8, kv_cache, weights, context_lens, block_table)
    chosen = _check_paged(*args, max_context_len, backend, schedule)
    rows = q_fp8.shape[0] * q_fp8.shape[1]
    if chosen == "deepgemm" and rows and max_context_len:
        return _paged_logits_deepgemm(*args, max_context_len, schedule)
    out = alloc_logits(rows, max_context_len, q_fp8.device)
    if chosen == "triton":
        return _paged_logits_launch(*args, out, None)
    if chosen == "torch":
        return _paged_logits_torch(*args, out)
    return out


paged_mqa_logits = register(
    "paged_mqa_logits",
    cpu=_paged_mqa_logits,
    cuda=_paged_mqa_logits,
    fake=_paged_mqa_logits_out,
)


# --- paged_mqa_schedule ---------------------------------------------------------------------


def _check_schedule(context_lens: Tensor, block_size: int) -> None:
    op = "paged_mqa_schedule"
    check_tensor(op, "context_lens", context_lens, dtype=INDEX_DTYPES, ndim=2, contiguous=True)
    check_nonnegative(op, "context_lens", context_lens)
    check_int(op, "block_size", block_size, low=1)


def _paged_mqa_schedule_out(context_lens: Tensor, block_size: int) -> Tensor:
    _check_schedule(context_lens, block_size)
    sms = _deepgemm.num_sms(context_lens.device)
    return torch.empty(sms + 1, 2, dtype=torch.int32, device=context_lens.device)


def _paged_mqa_schedule_cpu(context_lens: Tensor, block_size: int) -> Tensor:
    return _paged_mqa_schedule_out(context_lens, block_size).zero_()


def _paged_mqa_schedule_cuda(context_lens: Tensor, block_size: int) -> Tensor:
    out = _paged_mqa_schedule_out(context_lens, block_size)
    if context_lens.shape[0] and _deepgemm.schedule_supported(context_lens.device, block_size):
        dg = _deepgemm.deep_gemm()
        return dg.get_paged_mqa_logits_metadata(context_lens.clamp(min=1), block_size,
                                                dg.get_num_sms())
    return out.zero_()


paged_mqa_schedule = register(
    "paged_mqa_schedule",
    cpu=_paged_mqa_schedule_cpu,
    cuda=_paged_mqa_schedule_cuda,
    fake=_paged_mqa_schedule_out,
)


# --- mqa_logits (ragged prefill) ------------------------------------------------------------


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
    """Default launch parameters: up to 128 (query, head) rows per dot (at most 4 queries),
    about 8 programs per SM."""
    block_q = max(1, min(4, 128 // triton.next_power_of_2(num_heads)))
    tile = 128
    q_tiles = triton.cdiv(num_q, block_q)
    splits = max(1, triton.cdiv(8 * _deepgemm.num_sms(device), max(q_tiles, 1)))
    tiles_per_program = max(1, min(16, triton.cdiv(triton.cdiv(max_seqlen_k, tile), splits)))
    return MqaLogitsConfig(block_q=block_q, tile=tile, tiles_per_program=tiles_per_program)


def _check_mqa(q_fp8: Tensor, k_fp8: Tensor, k_scale: Tensor, weights: Tensor, ks: Tensor,
               ke: Tensor, max_seqlen_k: int, backend: str) -> str:
    """Validates an mqa_logits call; returns the backend that runs it."""
    op = "mqa_logits"
    check_tensor(op, "q_fp8", q_fp8, dtype=torch.float8_e4m3fn, ndim=3, contiguous=True)
    num_q, num_heads, head_dim = q_fp8.shape
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
    reason = _deepgemm.mqa_unsupported_reason(q_fp8.device, num_heads, head_dim)
    return _resolve_backend(op, backend, q_fp8.device, reason)


def _mqa_logits_out(q_fp8: Tensor, k_fp8: Tensor, k_scale: Tensor, weights: Tensor, ks: Tensor,
                    ke: Tensor, max_seqlen_k: int, backend: str = "auto") -> Tensor:
    _check_mqa(q_fp8, k_fp8, k_scale, weights, ks, ke, max_seqlen_k, backend)
    return alloc_logits(q_fp8.shape[0], max_seqlen_k, q_fp8.device)


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
        ok = (j < (ke[rows] - ks[rows])[:, None]) & (key >= 0) & (key < num_keys)
        key = torch.where(ok, key, 0)
        scores = torch.einsum("mhd,mjd->mhj", q_fp8[rows].float(), _fp8_rows(key_bytes[key]))
        logits = (scores.relu_() * weights[rows, :, None]).sum(dim=1) * k_scale[key]
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
    lens = tl.load(ke_ptr + m0 + qi, mask=q_ok, other=0) - ks
    lens = tl.minimum(tl.maximum(lens, 0), max_seqlen_k)
    t_begin = split * tiles_per_program
    t_end = tl.minimum(t_begin + tiles_per_program, tl.cdiv(max_seqlen_k, TILE))
    out_rows = out_ptr + (m0 + qi).to(tl.int64) * out_stride
    cols = tl.arange(0, TILE)

    r = tl.arange(0, BM * HP)
    row_ok = (m0 + r // HP < num_q) & (r % HP < H)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + ((m0 + r // HP) * H + r % HP).to(tl.int64)[:, None] * D + d[None, :],
                mask=row_ok[:, None] & (d < D)[None, :], other=0.0)
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
            for t in range(t_begin, t_mid):
                j = t * TILE + cols
                key = ks_g + j
                ok = (j < longest) & (key >= 0) & (key < num_keys)
                # Invalid columns read key 0 (always present) and are masked to -inf below.
                key = tl.where(ok, key, 0).to(tl.int64)
                if BLOCK_D == D:
                    k = tl.load(k_ptr + key[:, None] * D + d[None, :])
                else:
                    k = tl.load(k_ptr + key[:, None] * D + d[None, :], mask=(d < D)[None, :],
                                other=0.0)
                s = tl.maximum(tl.dot(k, tl.trans(q)), 0.0)
                k_scale = tl.load(k_scale_ptr + key)
                for i in tl.static_range(BM):
                    # Query i's heads are the columns [i * HP, i * HP + H) of s.
                    w_i = tl.where(r // HP == i, w, 0.0)
                    logits = tl.sum(s * w_i[None, :], axis=1) * k_scale
                    len_i = tl.sum(tl.where(qi == i, lens, 0), axis=0)
                    # Store bound: the output width for this pass's queries, 0 for others.
                    end_i = tl.sum(tl.where((qi == i) & member, max_seqlen_k, 0), axis=0)
                    tl.store(out_ptr + (m0 + i).to(tl.int64) * out_stride + j,
                             tl.where(ok & (j < len_i), logits, float("-inf")), mask=j < end_i)
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
    _mqa_logits_kernel[grid](
        q_fp8, k_fp8, k_scale, weights, weights.stride(0), weights.stride(1), ks, ke, out,
        out.stride(0), num_q, k_fp8.shape[0], max_seqlen_k, config.tiles_per_program,
        H=num_heads, D=head_dim, HP=hp, BM=config.block_q,
        BLOCK_D=max(32, triton.next_power_of_2(head_dim)), TILE=config.tile,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def mqa_logits_triton(q_fp8: Tensor, k_fp8: Tensor, k_scale: Tensor, weights: Tensor,
                      ks: Tensor, ke: Tensor, max_seqlen_k: int,
                      config: MqaLogitsConfig | None = None) -> Tensor:
    """The Triton backend with explicit launch parameters (None: :func:`mqa_logits_config`),
    for benchmark sweeps; validates like the op."""
    args = (q_fp8, k_fp8, k_scale, weights, ks, ke)
    _check_mqa(*args, max_seqlen_k, "triton")
    return _mqa_logits_launch(*args, alloc_logits(q_fp8.shape[0], max_seqlen_k, q_fp8.device),
                              config)


def _mqa_logits(q_fp8: Tensor, k_fp8: Tensor, k_scale: Tensor, weights: Tensor, ks: Tensor,
                ke: Tensor, max_seqlen_k: int, backend: str = "auto") -> Tensor:
    """Both real faces: the device and ``backend`` pick the implementation."""
    args = (q_fp8, k_fp8, k_scale, weights, ks, ke)
    chosen = _check_mqa(*args, max_seqlen_k, backend)
    if chosen == "deepgemm" and q_fp8.shape[0] and k_fp8.shape[0] and max_seqlen_k:
        return _deepgemm.deep_gemm().fp8_fp4_mqa_logits(
            (q_fp8, None), (k_fp8, k_scale), _weights_for_deepgemm(weights), ks, ke, max_seqlen_k)
    out = alloc_logits(q_fp8.shape[0], max_seqlen_k, q_fp8.device)
    if chosen == "triton":
        return _mqa_logits_launch(*args, out, None)
    if chosen == "torch":
        return _mqa_logits_torch(*args, out)
    return out.fill_(float("-inf"))


mqa_logits = register("mqa_logits", cpu=_mqa_logits, cuda=_mqa_logits, fake=_mqa_logits_out)
