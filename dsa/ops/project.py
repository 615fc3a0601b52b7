"""The indexer's decode prologue from the hidden state in one op (design §2, "Projections"):
``dsa::project_quantize_and_cache_k``.

``project_quantize_and_cache_k(hidden, q_latent, wq_b, wk, norm_weight, norm_bias, eps,
weights_proj, kv_cache, slot_mapping, cos_sin, positions, hadamard, ue8m0, wq_b_scale,
wk_scale, interleaved)`` → ``(q_fp8 [T, H, D], head_weights [T, H])``, and the step's K
written to ``kv_cache``: the layer's three projections, then its two prologue ops (τ =
hidden's dtype)::

    q = round_τ(q_latent @ wq_b.T) viewed as [T, H, D]
    k = round_τ(LayerNorm(round_τ(hidden @ wk.T)))              (LayerNorm in fp32)
    weights = hidden.float() @ weights_proj.float().T
    rope_hadamard_quantize_and_cache_k(k, kv_cache, slot_mapping, cos_sin, positions, ...)
    q_fp8, head_weights = rope_hadamard_quantize_q(q, weights, cos_sin, positions, ...)

``wq_b`` and ``wk`` are τ, or fp8 e4m3 with their block scales (``wq_b_scale``,
``wk_scale``) as DeepSeek ships them: the op then computes on the weights dequantised to τ
(``block_fp8``), and its kernels read half the bytes (the CPU face gives the dequantised
weights' outputs bit for bit; the kernels sum fp8 tiles in another order than 16-bit ones).

A decode step multiplies a few tokens by three weight matrices (28 MB at V3.2's sizes, 15
with fp8 ``wq_b`` and ``wk``): what it costs is reading them once. On CUDA, up to
``KERNEL_TOKENS`` tokens take two Triton launches: fp32 partial sums of the three products
over slices of their inner dims (one token at a time up to ``SMALL_TOKENS``, matrix products
of token tiles above), then a program per tile of (token, head) rows that adds up its q and
weight partials and runs the q prologue, and one per token that adds up its k partials,
normalises k and runs the k prologue. That replaces the GEMMs, their split-K reductions, the
casts, the LayerNorm and the two prologue launches. The partial sums run in fp32, in another
order than a GEMM's. More tokens, and the CPU, take the torch ops and the prologue ops'
faces; ``dsa.Indexer`` calls those itself above ``KERNEL_TOKENS`` tokens, so torch.compile
fuses them with their neighbours.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from dsa.ops._checks import check_heads, check_size, check_tensor
from dsa.ops._l2 import discard_lines
from dsa.ops._launch import (
    CHAIN_ROWS,
    chain_pdl,
    has_tma,
    launch,
    on_nvidia_gpu,
    pdl_chain_wait,
    pdl_enabled,
    pdl_launch,
    row_tile,
    tile_warps,
)
from dsa.ops._registry import dsa_op
from dsa.ops.block_fp8 import BLOCK as WEIGHT_BLOCK
from dsa.ops.block_fp8 import check_block_fp8, dequantize
from dsa.ops.kcache import (
    check_kv_cache,
    check_write_args,
    kcache_views,
    load_slots,
    store_k_rows,
    write_k_rows,
)
from dsa.ops.prologue import (
    check_rotation,
    hadamard_scale,
    k_prologue_triton,
    load_positions,
    q_prologue_triton,
    rope_constexprs,
    rope_hadamard,
    rope_hadamard_tile,
    rope_partner,
)
from dsa.ops.quant import (
    FLOAT_DTYPES,
    quantize_heads_into,
    round_to,
    store_q_rows,
    weight_scale,
)

# Tokens up to which the CUDA face runs its own kernels; more (a long prefill chunk) take
# the GEMMs. Up to SMALL_TOKENS (one: a decode step of one request) the partial sums are
# products of one token at a time, above it matrix products of a tile of tokens. H200
# (662e3da, one call after an L2 flush): one token 18.4 us against 19.7 by matrix
# products, 4 tokens 19.9 against 25.4 one at a time, 512 tokens 82.1 against 105.3 for
# the GEMMs and the prologue ops.
KERNEL_TOKENS = 512
SMALL_TOKENS = 1
# Columns of wk and weights_proj a program multiplies (every T) and, up to SMALL_TOKENS, of
# wq_b (twice as many with fp8 wq_b).
COLS = 32
# Up to SMALL_TOKENS, (inner-dim elements per step, steps of a hidden-dim slice, of a
# q_lora-dim slice, columns of wq_b per program, warps) with 16-bit weights and with fp8 ones
# (a step inside a block of scales; fp8 wq_b: slices of one step, 2 * COLS columns).
ONE_TOKEN_16BIT, ONE_TOKEN_FP8 = (256, 2, 1, 2 * COLS, 16), (WEIGHT_BLOCK, 4, 2, COLS, 4)
# Above SMALL_TOKENS: inner-dim elements per step (64: a program of 64 tokens holds its
# operands in registers without spilling), steps of a hidden-dim slice, columns of wq_b per
# program, load stages; tokens, warps and q_lora-dim slice steps of a program by T
# (partials_plan).
TILE_STEP, TILE_HIDDEN_STEPS, TILE_Q_COLS, TILE_STAGES = 64, 8, 64, 4
# fp8 weights: a program's columns and a step's inner-dim elements lie in one block of
# scales (COLS, the q columns and the steps divide it; tests/test_project.py checks).
_BLOCK = tl.constexpr(WEIGHT_BLOCK)
# Rows of q heads a prologue program takes, at most: two rows of 128 in one warp. H200
# (b96013f, the kernel after a 256 MB flush): 3.4 / 4.6 / 7.0 us at 16 / 64 / 128 tokens
# against 4.6 / 6.0 / 8.8 with row_tile's 8-16 rows in 2-4 warps.
PROLOGUE_ROWS = 2
# The fewest tokens at which a prologue program drops its q partial sums' lines from L2 once
# it has read them (on NVIDIA GPUs): dead after it, left dirty they are written back under the
# paged logits' K reads (4 MB at 64 tokens); below, the drop's barrier and instructions cost
# more than the write-back. H100, bench_step's layer, device µs without the drop minus with it
# (bench_step_options.py --only DISCARD_Q_PARTIALS, three rounds): +0.9 / +1.1 (bf16 / fp8
# weights) at 32 tokens (a later fp8 run: -0.1), +0.9-1.3 at 64-128; -0.8 to +0.4 at 2-16;
# -0.2 / -1.8 at 1.
DISCARD_Q_PARTIALS_FROM = 32
# Whether fp8 block-scaled weights' tiles go by TMA too (their codes scaled in registers as
# the pointer path scales them, so the same sums bit for bit). H100, bench_step's fp8 layer,
# device / kernels read over µs, two rounds: 64x64K 251.2 / 242.3, 250.1 / 242.8 -> 248.4 /
# 239.1, 249.2 / 239.8; 128x32K 258.0 / 252.0, 258.3 / 251.5 -> 257.7 / 249.3, 257.8 / 249.9.
FP8_WEIGHTS_BY_TMA = True


class PartialsPlan(NamedTuple):
    """How the partial-sums launch covers T tokens: programs of ``tokens`` tokens, matrix
    products (``dot``) or one token at a time, slices of ``hidden_steps`` and ``q_steps``
    steps of ``step`` elements, ``q_cols`` columns of ``wq_b`` per program, ``warps``, and
    ``stages`` of loads in flight (Triton's ``num_stages``)."""

    tokens: int
    dot: bool
    step: int
    hidden_steps: int
    q_steps: int
    q_cols: int
    warps: int
    stages: int = 3


def partials_plan(tokens: int, fp8_q: bool = False, fp8_k: bool = False) -> PartialsPlan:
    """The partial-sums launch of a call of ``tokens`` tokens. Above SMALL_TOKENS, H200
    (77f4233, one call after an L2 flush; BENCHMARKS.md, "Session of 2026-12-01, eighth"):
    up to 64 tokens one tile of 4 warps, the q_lora dim in two slices (21.2 against 24.9
    us at T = 8, 24.3 against 28.8 at T = 64); above, tiles of 128 tokens in 8 warps, the
    q_lora dim whole (33.8 against 34.6 us at T = 128, 49.3 against 51.1 at T = 256).
    One token, 16-bit weights: steps of 256 elements, slices of 512 (hidden) and 256
    (q_lora), 8 warps (a V3.2 layer's step at (1, 4K), µs, min / median of seven, two runs:
    29.31 / 29.38 and 29.86 / 30.02 against 29.79 / 29.89 and 30.14 / 30.18 for steps of
    128 in 4 warps; BENCHMARKS.md, "twenty-fourth"), then 64 columns of ``wq_b`` a program
    in 16 warps (the step's device µs, 256 MB written over, two rounds: H200 28.32 / 28.22
    against 28.67 / 29.95, H100 32.54 / 32.64 against 33.12 / 33.06; "forty-seventh").
    fp8 weights (``fp8_q``: ``wq_b``, ``fp8_k``: ``wk``) take steps of 128, inside a block
    of scales; fp8 ``wq_b`` as many bytes a step in twice the columns, and q_lora slices of
    one step (the op in a graph, flushed: 10.6 / 10.7 against 11.3 / 11.4 us in two runs;
    BENCHMARKS.md, "fourteenth").
    Plans that win on their own (T = 128: q_lora slices of 12 steps, 128 columns, 4 load
    stages, 14.1 against 16.9 us) did not in the layer step (17.9 against 17.3;
    "twenty-eighth"). Matrix products take 4 stages, their q tiles by TMA where the operands
    allow (``_tma_tiles``; bitwise the same sums): the kernel at T = 16 / 64 / 128 / 256 / 512
    9.1 / 11.1 / 13.8 / 23.4 / 38.8 us against 9.8 / 12.2 / 17.2 / 29.7 / 47.5 by pointers in
    3 stages ("thirty-second"); the hidden product's tiles too (hidden states, 16-bit ``wk``
    and ``weights_proj`` of their dtype): in the layer step at (128, 32K) 15.4 against
    16.3 us, at (64, 64K) 13.1 against 13.0 ("thirty-third")."""
    if tokens <= SMALL_TOKENS:
        step, hidden_steps, q_steps, q_cols, warps = (ONE_TOKEN_FP8 if fp8_q or fp8_k
                                                      else ONE_TOKEN_16BIT)
        return PartialsPlan(triton.next_power_of_2(tokens), False, step, hidden_steps,
                            1 if fp8_q else q_steps, 2 * COLS if fp8_q else q_cols, warps)
    if tokens <= 64:
        return PartialsPlan(max(16, triton.next_power_of_2(tokens)), True, TILE_STEP,
                            TILE_HIDDEN_STEPS, 12, TILE_Q_COLS, 4, TILE_STAGES)
    return PartialsPlan(128, True, TILE_STEP, TILE_HIDDEN_STEPS, 24, TILE_Q_COLS, 8, TILE_STAGES)


class _Sizes:
    """Tokens T, hidden and q_lora widths, heads H and head_dim D of a call."""

    def __init__(self, hidden: Tensor, q_latent: Tensor, wk: Tensor, weights_proj: Tensor
                 ) -> None:
        self.tokens, self.width = hidden.shape
        self.q_width = q_latent.shape[1]
        self.head_dim, self.heads = wk.shape[0], weights_proj.shape[0]


def _check(hidden: Tensor, q_latent: Tensor, wq_b: Tensor, wk: Tensor, norm_weight: Tensor,
           norm_bias: Tensor, eps: float, weights_proj: Tensor, kv_cache: Tensor,
           slot_mapping: Tensor, cos_sin: Tensor, positions: Tensor, hadamard: bool,
           ue8m0: bool, wq_b_scale: Tensor | None, wk_scale: Tensor | None) -> _Sizes:
    op = "project_quantize_and_cache_k"
    check_tensor(op, "hidden", hidden, dtype=FLOAT_DTYPES, ndim=2)
    tokens, width = hidden.shape
    tokens_are = (tokens, "num_tokens = hidden.shape[0]")
    check_tensor(op, "q_latent", q_latent, dtype=hidden.dtype, ndim=2, like=hidden)
    check_size(op, "q_latent", q_latent, 0, *tokens_are)
    check_block_fp8(op, "wk", wk, wk_scale, hidden.dtype, like=hidden)
    check_size(op, "wk", wk, 1, width, "hidden_size = hidden.shape[1]")
    head_dim = wk.shape[0]
    if width < 1 or head_dim < 1:
        raise ValueError(f"dsa.{op}: `wk` must be [head_dim >= 1, hidden_size >= 1], got shape "
                         f"{tuple(wk.shape)}")
    for name, x in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
        check_tensor(op, name, x, dtype=torch.float32, ndim=1, contiguous=True, like=hidden)
        check_size(op, name, x, 0, head_dim, "head_dim = wk.shape[0]")
    if not isinstance(eps, float) or not eps > 0:
        raise ValueError(f"dsa.{op}: `eps` must be a positive float, got {eps!r}")
    check_tensor(op, "weights_proj", weights_proj, dtype=FLOAT_DTYPES, ndim=2, like=hidden)
    check_size(op, "weights_proj", weights_proj, 1, width, "hidden_size = hidden.shape[1]")
    heads = weights_proj.shape[0]
    check_heads(op, "weights_proj", weights_proj, 0)
    check_block_fp8(op, "wq_b", wq_b, wq_b_scale, hidden.dtype, like=hidden)
    check_size(op, "wq_b", wq_b, 0, heads * head_dim,
               "num_heads * head_dim = weights_proj.shape[0] * wk.shape[0]")
    check_size(op, "wq_b", wq_b, 1, q_latent.shape[1], "q_lora_rank = q_latent.shape[1]")
    if q_latent.shape[1] < 1:
        raise ValueError(f"dsa.{op}: `q_latent` must have q_lora_rank >= 1, got shape "
                         f"{tuple(q_latent.shape)}")
    _, _, cache_dim = check_kv_cache(op, kv_cache, like=hidden)
    if cache_dim != head_dim:
        raise ValueError(f"dsa.{op}: `kv_cache` must hold head_dim = wk.shape[0] = {head_dim} "
                         f"(shape[3] = {head_dim + 4}), got shape {tuple(kv_cache.shape)}")
    check_write_args(op, slot_mapping, ue8m0, like=hidden, tokens=tokens_are)
    check_rotation(op, cos_sin, positions, hadamard, head_dim=head_dim, like=hidden,
                   tokens=tokens_are)
    return _Sizes(hidden, q_latent, wk, weights_proj)


@dsa_op("project_quantize_and_cache_k", mutates_args=("kv_cache",))
def _project_quantize_out(hidden: Tensor, q_latent: Tensor, wq_b: Tensor, wk: Tensor,
                          norm_weight: Tensor, norm_bias: Tensor, eps: float,
                          weights_proj: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                          cos_sin: Tensor, positions: Tensor, hadamard: bool = True,
                          ue8m0: bool = False, wq_b_scale: Tensor | None = None,
                          wk_scale: Tensor | None = None, interleaved: bool = False
                          ) -> tuple[Tensor, Tensor]:
    n = _check(hidden, q_latent, wq_b, wk, norm_weight, norm_bias, eps, weights_proj, kv_cache,
               slot_mapping, cos_sin, positions, hadamard, ue8m0, wq_b_scale, wk_scale)
    return (hidden.new_empty((n.tokens, n.heads, n.head_dim), dtype=torch.float8_e4m3fn),
            hidden.new_empty((n.tokens, n.heads), dtype=torch.float32))


def project_torch(hidden: Tensor, q_latent: Tensor, wq_b: Tensor, wk: Tensor,
                  norm_weight: Tensor, norm_bias: Tensor, eps: float, weights_proj: Tensor,
                  wq_b_scale: Tensor | None = None, wk_scale: Tensor | None = None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """The layer's projections as torch ops: q ``[T, H, D]``, k ``[T, D]``, the weights
    (fp8 ``wq_b`` / ``wk`` dequantised to hidden's dtype first)."""
    wq_b = dequantize(wq_b, wq_b_scale, hidden.dtype)
    wk = dequantize(wk, wk_scale, hidden.dtype)
    head_dim = wk.shape[0]
    q = F.linear(q_latent, wq_b).view(hidden.shape[0], wq_b.shape[0] // head_dim, head_dim)
    k = F.layer_norm(F.linear(hidden, wk).float(), (head_dim,), norm_weight, norm_bias, eps)
    return q, k.to(hidden.dtype), F.linear(hidden.float(), weights_proj.float())


@_project_quantize_out.cpu
def _project_quantize_cpu(hidden: Tensor, q_latent: Tensor, wq_b: Tensor, wk: Tensor,
                          norm_weight: Tensor, norm_bias: Tensor, eps: float,
                          weights_proj: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                          cos_sin: Tensor, positions: Tensor, hadamard: bool = True,
                          ue8m0: bool = False, wq_b_scale: Tensor | None = None,
                          wk_scale: Tensor | None = None, interleaved: bool = False
                          ) -> tuple[Tensor, Tensor]:
    outputs = _project_quantize_out(hidden, q_latent, wq_b, wk, norm_weight, norm_bias, eps,
                                    weights_proj, kv_cache, slot_mapping, cos_sin, positions,
                                    hadamard, ue8m0, wq_b_scale, wk_scale, interleaved)
    q, k, weights = project_torch(hidden, q_latent, wq_b, wk, norm_weight, norm_bias, eps,
                                  weights_proj, wq_b_scale, wk_scale)
    rotation = (cos_sin, positions, hadamard, interleaved)
    write_k_rows(rope_hadamard(k, *rotation), kv_cache, slot_mapping, ue8m0)
    return quantize_heads_into(*outputs, rope_hadamard(q, *rotation), weights, ue8m0)


# --- the kernels -----------------------------------------------------------------------------


@triton.jit
def _exact_scale(scale, dtype: tl.constexpr):
    """Whether every fp8 code times fp32 ``scale`` is exact in fp32 and in ``dtype``: a power
    of two from 2**-117 (a code's smallest magnitude, 2**-9, times it stays normal) to
    2**127, and ``dtype`` bf16 or fp32 (fp32's exponent range; fp16's is narrower)."""
    bits = scale.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    return ((bits & 0x7FFFFF) == 0) & (exponent >= 10) & (exponent < 255) & (
        dtype != tl.float16)


@triton.jit
def _weight_tile(w, rows_ok, e0, e, width, dtype: tl.constexpr, SCALED: tl.constexpr,
                 SCALE_SUMS: tl.constexpr):
    """(``w[rows, e]``, 0 where masked; the factor of its products' sums). ``w``: (row
    pointers, their column stride, the first row, the scales' pointer and strides); ``e0``:
    ``e``'s first. SCALED: fp8 codes times their block's scale (the rows and ``e`` lie in
    one block) rounded to ``dtype``; where those products are exact (:func:`_exact_scale`:
    power-of-two scales, V3.1+ checkpoints) no rounding is needed, and with SCALE_SUMS the
    fp32 codes come with the scale as the factor (the sums scaled instead: exact unless a
    product with the activations falls below fp32's normal range), else 1."""
    w_rows, w_s1, row0, s_ptr, s_s0, s_s1 = w
    tile = tl.load(w_rows[:, None] + e[None, :].to(tl.int64) * w_s1,
                   mask=rows_ok[:, None] & (e < width)[None, :], other=0.0)
    factor = tl.full([], 1.0, tl.float32)
    if SCALED:
        tile, factor = _scaled_codes(tile, (s_ptr, s_s0, s_s1), row0, e0, width, dtype,
                                     SCALE_SUMS)
    return tile, factor


@triton.jit
def _scaled_codes(codes, scales, row0, e0, width, dtype: tl.constexpr,
                  SCALE_SUMS: tl.constexpr):
    """(fp8 ``codes`` of rows ``row0 ..``, elements ``e0 ..`` (in one block of scales) times
    their block's scale, as :func:`_weight_tile` takes them; the factor of their sums).
    ``scales``: the scales' pointer and strides."""
    s_ptr, s_s0, s_s1 = scales
    e0 = tl.minimum(e0, width - 1)  # past the width: any block's scale, the codes are 0
    scale = tl.load(s_ptr + (row0 // _BLOCK) * s_s0 + (e0 // _BLOCK) * s_s1)
    codes = codes.to(tl.float32)
    factor = tl.full([], 1.0, tl.float32)
    exact = _exact_scale(scale, dtype)
    if SCALE_SUMS:
        if exact:
            values = codes
            factor = scale
        else:
            values = round_to(codes * scale, dtype)
    elif exact:
        values = (codes * scale).to(dtype)
    else:  # round_to: the interpreter's bf16 cast truncates
        values = round_to(codes * scale, dtype).to(dtype)
    return values, factor


@triton.jit
def _slice_products(x_ptr, x_s0, x_s1, w, rows_ok, tokens, width, lo, TP: tl.constexpr,
                    COLS: tl.constexpr, STEP: tl.constexpr, SLICE_STEPS: tl.constexpr,
                    SCALED: tl.constexpr, PDL: tl.constexpr):
    """fp32 ``[TP, COLS]`` sums over inner-dim elements ``lo .. lo + SLICE_STEPS * STEP`` of
    ``x[t, :] * w[c, :]`` (``w``: see :func:`_weight_tile`; masked rows count 0), one token
    at a time. PDL: the first step's weights are loaded before waiting for the kernel
    before (which may write ``x``)."""
    t = tl.arange(0, TP)
    acc = tl.zeros([TP, COLS], tl.float32)
    for step in tl.static_range(SLICE_STEPS):
        e0 = lo + step * STEP
        e = e0 + tl.arange(0, STEP)
        w_tile, factor = _weight_tile(w, rows_ok, e0, e, width, x_ptr.dtype.element_ty,
                                      SCALED, True)
        if PDL and step == 0:
            tl.extra.cuda.gdc_wait()
        w_tile = w_tile.to(tl.float32)
        x_row = x_ptr  # advanced by a stride (a plain int where Triton specialises it to 1)
        for j in tl.static_range(TP):
            x = tl.load(x_row + e.to(tl.int64) * x_s1,
                        mask=(e < width) & (e * 0 + j < tokens), other=0.0).to(tl.float32)
            sums = tl.sum(w_tile * x[None, :], axis=1)
            if SCALED:
                sums *= factor
            acc += tl.where(t[:, None] == j, sums[None, :], 0.0)
            x_row += x_s0
    return acc


@triton.jit
def _tile_products(x_ptr, x_s0, x_s1, w, rows_ok, tokens, width, lo, TP: tl.constexpr,
                   COLS: tl.constexpr, STEP: tl.constexpr, SLICE_STEPS: tl.constexpr,
                   SCALED: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    """:func:`_slice_products` for a tile of TP tokens by matrix products, their operands'
    products exact and summed in fp32: NATIVE, in the operands' dtype where both share a
    16-bit one, else in fp32 (without TF32). PDL: waits for the kernel before first."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    t = tl.arange(0, TP)
    acc = tl.zeros([TP, COLS], tl.float32)
    for step in range(SLICE_STEPS):
        e = lo + step * STEP + tl.arange(0, STEP)
        e_ok = (e < width)[None, :]
        x = tl.load(x_ptr + t[:, None].to(tl.int64) * x_s0 + e[None, :].to(tl.int64) * x_s1,
                    mask=(t < tokens)[:, None] & e_ok, other=0.0)
        w_tile, _ = _weight_tile(w, rows_ok, lo + step * STEP, e, width, x.dtype, SCALED,
                                 False)
        acc = _tile_dot(x, w_tile, acc, NATIVE)
    return acc


@triton.jit
def _tile_dot(x, w, acc, NATIVE: tl.constexpr):
    """``acc + x @ w.T``, the products exact and summed in fp32: NATIVE, in the operands'
    dtype where both share a 16-bit one (or :func:`_split_dot` for bf16 ``x`` and fp32
    ``w``), else in fp32 (without TF32)."""
    if NATIVE and (x.dtype == w.dtype) and (x.dtype != tl.float32):
        acc = tl.dot(x, tl.trans(w), acc)
    elif NATIVE and (x.dtype == tl.bfloat16) and (w.dtype == tl.float32):
        acc = _split_dot(x, w, acc)
    else:
        acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return acc


@triton.jit
def _tma_products(x_desc, w_desc, w_scales, t0, col0, lo, width, TP: tl.constexpr,
                  COLS: tl.constexpr, STEP: tl.constexpr, SLICE_STEPS: tl.constexpr,
                  SCALED: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    """:func:`_tile_products` of 16-bit activations and weights of their dtype, or (SCALED)
    fp8 weights with block scales (``w_scales``: pointer and strides, as
    :func:`_scaled_codes` takes them), whose tiles (tokens ``t0 ..``, columns ``col0 ..``,
    inner-dim elements ``lo ..``) are copied by TMA (Hopper's tensor memory accelerator;
    zeros past either operand's edges): the same products in the same order. PDL: waits for
    the kernel before first."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([TP, COLS], tl.float32)
    for step in range(SLICE_STEPS):
        e0 = lo + step * STEP
        x = x_desc.load([t0, e0])
        w = w_desc.load([col0, e0])
        if SCALED:
            w, _ = _scaled_codes(w, w_scales, col0, e0, width, x.dtype, False)
        acc = _tile_dot(x, w, acc, NATIVE)
    return acc


@triton.jit
def _split_dot(x, w, acc):
    """``acc + x @ w.T`` for bf16 ``x`` and fp32 ``w`` in three bf16 products: ``w`` as the
    sum of three bf16 pieces (8 of its 24 significant bits each, exact), each product exact
    in fp32."""
    high = w.to(tl.bfloat16)
    rest = w - high.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    low = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    acc = tl.dot(x, tl.trans(high), acc)
    acc = tl.dot(x, tl.trans(mid), acc)
    return tl.dot(x, tl.trans(low), acc)


@triton.jit
def _products(x_ptr, x_s0, x_s1, w, rows_ok, tokens, width, lo, TP: tl.constexpr,
              COLS: tl.constexpr, STEP: tl.constexpr, SLICE_STEPS: tl.constexpr,
              SCALED: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr):
    """The partial sums of a program: DOT 0 :func:`_slice_products`, 1
    :func:`_tile_products` in fp32, 2 the same with native 16-bit operands."""
    if DOT:
        acc = _tile_products(x_ptr, x_s0, x_s1, w, rows_ok, tokens, width, lo, TP, COLS, STEP,
                             SLICE_STEPS, SCALED, DOT == 2, PDL)
    else:
        acc = _slice_products(x_ptr, x_s0, x_s1, w, rows_ok, tokens, width, lo, TP, COLS,
                              STEP, SLICE_STEPS, SCALED, PDL)
    return acc


@triton.jit
def _hidden_partials(pid, t0, x_ptr, x_s0, x_s1, wk_ptr, wk_s0, wk_s1, wks_ptr, wks_s0, wks_s1,
                     wp_ptr, wp_s0, wp_s1, x_desc, wk_desc, wp_desc, hpart_ptr, tokens, width,
                     D: tl.constexpr, H: tl.constexpr, TP: tl.constexpr, COLS: tl.constexpr,
                     STEP: tl.constexpr, H_STEPS: tl.constexpr, WK_SCALED: tl.constexpr,
                     DOT: tl.constexpr, K_TMA: tl.constexpr, P_TMA: tl.constexpr,
                     PDL: tl.constexpr):
    """``hpart[s, t, c]`` of program ``pid = s * H_BLOCKS + block``: COLS columns c of
    ``[wk; weights_proj]`` (k's D, then the H head weights), tokens ``t0 .. t0 + TP - 1``
    (WK_SCALED: fp8 ``wk`` with its block scales at ``wks_ptr``; K_TMA, P_TMA: ``wk``'s,
    ``weights_proj``'s tiles and the hidden states' copied through the descriptors,
    :func:`_tma_products`)."""
    K_BLOCKS: tl.constexpr = (D + COLS - 1) // COLS
    H_BLOCKS: tl.constexpr = K_BLOCKS + (H + COLS - 1) // COLS
    c = tl.arange(0, COLS)
    t = t0 + tl.arange(0, TP)
    x = x_ptr + t0.to(tl.int64) * x_s0
    s = pid // H_BLOCKS
    block = pid % H_BLOCKS
    lo = s * (H_STEPS * STEP)
    if block < K_BLOCKS:
        rows = block * COLS + c
        if K_TMA:
            acc = _tma_products(x_desc, wk_desc, (wks_ptr, wks_s0, wks_s1), t0, block * COLS,
                                lo, width, TP, COLS, STEP, H_STEPS, WK_SCALED, DOT == 2, PDL)
        else:
            wk_tile = (wk_ptr + rows.to(tl.int64) * wk_s0, wk_s1, block * COLS, wks_ptr,
                       wks_s0, wks_s1)
            acc = _products(x, x_s0, x_s1, wk_tile, rows < D, tokens - t0, width, lo, TP, COLS,
                            STEP, H_STEPS, WK_SCALED, DOT, PDL)
        col, col_ok = rows, rows < D
    else:
        rows = (block - K_BLOCKS) * COLS + c
        if P_TMA:
            acc = _tma_products(x_desc, wp_desc, (wp_ptr, 0, 0), t0, (block - K_BLOCKS) * COLS,
                                lo, width, TP, COLS, STEP, H_STEPS, False, DOT == 2, PDL)
        else:
            wp_tile = (wp_ptr + rows.to(tl.int64) * wp_s0, wp_s1, 0, wp_ptr, 0, 0)
            acc = _products(x, x_s0, x_s1, wp_tile, rows < H, tokens - t0, width, lo, TP, COLS,
                            STEP, H_STEPS, False, DOT, PDL)
        col, col_ok = D + rows, rows < H
    out = hpart_ptr + (s * tokens + t[:, None]).to(tl.int64) * (D + H) + col[None, :]
    tl.store(out, acc, mask=(t < tokens)[:, None] & col_ok[None, :])


@triton.jit
def _q_partials(q_pid, t0, ql_ptr, ql_s0, ql_s1, wq_ptr, wq_s0, wq_s1, wqs_ptr, wqs_s0, wqs_s1,
                ql_desc, wq_desc, qpart_ptr, tokens, q_width, N: tl.constexpr,
                TP: tl.constexpr, Q_COLS: tl.constexpr, STEP: tl.constexpr,
                Q_STEPS: tl.constexpr, WQ_SCALED: tl.constexpr, DOT: tl.constexpr,
                Q_TMA: tl.constexpr, PDL: tl.constexpr):
    """``qpart[s, t, c]`` of program ``q_pid = s * Q_BLOCKS + block``: Q_COLS of the N
    columns of ``wq_b``, tokens ``t0 .. t0 + TP - 1`` (WQ_SCALED: fp8 ``wq_b`` with its
    block scales at ``wqs_ptr``; Q_TMA: tiles copied through ``ql_desc`` and ``wq_desc``,
    :func:`_tma_products`)."""
    Q_BLOCKS: tl.constexpr = (N + Q_COLS - 1) // Q_COLS
    t = t0 + tl.arange(0, TP)
    s = q_pid // Q_BLOCKS
    col0 = (q_pid % Q_BLOCKS) * Q_COLS
    col = col0 + tl.arange(0, Q_COLS)
    lo = s * (Q_STEPS * STEP)
    if Q_TMA:
        acc = _tma_products(ql_desc, wq_desc, (wqs_ptr, wqs_s0, wqs_s1), t0, col0, lo,
                            q_width, TP, Q_COLS, STEP, Q_STEPS, WQ_SCALED, DOT == 2, PDL)
    else:
        w = (wq_ptr + col.to(tl.int64) * wq_s0, wq_s1, col0, wqs_ptr, wqs_s0, wqs_s1)
        acc = _products(ql_ptr + t0.to(tl.int64) * ql_s0, ql_s0, ql_s1, w, col < N,
                        tokens - t0, q_width, lo, TP, Q_COLS, STEP, Q_STEPS, WQ_SCALED, DOT,
                        PDL)
    out = qpart_ptr + (s * tokens + t[:, None]).to(tl.int64) * N + col[None, :]
    tl.store(out, acc, mask=(t < tokens)[:, None] & (col < N)[None, :])


@triton.jit
def _partials_kernel(x_ptr, x_s0, x_s1, ql_ptr, ql_s0, ql_s1, wk_ptr, wk_s0, wk_s1, wks_ptr,
                     wks_s0, wks_s1, wp_ptr, wp_s0, wp_s1, wq_ptr, wq_s0, wq_s1, wqs_ptr,
                     wqs_s0, wqs_s1, x_desc, wk_desc, wp_desc, ql_desc, wq_desc, hpart_ptr,
                     qpart_ptr, tokens, width, q_width, D: tl.constexpr, H: tl.constexpr,
                     TP: tl.constexpr, COLS: tl.constexpr, Q_COLS: tl.constexpr,
                     STEP: tl.constexpr, H_STEPS: tl.constexpr, Q_STEPS: tl.constexpr,
                     H_PROGRAMS: tl.constexpr, WK_SCALED: tl.constexpr,
                     WQ_SCALED: tl.constexpr, DOT: tl.constexpr, K_TMA: tl.constexpr,
                     P_TMA: tl.constexpr, Q_TMA: tl.constexpr, PDL: tl.constexpr):
    """Program (i, j), tokens ``j * TP ..``: the first H_PROGRAMS programs i
    :func:`_hidden_partials` (over the hidden dim), the others :func:`_q_partials` (over the
    q_lora dim). PDL (programmatic dependent launch): a program may start while the kernel
    before runs, and reads only weights before it waits for that kernel."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    t0 = tl.program_id(1) * TP
    if pid < H_PROGRAMS:
        _hidden_partials(pid, t0, x_ptr, x_s0, x_s1, wk_ptr, wk_s0, wk_s1, wks_ptr, wks_s0,
                         wks_s1, wp_ptr, wp_s0, wp_s1, x_desc, wk_desc, wp_desc, hpart_ptr,
                         tokens, width, D, H, TP, COLS, STEP, H_STEPS, WK_SCALED, DOT, K_TMA,
                         P_TMA, PDL)
    else:
        _q_partials(pid - H_PROGRAMS, t0, ql_ptr, ql_s0, ql_s1, wq_ptr, wq_s0, wq_s1, wqs_ptr,
                    wqs_s0, wqs_s1, ql_desc, wq_desc, qpart_ptr, tokens, q_width, H * D, TP,
                    Q_COLS, STEP, Q_STEPS, WQ_SCALED, DOT, Q_TMA, PDL)


@triton.jit
def _summed(part_ptr, slice_stride, offs, mask, SLICES: tl.constexpr):
    """fp32 sums over the SLICES slices of the partials at ``offs`` (0 where not ``mask``),
    slice by slice in order."""
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SLICES):
        acc += tl.load(part_ptr + s * slice_stride + offs, mask=mask, other=0.0)
    return acc


@triton.jit
def _layer_norm(x, mean, rstd, nw_ptr, nb_ptr, cols, ok):
    """``(x - mean) * rstd * w + b`` at columns ``cols`` (0 where not ``ok``)."""
    w = tl.load(nw_ptr + cols, mask=ok, other=0.0)
    b = tl.load(nb_ptr + cols, mask=ok, other=0.0)
    return tl.where(ok, (x - mean) * rstd * w + b, 0.0)


@triton.jit
def _q_rows(pid, hpart_ptr, qpart_ptr, tokens, q_out_ptr, hw_ptr, cs_ptr, pos_ptr, max_pos, c,
            w_scale, dtype: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, H_SLICES: tl.constexpr,
            Q_SLICES: tl.constexpr, ROPE_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
            HADAMARD: tl.constexpr, LOG2_D: tl.constexpr, UE8M0: tl.constexpr,
            DISCARD: tl.constexpr):
    """BLOCK_R rows of the flat ``[T * H]`` q heads: q and weight partials added up, q
    rounded to ``dtype``, then the q prologue. DISCARD: then the rows' q partials (read by
    this program only) leave L2 unwritten."""
    d, partner, in_rope = rope_partner(BLOCK_D, ROPE_DIM, INTERLEAVED)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < tokens * H
    base = rows.to(tl.int64)[:, None] * D
    q_stride = tokens * (H * D)
    x = _summed(qpart_ptr, q_stride, base + d[None, :], row_ok[:, None] & (d < D)[None, :],
                Q_SLICES)
    other = _summed(qpart_ptr, q_stride, base + partner[None, :],
                    row_ok[:, None] & in_rope[None, :], Q_SLICES)
    tok = rows // H
    pos = load_positions(pos_ptr, tok, row_ok, max_pos)
    x = rope_hadamard_tile(round_to(x, dtype), round_to(other, dtype), row_ok, pos, cs_ptr, c,
                           dtype, BLOCK_R, BLOCK_D, ROPE_DIM, INTERLEAVED, HADAMARD, LOG2_D)
    w = _summed(hpart_ptr, tokens * (D + H), tok.to(tl.int64) * (D + H) + D + rows % H, row_ok,
                H_SLICES)
    store_q_rows(x, w, rows, tokens * H, q_out_ptr, hw_ptr, w_scale, D=D, BLOCK_D=BLOCK_D,
                 UE8M0=UE8M0)
    if DISCARD:
        tl.debug_barrier()  # every thread's reads of the partials are done
        first = pid * BLOCK_R
        size = (tl.minimum(first + BLOCK_R, tokens * H) - first).to(tl.int64) * (D * 4)
        for s in tl.static_range(Q_SLICES):
            start = (qpart_ptr + s * q_stride + first.to(tl.int64) * D).to(tl.int64)
            discard_lines(start, start + size, (BLOCK_R * BLOCK_D + 31) // 32)


@triton.jit
def _k_token(t, hpart_ptr, tokens, nw_ptr, nb_ptr, eps, slot_ptr, value_ptr, scale_ptr,
             num_slots, cs_ptr, pos_ptr, max_pos, c, dtype: tl.constexpr, H: tl.constexpr,
             D: tl.constexpr, BLOCK_D: tl.constexpr, H_SLICES: tl.constexpr,
             VALUE_STRIDE: tl.constexpr, SCALE_STRIDE: tl.constexpr, BS: tl.constexpr,
             ROPE_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, HADAMARD: tl.constexpr,
             LOG2_D: tl.constexpr, UE8M0: tl.constexpr):
    """Token ``t``'s k: partials added up and rounded to ``dtype``, LayerNorm, rounded (each
    rotated column's partner from the same sums and statistics), then the k prologue."""
    d, partner, in_rope = rope_partner(BLOCK_D, ROPE_DIM, INTERLEAVED)
    tok = t + tl.arange(0, 1)
    slot, ok = load_slots(slot_ptr, tok, tokens, num_slots)
    base = tok.to(tl.int64)[:, None] * (D + H)
    h_stride = tokens * (D + H)
    col_ok = (d < D)[None, :]
    x = round_to(_summed(hpart_ptr, h_stride, base + d[None, :], col_ok, H_SLICES), dtype)
    other = round_to(_summed(hpart_ptr, h_stride, base + partner[None, :], in_rope[None, :],
                             H_SLICES), dtype)
    mean = tl.sum(x, axis=1)[:, None] / D
    diff = tl.where(col_ok, x - mean, 0.0)
    rstd = tl.math.rsqrt(tl.sum(diff * diff, axis=1)[:, None] / D + eps)
    x = round_to(_layer_norm(x, mean, rstd, nw_ptr, nb_ptr, d[None, :], col_ok), dtype)
    other = round_to(_layer_norm(other, mean, rstd, nw_ptr, nb_ptr, partner[None, :],
                                 in_rope[None, :]), dtype)
    pos = load_positions(pos_ptr, tok, ok, max_pos)
    x = rope_hadamard_tile(x, other, ok, pos, cs_ptr, c, dtype, 1, BLOCK_D, ROPE_DIM,
                           INTERLEAVED, HADAMARD, LOG2_D)
    store_k_rows(x, slot, ok, value_ptr, scale_ptr, VALUE_STRIDE=VALUE_STRIDE,
                 SCALE_STRIDE=SCALE_STRIDE, BS=BS, D=D, BLOCK_D=BLOCK_D, UE8M0=UE8M0)


@triton.jit
def _prologue_kernel(hpart_ptr, qpart_ptr, tokens, q_programs, nw_ptr, nb_ptr, eps, q_out_ptr,
                     hw_ptr, slot_ptr, value_ptr, scale_ptr, num_slots, cs_ptr, pos_ptr,
                     max_pos, c, w_scale, dtype: tl.constexpr, H: tl.constexpr,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                     H_SLICES: tl.constexpr, Q_SLICES: tl.constexpr,
                     VALUE_STRIDE: tl.constexpr, SCALE_STRIDE: tl.constexpr, BS: tl.constexpr,
                     ROPE_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
                     HADAMARD: tl.constexpr, LOG2_D: tl.constexpr, UE8M0: tl.constexpr,
                     DISCARD: tl.constexpr, PDL: tl.constexpr):
    """The first ``q_programs`` programs: :func:`_q_rows`; then one per token: :func:`_k_token`."""
    pdl_chain_wait(PDL)
    pid = tl.program_id(0)
    if pid < q_programs:
        _q_rows(pid, hpart_ptr, qpart_ptr, tokens, q_out_ptr, hw_ptr, cs_ptr, pos_ptr, max_pos,
                c, w_scale, dtype, H, D, BLOCK_D, BLOCK_R, H_SLICES, Q_SLICES, ROPE_DIM,
                INTERLEAVED, HADAMARD, LOG2_D, UE8M0, DISCARD)
    else:
        _k_token(pid - q_programs, hpart_ptr, tokens, nw_ptr, nb_ptr, eps, slot_ptr, value_ptr,
                 scale_ptr, num_slots, cs_ptr, pos_ptr, max_pos, c, dtype, H, D, BLOCK_D,
                 H_SLICES, VALUE_STRIDE, SCALE_STRIDE, BS, ROPE_DIM, INTERLEAVED, HADAMARD,
                 LOG2_D, UE8M0)


def project_triton(hidden: Tensor, q_latent: Tensor, wq_b: Tensor, wk: Tensor,
                   norm_weight: Tensor, norm_bias: Tensor, eps: float, weights_proj: Tensor,
                   kv_cache: Tensor, slot_mapping: Tensor, cos_sin: Tensor, positions: Tensor,
                   hadamard: bool, ue8m0: bool, q_fp8: Tensor, head_weights: Tensor,
                   wq_b_scale: Tensor | None = None, wk_scale: Tensor | None = None,
                   interleaved: bool = False) -> None:
    """The two Triton launches into ``q_fp8``, ``head_weights`` and the cache (arguments
    already validated; at most ``KERNEL_TOKENS`` tokens)."""
    n = _Sizes(hidden, q_latent, wk, weights_proj)
    if n.tokens > KERNEL_TOKENS:
        raise ValueError(f"dsa.project_quantize_and_cache_k: the kernels take at most "
                         f"{KERNEL_TOKENS} tokens, got {n.tokens}")
    if n.tokens == 0:
        return
    plan = partials_plan(n.tokens, wq_b_scale is not None, wk_scale is not None)
    h_slices = triton.cdiv(n.width, plan.hidden_steps * plan.step)
    q_slices = triton.cdiv(n.q_width, plan.q_steps * plan.step)
    h_blocks = triton.cdiv(n.head_dim, COLS) + triton.cdiv(n.heads, COLS)
    q_blocks = triton.cdiv(n.heads * n.head_dim, plan.q_cols)
    f32 = {"dtype": torch.float32, "device": hidden.device}
    hpart = torch.empty(h_slices, n.tokens, n.head_dim + n.heads, **f32)
    qpart = torch.empty(q_slices, n.tokens, n.heads * n.head_dim, **f32)
    pdl, chain = pdl_enabled(hidden), chain_pdl(hidden, n.tokens <= CHAIN_ROWS, n.tokens)
    q_tma = plan.dot and _tma_operands(q_latent, wq_b, wq_b_scale)
    k_tma = plan.dot and _tma_operands(hidden, wk, wk_scale)
    p_tma = plan.dot and _tma_operands(hidden, weights_proj)
    x_desc = _tile_descriptor(hidden, plan.tokens, plan.step, k_tma or p_tma)
    wk_desc = _tile_descriptor(wk, COLS, plan.step, k_tma)
    wp_desc = _tile_descriptor(weights_proj, COLS, plan.step, p_tma)
    ql_desc = _tile_descriptor(q_latent, plan.tokens, plan.step, q_tma)
    wq_desc = _tile_descriptor(wq_b, plan.q_cols, plan.step, q_tma)
    launch(_partials_kernel,
           (h_slices * h_blocks + q_slices * q_blocks, triton.cdiv(n.tokens, plan.tokens)),
           hidden, *hidden.stride(), q_latent, *q_latent.stride(), wk, *wk.stride(),
           *_scale_args(wk_scale, wk), weights_proj, *weights_proj.stride(), wq_b,
           *wq_b.stride(), *_scale_args(wq_b_scale, wq_b), x_desc, wk_desc, wp_desc, ql_desc,
           wq_desc, hpart, qpart, n.tokens, n.width, n.q_width, D=n.head_dim, H=n.heads,
           TP=plan.tokens, COLS=COLS, Q_COLS=plan.q_cols, STEP=plan.step,
           H_STEPS=plan.hidden_steps, Q_STEPS=plan.q_steps,
           H_PROGRAMS=h_slices * h_blocks, WK_SCALED=wk_scale is not None,
           WQ_SCALED=wq_b_scale is not None,
           DOT=(2 if hidden.is_cuda else 1) if plan.dot else 0, K_TMA=k_tma, P_TMA=p_tma,
           Q_TMA=q_tma, PDL=pdl,
           num_warps=plan.warps, num_stages=plan.stages, **pdl_launch(pdl))
    values, scales = kcache_views(kv_cache)
    num_blocks, block_size = scales.shape
    block_d = triton.next_power_of_2(n.head_dim)
    rows = n.tokens * n.heads
    block_r = row_tile(rows, block_d, max_rows=PROLOGUE_ROWS)
    q_programs = triton.cdiv(rows, block_r)
    launch(_prologue_kernel, (q_programs + n.tokens,),
           hpart, qpart, n.tokens, q_programs, norm_weight, norm_bias, eps,
           q_fp8.view(torch.uint8), head_weights, slot_mapping, values.view(torch.uint8),
           scales, num_blocks * block_size, cos_sin, positions, cos_sin.shape[0] - 1,
           hadamard_scale(n.head_dim, hidden.dtype), weight_scale(n.heads, n.head_dim),
           dtype=_TL_DTYPES[hidden.dtype], H=n.heads, D=n.head_dim, BLOCK_D=block_d,
           BLOCK_R=block_r, H_SLICES=h_slices, Q_SLICES=q_slices,
           VALUE_STRIDE=values.stride(0), SCALE_STRIDE=scales.stride(0), BS=block_size,
           UE8M0=ue8m0,
           DISCARD=n.tokens >= DISCARD_Q_PARTIALS_FROM and on_nvidia_gpu(hidden),
           num_warps=tile_warps(block_r, block_d),
           # Unchained (launched without PDL, its wait a no-op), it still lets a dependent
           # start: the paged logits' early start (PagedLogitsConfig.early_tiles).
           PDL=max(chain, int(pdl)),
           **rope_constexprs(n.head_dim, cos_sin, hadamard, interleaved),
           **pdl_launch(chain > 0))


def _tma_tiles(t: Tensor) -> bool:
    """Whether TMA can copy tiles of 2-D ``t``: 16-bit or fp8 rows of unit stride at a
    16-byte aligned offset into their storage (whose base the allocator aligns) and row
    pitch, on an NVIDIA GPU of compute capability 9 or more (or the CPU, where the
    interpreter runs the kernel). Sizes only, no data pointer: the same answer for a traced
    (fake) tensor."""
    return (has_tma(t) and t.dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
            and t.stride(1) == 1 and t.storage_offset() * t.element_size() % 16 == 0
            and t.stride(0) * t.element_size() % 16 == 0)


def _tma_operands(x: Tensor, w: Tensor, w_scale: Tensor | None = None) -> bool:
    """Whether a product's activation and weight tiles both go by TMA: both copyable
    (:func:`_tma_tiles`), 16-bit activations, and a weight of their dtype or (with
    ``FP8_WEIGHTS_BY_TMA``) fp8 codes with block scales."""
    if x.dtype not in (torch.bfloat16, torch.float16) or not (_tma_tiles(x) and _tma_tiles(w)):
        return False
    return x.dtype == w.dtype if w_scale is None else FP8_WEIGHTS_BY_TMA


def _tile_descriptor(t: Tensor, rows: int, cols: int, wanted: bool) -> TensorDescriptor | None:
    """A TMA descriptor of ``[rows, cols]`` tiles of ``t`` where ``wanted``, else None."""
    return TensorDescriptor.from_tensor(t, [rows, cols]) if wanted else None


def _scale_args(scale: Tensor | None, weight: Tensor) -> tuple[Tensor, int, int]:
    """A block-scaled weight's scales and strides; without scales, the weight (never read)."""
    return (weight, 0, 0) if scale is None else (scale, *scale.stride())


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@_project_quantize_out.cuda
def _project_quantize_cuda(hidden: Tensor, q_latent: Tensor, wq_b: Tensor, wk: Tensor,
                           norm_weight: Tensor, norm_bias: Tensor, eps: float,
                           weights_proj: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                           cos_sin: Tensor, positions: Tensor, hadamard: bool = True,
                           ue8m0: bool = False, wq_b_scale: Tensor | None = None,
                           wk_scale: Tensor | None = None, interleaved: bool = False
                           ) -> tuple[Tensor, Tensor]:
    args = (hidden, q_latent, wq_b, wk, norm_weight, norm_bias, eps, weights_proj)
    rotation = (cos_sin, positions, hadamard, ue8m0)
    scales = (wq_b_scale, wk_scale)
    outputs = _project_quantize_out(*args, kv_cache, slot_mapping, *rotation, *scales,
                                    interleaved)
    if hidden.shape[0] <= KERNEL_TOKENS:
        project_triton(*args, kv_cache, slot_mapping, *rotation, *outputs, *scales,
                       interleaved=interleaved)
        return outputs
    q, k, weights = project_torch(*args, *scales)
    k_prologue_triton(k, kv_cache, slot_mapping, *rotation, interleaved=interleaved)
    q_prologue_triton(q, weights, *rotation, *outputs, interleaved=interleaved)
    return outputs
