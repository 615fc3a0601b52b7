"""Whole decode steps as CUDA graphs: no sync, no graph break, no recompile, replay == eager.

Runs on the GPU machine only. Each configuration captures two buckets and replays 20+
batch compositions in each (mixed lengths, graph padding, an all-padding batch, uneven
decode lengths, contexts from the query tokens alone to max_model_len).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import pathlib
import random
import re
import zlib

import pytest
import torch
from torch._dynamo.utils import counters

import dsa
import dsa.ops._launch
from dsa.graphs import DecodeGraphRunner, StaticBatch, pad_batch
from dsa.ops import block_fp8
from dsa.ops.logits import paged
from dsa.ops.logits.deepgemm import deepgemm_paged_supported
from tests.batches import STEP_CONFIGS, random_decode_batch, table_width

pytestmark = pytest.mark.gpu

HIDDEN, Q_LORA_RANK, LAYERS = 256, 128, 2
BUCKETS = (4, 8)
COMPOSITIONS = 20


def make_cfg(**overrides) -> dsa.IndexerConfig:
    base = {"max_num_reqs": max(BUCKETS), "max_num_batched_tokens": 64, "max_model_len": 2048,
            "topk": 128}
    cfg = dsa.IndexerConfig(**{**base, **overrides})
    if cfg.num_blocks is None:
        cfg = dataclasses.replace(cfg, num_blocks=max(BUCKETS) * table_width(cfg))
    return cfg


def make_layers(cfg: dsa.IndexerConfig, fp8_weights: bool = False) -> list[dsa.Indexer]:
    """LAYERS layers (fp8_weights: their wq_b and wk quantised to fp8 blocks)."""
    layers = []
    for _ in range(LAYERS):
        layer = dsa.Indexer(cfg, hidden_size=HIDDEN, q_lora_rank=Q_LORA_RANK, device="cuda")
        if fp8_weights:
            state = layer.state_dict()
            for name in ("wq_b", "wk"):
                state[f"{name}.weight"], state[f"{name}.weight_scale_inv"] = (
                    block_fp8.quantize(state[f"{name}.weight"]))
            layer = dsa.Indexer(cfg, hidden_size=HIDDEN, q_lora_rank=Q_LORA_RANK,
                                device="cuda", fp8_weights=True)
            layer.load_state_dict(state)
        layers.append(layer)
    return layers


def make_step(cfg: dsa.IndexerConfig, layers: list[dsa.Indexer] | None = None):
    layers = layers or make_layers(cfg)

    def step(batch: dsa.Batch, hidden: torch.Tensor, q_latent: torch.Tensor):
        meta = dsa.build_decode_metadata(cfg, batch)
        outs = [layer(hidden, q_latent, batch.positions, meta) for layer in layers]
        return [o.indices for o in outs] + [o.slots for o in outs]

    return step


def compositions(cfg: dsa.IndexerConfig, bucket: int, rng: random.Random):
    """Live batches that replay in ``bucket``: empty, full, and random sizes between."""
    lower = max([b for b in BUCKETS if b < bucket], default=0)
    sizes = [0, bucket] + [rng.randint(lower + 1, bucket) for _ in range(COMPOSITIONS - 2)]
    if lower:  # an all-padding batch only replays in the smallest bucket
        sizes[0] = lower + 1
    for n in sizes:
        yield random_decode_batch(rng, cfg, n, device="cuda", uneven=rng.random() < 0.7)


def token_inputs(num_tokens: int) -> dict[str, torch.Tensor]:
    return {"hidden": torch.randn(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16),
            "q_latent": torch.randn(num_tokens, Q_LORA_RANK, device="cuda",
                                    dtype=torch.bfloat16)}


@contextlib.contextmanager
def strict_replay():
    """Any host sync raises; any recompile of the compiled step raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


