"""The indexer's q/k prologue in one pass each (design §2, "Prologue"): RoPE, the Hadamard
rotation and fp8 quantisation after the projections, one launch for q, one for k.

- ``dsa::rope_hadamard_quantize_q(q, weights, cos_sin, positions, hadamard, ue8m0,
  interleaved)``: ``quantize_q`` of the rotated q, ``(q_fp8 [T, H, D], head_weights [T, H])``.
- ``dsa::rope_hadamard_quantize_and_cache_k(k, kv_cache, slot_mapping, cos_sin, positions,
  hadamard, ue8m0, interleaved)``: ``quantize_and_cache_k`` of the rotated k (mutates
  ``kv_cache``).

``cos_sin`` is the fp32 RoPE table ``[max_len, rope_dim]`` (cos, then sin; design §10),
indexed by ``positions`` clamped into it; RoPE rotates NeoX halves (dim ``i`` with ``i +
rope_dim / 2``, DeepSeek), or with ``interleaved`` pairs (``2i`` with ``2i + 1``, GLM-5), at
frequency ``i``. Each row is rounded to the input's dtype after RoPE and after the Hadamard
rotation, as the unfused path does; the rotation is a fast Walsh-Hadamard transform
(butterflies ``(a + b, a - b)`` of stride 1, 2, ..., D/2, in fp32) times the dtype's rounding
of ``D**-0.5``, in that order on every face.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsa.ops._checks import POSITION_DTYPES, check_size, check_tensor
from dsa.ops._launch import launch, row_tile, tile_warps
from dsa.ops._registry import dsa_op
from dsa.ops.kcache import (
    check_k_write,
    launch_k_rows,
    load_slots,
    store_k_rows,
    write_k_rows,
)
from dsa.ops.quant import (
    check_q,
    empty_q_outputs,
    load_head_weights,
    quantize_heads_into,
    round_to,
    store_q_rows,
    weight_scale,
)
from dsa.rope import interleaved_rope, neox_rope

# Triton contracts a * b - c * d into an fma; the torch face rounds every product.
_NO_FMA = {"enable_fp_fusion": False}


def check_rope(op: str, x: Tensor, cos_sin: Tensor, positions: Tensor, hadamard: bool) -> None:
    """The RoPE table and positions of ``x`` (``[T, ..., D]``); a power-of-two D for the
    Hadamard rotation."""
    check_rotation(op, cos_sin, positions, hadamard, head_dim=x.shape[-1], like=x,
                   tokens=(x.shape[0], "num_tokens = x.shape[0]"))


def check_rotation(op: str, cos_sin: Tensor, positions: Tensor, hadamard: bool, *,
                   head_dim: int, like: Tensor, tokens: tuple[int, str]) -> None:
    """:func:`check_rope` for rows of ``head_dim`` on ``like``'s device; ``tokens``: how many
    positions there must be, and what that count is."""
    check_tensor(op, "cos_sin", cos_sin, dtype=torch.float32, ndim=2, contiguous=True,
                 like=like)
    rope_dim = cos_sin.shape[1]
    if cos_sin.shape[0] < 1 or not 0 < rope_dim <= head_dim or rope_dim % 2:
        raise ValueError(f"dsa.{op}: `cos_sin` must be [max_len >= 1, rope_dim] with rope_dim "
                         f"even and in (0, head_dim={head_dim}], got shape "
                         f"{tuple(cos_sin.shape)}")
    check_tensor(op, "positions", positions, dtype=POSITION_DTYPES, ndim=1, contiguous=True,
                 like=like)
    check_size(op, "positions", positions, 0, *tokens)
    if hadamard and head_dim & (head_dim - 1):
        raise ValueError(f"dsa.{op}: the Hadamard rotation needs a power-of-two head_dim, got "
                         f"{head_dim}")


@functools.cache
def hadamard_scale(head_dim: int, dtype: torch.dtype) -> float:
    """``head_dim**-0.5`` rounded to ``dtype``: the entries of the orthonormal Hadamard
    matrix in the layer's dtype."""
    return torch.tensor(head_dim**-0.5, dtype=torch.float64).to(dtype).item()


