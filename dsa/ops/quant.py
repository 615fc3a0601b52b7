"""fp8 e4m3 quantisation of the indexer's q and k (design §2-§3), and ``dsa::quantize_q``.

One row (a token's k, or one head of a token's q) shares one fp32 scale::

    x     = nan_to_num(x)                    (NaN -> 0, ±inf -> ±fp32 max)
    amax  = max(max|x|, 1e-4)
    scale = amax / 448                       (IEEE division; ue8m0: rounded up to 2**n)
    x_fp8 = fp8_e4m3(x / scale)              (round to nearest even, saturating at ±448)

Non-finite inputs therefore behave the same on every face: NaN quantises to 0, and an
infinity dominates its row like the largest finite value would (it becomes ±448, the
row's finite values round towards 0); scales stay finite.

The Triton helpers divide with correct rounding and round to nearest even, so GPU,
interpreter and torch agree byte for byte: compiled for an NVIDIA GPU of compute capability
9 or more, by the conversion instructions (fp32 to bf16, and to fp8 e4m3 saturating, in one
rounding each); interpreted, by integer arithmetic on the bits (the interpreter's casts
truncate).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton import knobs

from dsa.ops._checks import check_heads, check_size, check_tensor
from dsa.ops._launch import launch
from dsa.ops._registry import dsa_op

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
_FP8_MAX, _AMAX_FLOOR = tl.constexpr(FP8_MAX), tl.constexpr(AMAX_FLOOR)  # in the kernels
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --- torch ---------------------------------------------------------------------------------


def _pow2_ceil(x: Tensor) -> Tensor:
    """Smallest power of two >= x, for positive normal fp32 x (exact, on the bits)."""
    bits = x.view(torch.int32)
    exponent = bits & 0x7F800000
    exponent = torch.where((bits & 0x7FFFFF) != 0, exponent + 0x800000, exponent)
    return exponent.view(torch.float32)


def fp8_scales(amax: Tensor, ue8m0: bool) -> Tensor:
    """fp32 scales from fp32 row maxima of |x|.

    The divisor is a tensor, not a Python number: on CUDA, torch turns division by a scalar
    into a multiplication by its reciprocal, which is not correctly rounded.
    """
    scale = amax.clamp(min=AMAX_FLOOR) / torch.full_like(amax, FP8_MAX)
    return _pow2_ceil(scale) if ue8m0 else scale


def quantize_rows(x: Tensor, ue8m0: bool) -> tuple[Tensor, Tensor]:
    """Quantises ``x`` along its last dimension: (fp8 values, fp32 scales ``x.shape[:-1]``)."""
    xf = torch.nan_to_num(x.float(), nan=0.0)
    scale = fp8_scales(xf.abs().amax(dim=-1), ue8m0)
    values = (xf / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values, scale


# --- Triton helpers (shared with the K-cache write) ----------------------------------------


# Kernels compiled for an NVIDIA GPU of compute capability 9 or more (``not _INTERPRETED and
# tl.target_info.cuda_capability_geq(9)``) round fp32 to bf16 and to fp8 e4m3 (saturating) to
# nearest even in one conversion instruction; below 9 Triton reaches fp8 through fp16 (two
# roundings), and the interpreter's casts truncate (TRITON_INTERPRET=1 at import): there the
# helpers round on the bits. A constexpr global, not a function, so that Inductor's copy of a
# kernel's source (a traced triton_op) carries it.
_INTERPRETED = tl.constexpr(knobs.runtime.interpret)


@triton.jit
def nan_to_num(x):
    """fp32 ``x`` with NaN -> 0 and ±inf -> ±fp32 max (``torch.nan_to_num``'s defaults)."""
    x = tl.where(x == x, x, 0.0)
    return tl.minimum(tl.maximum(x, -3.4028234663852886e38), 3.4028234663852886e38)


@triton.jit
def fp8_scale_of(amax, UE8M0: tl.constexpr):
    """fp32 scale of rows with fp32 maxima ``amax`` (see the module docstring)."""
    scale = tl.div_rn(tl.maximum(amax, _AMAX_FLOOR), _FP8_MAX)
    if UE8M0:
        bits = scale.to(tl.int32, bitcast=True)
        exponent = bits & 0x7F800000
        exponent = tl.where((bits & 0x7FFFFF) != 0, exponent + 0x800000, exponent)
        scale = exponent.to(tl.float32, bitcast=True)
    return scale


@triton.jit
def scaled_down(x, scale, UE8M0: tl.constexpr):
    """fp32 ``x / scale[:, None]``, correctly rounded: by the exact reciprocal of a ue8m0
    scale (a power of two), one multiplication an element; else an IEEE division each."""
    if UE8M0:
        return x * tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None]
    return tl.div_rn(x, scale[:, None])