CONFIGS = {
    **STEP_CONFIGS,
    "next_n1_triton": {"next_n": 1, "logits_backend": "triton"},
    "next_n2_triton": {"next_n": 2, "logits_backend": "triton"},
    # the cache's block count in the config: lengths capped on the device (cap_context_lens)
    "next_n2_num_blocks": {"next_n": 2, "num_blocks": max(BUCKETS) * 2048 // 64},
    "next_n1_fp8_weights": {"next_n": 1},  # the layers' wq_b and wk as fp8 blocks
}
# (config, compile backend): inductor on the default backends; aot_eager (eager numerics,
# so the replay is also checked bit for bit against the uncompiled step) on the rest.
CASES = [("next_n1", "inductor"), ("next_n2_native", "inductor"), ("next_n3_flat", "inductor"),
         ("compress4", "inductor"), ("next_n2_native", "aot_eager"),
         ("next_n3_flat", "aot_eager"), ("next_n1_triton", "aot_eager"),
         ("next_n2_triton", "aot_eager"), ("next_n2_num_blocks", "inductor"),
         ("next_n4_native", "inductor"), ("next_n1_fp8_weights", "inductor")]


@pytest.mark.parametrize(("name", "compile_backend"), CASES)
def test_decode_step_replays_as_one_graph(name, compile_backend):
    torch._dynamo.reset()
    cfg = make_cfg(**CONFIGS[name])
    step = make_step(cfg, make_layers(cfg, fp8_weights=name.endswith("fp8_weights")))
    runner = DecodeGraphRunner(
        step, cfg, sizes=BUCKETS, table_width=table_width(cfg),
        token_inputs={"hidden": ((HIDDEN,), torch.bfloat16),
                      "q_latent": ((Q_LORA_RANK,), torch.bfloat16)},
        compile_backend=compile_backend,
    )
    runner.capture()
    rng = random.Random(zlib.crc32(name.encode()))  # str hash() changes per process
    for bucket in BUCKETS:
        for live in compositions(cfg, bucket, rng):
            assert runner.bucket(live.num_reqs) == bucket
            x = token_inputs(live.num_tokens)
            with strict_replay():
                got = runner.replay(live, **x)
            padded = pad_batch(live, bucket, bucket * cfg.next_n, table_width(cfg))
            padded_x = {k: torch.cat([v, v.new_zeros(padded.num_tokens - len(v), v.shape[1])])
                        for k, v in x.items()}
            with torch.compiler.set_stance("fail_on_recompile"):
                want = runner.step(padded, **padded_x)
            for g, w in zip(got, want):
                assert torch.equal(g, w[: live.num_tokens])
            if compile_backend == "aot_eager":  # the uncompiled step, bit for bit
                for g, w in zip(got, step(padded, **padded_x)):
                    assert torch.equal(g, w[: live.num_tokens])

    live = random_decode_batch(rng, cfg, BUCKETS[-1], device="cuda")
    x = token_inputs(live.num_tokens)
    with strict_replay():  # comparing syncs: compare after
        replays = [runner.replay(live, **x) for _ in range(20)]
    for again in replays[1:]:
        assert all(torch.equal(a, b) for a, b in zip(replays[0], again))


@pytest.mark.parametrize(("backend", "level", "unchained_logits"),
                         [("triton", 1, False), ("triton", 2, False), ("deepgemm", 1, False),
                          ("deepgemm", 2, False), ("triton", 1, True)])
def test_programmatic_dependent_launch_replays_equal(monkeypatch, backend, level,
                                                     unchained_logits):
    """The step's kernels launched with programmatic dependent launch (each may start while
    the kernel before runs, and waits before it reads what that kernel writes) give, in a
    graph, at either level of ``DSA_PDL``, the slots, indices and K cache of the step
    launched without it, bit for bit, over two layers (the second layer's partial sums
    launch after the first's top-k). unchained_logits: every paged-logits call as large
    ones are (``CHAIN_KEYS`` 0), so those of more than one row start early
    (``PagedLogitsConfig.early_tiles``: their first tiles prefetched into L2 while the
    prologue writes q and the new keys)."""
    if unchained_logits:
        monkeypatch.setattr(paged, "CHAIN_KEYS", 0)
        assert paged.PAGED_LAUNCH[1].early_tiles > 0
    cfg = make_cfg(next_n=1, logits_backend=backend)
    if backend == "deepgemm" and not deepgemm_paged_supported(
        torch.device("cuda"), cfg.num_heads, cfg.head_dim, cfg.block_size, cfg.next_n
    ):
        pytest.skip("DeepGEMM is not usable here")
    layers = make_layers(cfg)
    rng = random.Random(17)
    batches = [random_decode_batch(rng, cfg, bucket, device="cuda", uneven=True)
               for bucket in BUCKETS for _ in range(4)]
    inputs = [token_inputs(live.num_tokens) for live in batches]
    runs = []
    for pdl in (0, level):
        monkeypatch.setattr(dsa.ops._launch, "PDL", pdl)
        torch._dynamo.reset()
        runner = DecodeGraphRunner(
            make_step(cfg, layers), cfg, sizes=BUCKETS, table_width=table_width(cfg),
            token_inputs={"hidden": ((HIDDEN,), torch.bfloat16),
                          "q_latent": ((Q_LORA_RANK,), torch.bfloat16)},
        )
        runner.capture()
        for layer in layers:  # the capture's warm-up wrote K
            layer.kv_cache.zero_()
        with strict_replay():
            outs = [runner.replay(live, **x) for live, x in zip(batches, inputs)]
        runs.append((outs, [layer.kv_cache.clone() for layer in layers]))
    (outs_off, caches_off), (outs_on, caches_on) = runs
    for got, want in zip(outs_on, outs_off):
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert all(torch.equal(g, w) for g, w in zip(caches_on, caches_off))


BATCH_FIELDS = ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "positions")


