"""dsa.Indexer end to end on the CPU: prefill, then an uneven, padded MTP decode step, each
token's selection checked against a float64 reference written from the model's equations."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dsa
import dsa.meta.decode
from dsa.graphs import pad_batch
from dsa.ops.logits import deepgemm
from tests import reference_compute as ref

HIDDEN, Q_LORA_RANK, ROPE_DIM, THETA = 32, 24, 32, 10000.0
PROMPTS, DECODE = [20, 7, 33], [2, 1, 2]


def make_config(**overrides) -> dsa.IndexerConfig:
    """A small config whose K cache holds three requests of max_model_len."""
    cfg = dsa.IndexerConfig(**{
        "max_num_reqs": 4, "max_num_batched_tokens": 64, "max_model_len": 256,
        "num_heads": 16, "head_dim": 64, "topk": 16, "block_size": 16, "next_n": 2,
        **overrides})
    return dataclasses.replace(cfg, num_blocks=3 * cfg.max_blocks_per_req)


def make_layer(cfg: dsa.IndexerConfig, seed: int = 0) -> dsa.Indexer:
    torch.manual_seed(seed)
    layer = dsa.Indexer(cfg, hidden_size=HIDDEN, q_lora_rank=Q_LORA_RANK, rope_dim=ROPE_DIM,
                        rope_theta=THETA, dtype=torch.float32)
    with torch.no_grad():
        layer.k_norm.weight.uniform_(0.5, 1.5)
        layer.k_norm.bias.uniform_(-0.2, 0.2)
    return layer


def reference_projection(layer: dsa.Indexer, hidden, q_latent, positions):
    """q [T, H, D], k [T, D], head weights [T, H] in float64, from the DeepSeek V3.2 indexer's
    equations (NeoX RoPE on the first ROPE_DIM dims, then the orthonormal Hadamard)."""
    cfg = layer.cfg
    w = {name: p.detach().double() for name, p in layer.state_dict().items()}
    q = (q_latent.double() @ w["wq_b.weight"].T).view(-1, cfg.num_heads, cfg.head_dim)
    k = F.layer_norm(hidden.double() @ w["wk.weight"].T, (cfg.head_dim,), w["k_norm.weight"],
                     w["k_norm.bias"], eps=1e-6)
    half = ROPE_DIM // 2
    freq = THETA ** (-torch.arange(half, dtype=torch.float64) * 2 / ROPE_DIM)
    angle = positions.double()[:, None] * freq

    def rope(x, cos, sin):
        x1, x2 = x[..., :half], x[..., half:ROPE_DIM]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., ROPE_DIM:]], -1)

    q = rope(q, angle.cos()[:, None], angle.sin()[:, None])
    k = rope(k, angle.cos(), angle.sin())
    idx = torch.arange(cfg.head_dim)
    popcount = torch.tensor([bin(i & j).count("1") for i in idx for j in idx]).view(
        cfg.head_dim, cfg.head_dim)
    hadamard = (-1.0) ** popcount.double() / math.sqrt(cfg.head_dim)
    return q @ hadamard, k @ hadamard, hidden.double() @ w["weights_proj.weight"].T


def reference_logits(layer, tokens):
    """Logits of every token over its own request's positions 0..pos, from design §2-§3's
    quantisation of the float64 projections. ``tokens``: (request, pos, hidden, q_latent)."""
    hidden = torch.stack([t[2] for t in tokens])
    q_latent = torch.stack([t[3] for t in tokens])
    positions = torch.tensor([t[1] for t in tokens])
    q, k, w = reference_projection(layer, hidden, q_latent, positions)
    q_codes, head_weights = ref.quantize_q(q.float().numpy(), w.float().numpy(), False)
    keys = {}
    for (r, pos, *_), row in zip(tokens, k.float().numpy()):
        codes, scale = ref.quantize_row(row, False)
        keys[r, pos] = (ref.fp8_decode(codes), float(scale))
    out = []
    for t, (r, pos, *_) in enumerate(tokens):
        k_rows = np.stack([keys[r, p][0] for p in range(pos + 1)])
        k_scales = np.array([keys[r, p][1] for p in range(pos + 1)])
        out.append(ref._logits(ref.fp8_decode(q_codes[t]), head_weights[t], k_rows, k_scales))
    return out


def check_selection(indices: torch.Tensor, logits: list[np.ndarray], k: int) -> None:
    """Each row: min(k, valid) unique valid indices, then -1; a true top-k up to fp noise."""
    for row, ref_logits in zip(indices.tolist(), logits):
        valid = len(ref_logits)
        chosen = [i for i in row if i >= 0]
        assert row[len(chosen):] == [-1] * (k - len(chosen))
        assert len(chosen) == len(set(chosen)) == min(k, valid)
        assert all(0 <= i < valid for i in chosen)
        rest = np.delete(ref_logits, chosen)
        if rest.size:
            tol = 1e-4 * np.abs(ref_logits).max()
            assert ref_logits[chosen].min() >= rest.max() - tol


def run_prefill_then_decode(layer: dsa.Indexer, decode_lens: list[int] = DECODE):
    cfg = layer.cfg
    width = cfg.max_blocks_per_req
    table = torch.arange(3 * width, dtype=torch.int32).view(3, width).flip(0).contiguous()
    seq_lens, history = [0, 0, 0], []

    def batch_for(query_lens):
        qsl, positions, slots, tokens = [0], [], [], []
        for r, q in enumerate(query_lens):
            for pos in range(seq_lens[r], seq_lens[r] + q):
                positions.append(pos)
                slots.append(int(table[r, pos // cfg.block_size]) * cfg.block_size
                             + pos % cfg.block_size)
                tokens.append((r, pos, torch.randn(HIDDEN), torch.randn(Q_LORA_RANK)))
            seq_lens[r] += q
            qsl.append(qsl[-1] + q)
        batch = dsa.Batch(torch.tensor(qsl, dtype=torch.int32),
                          torch.tensor(seq_lens, dtype=torch.int32), table,
                          torch.tensor(slots), torch.tensor(positions))
        return batch, qsl, tokens

    def inputs(tokens, capacity):
        pad = capacity - len(tokens)
        hidden = torch.stack([t[2] for t in tokens] + [torch.zeros(HIDDEN)] * pad)
        q_latent = torch.stack([t[3] for t in tokens] + [torch.zeros(Q_LORA_RANK)] * pad)
        return hidden, q_latent

    batch, qsl, tokens = batch_for(PROMPTS)
    meta = dsa.build_prefill_metadata(cfg, batch, seq_lens_cpu=list(seq_lens),
                                      query_start_loc_cpu=qsl)
    prefill = layer(*inputs(tokens, batch.num_tokens), batch.positions, meta)
    history += tokens

    live, _, tokens = batch_for(decode_lens)
    padded = pad_batch(live, 4, 4 * cfg.next_n)  # one padding request, three padding tokens
    decode = layer(*inputs(tokens, padded.num_tokens), padded.positions,
                   dsa.build_decode_metadata(cfg, padded))
    history += tokens
    return prefill, decode, history, table


@pytest.mark.parametrize(("layout", "next_n", "decode_lens"), [
    ("native", 2, DECODE), ("flat", 2, DECODE), ("native", 3, [3, 1, 2]),
    ("native", 4, [4, 2, 3]), ("auto", 4, [1, 4, 4])])
def test_prefill_and_decode_select_the_true_top_k(layout, next_n, decode_lens):
    cfg = make_config(decode_layout=layout, next_n=next_n)
    assert cfg.layout == ("native" if layout == "auto" else layout)
    layer = make_layer(cfg)
    prefill, decode, history, table = run_prefill_then_decode(layer, decode_lens)
    logits = reference_logits(layer, history)
    num_prefill = sum(PROMPTS)
    check_selection(prefill.indices, logits[:num_prefill], cfg.topk)
    real = sum(decode_lens)
    check_selection(decode.indices[:real], logits[num_prefill:], cfg.topk)
    assert (decode.indices[real:] == -1).all() and (decode.slots[real:] == -1).all()

    requests = [r for r, *_ in history[num_prefill:]]
    for t, r in enumerate(requests):
        idx = decode.indices[t]
        want = torch.where(idx >= 0, table[r, idx.clamp(min=0) // 16] * 16 + idx % 16, -1)
        assert torch.equal(decode.slots[t], want.int())


def test_weights_load_from_a_deepseek_state_dict():
    cfg = make_config()
    source, target = make_layer(cfg, seed=1), make_layer(cfg, seed=2)
    state = source.state_dict()
    assert set(state) == {"wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias",
                          "weights_proj.weight"}
    target.load_state_dict(state)
    torch.manual_seed(3)
    first = run_prefill_then_decode(source)[1]
    torch.manual_seed(3)
    second = run_prefill_then_decode(target)[1]
    assert torch.equal(first.indices, second.indices)


def test_indexer_rejects_bad_sizes():
    with pytest.raises(ValueError, match="rope_dim must be even and in"):
        dsa.Indexer(make_config(), hidden_size=8, q_lora_rank=8, rope_dim=65)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        dsa.Indexer(make_config(head_dim=48), hidden_size=8, q_lora_rank=8, rope_dim=32)
    with pytest.raises(ValueError, match="kpool tail is a storage-only cache"):
        dsa.Indexer(make_config(kpool=8), hidden_size=8, q_lora_rank=8)


def test_indexer_needs_metadata_built_for_its_cache():
    """The metadata keeps selections inside the cache only for the cache size it was built
    for: the layer needs ``cfg.num_blocks`` and refuses metadata for another size."""
    cfg = make_config()
    with pytest.raises(ValueError, match=r"IndexerConfig.num_blocks \(the K cache's blocks\)"):
        dsa.Indexer(dataclasses.replace(cfg, num_blocks=None), hidden_size=8, q_lora_rank=8,
                    rope_dim=32)
    layer = dsa.Indexer(cfg, hidden_size=8, q_lora_rank=8, rope_dim=32, dtype=torch.float32)
    batch = dsa.Batch(query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                      seq_lens=torch.tensor([5], dtype=torch.int32),
                      block_table=torch.zeros(1, cfg.max_blocks_per_req, dtype=torch.int32),
                      slot_mapping=torch.tensor([4]), positions=torch.tensor([4]))
    for other in (None, cfg.num_blocks + 1):
        meta = dsa.build_decode_metadata(dataclasses.replace(cfg, num_blocks=other), batch)
        with pytest.raises(ValueError, match=rf"built for num_blocks={other}, the layer has "
                                             rf"num_blocks={cfg.num_blocks}"):
            layer(torch.randn(1, 8), torch.randn(1, 8), batch.positions, meta)
    meta = dsa.build_decode_metadata(cfg, batch)
    assert layer(torch.randn(1, 8), torch.randn(1, 8), batch.positions, meta).indices.shape == (
        1, cfg.topk)


@pytest.mark.parametrize(("base", "change"), [
    ({}, {"compress_ratio": 4}), ({}, {"dcp_world": 2, "dcp_rank": 1}),
    ({"dcp_world": 2}, {"dcp_rank": 1}), ({}, {"block_size": 32}), ({}, {"kernel_block_size": 8}),
    ({}, {"decode_layout": "flat"}), ({}, {"max_model_len": 512})])
def test_indexer_refuses_metadata_of_another_config(base, change):
    """Metadata from a config that differs in what the metadata depends on (compression, DCP
    group or rank, block sizes, layout, model length) would score other keys: the layer
    refuses it, naming the fields; a config differing elsewhere (topk, debug) is fine."""
    cfg = make_config(**base)
    layer = dsa.Indexer(cfg, hidden_size=8, q_lora_rank=8, rope_dim=32, dtype=torch.float32)
    other = dataclasses.replace(cfg, **change)
    batch = dsa.Batch(query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                      seq_lens=torch.tensor([5], dtype=torch.int32),
                      block_table=torch.zeros(1, other.table_factor * -(
                          -other.max_blocks_per_req // other.dcp_world), dtype=torch.int32),
                      slot_mapping=torch.tensor([4]), positions=torch.tensor([4]))
    meta = dsa.build_decode_metadata(other, batch)
    name, value = next(iter(change.items()))
    name = "layout" if name == "decode_layout" else name
    with pytest.raises(ValueError, match=rf"built for .*{name}={value}.* the layer has"):
        layer(torch.randn(1, 8), torch.randn(1, 8), batch.positions, meta)
    same = {"topk": cfg.topk // 2, "debug": True, "kernel_block_size": cfg.block_size,
            "decode_layout": cfg.layout}
    fine = dsa.build_decode_metadata(dataclasses.replace(cfg, **same),
                                     dsa.Batch(batch.query_start_loc, batch.seq_lens,
                                               torch.zeros(1, cfg.max_blocks_per_req,
                                                           dtype=torch.int32),
                                               batch.slot_mapping, batch.positions))
    assert layer(torch.randn(1, 8), torch.randn(1, 8), batch.positions, fine).indices.shape == (
        1, cfg.topk)


@pytest.mark.parametrize("backend", ["triton", "deepgemm"])
@pytest.mark.parametrize(("layout", "next_n"), [("native", 1), ("flat", 2)])
def test_decode_step_adjusts_no_lengths(monkeypatch, backend, layout, next_n):
    """Where logits rows are the tokens, nothing runs between the metadata and the leaves
    only to adjust lengths: the metadata carries top-k's lengths (0 where a token selects
    nothing) and DeepGEMM's (>= 1). The exported step holds no where and no clamp (traced,
    not run: DeepGEMM is patched in)."""
    if backend == "deepgemm":
        monkeypatch.setattr(dsa.meta.decode, "paged_backend", lambda *_, **__: "deepgemm")
        monkeypatch.setattr(deepgemm, "paged_unsupported_reason", lambda *_: None)
        monkeypatch.setattr(deepgemm, "num_sms", lambda _: 4)
    cfg = make_config(decode_layout=layout, next_n=next_n)
    layer = make_layer(cfg)
    width = cfg.max_blocks_per_req
    batch = dsa.Batch(torch.tensor([0, 1, 2, 3], dtype=torch.int32),
                      torch.tensor([5, 6, 7], dtype=torch.int32),
                      torch.arange(3 * width, dtype=torch.int32).view(3, width),
                      torch.tensor([4, width * 16 + 5, 2 * width * 16 + 6]),
                      torch.tensor([4, 5, 6]))

    class Step(torch.nn.Module):
        def forward(self, batch, hidden, q_latent):
            meta = dsa.build_decode_metadata(cfg, batch)
            assert meta.logits_backend == backend and not meta.packed
            return layer(hidden, q_latent, batch.positions, meta).slots

    program = torch.export.export(Step(), (batch, torch.randn(3, HIDDEN),
                                           torch.randn(3, Q_LORA_RANK)))
    calls = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert not [c for c in calls if "where" in c or "clamp" in c], calls
    assert any("paged_mqa_logits" in c for c in calls)


def test_rope_may_cover_the_whole_head():
    """rope_dim == head_dim is valid (RoPE on every dim) and runs; odd, 0 or past head_dim
    is not."""
    cfg = make_config()
    layer = dsa.Indexer(cfg, hidden_size=8, q_lora_rank=8, rope_dim=cfg.head_dim,
                        dtype=torch.float32)
    assert layer.rope_cos_sin.shape == (cfg.max_model_len, cfg.head_dim)
    batch = dsa.Batch(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
                      torch.zeros(1, cfg.max_blocks_per_req, dtype=torch.int32),
                      torch.tensor([4]), torch.tensor([4]))
    out = layer(torch.randn(1, 8), torch.randn(1, 8), batch.positions,
                dsa.build_decode_metadata(cfg, batch))
    assert sorted(out.indices[0, :5].tolist()) == [0, 1, 2, 3, 4]
    for bad in (cfg.head_dim + 2, 0, 31):
        with pytest.raises(ValueError, match="rope_dim must be even and in"):
            dsa.Indexer(cfg, hidden_size=8, q_lora_rank=8, rope_dim=bad)


def test_unchecked_out_of_range_position_selects_nothing():
    """Traced metadata (values unread) leaves a real token at a position outside
    [0, max_model_len) out of valid_tokens; in the packed native layout the layer then
    gives it no index and no slot, though its request's row has keys to select."""
    torch._dynamo.reset()
    cfg = make_config(next_n=2)
    layer = make_layer(cfg)
    width = cfg.max_blocks_per_req
    batch = dsa.Batch(torch.tensor([0, 2, 3], dtype=torch.int32),
                      torch.tensor([20, 5], dtype=torch.int32),
                      torch.arange(2 * width, dtype=torch.int32).view(2, width),
                      torch.tensor([18, -1, width * 16 + 4]),
                      torch.tensor([18, cfg.max_model_len, 4]))
    build = torch.compile(lambda b: dsa.build_decode_metadata(cfg, b), fullgraph=True,
                          backend="aot_eager")
    meta = build(batch)
    assert meta.packed and meta.valid_tokens.tolist() == [True, False, True]
    out = layer(torch.randn(3, HIDDEN), torch.randn(3, Q_LORA_RANK), batch.positions, meta)
    assert (out.indices[1] == -1).all() and (out.slots[1] == -1).all()
    assert (out.indices[0] >= 0).sum() == cfg.topk  # its neighbour, valid, selects


