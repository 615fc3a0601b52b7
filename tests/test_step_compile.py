"""A whole decode step (metadata + Indexer layers) under torch.compile on the CPU:
fullgraph, one compile per capacity, no recompile across 20 batch compositions (full,
all-padding, mixed; even and uneven decode lengths), equal to eager.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import dsa
from dsa.graphs import pad_batch
from tests.batches import STEP_CONFIGS, random_decode_batch, table_width

HIDDEN, Q_LORA_RANK, LAYERS, CAPACITY = 64, 32, 2, 4



def make_step(cfg: dsa.IndexerConfig, layers: list[dsa.Indexer]):
    def step(batch: dsa.Batch, hidden: torch.Tensor, q_latent: torch.Tensor):
        meta = dsa.build_decode_metadata(cfg, batch)
        outs = [layer(hidden, q_latent, batch.positions, meta) for layer in layers]
        return [o.indices for o in outs] + [o.slots for o in outs]

    return step


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("name", list(STEP_CONFIGS))
def test_compiled_step_matches_eager_without_recompiles(name, backend):
    if backend == "inductor" and name != "next_n2_native":
        pytest.skip("inductor (slow to compile on CPU) runs one configuration")
    torch._dynamo.reset()
    cfg = dsa.IndexerConfig(max_num_reqs=CAPACITY, max_num_batched_tokens=16,
                            max_model_len=512, topk=32, **STEP_CONFIGS[name])
    cfg = dataclasses.replace(cfg, num_blocks=CAPACITY * table_width(cfg))
    layers = [dsa.Indexer(cfg, hidden_size=HIDDEN, q_lora_rank=Q_LORA_RANK, dtype=torch.float32)
              for _ in range(LAYERS)]
    eager = make_step(cfg, copy.deepcopy(layers))  # same weights, its own K caches
    compiled = torch.compile(make_step(cfg, layers), fullgraph=True, dynamic=False,
                             backend=backend)
    rng = random.Random(len(name))
    capacity = (CAPACITY, CAPACITY * cfg.next_n, table_width(cfg))
    compositions = 20 if backend == "aot_eager" else 8
    sizes = [CAPACITY, 0] + [rng.randint(1, CAPACITY) for _ in range(compositions - 2)]
    for i, num_reqs in enumerate(sizes):
        live = random_decode_batch(rng, cfg, num_reqs, uneven=i % 2 == 1)
        batch = pad_batch(live, *capacity)
        x = {"hidden": torch.randn(batch.num_tokens, HIDDEN),
             "q_latent": torch.randn(batch.num_tokens, Q_LORA_RANK)}
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            got = compiled(batch, **x)
        want = eager(batch, **x)
        for g, w in zip(got, want):
            if backend == "aot_eager":  # eager numerics: bit for bit
                assert torch.equal(g, w)
            else:  # fused projections may round differently: the same selected sets
                assert torch.equal(g.sort(-1).values, w.sort(-1).values)


def test_compiled_step_selects_from_its_logits_in_place():
    """The decode step's top-k consumes (mutates) the step's fresh logits: Inductor hands it
    the logits' own buffer, with no copy of 16 MB at (64, 64K) in between."""
    torch._dynamo.reset()
    cfg = dsa.IndexerConfig(max_num_reqs=CAPACITY, max_num_batched_tokens=16,
                            max_model_len=512, topk=32)
    cfg = dataclasses.replace(cfg, num_blocks=CAPACITY * table_width(cfg))
    step = make_step(cfg, [dsa.Indexer(cfg, hidden_size=HIDDEN, q_lora_rank=Q_LORA_RANK,
                                       dtype=torch.float32)])
    batch = pad_batch(random_decode_batch(random.Random(0), cfg, CAPACITY - 1), CAPACITY,
                      CAPACITY, table_width(cfg))
    x = (torch.randn(batch.num_tokens, HIDDEN), torch.randn(batch.num_tokens, Q_LORA_RANK))
    _, (code, *_) = run_and_get_code(torch.compile(step, fullgraph=True, dynamic=False),
                                     batch, *x)
    logits = re.findall(r"assert_size_stride\((buf\d+), .*'torch\.ops\.dsa\.paged_mqa_logits\.",
                        code)
    consumed = re.findall(r"dsa\.topk_indices_and_slots_consume\.default\((buf\d+),", code)
    assert len(logits) == 1 and consumed == logits, code