def write_in_place(static: StaticBatch, live: dsa.Batch, x: dict[str, torch.Tensor]) -> None:
    """What an engine does: writes the live rows into the bucket's buffers, then pads."""
    view = static.prefix(live.num_reqs, live.num_tokens)
    for name in BATCH_FIELDS:
        dst, src = getattr(view.batch, name), getattr(live, name)
        dst[tuple(slice(0, n) for n in src.shape)].copy_(src)
    for name, value in x.items():
        view.inputs[name].copy_(value)
    static.pad(live.num_reqs, live.num_tokens)


def test_in_place_replay_equals_eager_and_returns_views():
    """Engine-owned buffers, the batch written in place, ``replay_in_place``: no sync, no
    recompile, equal bit for bit to the uncompiled step; the outputs are the graph's own
    tensors, which the next replay overwrites."""
    torch._dynamo.reset()
    cfg = make_cfg(next_n=2, logits_backend="triton")
    width = table_width(cfg)
    step = make_step(cfg)
    buffers = StaticBatch(max(BUCKETS), max(BUCKETS) * cfg.next_n, width, device="cuda",
                          token_inputs={"hidden": ((HIDDEN,), torch.bfloat16),
                                        "q_latent": ((Q_LORA_RANK,), torch.bfloat16)})
    runner = DecodeGraphRunner(step, cfg, buffers=buffers, sizes=BUCKETS,
                               compile_backend="aot_eager")
    runner.capture()
    rng = random.Random(11)
    for bucket in BUCKETS:
        static = runner.static_batch(bucket)
        assert static.batch.seq_lens.data_ptr() == buffers.batch.seq_lens.data_ptr()
        for live in compositions(cfg, bucket, rng):
            x = token_inputs(live.num_tokens)
            with strict_replay():
                write_in_place(static, live, x)
                got = runner.replay_in_place(bucket)
            assert got is runner._graphs[bucket][1]  # the graph's outputs, not copies
            padded = pad_batch(live, bucket, bucket * cfg.next_n, width)
            padded_x = {k: torch.cat([v, v.new_zeros(padded.num_tokens - len(v), v.shape[1])])
                        for k, v in x.items()}
            want = step(padded, **padded_x)
            for g, w in zip(got, want):
                assert g.shape == w.shape  # the bucket's capacity
                assert torch.equal(g[: live.num_tokens], w[: live.num_tokens])
                assert (g[live.num_tokens:] == -1).all()  # padding selects nothing
    kept = [t.clone() for t in runner.replay_in_place(BUCKETS[-1])]
    other = random_decode_batch(rng, cfg, BUCKETS[-1], device="cuda")
    write_in_place(runner.static_batch(BUCKETS[-1]), other, token_inputs(other.num_tokens))
    again = runner.replay_in_place(BUCKETS[-1])
    assert not all(torch.equal(a, b) for a, b in zip(again, kept))  # views: overwritten


