"""Optional DeepGEMM backend: lazy import, the shapes its SM90 MQA-logits kernels take, and
calls by keyword against the API dsa knows.

DeepGEMM is never required: without it (or off Hopper) every caller falls back to Triton.
``deep_gemm`` is imported on first use, never when ``dsa`` is imported. Its kernels
JIT-compile on their first call, so warm them up before capturing a CUDA graph.

DeepGEMM's functions are pybind11 builtins whose parameter order changed between releases
(upstream inserted ``clean_logits`` where 2.8.2 takes ``max_seqlen_k``): dsa reads each
function's parameter names from its signature line, calls it by keyword, and refuses a
DeepGEMM whose functions lack a parameter dsa passes.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

PAGED_HEADS = (32, 64)
PAGED_HEAD_DIMS = (32, 64, 128)
PAGED_BLOCK_SIZE = 64
PAGED_NEXT_N = (1, 2)  # its SM90 kernel's native rows a request


@functools.cache
def deep_gemm() -> ModuleType | None:
    """The ``deep_gemm`` module, or None when it cannot be imported (imported once)."""
    try:
        import deep_gemm as module
    except Exception:  # not installed, or built for another torch/CUDA
        return None
    return module


@torch.compiler.assume_constant_result
def deep_gemm_importable() -> bool:
    """Whether ``deep_gemm`` imports. A constant to torch.compile, which otherwise traces the
    import inside :func:`deep_gemm` (it ignores the cache) and fails the whole graph where the
    package is missing."""
    return deep_gemm() is not None


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
    if not deep_gemm_importable():
        return "the `deep_gemm` package cannot be imported"
    return api_mismatch()


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


# The parameters dsa passes to each DeepGEMM function, by name.
API = {
    "get_paged_mqa_logits_metadata": ("context_lens", "block_kv", "num_sms"),
    "fp8_fp4_paged_mqa_logits": ("q", "kv_cache", "weights", "context_lens", "block_table",
                                 "schedule_meta", "max_context_len"),
    "fp8_fp4_mqa_logits": ("q", "kv", "weights", "cu_seq_len_k_start", "cu_seq_len_k_end",
                           "max_seqlen_k"),
}


def parameter_names(fn: Callable) -> tuple[str, ...] | None:
    """Parameter names of a Python function or a pybind11 builtin (from the signature line
    of its docstring); None when neither says."""
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        pass
    name = getattr(fn, "__name__", "")
    for line in (getattr(fn, "__doc__", None) or "").splitlines():
        if line.startswith(f"{name}("):
            return tuple(re.findall(r"[(,]\s*(\w+)\s*:", line.split(") ->")[0]))
    return None


@torch.compiler.assume_constant_result
def api_mismatch() -> str | None:
    """Why the installed DeepGEMM's API is not the one dsa calls, or None when it is.

    Checked once; under ``torch.compile`` the answer is a trace-time constant."""
    if not _API_CHECK:
        _API_CHECK.append(_api_mismatch(deep_gemm()))
    return _API_CHECK[0]


_API_CHECK: list[str | None] = []


def _api_mismatch(module: ModuleType) -> str | None:
    for fn_name, wanted in API.items():
        fn = getattr(module, fn_name, None)
        if fn is None:
            return f"deep_gemm {_version(module)} has no `{fn_name}`"
        names = parameter_names(fn)
        if names is None or not set(wanted) <= set(names):
            return (f"deep_gemm {_version(module)}'s `{fn_name}` takes {names}, not the "
                    f"parameters dsa passes {wanted}")
    return None


def _version(module: ModuleType) -> str:
    return str(getattr(module, "__version__", "(unknown version)"))


def call(fn_name: str, **kwargs: Any) -> Tensor:
    """Calls DeepGEMM's ``fn_name`` by keyword (its API checked by :func:`api_mismatch`)."""
    return getattr(deep_gemm(), fn_name)(**kwargs)


def tma_weights(weights: Tensor) -> Tensor:
    """``weights`` as DeepGEMM loads them by TMA: unit column stride, 16-byte row stride."""
    if weights.stride(1) == 1 and (weights.stride(0) * weights.element_size()) % 16 == 0:
        return weights
    return weights.contiguous()
