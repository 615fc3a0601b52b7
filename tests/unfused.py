"""The indexer prologue as it ran before the fused ops: RoPE (``neox_rope``), the Hadamard
rotation as a matmul in the layer's dtype, then ``quantize_and_cache_k`` / ``quantize_q``.
The baseline of tests/test_prologue.py and benchmarks/bench_prologue.py."""

from __future__ import annotations

import torch
from torch import Tensor

from dsa.rope import neox_rope


def hadamard_matrix(dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
    """The orthonormal Sylvester-Hadamard matrix of order ``dim``, in ``dtype``."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * dim**-0.5).to(device=device, dtype=dtype)


def unfused_prologue(q: Tensor, k: Tensor, weights: Tensor, kv_cache: Tensor,
                     slot_mapping: Tensor, cos_sin: Tensor, positions: Tensor,
                     hadamard: Tensor | None, ue8m0: bool = False) -> tuple[Tensor, Tensor]:
    """Writes k to ``kv_cache`` and returns ``(q_fp8, head_weights)``, the unfused way."""
    rows = cos_sin[positions.long().clamp(0, cos_sin.shape[0] - 1)]
    q = neox_rope(q, rows.unsqueeze(1), cos_sin.shape[1])
    k = neox_rope(k, rows, cos_sin.shape[1])
    if hadamard is not None:
        q, k = q @ hadamard, k @ hadamard
    torch.ops.dsa.quantize_and_cache_k(k, kv_cache, slot_mapping, ue8m0)
    return torch.ops.dsa.quantize_q(q.contiguous(), weights, ue8m0)