def test_padding_path_equals_replay():
    """``load`` + ``replay_in_place`` (one padding launch, views) gives what ``replay``
    gives (the old path: load, replay, cut and clone), and so does a live batch on the
    host."""
    torch._dynamo.reset()
    cfg = make_cfg(next_n=2)
    runner = DecodeGraphRunner(
        make_step(cfg), cfg, sizes=BUCKETS, table_width=table_width(cfg),
        token_inputs={"hidden": ((HIDDEN,), torch.bfloat16),
                      "q_latent": ((Q_LORA_RANK,), torch.bfloat16)},
    )
    runner.capture()
    rng = random.Random(5)
    for bucket in BUCKETS:
        for live in compositions(cfg, bucket, rng):
            x = token_inputs(live.num_tokens)
            with strict_replay():
                size = runner.load(live, **x)
                got = [t[: live.num_tokens].clone() for t in runner.replay_in_place(size)]
                want = runner.replay(live, **x)
            assert size == bucket
            assert all(torch.equal(g, w) for g, w in zip(got, want))
            host = dsa.Batch(*(getattr(live, name).cpu() for name in BATCH_FIELDS))
            from_host = runner.replay(host, **x)  # one pinned, non-blocking copy
            assert all(torch.equal(g, w) for g, w in zip(from_host, want))


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("compress_ratio", [1, 4])
def test_dcp_metadata_replays_as_one_graph(rank, compress_ratio):
    torch._dynamo.reset()
    cfg = make_cfg(next_n=2, dcp_world=2, dcp_rank=rank, compress_ratio=compress_ratio)
    build = lambda batch: dsa.build_decode_metadata(cfg, batch)
    runner = DecodeGraphRunner(build, cfg, sizes=BUCKETS, table_width=table_width(cfg),
                               token_inputs={})
    runner.capture()
    rng = random.Random(rank)
    for bucket in BUCKETS:
        for live in compositions(cfg, bucket, rng):
            with strict_replay():
                got = runner.replay(live)
            want = dsa.build_decode_metadata(cfg, pad_batch(live, bucket, bucket * cfg.next_n,
                                                            table_width(cfg)))
            for field in ("context_lens", "global_context_lens", "block_table",
                          "token_requests", "slot_mapping"):
                g, w = getattr(got, field), getattr(want, field)
                if g.shape[0] != w.shape[0]:  # token-major fields are cut to live tokens
                    w = w[: g.shape[0]]
                assert torch.equal(g, w), field


@pytest.mark.parametrize("backend", ["triton", "deepgemm"])
def test_reduce_overhead_mode_captures_without_skips(backend):
    cfg = make_cfg(next_n=2, logits_backend=backend)
    if backend == "deepgemm" and not deepgemm_paged_supported(
        torch.device("cuda"), cfg.num_heads, cfg.head_dim, cfg.block_size, cfg.next_n
    ):
        pytest.skip("DeepGEMM is not usable here")
    torch._dynamo.reset()
    counters.clear()
    layers = make_layers(cfg)
    eager_reference = make_step(cfg, copy.deepcopy(layers))  # same weights, its own caches
    step = make_step(cfg, layers)
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=False)
    rng = random.Random(7)
    bucket = BUCKETS[-1]
    with torch._inductor.config.patch({"triton.cudagraph_or_error": True}):
        for i in range(8):
            live = random_decode_batch(rng, cfg, rng.randint(1, bucket), device="cuda")
            padded = pad_batch(live, bucket, bucket * cfg.next_n, table_width(cfg))
            x = token_inputs(padded.num_tokens)
            with (torch.compiler.set_stance("fail_on_recompile") if i > 2
                  else contextlib.nullcontext()):
                got = [t.clone() for t in compiled(padded, **x)]
            want = eager_reference(padded, **x)
            for g, w in zip(got, want):  # fused bf16 projections may flip near-ties
                shared = (g.unsqueeze(-1) == w.unsqueeze(-2)).any(-1) & (g >= 0)
                assert shared.sum() >= 0.99 * (g >= 0).sum()
                assert torch.equal(g >= 0, w >= 0)
    assert counters["inductor"]["cudagraph_skips"] == 0


