"""The exact top-k across DCP ranks on NCCL (design §11): one process per GPU, 2 GPUs.

Each rank's whole decode step (metadata, K write, local logits, local top-k, all-gather,
merge, ownership, slots) is compiled with ``fullgraph=True`` and captured as one CUDA graph;
20 replays equal the uncaptured step, and the selection equals that of one GPU holding the
whole K cache. NVLink multicast stays off (``dsa.distributed.NCCL_NO_MULTICAST``, set in
every process).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from dcp_workers import gpu_worker, op_worker, spawn

from dsa.distributed import NCCL_NO_MULTICAST

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                       reason="needs 2 GPUs and NCCL"),
]


@pytest.fixture(autouse=True)
def nccl_env(monkeypatch):
    for name, value in NCCL_NO_MULTICAST.items():
        monkeypatch.setenv(name, value)


def test_sharded_rows_on_nccl():
    spawn(op_worker, 2, "nccl", 40, timeout=300)


@pytest.mark.parametrize("compile_backend", ["inductor", "aot_eager"])
def test_decode_step_captured_per_rank(compile_backend):
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    spawn(gpu_worker, 2, compile_backend, timeout=600)