def fwht(x: Tensor) -> Tensor:
    """Unnormalised Walsh-Hadamard transform of the last dim (a power of two) in fp32:
    ``x @ H`` with H the ±1 Sylvester matrix, butterflies of stride 1, 2, 4, ..."""
    shape, dim = x.shape, x.shape[-1]
    stride = 1
    while stride < dim:
        pairs = x.reshape(*shape[:-1], dim // (2 * stride), 2, stride)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(shape)
        stride *= 2
    return x


def rope_hadamard(x: Tensor, cos_sin: Tensor, positions: Tensor, hadamard: bool,
                  interleaved: bool = False) -> Tensor:
    """Torch face of the rotation: ``x`` ``[T, D]`` or ``[T, H, D]`` after RoPE (NeoX halves,
    or interleaved pairs) and the Hadamard rotation, in ``x``'s dtype, rounded as the module
    docstring says."""
    cs = cos_sin[positions.long().clamp(0, cos_sin.shape[0] - 1)]
    rope = interleaved_rope if interleaved else neox_rope
    x = rope(x, cs.view(cs.shape[0], *[1] * (x.ndim - 2), cs.shape[1]), cos_sin.shape[1])
    if hadamard:
        x = (fwht(x.float()) * hadamard_scale(x.shape[-1], x.dtype)).to(x.dtype)
    return x


@triton.jit
def _fwht_rows(x, BLOCK_R: tl.constexpr, D: tl.constexpr, LOG2_D: tl.constexpr):
    """``fwht`` of each row of the fp32 tile ``x`` ``[BLOCK_R, D]``, in the same order."""
    for s in tl.static_range(LOG2_D):  # stride 1 << s
        pairs = tl.permute(tl.reshape(x, (BLOCK_R, D >> (s + 1), 2, 1 << s)), (0, 1, 3, 2))
        a, b = tl.split(pairs)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (BLOCK_R, D))
    return x


