"""Block-scaled fp8 weights, as DeepSeek ships its linear layers (design §2, "fp8 weights").

A weight ``[rows, cols]`` is stored as fp8 e4m3 codes with one fp32 scale per
``BLOCK x BLOCK`` block (the checkpoint's ``weight_scale_inv``, ``[ceil(rows / BLOCK),
ceil(cols / BLOCK)]``). Its value in a layer of dtype τ is the dequantised weight::

    w[r, c] = round_τ(fp32(code[r, c] * scale[r // BLOCK, c // BLOCK]))

so an op given the fp8 codes and their scales computes what it computes on the weight
dequantised to τ (as ``Indexer.load_checkpoint`` does), reading half the bytes of a bf16
weight.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsa.ops._checks import check_size, check_tensor
from dsa.ops.quant import FP8_MAX, fp8_scales

BLOCK = 128


def scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """The scales' shape of a ``[rows, cols]`` weight."""
    return -(-rows // BLOCK), -(-cols // BLOCK)


def check_block_fp8(op: str, name: str, weight: Tensor, scale: Tensor | None,
                    dtype: torch.dtype, like: Tensor) -> None:
    """``weight`` 2-D in ``dtype`` with no scale, or fp8 e4m3 with its fp32 block scales
    (``scale``, named ``<name>_scale``)."""
    check_tensor(op, name, weight, dtype=(dtype, torch.float8_e4m3fn), ndim=2, like=like)
    scale_name = f"{name}_scale"
    if weight.dtype != torch.float8_e4m3fn:
        if scale is not None:
            raise ValueError(f"dsa.{op}: `{scale_name}` goes with an fp8 e4m3 `{name}` only, "
                             f"got a scale for a {weight.dtype} `{name}`")
        return
    if scale is None:
        raise ValueError(f"dsa.{op}: an fp8 e4m3 `{name}` needs `{scale_name}`, its fp32 "
                         f"scales per {BLOCK}x{BLOCK} block, got None")
    check_tensor(op, scale_name, scale, dtype=torch.float32, ndim=2, like=like)
    blocks = scale_shape(*weight.shape)
    for dim in (0, 1):
        check_size(op, scale_name, scale, dim, blocks[dim],
                   f"ceil({name}.shape[{dim}] / {BLOCK})")


def dequantize(weight: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The weight in ``dtype``: fp8 codes times their block's scale (fp32), rounded to
    ``dtype``; a weight without scale as it is."""
    if scale is None:
        return weight
    rows, cols = weight.shape
    blocks = scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return (weight.float() * blocks).to(dtype)


def quantize(weight: Tensor, ue8m0: bool = False) -> tuple[Tensor, Tensor]:
    """fp8 e4m3 codes and fp32 block scales of a weight (a block's scale ``amax / 448``, a
    power of two with ``ue8m0``, as DeepSeek V3.1+ checkpoints hold), e.g. to store a layer
    whose checkpoint ships 16-bit weights at fp8's size."""
    rows, cols = weight.shape
    r, c = scale_shape(rows, cols)
    padded = weight.new_zeros(r * BLOCK, c * BLOCK, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(r, BLOCK, c, BLOCK)
    scale = fp8_scales(blocks.abs().amax(dim=(1, 3)), ue8m0)
    codes = (blocks / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    return codes.view(r * BLOCK, c * BLOCK)[:rows, :cols].to(torch.float8_e4m3fn), scale
