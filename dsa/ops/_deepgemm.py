"""Optional DeepGEMM backend: lazy import and the shapes its SM90 MQA-logits kernels take.

DeepGEMM is never required: without it (or off Hopper) every caller falls back to Triton.
``deep_gemm`` is imported on first use, never when ``dsa`` is imported. Its kernels
JIT-compile on their first call, so warm them up before capturing a CUDA graph.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

PAGED_HEADS = (32, 64)
PAGED_HEAD_DIMS = (32, 64, 128)
PAGED_BLOCK_SIZE = 64
PAGED_NEXT_N = (1, 2)


@functools.cache
def deep_gemm() -> ModuleType | None:
    """The ``deep_gemm`` module, or None when it cannot be imported (imported once)."""
    try:
        import deep_gemm as module
    except Exception:  # not installed, or built for another torch/CUDA
        return None
    return module


def arch_major(device: torch.device) -> int:
    """Compute-capability major of a CUDA device; 0 for any other device."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_capability(device)[0]


def _backend_reason(device: torch.device) -> str | None:
    """Why DeepGEMM cannot run on ``device`` at all, or None when it can."""
    if device.type != "cuda":
        return f"it needs CUDA tensors, got {device.type} tensors"
    major = arch_major(device)
    if major == 10:
        return ("its sm_10x kernels take other arguments (varlen row indices, MX q scales), "
                "which dsa does not implement")
    if major != 9:
        return f"it needs an sm_90 (Hopper) GPU, got sm_{major}x"
    if deep_gemm() is None:
        return "the `deep_gemm` package cannot be imported"
    return None


def paged_unsupported_reason(device: torch.device, num_heads: int, head_dim: int,
                             block_size: int, next_n: int) -> str | None:
    """Why DeepGEMM's paged MQA logits cannot take this call, or None when it can."""
    reason = mqa_unsupported_reason(device, num_heads, head_dim)
    if reason is not None:
        return reason
    if block_size != PAGED_BLOCK_SIZE:
        return f"it needs block_size {PAGED_BLOCK_SIZE}, got {block_size}"
    if next_n not in PAGED_NEXT_N:
        return f"it needs next_n in {PAGED_NEXT_N}, got {next_n}"
    return None


def mqa_unsupported_reason(device: torch.device, num_heads: int, head_dim: int) -> str | None:
    """Why DeepGEMM's ragged (prefill) MQA logits cannot take this call, or None."""
    reason = _backend_reason(device)
    if reason is not None:
        return reason
    if num_heads not in PAGED_HEADS:
        return f"it needs num_heads in {PAGED_HEADS}, got {num_heads}"
    if head_dim not in PAGED_HEAD_DIMS:
        return f"it needs head_dim in {PAGED_HEAD_DIMS}, got {head_dim}"
    return None


def deepgemm_paged_supported(device: torch.device, num_heads: int, head_dim: int,
                             block_size: int, next_n: int) -> bool:
    """Whether DeepGEMM's SM90 paged MQA logits can run this shape on ``device``."""
    return paged_unsupported_reason(device, num_heads, head_dim, block_size, next_n) is None


def deepgemm_mqa_supported(device: torch.device, num_heads: int, head_dim: int) -> bool:
    """Whether DeepGEMM's SM90 ragged MQA logits can run this shape on ``device``."""
    return mqa_unsupported_reason(device, num_heads, head_dim) is None


def schedule_supported(device: torch.device, block_size: int) -> bool:
    """Whether DeepGEMM's SM90 paged-logits schedule can be built for this cache."""
    return _backend_reason(device) is None and block_size == PAGED_BLOCK_SIZE


def num_sms(device: torch.device) -> int:
    """SMs a paged-logits schedule covers: DeepGEMM's count where it runs, else the device's
    multiprocessor count; 1 off CUDA."""
    if device.type != "cuda":
        return 1
    if _backend_reason(device) is None:
        return deep_gemm().get_num_sms()
    return torch.cuda.get_device_properties(device).multi_processor_count