@triton.jit
def rope_partner(BLOCK_D: tl.constexpr, ROPE_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """(columns ``d``, the column each rotates with: ``d ± ROPE_DIM / 2``, or ``d ^ 1``
    INTERLEAVED; whether ``d`` is rotated)."""
    HALF: tl.constexpr = ROPE_DIM // 2
    d = tl.arange(0, BLOCK_D)
    partner = d ^ 1 if INTERLEAVED else tl.where(d < HALF, d + HALF, d - HALF)
    return d, partner, d < ROPE_DIM


@triton.jit
def rope_hadamard_tile(x, other, row_ok, pos, cs_ptr, c, dtype: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ROPE_DIM: tl.constexpr,
                       INTERLEAVED: tl.constexpr, HADAMARD: tl.constexpr,
                       LOG2_D: tl.constexpr):
    """fp32 rows ``x`` ``[BLOCK_R, BLOCK_D]`` (values of ``dtype``; ``other``: each rotated
    column's partner, :func:`rope_partner`) after RoPE at ``pos`` and the Hadamard rotation,
    rounded to ``dtype`` after each."""
    HALF: tl.constexpr = ROPE_DIM // 2
    d, _, in_rope = rope_partner(BLOCK_D, ROPE_DIM, INTERLEAVED)
    if INTERLEAVED:  # the pair's first column, and its frequency
        first = d % 2 == 0
        freq = d // 2
    else:
        first = d < HALF
        freq = d % HALF
    rope_mask = row_ok[:, None] & in_rope[None, :]
    cs = cs_ptr + pos[:, None] * ROPE_DIM + freq[None, :]
    cos = tl.load(cs, mask=rope_mask, other=0.0)
    sin = tl.load(cs + HALF, mask=rope_mask, other=0.0)
    rotated = tl.where(first[None, :], x * cos - other * sin, x * cos + other * sin)
    x = tl.where(in_rope[None, :], round_to(rotated, dtype), x)
    if HADAMARD:
        x = round_to(_fwht_rows(x, BLOCK_R, BLOCK_D, LOG2_D) * c, dtype)
    return x


@triton.jit
def _rope_hadamard_rows(x_ptr, row_offs, col_stride, row_ok, pos, cs_ptr, c,
                        BLOCK_R: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                        ROPE_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
                        HADAMARD: tl.constexpr, LOG2_D: tl.constexpr):
    """Rows ``row_offs`` of ``x_ptr`` after RoPE at ``pos`` and the Hadamard rotation, as
    fp32 values of ``x_ptr``'s dtype; zero past ``D`` and where not ``row_ok``."""
    d, partner, in_rope = rope_partner(BLOCK_D, ROPE_DIM, INTERLEAVED)
    base = x_ptr + row_offs[:, None]
    x = tl.load(base + d[None, :] * col_stride, mask=row_ok[:, None] & (d < D)[None, :],
                other=0.0).to(tl.float32)
    other = tl.load(base + partner[None, :] * col_stride,
                    mask=row_ok[:, None] & in_rope[None, :], other=0.0).to(tl.float32)
    return rope_hadamard_tile(x, other, row_ok, pos, cs_ptr, c, x_ptr.dtype.element_ty,
                              BLOCK_R, BLOCK_D, ROPE_DIM, INTERLEAVED, HADAMARD, LOG2_D)


@triton.jit
def load_positions(pos_ptr, tok, ok, max_pos):
    pos = tl.load(pos_ptr + tok, mask=ok, other=0).to(tl.int64)
    return tl.minimum(tl.maximum(pos, 0), max_pos)


def rope_constexprs(head_dim: int, cos_sin: Tensor, hadamard: bool, interleaved: bool
                    ) -> dict:
    """Constexprs of :func:`rope_hadamard_tile` (D is a power of two with the Hadamard) and
    the compile option every face's rounding needs."""
    log2_d = head_dim.bit_length() - 1 if hadamard else 0
    return {"ROPE_DIM": cos_sin.shape[1], "INTERLEAVED": interleaved, "HADAMARD": hadamard,
            "LOG2_D": log2_d, **_NO_FMA}


# --- rope_hadamard_quantize_q ----------------------------------------------------------------


@dsa_op("rope_hadamard_quantize_q")
def _rope_hadamard_quantize_q_out(q: Tensor, weights: Tensor, cos_sin: Tensor,
                                  positions: Tensor, hadamard: bool = True,
                                  ue8m0: bool = False, interleaved: bool = False
                                  ) -> tuple[Tensor, Tensor]:
    op = "rope_hadamard_quantize_q"
    check_q(op, q, weights)
    check_rope(op, q, cos_sin, positions, hadamard)
    return empty_q_outputs(q)


@_rope_hadamard_quantize_q_out.cpu
def _rope_hadamard_quantize_q_cpu(q: Tensor, weights: Tensor, cos_sin: Tensor,
                                  positions: Tensor, hadamard: bool = True,
                                  ue8m0: bool = False, interleaved: bool = False
                                  ) -> tuple[Tensor, Tensor]:
    outputs = _rope_hadamard_quantize_q_out(q, weights, cos_sin, positions, hadamard, ue8m0,
                                            interleaved)
    rotated = rope_hadamard(q, cos_sin, positions, hadamard, interleaved)
    return quantize_heads_into(*outputs, rotated, weights, ue8m0)


@triton.jit
def _q_prologue_kernel(q_ptr, w_ptr, w_stride0, w_stride1, cs_ptr, pos_ptr, max_pos, out_ptr,
                       hw_ptr, num_rows, c, w_scale, H: tl.constexpr, D: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, ROPE_DIM: tl.constexpr,
                       INTERLEAVED: tl.constexpr, HADAMARD: tl.constexpr,
                       LOG2_D: tl.constexpr, UE8M0: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    pos = load_positions(pos_ptr, rows // H, row_ok, max_pos)
    x = _rope_hadamard_rows(q_ptr, rows.to(tl.int64) * D, 1, row_ok, pos, cs_ptr, c,
                            BLOCK_R=BLOCK_R, D=D, BLOCK_D=BLOCK_D, ROPE_DIM=ROPE_DIM,
                            INTERLEAVED=INTERLEAVED, HADAMARD=HADAMARD, LOG2_D=LOG2_D)
    w = load_head_weights(w_ptr, w_stride0, w_stride1, rows, num_rows, H)
    store_q_rows(x, w, rows, num_rows, out_ptr, hw_ptr, w_scale, D=D, BLOCK_D=BLOCK_D,
                 UE8M0=UE8M0)


# Rows (q) and tokens (k) a program of the two kernels takes, at most: the rotation's
# butterflies exchange values across a program's threads, cheaper within one warp. H200
# (c3355e6, one kernel after a 256 MB flush): q at 512 / 4096 tokens of 64 heads 15.8 /
# 106.7 us in programs of 4 rows (one warp) against 21.7 / 148.8 with row_tile's 16 rows in
# 4 warps; k at 512 / 4096 tokens 3.3 / 4.6 us in programs of 2 tokens against 4.0 / 6.3
# with 4 / 16. Outputs are the same bytes either way.
Q_ROWS, K_TOKENS = 4, 2


def q_prologue_triton(q: Tensor, weights: Tensor, cos_sin: Tensor, positions: Tensor,
                      hadamard: bool, ue8m0: bool, q_fp8: Tensor, head_weights: Tensor,
                      block_r: int | None = None, num_warps: int | None = None,
                      interleaved: bool = False) -> None:
    """The q kernel into given outputs, ``block_r`` (token, head) rows a program (default:
    ``row_tile``'s, at most Q_ROWS; the rotation holds four tiles of the rows) in
    ``num_warps`` warps (default: ``tile_warps``)."""
    num_tokens, num_heads, head_dim = q.shape
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_r = block_r or row_tile(num_rows, block_d, max_rows=Q_ROWS)
    launch(_q_prologue_kernel, (triton.cdiv(num_rows, block_r),),
           q, weights, weights.stride(0), weights.stride(1), cos_sin, positions,
           cos_sin.shape[0] - 1, q_fp8.view(torch.uint8), head_weights, num_rows,
           hadamard_scale(head_dim, q.dtype), weight_scale(num_heads, head_dim), H=num_heads,
           D=head_dim, BLOCK_D=block_d, BLOCK_R=block_r, UE8M0=ue8m0,
           num_warps=num_warps or tile_warps(block_r, block_d),
           **rope_constexprs(head_dim, cos_sin, hadamard, interleaved))


@_rope_hadamard_quantize_q_out.cuda
def _rope_hadamard_quantize_q_cuda(q: Tensor, weights: Tensor, cos_sin: Tensor,
                                   positions: Tensor, hadamard: bool = True,
                                   ue8m0: bool = False, interleaved: bool = False
                                   ) -> tuple[Tensor, Tensor]:
    outputs = _rope_hadamard_quantize_q_out(q, weights, cos_sin, positions, hadamard, ue8m0,
                                            interleaved)
    q_prologue_triton(q, weights, cos_sin, positions, hadamard, ue8m0, *outputs,
                      interleaved=interleaved)
    return outputs


# --- rope_hadamard_quantize_and_cache_k ------------------------------------------------------


@dsa_op("rope_hadamard_quantize_and_cache_k", mutates_args=("kv_cache",))
def _check_k_prologue(k: Tensor, kv_cache: Tensor, slot_mapping: Tensor, cos_sin: Tensor,
                      positions: Tensor, hadamard: bool = True, ue8m0: bool = False,
                      interleaved: bool = False) -> None:
    op = "rope_hadamard_quantize_and_cache_k"
    check_k_write(op, k, kv_cache, slot_mapping, ue8m0)
    check_rope(op, k, cos_sin, positions, hadamard)


@_check_k_prologue.cpu
def _rope_hadamard_quantize_and_cache_k_cpu(k: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                                            cos_sin: Tensor, positions: Tensor,
                                            hadamard: bool = True, ue8m0: bool = False,
                                            interleaved: bool = False) -> None:
    _check_k_prologue(k, kv_cache, slot_mapping, cos_sin, positions, hadamard, ue8m0,
                      interleaved)
    write_k_rows(rope_hadamard(k, cos_sin, positions, hadamard, interleaved), kv_cache,
                 slot_mapping, ue8m0)


@triton.jit
def _k_prologue_kernel(k_ptr, k_stride0, k_stride1, slot_ptr, value_ptr, scale_ptr, num_tokens,
                       num_slots, cs_ptr, pos_ptr, max_pos, c, VALUE_STRIDE: tl.constexpr,
                       SCALE_STRIDE: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, ROPE_DIM: tl.constexpr,
                       INTERLEAVED: tl.constexpr, HADAMARD: tl.constexpr,
                       LOG2_D: tl.constexpr, UE8M0: tl.constexpr):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot, ok = load_slots(slot_ptr, tok, num_tokens, num_slots)
    pos = load_positions(pos_ptr, tok, ok, max_pos)
    x = _rope_hadamard_rows(k_ptr, tok.to(tl.int64) * k_stride0, k_stride1, ok, pos, cs_ptr, c,
                            BLOCK_R=BLOCK_T, D=D, BLOCK_D=BLOCK_D, ROPE_DIM=ROPE_DIM,
                            INTERLEAVED=INTERLEAVED, HADAMARD=HADAMARD, LOG2_D=LOG2_D)
    store_k_rows(x, slot, ok, value_ptr, scale_ptr, VALUE_STRIDE=VALUE_STRIDE,
                 SCALE_STRIDE=SCALE_STRIDE, BS=BS, D=D, BLOCK_D=BLOCK_D, UE8M0=UE8M0)


def k_prologue_triton(k: Tensor, kv_cache: Tensor, slot_mapping: Tensor, cos_sin: Tensor,
                      positions: Tensor, hadamard: bool, ue8m0: bool,
                      block_t: int | None = None, num_warps: int | None = None,
                      interleaved: bool = False) -> None:
    """The k kernel, ``block_t`` tokens a program (default: ``row_tile``'s, at most
    K_TOKENS) in ``num_warps`` warps (default: ``tile_warps``)."""
    launch_k_rows(_k_prologue_kernel, k, kv_cache, slot_mapping, cos_sin, positions,
                  cos_sin.shape[0] - 1, hadamard_scale(k.shape[1], k.dtype), block_t=block_t,
                  num_warps=num_warps, max_block_t=K_TOKENS, UE8M0=ue8m0,
                  **rope_constexprs(k.shape[1], cos_sin, hadamard, interleaved))


@_check_k_prologue.cuda
def _rope_hadamard_quantize_and_cache_k_cuda(k: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                                             cos_sin: Tensor, positions: Tensor,
                                             hadamard: bool = True, ue8m0: bool = False,
                                             interleaved: bool = False) -> None:
    _check_k_prologue(k, kv_cache, slot_mapping, cos_sin, positions, hadamard, ue8m0,
                      interleaved)
    k_prologue_triton(k, kv_cache, slot_mapping, cos_sin, positions, hadamard, ue8m0,
                      interleaved=interleaved)
