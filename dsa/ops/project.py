"""The indexer's k and head-weight projections of the hidden state in one op (design §2,
"Projections").

``dsa::project_k_and_weights(hidden, wk, norm_weight, norm_bias, eps, weights_proj)`` →
``(k [T, D], weights [T, H])``, what the layer's ``wk``, ``k_norm`` and ``weights_proj``
compute::

    k = LayerNorm(round_τ(hidden @ wk.T)) rounded to τ    (τ = hidden's dtype, LayerNorm in fp32)
    weights = hidden.float() @ weights_proj.float().T

A decode step multiplies a few tokens by two weight matrices of a few MB each. On CUDA, up to
``SMALL_TOKENS`` tokens take two Triton launches: fp32 partial sums of both products over
slices of the hidden dim, then one program per token that adds them up, rounds k to τ and
normalises it. That replaces two GEMMs, their split-K reductions, the input cast and the
LayerNorm. More tokens, and the CPU, take the torch ops; ``dsa.Indexer`` calls those itself
above ``SMALL_TOKENS`` tokens, so torch.compile fuses them with their neighbours. The sums
run in fp32, in another order than a GEMM's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from dsa.ops._checks import check_size, check_tensor
from dsa.ops._launch import launch
from dsa.ops._registry import dsa_op
from dsa.ops.quant import FLOAT_DTYPES, round_to

# Tokens up to which the CUDA face runs its own kernels (a decode step of one to four
# tokens: one request, or a few, with next_n up to 4); more take the torch ops (GEMMs).
# H200 (BENCHMARKS.md, "Indexer projections"): at one token 6.0 us against 14.1 for the
# compiled torch ops; at 16 tokens a tile of them (one fp32 MMA) was slower than the GEMMs.
SMALL_TOKENS = 4
# Columns of one weight matrix and hidden-dim elements a partial-sums program multiplies per
# step; SLICE_STEPS steps make one program's slice of the hidden dim.
COLS, STEP, SLICE_STEPS = 32, 128, 2


@dsa_op("project_k_and_weights")
def _project_k_and_weights_out(hidden: Tensor, wk: Tensor, norm_weight: Tensor,
                               norm_bias: Tensor, eps: float, weights_proj: Tensor
                               ) -> tuple[Tensor, Tensor]:
    op = "project_k_and_weights"
    check_tensor(op, "hidden", hidden, dtype=FLOAT_DTYPES, ndim=2)
    width = hidden.shape[1]
    check_tensor(op, "wk", wk, dtype=hidden.dtype, ndim=2, like=hidden)
    check_size(op, "wk", wk, 1, width, "hidden_size = hidden.shape[1]")
    head_dim = wk.shape[0]
    if width < 1 or head_dim < 1:
        raise ValueError(f"dsa.{op}: `wk` must be [head_dim >= 1, hidden_size >= 1], got shape "
                         f"{tuple(wk.shape)}")
    for name, x in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
        check_tensor(op, name, x, dtype=torch.float32, ndim=1, like=hidden)
        check_size(op, name, x, 0, head_dim, "head_dim = wk.shape[0]")
    if not isinstance(eps, float) or not eps > 0:
        raise ValueError(f"dsa.{op}: `eps` must be a positive float, got {eps!r}")
    check_tensor(op, "weights_proj", weights_proj, dtype=FLOAT_DTYPES, ndim=2, like=hidden)
    check_size(op, "weights_proj", weights_proj, 1, width, "hidden_size = hidden.shape[1]")
    tokens, heads = hidden.shape[0], weights_proj.shape[0]
    return (hidden.new_empty(tokens, head_dim),
            hidden.new_empty(tokens, heads, dtype=torch.float32))


@_project_k_and_weights_out.cpu
def _project_torch(hidden: Tensor, wk: Tensor, norm_weight: Tensor, norm_bias: Tensor,
                   eps: float, weights_proj: Tensor) -> tuple[Tensor, Tensor]:
    """The layer's torch ops: the CPU face, and the CUDA face above ``SMALL_TOKENS``."""
    args = (hidden, wk, norm_weight, norm_bias, eps, weights_proj)
    k, weights = _project_k_and_weights_out(*args)
    k_linear = F.linear(hidden, wk).float()
    k.copy_(F.layer_norm(k_linear, (k.shape[1],), norm_weight, norm_bias, eps))
    return k, weights.copy_(F.linear(hidden.float(), weights_proj.float()))


@triton.jit
def _slice_products(x_ptr, x_s0, x_s1, w_rows, w_s1, rows_ok, tokens, width, lo,
                    TP: tl.constexpr, COLS: tl.constexpr, STEP: tl.constexpr,
                    SLICE_STEPS: tl.constexpr):
    """fp32 ``[TP, COLS]`` sums over hidden-dim elements ``lo .. lo + SLICE_STEPS * STEP`` of
    ``x[t, :] * w[c, :]`` (``w_rows``: the ``COLS`` row pointers; masked rows count 0), one
    token at a time."""
    t = tl.arange(0, TP)
    acc = tl.zeros([TP, COLS], tl.float32)
    for step in tl.static_range(SLICE_STEPS):
        e = lo + step * STEP + tl.arange(0, STEP)
        w = tl.load(w_rows[:, None] + e[None, :].to(tl.int64) * w_s1,
                    mask=rows_ok[:, None] & (e < width)[None, :], other=0.0).to(tl.float32)
        x_row = x_ptr  # advanced by a stride (a plain int where Triton specialises it to 1)
        for j in tl.static_range(TP):
            x = tl.load(x_row + e.to(tl.int64) * x_s1,
                        mask=(e < width) & (e * 0 + j < tokens), other=0.0).to(tl.float32)
            acc += tl.where(t[:, None] == j, tl.sum(w * x[None, :], axis=1)[None, :], 0.0)
            x_row += x_s0
    return acc