def test_readme_step_returns_live_indexer_outputs_that_survive_the_next_replay():
    """The README's step returns ``dsa.IndexerOutput``: replay cuts it to the live tokens and
    clones it, so a second replay leaves the first result as it was, equal to eager."""
    torch._dynamo.reset()
    cfg = dsa.IndexerConfig(max_num_reqs=4, max_num_batched_tokens=64, max_model_len=1024,
                            next_n=2, topk=64, num_blocks=64)
    layer = dsa.Indexer(cfg, hidden_size=HIDDEN, q_lora_rank=Q_LORA_RANK, device="cuda")
    eager_layer = copy.deepcopy(layer)

    def step(batch, hidden, q_latent):
        meta = dsa.build_decode_metadata(cfg, batch)
        return layer(hidden, q_latent, batch.positions, meta)

    width = table_width(cfg)
    runner = DecodeGraphRunner(
        step, cfg, table_width=width, sizes=(4,),
        token_inputs={"hidden": ((HIDDEN,), torch.bfloat16),
                      "q_latent": ((Q_LORA_RANK,), torch.bfloat16)},
        compile_backend="aot_eager",
    )
    runner.capture()
    rng = random.Random(3)
    first_live = random_decode_batch(rng, cfg, 3, device="cuda", uneven=False)  # 6 tokens
    second_live = random_decode_batch(rng, cfg, 4, device="cuda")
    first_x, second_x = token_inputs(first_live.num_tokens), token_inputs(second_live.num_tokens)
    first = runner.replay(first_live, **first_x)
    kept = dsa.IndexerOutput(first.indices.clone(), first.slots.clone())
    runner.replay(second_live, **second_x)

    assert isinstance(first, dsa.IndexerOutput)
    assert first.indices.shape == first.slots.shape == (6, cfg.topk)  # not the 8 of the bucket
    assert torch.equal(first.indices, kept.indices) and torch.equal(first.slots, kept.slots)
    padded = pad_batch(first_live, 4, 4 * cfg.next_n, width)
    padded_x = {k: torch.cat([v, v.new_zeros(padded.num_tokens - len(v), v.shape[1])])
                for k, v in first_x.items()}
    meta = dsa.build_decode_metadata(cfg, padded)
    want = eager_layer(padded_x["hidden"], padded_x["q_latent"], padded.positions, meta)
    assert torch.equal(first.indices, want.indices[:6])
    assert torch.equal(first.slots, want.slots[:6])


def test_readme_runner_snippet_runs():
    """README's DecodeGraphRunner snippet (after the tour it builds on) runs as written, and
    its three paths agree on the live rows."""
    torch._dynamo.reset()
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    tour, runner_snippet = re.findall(r"```python\n(.*?)```", readme, flags=re.S)[:2]
    scope: dict = {}
    exec(compile(tour, "README.md", "exec"), scope)
    exec(compile(runner_snippet, "README.md", "exec"), scope)
    runner, batch = scope["runner"], scope["batch"]
    in_place = runner.replay_in_place(runner.load(batch, hidden=scope["h"], q_latent=scope["q"]))
    for field in ("indices", "slots"):
        assert torch.equal(getattr(in_place, field)[: batch.num_tokens],
                           getattr(scope["out"], field))


def test_debug_mode_checks_device_batches():
    """``debug=True`` reads device values with a sync and raises on an impossible batch."""
    cfg = make_cfg(next_n=2, debug=True)
    live = random_decode_batch(random.Random(0), cfg, 2, device="cuda")
    bad = dsa.Batch(live.query_start_loc, torch.zeros_like(live.seq_lens), live.block_table,
                    live.slot_mapping, live.positions)
    with pytest.raises(ValueError, match="`seq_lens` of request 0 must be >= its query length"):
        dsa.build_decode_metadata(cfg, bad)
    dsa.build_decode_metadata(dataclasses.replace(cfg, debug=False), bad)  # not read: no sync


def test_load_of_a_host_batch_whose_table_has_a_row_stride():
    """A host block table sliced from a wider one (row stride past its width) travels to
    the GPU packed, rows contiguous: the CUDA load reads it as packed, equal to a host
    load; a host table the op would refuse (columns strided) is refused here too."""
    width = 4
    wide = torch.arange(3 * (width + 3), dtype=torch.int32).view(3, width + 3)
    live = dsa.Batch(torch.tensor([0, 1, 2, 3], dtype=torch.int32),
                     torch.tensor([5, 5, 5], dtype=torch.int32), wide[:, :width],
                     torch.tensor([4, 68, 132]), torch.tensor([4, 4, 4]))
    on_host, on_gpu = StaticBatch(4, 4, width), StaticBatch(4, 4, width, device="cuda")
    on_host.load(live)
    on_gpu.load(live)
    assert on_gpu.batch.block_table.cpu().tolist() == on_host.batch.block_table.tolist() == [
        [0, 1, 2, 3], [7, 8, 9, 10], [14, 15, 16, 17], [0, 0, 0, 0]]
    strided = dataclasses.replace(live, block_table=wide[:, ::2][:, :width].contiguous()
                                  .t().contiguous().t())
    with pytest.raises(ValueError, match=r"`block_table` rows must be contiguous"):
        StaticBatch(4, 4, width, device="cuda").load(strided)