@pytest.mark.parametrize("fp8_weights", [False, True])
def test_a_cast_layer_equals_one_built_in_that_dtype(fp8_weights):
    """``to(dtype)`` (a whole model's cast) sets the layer's dtype and its 16-bit weights;
    k_norm, weights_proj, the RoPE table, fp8 weights and their scales keep theirs."""
    cfg = make_config(next_n=1)
    kwargs = dict(hidden_size=HIDDEN, q_lora_rank=Q_LORA_RANK, rope_dim=ROPE_DIM,
                  rope_theta=THETA, fp8_weights=fp8_weights)
    source = dsa.Indexer(cfg, **kwargs, dtype=torch.float32)
    direct = dsa.Indexer(cfg, **kwargs, dtype=torch.bfloat16)
    direct.load_state_dict(source.state_dict())
    cast = source.to(torch.bfloat16)
    assert cast.dtype == torch.bfloat16
    got, want = cast.state_dict(), direct.state_dict()
    got["rope"], want["rope"] = cast.rope_cos_sin, direct.rope_cos_sin
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    batch = dsa.Batch(torch.tensor([0, 1], dtype=torch.int32),
                      torch.tensor([1], dtype=torch.int32),
                      torch.zeros(1, cfg.max_blocks_per_req, dtype=torch.int32),
                      torch.tensor([0]), torch.tensor([0]))
    meta = dsa.build_decode_metadata(cfg, batch)
    hidden = torch.randn(1, HIDDEN, dtype=torch.bfloat16)
    q_latent = torch.randn(1, Q_LORA_RANK, dtype=torch.bfloat16)
    out = cast(hidden, q_latent, batch.positions, meta)
    assert torch.equal(out.indices, direct(hidden, q_latent, batch.positions, meta).indices)
    with pytest.raises(ValueError, match=r"dtype must be one of .* a cast asks for torch\.float64"):
        cast.double()
