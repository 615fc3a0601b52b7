"""Shared indexer layers (dsa.IndexShare): the layer patterns engines configure, and a
compiled step where shared layers return their source layer's top-k: one graph, no
recompile, equal to running the source layer (CPU), and one CUDA graph (GPU)."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import dsa
from dsa.graphs import DecodeGraphRunner, pad_batch
from tests.batches import random_decode_batch, table_width

HIDDEN, Q_LORA_RANK, CAPACITY = 32, 16, 4


def test_every_follows_the_engines_index_topk_freq_rule():
    assert dsa.IndexShare.every(61, 1).pattern == "F" * 61  # DeepSeek V3.2 as shipped
    assert dsa.IndexShare.every(10, 4).pattern == "FFSSSFSSSF"  # vLLM: max(i - 1, 0) % 4
    glm52 = dsa.IndexShare.every(78, 4, offset=3)  # GLM-5.2: layers 0, 1, 2, then 6, 10, ...
    assert glm52.pattern.startswith("FFFSSSFSSSF") and glm52.pattern.count("F") == 21
    share = dsa.IndexShare("FSSFFS")
    assert share.num_layers == 6
    assert share.sources == (0, 0, 0, 3, 4, 4)
    assert [share.is_full(i) for i in range(6)] == [True, False, False, True, True, False]


def test_from_hf_config_reads_each_engine_setting():
    base = {"num_hidden_layers": 6}
    assert dsa.IndexShare.from_hf_config(base).pattern == "FFFFFF"
    assert dsa.IndexShare.from_hf_config({**base, "index_topk_freq": 2}).pattern == "FFFFFF"
    on = {**base, "use_index_cache": True}
    assert dsa.IndexShare.from_hf_config({**on, "index_topk_freq": 2}).pattern == "FFSFSF"
    assert dsa.IndexShare.from_hf_config(
        {**on, "index_topk_freq": 2, "index_skip_topk_offset": 3}).pattern == "FFFSFS"
    assert dsa.IndexShare.from_hf_config(  # null: the default offset, as a null freq
        {**on, "index_topk_freq": 2, "index_skip_topk_offset": None}).pattern == "FFSFSF"
    assert dsa.IndexShare.from_hf_config(
        {**on, "index_topk_freq": 2, "index_topk_pattern": "FSSSSF"}).pattern == "FSSSSF"
    glm = {**base, "index_topk_freq": 4,
           "indexer_types": ["full", "full", "shared", "shared", "full", "shared"]}
    assert dsa.IndexShare.from_hf_config(glm).pattern == "FFSSFS"


@pytest.mark.parametrize(("make", "message"), [
    (lambda: dsa.IndexShare(""), "non-empty string of 'F'"),
    (lambda: dsa.IndexShare("FFX"), "non-empty string of 'F'"),
    (lambda: dsa.IndexShare("SF"), "first layer must be full"),
    (lambda: dsa.IndexShare.every(8, 0), "freq must be an int >= 1"),
    (lambda: dsa.IndexShare.every(8, 4, offset=0), "offset 0 with freq 4 makes the first layer "
                                                   "shared"),
    (lambda: dsa.IndexShare.from_hf_config({}), "needs num_hidden_layers"),
    (lambda: dsa.IndexShare.from_hf_config(
        {"num_hidden_layers": 3, "indexer_types": ["full", "shared"]}), "each of the 3 layers"),
    (lambda: dsa.IndexShare.from_hf_config(
        {"num_hidden_layers": 3, "use_index_cache": True, "index_topk_pattern": "FS"}),
     r"one 'F' or 'S' per layer \(3\), got 2"),
    (lambda: dsa.IndexShare(["F", "S"]), "non-empty string of 'F'"),
    (lambda: dsa.IndexShare("FS").is_full(2), r"layer must be an int in \[0, 2\), got 2"),
    (lambda: dsa.IndexShare("FS").is_full(-1), r"layer must be an int in \[0, 2\), got -1"),
    (lambda: dsa.IndexShare.from_hf_config(
        {"num_hidden_layers": 3, "use_index_cache": "false"}), "use_index_cache must be true"),
    (lambda: dsa.IndexShare.from_hf_config(
        {"num_hidden_layers": 3, "use_index_cache": True, "index_topk_freq": 0}),
     "freq must be an int >= 1, got 0"),
])
def test_bad_patterns_raise(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_from_hf_config_takes_a_config_object():
    """A transformers config object (anything with to_dict()) reads like its dict."""
    class Config:
        def to_dict(self):
            return {"num_hidden_layers": 3, "indexer_types": ["full", "shared", "full"]}

    assert dsa.IndexShare.from_hf_config(Config()).pattern == "FSF"
    with pytest.raises(TypeError, match=r"`config` must be a config\.json dict"):
        dsa.IndexShare.from_hf_config(3)


def make_step(cfg: dsa.IndexerConfig, share: dsa.IndexShare, indexers: dict[int, dsa.Indexer]):
    """Runs every layer on its own inputs (``hidden[:, layer]``, ``q_latent[:, layer]``): a
    full layer indexes, a shared one reuses."""

    def step(batch: dsa.Batch, hidden: torch.Tensor, q_latent: torch.Tensor):
        meta = dsa.build_decode_metadata(cfg, batch)
        outs: list[dsa.IndexerOutput] = []
        for layer, source in enumerate(share.sources):
            outs.append(indexers[layer](hidden[:, layer], q_latent[:, layer], batch.positions,
                                        meta) if layer == source else outs[source])
        return outs

    return step


def test_shared_layers_return_their_source_layers_top_k_in_one_graph():
    torch._dynamo.reset()
    cfg = dsa.IndexerConfig(max_num_reqs=CAPACITY, max_num_batched_tokens=16, max_model_len=256,
                            num_heads=8, head_dim=32, topk=16, block_size=16, next_n=2)
    cfg = dataclasses.replace(cfg, num_blocks=CAPACITY * table_width(cfg))
    share = dsa.IndexShare("FSSFS")
    indexers = {layer: dsa.Indexer(cfg, hidden_size=HIDDEN, q_lora_rank=Q_LORA_RANK,
                                   rope_dim=16, dtype=torch.float32)
                for layer in range(share.num_layers) if share.is_full(layer)}
    assert sorted(indexers) == [0, 3]  # shared layers: no indexer weights, no K cache
    sources = copy.deepcopy(indexers)  # the source layers run eagerly, with their own caches
    counter = CompileCounterWithBackend("aot_eager")  # eager numerics: bit for bit
    compiled = torch.compile(make_step(cfg, share, indexers), fullgraph=True, dynamic=False,
                             backend=counter)
    rng = random.Random(0)
    for i, num_reqs in enumerate([CAPACITY, 1, 3, 0, 2, CAPACITY]):
        live = random_decode_batch(rng, cfg, num_reqs, uneven=i % 2 == 1)
        batch = pad_batch(live, CAPACITY, CAPACITY * cfg.next_n, table_width(cfg))
        hidden = torch.randn(batch.num_tokens, share.num_layers, HIDDEN)  # layer's own inputs
        q_latent = torch.randn(batch.num_tokens, share.num_layers, Q_LORA_RANK)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            got = compiled(batch, hidden, q_latent)
        meta = dsa.build_decode_metadata(cfg, batch)
        want = {layer: layer_module(hidden[:, layer], q_latent[:, layer], batch.positions, meta)
                for layer, layer_module in sources.items()}
        for layer, source in enumerate(share.sources):
            assert torch.equal(got[layer].indices, want[source].indices), layer
            assert torch.equal(got[layer].slots, want[source].slots), layer
    assert counter.frame_count == 1
    k_writes = (torch.ops.dsa.project_quantize_and_cache_k,
                torch.ops.dsa.rope_hadamard_quantize_and_cache_k)  # up to / above 512 tokens
    writes = [node for node in counter.graphs[0].graph.nodes
              if node.target in (*k_writes, *(op.default for op in k_writes))]
    assert len(writes) == len(indexers)  # shared layers add nothing to the graph
    for layer, module in indexers.items():  # and the full layers' caches are the eager ones
        assert torch.equal(module.kv_cache, sources[layer].kv_cache)


@pytest.mark.gpu
def test_shared_layers_replay_in_one_cuda_graph():
    """V3.2's H and D (DeepGEMM where it runs): the replay equals the compiled step, and
    each shared layer's top-k is its source layer's."""
    torch._dynamo.reset()
    cfg = dsa.IndexerConfig(max_num_reqs=CAPACITY, max_num_batched_tokens=16,
                            max_model_len=2048, topk=128, next_n=2)
    cfg = dataclasses.replace(cfg, num_blocks=CAPACITY * table_width(cfg))
    share = dsa.IndexShare("FSSFS")
    indexers = {layer: dsa.Indexer(cfg, hidden_size=HIDDEN, q_lora_rank=Q_LORA_RANK,
                                   device="cuda")
                for layer in range(share.num_layers) if share.is_full(layer)}
    shapes = {"hidden": (share.num_layers, HIDDEN), "q_latent": (share.num_layers, Q_LORA_RANK)}
    runner = DecodeGraphRunner(
        make_step(cfg, share, indexers), cfg, sizes=(CAPACITY,), table_width=table_width(cfg),
        token_inputs={name: (shape, torch.bfloat16) for name, shape in shapes.items()})
    runner.capture()
    rng = random.Random(1)
    for num_reqs in (CAPACITY, 1, 3, 2):
        live = random_decode_batch(rng, cfg, num_reqs, device="cuda")
        x = {name: torch.randn(live.num_tokens, *shape, device="cuda", dtype=torch.bfloat16)
             for name, shape in shapes.items()}
        padded = pad_batch(live, CAPACITY, CAPACITY * cfg.next_n, table_width(cfg))
        padded_x = {name: torch.cat([v, v.new_zeros(padded.num_tokens - len(v), *v.shape[1:])])
                    for name, v in x.items()}
        with torch.compiler.set_stance("fail_on_recompile"):
            got = runner.replay(live, **x)
            want = runner.step(padded, **padded_x)
        for layer, source in enumerate(share.sources):
            for field in ("indices", "slots"):
                assert torch.equal(getattr(got[layer], field),
                                   getattr(want[source], field)[: live.num_tokens]), layer


def test_from_hf_config_ignores_patterns_while_index_cache_is_off():
    """use_index_cache false (vLLM's switch off): every layer full, whatever pattern or freq
    the config also holds."""
    base = {"num_hidden_layers": 4, "index_topk_pattern": "FSFS", "index_topk_freq": 2}
    assert dsa.IndexShare.from_hf_config({**base, "use_index_cache": False}).pattern == "FFFF"
    assert dsa.IndexShare.from_hf_config({**base, "use_index_cache": True}).pattern == "FSFS"


def test_index_topk_pattern_longer_than_the_layers_raises():
    """index_topk_pattern needs exactly one letter per layer: a longer one is refused too."""
    config = {"num_hidden_layers": 3, "use_index_cache": True, "index_topk_pattern": "FSFS"}
    with pytest.raises(ValueError, match=r"one 'F' or 'S' per layer \(3\), got 4"):
        dsa.IndexShare.from_hf_config(config)
