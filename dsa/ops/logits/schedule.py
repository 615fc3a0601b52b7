"""``dsa::paged_mqa_schedule``: DeepGEMM's paged-logits schedule, ``[num_sms + 1, 2]`` int32.

It must be rebuilt every step from the lengths the kernel sees (a stale schedule can
deadlock DeepGEMM's persistent kernel), with every length clamped to >= 1. Where DeepGEMM
cannot run (CPU, other GPUs, other block sizes) the schedule is all zeros.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsa.ops._checks import INDEX_DTYPES, check_int, check_nonnegative, check_tensor
from dsa.ops._registry import dsa_op
from dsa.ops.logits import deepgemm


def _check_schedule(context_lens: Tensor, block_size: int) -> None:
    op = "paged_mqa_schedule"
    check_tensor(op, "context_lens", context_lens, dtype=INDEX_DTYPES, ndim=2, contiguous=True)
    check_nonnegative(op, "context_lens", context_lens)
    check_int(op, "block_size", block_size, low=1)


@dsa_op("paged_mqa_schedule")
def _paged_mqa_schedule_out(context_lens: Tensor, block_size: int) -> Tensor:
    _check_schedule(context_lens, block_size)
    sms = deepgemm.num_sms(context_lens.device)
    return torch.empty(sms + 1, 2, dtype=torch.int32, device=context_lens.device)


@_paged_mqa_schedule_out.cpu
def _paged_mqa_schedule_cpu(context_lens: Tensor, block_size: int) -> Tensor:
    return _paged_mqa_schedule_out(context_lens, block_size).zero_()


@_paged_mqa_schedule_out.cuda
def _paged_mqa_schedule_cuda(context_lens: Tensor, block_size: int) -> Tensor:
    out = _paged_mqa_schedule_out(context_lens, block_size)
    return schedule_of_clamped(context_lens.clamp(min=1), block_size, out)


def schedule_of_clamped(clamped_lens: Tensor, block_size: int, out: Tensor) -> Tensor:
    """CUDA: DeepGEMM's schedule of lengths already clamped to >= 1 (``out`` zeroed where
    DeepGEMM cannot build one)."""
    if clamped_lens.shape[0] and deepgemm.schedule_supported(clamped_lens.device, block_size):
        return deepgemm.call("get_paged_mqa_logits_metadata", context_lens=clamped_lens,
                             block_kv=block_size, num_sms=deepgemm.num_sms(clamped_lens.device))
    return out.zero_()