@triton.jit
def _partials_kernel(x_ptr, x_s0, x_s1, wk_ptr, wk_s0, wk_s1, wp_ptr, wp_s0, wp_s1, part_ptr,
                     tokens, width, D: tl.constexpr, H: tl.constexpr, TP: tl.constexpr,
                     COLS: tl.constexpr, STEP: tl.constexpr, SLICE_STEPS: tl.constexpr):
    """Program (slice s, column block): ``part[s, t, c]`` for the block's ``COLS`` columns c
    of ``[wk; weights_proj]`` (k's D, then the H head weights) and every token t."""
    s = tl.program_id(0)
    block = tl.program_id(1)
    lo = s * (SLICE_STEPS * STEP)
    c = tl.arange(0, COLS)
    k_blocks: tl.constexpr = (D + COLS - 1) // COLS
    if block < k_blocks:
        rows = block * COLS + c
        acc = _slice_products(x_ptr, x_s0, x_s1, wk_ptr + rows.to(tl.int64) * wk_s0, wk_s1,
                              rows < D, tokens, width, lo, TP, COLS, STEP, SLICE_STEPS)
        col, col_ok = rows, rows < D
    else:
        rows = (block - k_blocks) * COLS + c
        acc = _slice_products(x_ptr, x_s0, x_s1, wp_ptr + rows.to(tl.int64) * wp_s0, wp_s1,
                              rows < H, tokens, width, lo, TP, COLS, STEP, SLICE_STEPS)
        col, col_ok = D + rows, rows < H
    t = tl.arange(0, TP)
    out = part_ptr + (s * tokens + t[:, None]).to(tl.int64) * (D + H) + col[None, :]
    tl.store(out, acc, mask=(t < tokens)[:, None] & col_ok[None, :])


@triton.jit
def _finish_kernel(part_ptr, slices, tokens, k_ptr, k_s0, k_s1, w_ptr, w_s0, w_s1, nw_ptr,
                   nb_ptr, eps, D: tl.constexpr, H: tl.constexpr, DP: tl.constexpr,
                   HP: tl.constexpr, SP: tl.constexpr):
    """Program per token: its partial sums added up over the slices; k rounded to the
    output's dtype, then LayerNorm in fp32 (mean, then the mean square deviation)."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SP)
    row = part_ptr + (s[:, None].to(tl.int64) * tokens + t) * (D + H)
    c = tl.arange(0, DP)
    k = tl.sum(tl.load(row + c[None, :], mask=(s < slices)[:, None] & (c < D)[None, :],
                       other=0.0), axis=0)
    k = round_to(k, k_ptr.dtype.element_ty)
    mean = tl.sum(k, axis=0) / D
    diff = tl.where(c < D, k - mean, 0.0)
    rstd = tl.math.rsqrt(tl.sum(diff * diff, axis=0) / D + eps)
    y = diff * rstd * tl.load(nw_ptr + c, mask=c < D, other=0.0) + tl.load(nb_ptr + c, mask=c < D,
                                                                           other=0.0)
    tl.store(k_ptr + t * k_s0 + c * k_s1, round_to(y, k_ptr.dtype.element_ty), mask=c < D)
    h = tl.arange(0, HP)
    w = tl.sum(tl.load(row + D + h[None, :], mask=(s < slices)[:, None] & (h < H)[None, :],
                       other=0.0), axis=0)
    tl.store(w_ptr + t * w_s0 + h * w_s1, w, mask=h < H)


def project_triton(hidden: Tensor, wk: Tensor, norm_weight: Tensor, norm_bias: Tensor,
                   eps: float, weights_proj: Tensor, k: Tensor, weights: Tensor) -> None:
    """The two Triton launches into ``k`` and ``weights`` (arguments already validated; at
    most ``SMALL_TOKENS`` tokens)."""
    tokens, width = hidden.shape
    if tokens > SMALL_TOKENS:
        raise ValueError(f"dsa.project_k_and_weights: the kernels take at most {SMALL_TOKENS} "
                         f"tokens, got {tokens}")
    if tokens == 0:
        return
    head_dim, heads = wk.shape[0], weights_proj.shape[0]
    slices = triton.cdiv(width, SLICE_STEPS * STEP)
    blocks = triton.cdiv(head_dim, COLS) + triton.cdiv(heads, COLS)
    part = torch.empty(slices, tokens, head_dim + heads, dtype=torch.float32,
                       device=hidden.device)
    launch(_partials_kernel, (slices, blocks), hidden, *hidden.stride(), wk, *wk.stride(),
           weights_proj, *weights_proj.stride(), part, tokens, width, D=head_dim, H=heads,
           TP=triton.next_power_of_2(tokens), COLS=COLS, STEP=STEP, SLICE_STEPS=SLICE_STEPS,
           num_warps=4)
    launch(_finish_kernel, (tokens,), part, slices, tokens, k, *k.stride(), weights,
           *weights.stride(), norm_weight, norm_bias, eps, D=head_dim, H=heads,
           DP=triton.next_power_of_2(head_dim), HP=triton.next_power_of_2(heads),
           SP=triton.next_power_of_2(slices), num_warps=4)


@_project_k_and_weights_out.triton
def _project_k_and_weights_cuda(hidden: Tensor, wk: Tensor, norm_weight: Tensor,
                                norm_bias: Tensor, eps: float, weights_proj: Tensor
                                ) -> tuple[Tensor, Tensor]:
    args = (hidden, wk, norm_weight, norm_bias, eps, weights_proj)
    if hidden.shape[0] > SMALL_TOKENS:
        return _project_torch(*args)
    k, weights = _project_k_and_weights_out(*args)
    project_triton(*args, k, weights)
    return k, weights