@triton.jit
def fp8_e4m3_bits(x):
    """uint8 e4m3fn codes of finite fp32 ``x``: round to nearest even, saturate at ±448."""
    if not _INTERPRETED and tl.target_info.cuda_capability_geq(9):
        return x.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    a = tl.minimum(tl.abs(x), _FP8_MAX)
    # Normal range (a >= 2**-6): round the fp32 mantissa to 3 bits (ties to even; a carry
    # moves into the exponent), then rebias the exponent from 127 to 7.
    bits = a.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20
    normal = rounded - (120 << 3)
    # Subnormal range: multiples of 2**-9, ties to even (a code of 8 is the smallest normal).
    t = a * 512.0
    n = tl.floor(t)
    frac = t - n
    odd = (n.to(tl.int32) & 1) == 1
    subnormal = n.to(tl.int32) + ((frac > 0.5) | ((frac == 0.5) & odd)).to(tl.int32)
    code = tl.where(a < 0.015625, subnormal, normal)
    sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
    return (code | (sign << 7)).to(tl.uint8)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (nearest even) and back to fp32."""
    if dtype == tl.bfloat16 and not _INTERPRETED and tl.target_info.cuda_capability_geq(9):
        x = x.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
    elif dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        x = tl.where(x == x, rounded, x)
    elif dtype != tl.float32:
        x = x.to(dtype).to(tl.float32)
    return x


# --- quantize_q ----------------------------------------------------------------------------


def check_q(op: str, q: Tensor, weights: Tensor) -> None:
    """q ``[T, H, D]`` contiguous and its head weights ``[T, H]``, float dtypes."""
    check_tensor(op, "q", q, dtype=FLOAT_DTYPES, ndim=3, contiguous=True)
    check_tensor(op, "weights", weights, dtype=FLOAT_DTYPES, ndim=2, like=q)
    num_tokens, num_heads, head_dim = q.shape
    check_heads(op, "q", q, 1)
    check_size(op, "weights", weights, 0, num_tokens, "num_tokens = q.shape[0]")
    check_size(op, "weights", weights, 1, num_heads, "num_heads = q.shape[1]")
    if head_dim < 1:
        raise ValueError(f"dsa.{op}: `q` must have head_dim >= 1, got shape {tuple(q.shape)}")


def empty_q_outputs(q: Tensor) -> tuple[Tensor, Tensor]:
    """(fp8 q like ``q``, fp32 head weights ``[T, H]``), uninitialised."""
    q_fp8 = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device)
    head_weights = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    return q_fp8, head_weights


@dsa_op("quantize_q")
def _quantize_q_out(q: Tensor, weights: Tensor, ue8m0: bool = False) -> tuple[Tensor, Tensor]:
    check_q("quantize_q", q, weights)
    return empty_q_outputs(q)


def weight_scale(num_heads: int, head_dim: int) -> float:
    """The constant folded into the head weights with the q scale (design §3)."""
    return num_heads**-0.5 * head_dim**-0.5


def quantize_heads_into(q_fp8: Tensor, head_weights: Tensor, q: Tensor, weights: Tensor,
                        ue8m0: bool) -> tuple[Tensor, Tensor]:
    """Torch face of the q quantisation: writes ``q``'s codes and its head weights (design
    §3) into the outputs and returns them."""
    values, scale = quantize_rows(q, ue8m0)
    q_fp8.copy_(values)
    head_weights.copy_(weights.float() * weight_scale(*q.shape[1:]) * scale)
    return q_fp8, head_weights


@_quantize_q_out.cpu
def _quantize_q_cpu(q: Tensor, weights: Tensor, ue8m0: bool = False) -> tuple[Tensor, Tensor]:
    return quantize_heads_into(*_quantize_q_out(q, weights, ue8m0), q, weights, ue8m0)


@triton.jit
def load_head_weights(w_ptr, w_stride0, w_stride1, rows, num_rows, H: tl.constexpr):
    """fp32 weights of rows ``rows`` of the flat ``[T * H]`` heads (0 past ``num_rows``)."""
    w = tl.load(w_ptr + (rows // H) * w_stride0 + (rows % H) * w_stride1, mask=rows < num_rows,
                other=0.0)
    return w.to(tl.float32)


@triton.jit
def store_q_rows(x, w, rows, num_rows, out_ptr, hw_ptr, w_scale, D: tl.constexpr,
                 BLOCK_D: tl.constexpr, UE8M0: tl.constexpr):
    """Quantises fp32 ``x`` ``[BLOCK_R, BLOCK_D]`` (rows ``rows`` of the flat ``[T * H]``
    heads, zero past ``D`` and ``num_rows``): stores the codes and the head weights (from
    the rows' fp32 weights ``w``)."""
    d = tl.arange(0, BLOCK_D)
    row_ok = rows < num_rows
    x = nan_to_num(x)
    scale = fp8_scale_of(tl.max(tl.abs(x), axis=1), UE8M0)
    offs = rows.to(tl.int64)[:, None] * D + d[None, :]
    tl.store(out_ptr + offs, fp8_e4m3_bits(scaled_down(x, scale, UE8M0)),
             mask=row_ok[:, None] & (d < D)[None, :])
    tl.store(hw_ptr + rows, w * w_scale * scale, mask=row_ok)


@triton.jit
def _quantize_q_kernel(q_ptr, w_ptr, w_stride0, w_stride1, out_ptr, hw_ptr, num_rows, w_scale,
                       H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_R: tl.constexpr, UE8M0: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    mask = (rows < num_rows)[:, None] & (d < D)[None, :]
    x = tl.load(q_ptr + rows.to(tl.int64)[:, None] * D + d[None, :], mask=mask, other=0.0)
    w = load_head_weights(w_ptr, w_stride0, w_stride1, rows, num_rows, H)
    store_q_rows(x.to(tl.float32), w, rows, num_rows, out_ptr, hw_ptr, w_scale, D=D,
                 BLOCK_D=BLOCK_D, UE8M0=UE8M0)


@_quantize_q_out.triton
def _quantize_q_cuda(q: Tensor, weights: Tensor, ue8m0: bool = False) -> tuple[Tensor, Tensor]:
    q_fp8, head_weights = _quantize_q_out(q, weights, ue8m0)
    num_tokens, num_heads, head_dim = q.shape
    num_rows = num_tokens * num_heads
    if num_rows:
        block_d = triton.next_power_of_2(head_dim)
        block_r = max(1, min(64, 4096 // block_d))
        launch(_quantize_q_kernel, (triton.cdiv(num_rows, block_r),),
            q, weights, weights.stride(0), weights.stride(1), q_fp8.view(torch.uint8),
            head_weights, num_rows, weight_scale(num_heads, head_dim),
            H=num_heads, D=head_dim, BLOCK_D=block_d, BLOCK_R=block_r, UE8M0=ue8m0,
        )
    return q_fp8, head_weights
