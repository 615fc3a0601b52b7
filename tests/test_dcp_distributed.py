"""The exact top-k across DCP ranks on gloo (design §11): 2 and 4 CPU processes.

Per token, every rank's merged selection equals the single-process top-k over the unsharded
rows (``dsa::topk_scored``) or K cache (a one-rank ``Indexer`` holding every key), position
for position, and the ranks' owned keys partition it. Random batches: uneven decode lengths,
rows shorter than k, padding requests and tokens, keys repeating a few vectors (many equal
logits), compressed (R = 4) and MTP (next_n 2, 3) steps, one of them compiled with
``fullgraph=True``.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from dcp_workers import op_worker, spawn, step_worker

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def gloo_worker(rank: int, world: int, store_path: str) -> None:
    op_worker(rank, world, store_path + ".ops", "gloo", cases=20)
    step_worker(rank, world, store_path + ".steps", "gloo", steps=8 if world == 2 else 4,
                compile_backend="aot_eager" if world == 2 else None)


@pytest.mark.parametrize("world", [2, 4])
def test_exact_topk_across_gloo_ranks(world):
    spawn(gloo_worker, world, timeout=300)
