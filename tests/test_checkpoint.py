"""A DeepSeek V3.2 layer from its config.json and its checkpoint as shipped (fp8 wq_b / wk with
128x128 block scales): the projections against a float64 transcription of the model's
equations, a prefill and a decode step end to end on the CPU, and the loaders' errors."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dsa
from dsa.ops.prologue import rope_hadamard
from tests import reference_compute as ref
from tests.test_rope import V32_ROPE_SCALING, spec_table

HIDDEN, Q_LORA, HEADS, DIM, ROPE_DIM, TOPK = 320, 192, 8, 128, 64, 16  # partial 128-blocks
HF_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"], "hidden_size": HIDDEN, "q_lora_rank": Q_LORA,
    "kv_lora_rank": 512, "index_n_heads": HEADS, "index_head_dim": DIM, "index_topk": TOPK,
    "qk_rope_head_dim": ROPE_DIM, "qk_nope_head_dim": 128, "rope_theta": 10000,
    "rope_scaling": V32_ROPE_SCALING, "max_position_embeddings": 163840,
}
LIMITS = {"max_num_reqs": 4, "max_num_batched_tokens": 128, "max_model_len": 8192}
LAYERS = (3, 13)


def prefix_of(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.indexer."


def fp8_blockwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 scales [ceil(rows/128), ceil(cols/128)]), one scale per block."""
    rows, cols = w.shape
    scale = torch.empty(math.ceil(rows / 128), math.ceil(cols / 128))
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = (slice(128 * i, 128 * i + 128), slice(128 * j, 128 * j + 128))
            scale[i, j] = w[block].abs().max() / 448
            codes[block] = (w[block] / scale[i, j]).to(torch.float8_e4m3fn)
    return codes, scale


def make_checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    """A V3.2-form state dict: two layers' indexers plus unrelated keys."""
    gen = torch.Generator().manual_seed(seed)

    def graded(rows, cols):  # magnitudes vary across blocks, so misplaced scales show
        return (torch.randn(rows, cols, generator=gen) * torch.logspace(-1, 0, rows)[:, None]
                * torch.logspace(0, -1, cols)[None, :] * 0.1)

    state = {"model.embed_tokens.weight": torch.randn(10, HIDDEN).bfloat16(),
             "model.layers.3.self_attn.wq_a.weight": torch.randn(Q_LORA, HIDDEN).bfloat16()}
    for layer in LAYERS:
        p = prefix_of(layer)
        state[p + "wq_b.weight"], state[p + "wq_b.weight_scale_inv"] = fp8_blockwise(
            graded(HEADS * DIM, Q_LORA))
        state[p + "wk.weight"], state[p + "wk.weight_scale_inv"] = fp8_blockwise(
            graded(DIM, HIDDEN))
        state[p + "k_norm.weight"] = (1 + 0.5 * torch.rand(DIM, generator=gen)).bfloat16()
        state[p + "k_norm.bias"] = (0.2 * torch.randn(DIM, generator=gen)).bfloat16()
        state[p + "weights_proj.weight"] = (0.1 * torch.randn(HEADS, HIDDEN,
                                                              generator=gen)).bfloat16()
    return state


def dequantise(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    w = codes.double()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            w[128 * i:128 * i + 128, 128 * j:128 * j + 128] *= scale[i, j].item()
    return w


def reference_projection(state, layer: int, hidden, q_latent, positions,
                         interleaved: bool = False):
    """float64 q [T, H, D], k [T, D], raw head weights [T, H] of DeepSeek V3.2's indexer:
    wq_b, wk + LayerNorm(1e-6), YaRN NeoX RoPE on the first 64 dims (``interleaved``: on
    their pairs 2i, 2i + 1, as GLM-5's indexer), Hadamard, weights_proj."""
    p = prefix_of(layer)
    wq_b = dequantise(state[p + "wq_b.weight"], state[p + "wq_b.weight_scale_inv"])
    wk = dequantise(state[p + "wk.weight"], state[p + "wk.weight_scale_inv"])
    hidden, q_latent = hidden.double(), q_latent.double()
    q = (q_latent @ wq_b.T).view(-1, HEADS, DIM)
    k = F.layer_norm(hidden @ wk.T, (DIM,), state[p + "k_norm.weight"].double(),
                     state[p + "k_norm.bias"].double(), eps=1e-6)
    table = torch.from_numpy(spec_table(LIMITS["max_model_len"], ROPE_DIM, 10000.0,
                                        V32_ROPE_SCALING))[positions]
    half = ROPE_DIM // 2
    cos, sin = table[:, :half], table[:, half:]

    def rope(x, cos, sin):
        if interleaved:
            x1, x2 = x[..., 0:ROPE_DIM:2], x[..., 1:ROPE_DIM:2]
            pairs = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
            return torch.cat([pairs.flatten(-2), x[..., ROPE_DIM:]], -1)
        x1, x2 = x[..., :half], x[..., half:ROPE_DIM]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., ROPE_DIM:]], -1)

    q, k = rope(q, cos[:, None], sin[:, None]), rope(k, cos, sin)
    signs = [[(-1) ** bin(i & j).count("1") for j in range(DIM)] for i in range(DIM)]
    hadamard = torch.tensor(signs, dtype=torch.float64) / math.sqrt(DIM)
    return q @ hadamard, k @ hadamard, hidden @ state[p + "weights_proj.weight"].double().T


def relative(x: torch.Tensor, want: torch.Tensor) -> float:
    return float((x.detach().double() - want).norm() / want.norm())


def make_layer(dtype: torch.dtype, state=None, layer: int = 13, fp8_weights: bool = False,
               config=HF_CONFIG) -> dsa.Indexer:
    indexer = dsa.Indexer.from_hf_config(config, **LIMITS, num_blocks=8, dtype=dtype,
                                         fp8_weights=fp8_weights)
    indexer.load_checkpoint(make_checkpoint() if state is None else state,
                            prefix=prefix_of(layer))
    return indexer


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 8e-3)])
def test_projections_match_the_model(dtype, tol):
    state = make_checkpoint()
    layer = make_layer(dtype, state)
    assert layer.wq_b.weight.dtype == layer.wk.weight.dtype == dtype
    assert layer.weights_proj.weight.dtype == torch.float32
    assert layer.k_norm.weight.dtype == layer.k_norm.bias.dtype == torch.float32
    torch.manual_seed(1)
    hidden, q_latent = torch.randn(12, HIDDEN).to(dtype), torch.randn(12, Q_LORA).to(dtype)
    positions = torch.tensor([0, 1, 63, 1000, 4095, 4096, 4097, 5000, 6144, 7000, 8000, 8191])
    q, k, weights = layer._project(hidden, q_latent)
    rotation = (layer.rope_cos_sin, positions, layer.hadamard)  # the fused ops' torch face
    q, k = rope_hadamard(q, *rotation), rope_hadamard(k, *rotation)
    want_q, want_k, want_w = reference_projection(state, 13, hidden, q_latent, positions)
    assert relative(q, want_q) < tol and relative(k, want_k) < tol
    assert weights.dtype == torch.float32  # fp32 weights_proj, whatever the layer's dtype
    torch.testing.assert_close(weights.double(), want_w, rtol=1e-5, atol=1e-6)
    # quantize_q folds the softmax scale H^-0.5 D^-0.5 and q's fp8 scale into the weights
    _, head_weights = torch.ops.dsa.quantize_q(q, weights)
    q_scale = q.float().abs().amax(-1).clamp(min=1e-4) / 448
    torch.testing.assert_close(head_weights, weights * (HEADS * DIM) ** -0.5 * q_scale)


def test_fp8_weights_dequantise_exactly_in_fp32():
    state = make_checkpoint()
    layer = make_layer(torch.float32, state, layer=3)
    p = prefix_of(3)
    for name in ("wq_b", "wk"):
        want = dequantise(state[f"{p}{name}.weight"], state[f"{p}{name}.weight_scale_inv"])
        assert torch.equal(getattr(layer, name).weight, want.float())
    assert torch.equal(layer.weights_proj.weight, state[p + "weights_proj.weight"].float())
    assert torch.equal(layer.k_norm.bias, state[p + "k_norm.bias"].float())


def test_unquantised_checkpoint_and_prefix_without_dot():
    state = make_checkpoint()
    p = prefix_of(3)
    plain = {key: value for key, value in state.items() if not key.endswith("_scale_inv")}
    for name in ("wq_b", "wk"):
        plain[f"{p}{name}.weight"] = dequantise(state[f"{p}{name}.weight"],
                                                state[f"{p}{name}.weight_scale_inv"]).float()
    layer = dsa.Indexer.from_hf_config(HF_CONFIG, **LIMITS, num_blocks=8, dtype=torch.float32)
    layer.load_checkpoint(plain, prefix=p.rstrip("."))
    assert torch.equal(layer.wq_b.weight, make_layer(torch.float32, state, 3).wq_b.weight)


def test_fp8_weights_are_kept_as_shipped():
    state = make_checkpoint()
    layer = make_layer(torch.bfloat16, state, layer=3, fp8_weights=True)
    p = prefix_of(3)
    for name in ("wq_b", "wk"):
        linear = getattr(layer, name)
        assert torch.equal(linear.weight.view(torch.uint8),
                           state[f"{p}{name}.weight"].view(torch.uint8))
        assert torch.equal(linear.weight_scale_inv, state[f"{p}{name}.weight_scale_inv"])
    assert set(layer.state_dict()) >= {"wq_b.weight_scale_inv", "wk.weight_scale_inv"}
    plain = dict(state)
    plain[p + "wk.weight"] = dequantise(state[p + "wk.weight"],
                                        state[p + "wk.weight_scale_inv"]).bfloat16()
    del plain[p + "wk.weight_scale_inv"]
    with pytest.raises(ValueError, match=re.escape(
            f"'{p}wk.weight' has dtype torch.bfloat16, expected fp8 e4m3 for a layer built "
            "with fp8_weights=True")):
        layer.load_checkpoint(plain, prefix=p)


def check_selection(indices: torch.Tensor, logits: list[np.ndarray]) -> None:
    """min(topk, valid) unique valid indices then -1, and a true top-k up to fp noise."""
    for row, want in zip(indices.tolist(), logits):
        chosen = [i for i in row if i >= 0]
        assert row[len(chosen):] == [-1] * (TOPK - len(chosen))
        assert len(set(chosen)) == len(chosen) == min(TOPK, len(want))
        rest = np.delete(want, chosen)
        if rest.size:
            assert want[chosen].min() >= rest.max() - 1e-4 * np.abs(want).max()


def run_prefill_then_decode(layer: dsa.Indexer, seed: int = 2):
    """A prefill step (40 and 24 tokens), then a decode step of both requests: each step's
    batch, inputs and indices."""
    cfg = layer.cfg
    table = torch.zeros(2, cfg.max_blocks_per_req, dtype=torch.int32)
    table[0, 0], table[1, 0] = 5, 2
    gen = torch.Generator().manual_seed(seed)
    seq_lens, steps = [0, 0], []
    for query_lens in ([40, 24], [1, 1]):
        positions = [pos for r, q in enumerate(query_lens)
                     for pos in range(seq_lens[r], seq_lens[r] + q)]
        requests = [r for r, q in enumerate(query_lens) for _ in range(q)]
        seq_lens = [s + q for s, q in zip(seq_lens, query_lens)]
        qsl = [0, query_lens[0], sum(query_lens)]
        slots = [int(table[r, 0]) * 64 + pos for r, pos in zip(requests, positions)]
        batch = dsa.Batch(torch.tensor(qsl, dtype=torch.int32),
                          torch.tensor(seq_lens, dtype=torch.int32), table,
                          torch.tensor(slots), torch.tensor(positions))
        meta = (dsa.build_decode_metadata(cfg, batch) if max(query_lens) == 1 else
                dsa.build_prefill_metadata(cfg, batch, seq_lens_cpu=seq_lens,
                                           query_start_loc_cpu=qsl))
        hidden = torch.randn(len(slots), HIDDEN, generator=gen).to(layer.dtype)
        q_latent = torch.randn(len(slots), Q_LORA, generator=gen).to(layer.dtype)
        out = layer(hidden, q_latent, batch.positions, meta)
        steps.append((requests, positions, hidden, q_latent, out))
    return steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_weights_layer_selects_as_the_dequantised_one(dtype):
    """Prefill (the torch projections) and decode (the fused op): the same indices, slots
    and K cache as the layer holding the weights dequantised."""
    state = make_checkpoint()
    fp8 = make_layer(dtype, state, layer=3, fp8_weights=True)
    plain = make_layer(dtype, state, layer=3)
    for got, want in zip(run_prefill_then_decode(fp8), run_prefill_then_decode(plain),
                         strict=True):
        assert torch.equal(got[-1].indices, want[-1].indices)
        assert torch.equal(got[-1].slots, want[-1].slots)
    assert torch.equal(fp8.kv_cache, plain.kv_cache)


@pytest.mark.parametrize("scale_fmt, interleave", [(None, False), ("ue8m0", False),
                                                   ("ue8m0", True)])
def test_from_hf_config_layer_runs_prefill_then_decode(scale_fmt, interleave):
    """... with the q and k scales of the config's scale_fmt (DeepSeek's fp8 checkpoints:
    ue8m0, powers of two) and its indexer RoPE (GLM-5's: interleaved pairs)."""
    state = make_checkpoint()
    config = {**HF_CONFIG, "indexer_rope_interleave": interleave,
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                      "weight_block_size": [128, 128], "scale_fmt": scale_fmt}}
    layer = make_layer(torch.float32, state, layer=3, config=config)
    cfg = layer.cfg
    assert (cfg.num_heads, cfg.head_dim, cfg.topk, layer.rope_dim) == (HEADS, DIM, TOPK, 64)
    ue8m0 = scale_fmt == "ue8m0"
    assert (cfg.ue8m0_scales, layer.rope_interleaved) == (ue8m0, interleave)
    keys, logits, outputs = {}, [], []
    for requests, positions, hidden, q_latent, out in run_prefill_then_decode(layer):
        outputs.append(out.indices)
        q, k, w = reference_projection(state, 3, hidden, q_latent, torch.tensor(positions),
                                       interleave)
        q_codes, head_weights = ref.quantize_q(q.float().numpy(), w.float().numpy(), ue8m0)
        for r, pos, row in zip(requests, positions, k.float().numpy()):
            codes, scale = ref.quantize_row(row, ue8m0)
            keys[r, pos] = (ref.fp8_decode(codes), float(scale))
        for t, (r, pos) in enumerate(zip(requests, positions)):
            k_rows = np.stack([keys[r, s][0] for s in range(pos + 1)])
            k_scales = np.array([keys[r, s][1] for s in range(pos + 1)])
            logits.append(ref._logits(ref.fp8_decode(q_codes[t]), head_weights[t], k_rows,
                                      k_scales))
    check_selection(torch.cat(outputs), logits)


def test_load_checkpoint_errors():
    p = prefix_of(3)
    layer = dsa.Indexer.from_hf_config(HF_CONFIG, **LIMITS, num_blocks=8)
    cases = [
        ({p + "wk.weight": None}, f"missing key '{p}wk.weight' \\(expected shape \\[128, 320\\]"),
        ({p + "wq_b.weight_scale_inv": None},
         f"missing key '{p}wq_b.weight_scale_inv' \\(expected shape \\[8, 2\\]"),
        ({p + "wk.weight": torch.zeros(HIDDEN, DIM)},
         f"'{p}wk.weight' has shape \\[320, 128\\], expected \\[128, 320\\]"),
        ({p + "wk.weight_scale_inv": torch.ones(1, 2)},
         f"'{p}wk.weight_scale_inv' has shape \\[1, 2\\], expected \\[1, 3\\]"),
        ({p + "k_norm.bias": torch.zeros(DIM + 1)},
         f"'{p}k_norm.bias' has shape \\[129\\], expected \\[128\\]"),
        ({p + "wk.bias": torch.zeros(DIM)}, f"unexpected keys \\['{p}wk.bias'\\]"),
        ({p + "weights_proj.weight_scale_inv": torch.ones(1, 3)},
         f"unexpected keys \\['{p}weights_proj.weight_scale_inv'\\]"),
        ({p + "k_norm.weight": torch.ones(DIM, dtype=torch.int32)},
         f"'{p}k_norm.weight' has dtype torch.int32, expected bf16/fp16/fp32"),
        ({p + "k_norm.weight": torch.ones(DIM).to(torch.float8_e4m3fn)},
         "has dtype torch.float8_e4m3fn"),
        ({p + "wk.weight_scale_inv": torch.ones(1, 3, dtype=torch.int32)},
         f"'{p}wk.weight_scale_inv' has dtype torch.int32, expected the fp32 block scales"),
    ]
    for change, match in cases:
        state = make_checkpoint()
        for key, value in change.items():
            if value is None:
                del state[key]
            else:
                state[key] = value
        with pytest.raises(ValueError, match=match):
            layer.load_checkpoint(state, prefix=p)
    with pytest.raises(ValueError, match=re.escape(f"missing key '{prefix_of(7)}wq_b")):
        layer.load_checkpoint(make_checkpoint(), prefix=prefix_of(7))
    fp8_layer = dsa.Indexer.from_hf_config(HF_CONFIG, **LIMITS, num_blocks=8, fp8_weights=True)
    state = make_checkpoint()
    state[p + "wq_b.weight_scale_inv"] = state[p + "wq_b.weight_scale_inv"].to(
        torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=f"'{p}wq_b.weight_scale_inv' has dtype "
                                         "torch.float8_e4m3fn, expected the fp32 block scales"):
        fp8_layer.load_checkpoint(state, prefix=p)


@pytest.mark.parametrize("key", ["hidden_size", "q_lora_rank", "index_n_heads",
                                 "index_head_dim", "index_topk", "qk_rope_head_dim",
                                 "rope_theta"])
def test_from_hf_config_names_a_missing_key(key):
    config = {k: v for k, v in HF_CONFIG.items() if k != key}
    with pytest.raises(ValueError, match=f"the config has no '{key}'"):
        dsa.Indexer.from_hf_config(config, **LIMITS, num_blocks=8)
    with pytest.raises(ValueError, match=f"the config has no '{key}'"):
        dsa.Indexer.from_hf_config({**HF_CONFIG, key: None}, **LIMITS, num_blocks=8)


def test_from_hf_config_reads_config_objects_and_checks_fields():
    class Config:
        def to_dict(self):
            return HF_CONFIG

    assert dsa.Indexer.from_hf_config(Config(), **LIMITS, num_blocks=8).rope_dim == HF_CONFIG[
        "qk_rope_head_dim"]
    with pytest.raises(ValueError, match="indexer_rope_interleave must be true, false or "
                                         "absent, got 'false'"):
        dsa.Indexer.from_hf_config({**HF_CONFIG, "indexer_rope_interleave": "false"}, **LIMITS,
                                   num_blocks=8)
    theta = HF_CONFIG["rope_theta"]
    both = {**HF_CONFIG, "rope_parameters": {"rope_theta": theta}}
    assert dsa.Indexer.from_hf_config(both, **LIMITS, num_blocks=8) is not None
    with pytest.raises(ValueError, match=r"RoPE thetas disagree: \{'rope_theta': .*, "
                                         r"'rope_parameters.rope_theta': "):
        dsa.Indexer.from_hf_config({**both, "rope_parameters": {"rope_theta": 2 * theta}},
                                   **LIMITS, num_blocks=8)
    # transformers 5 writes rope_theta (and rope_type) into a config.json's rope_scaling
    scaling = {**HF_CONFIG["rope_scaling"], "rope_theta": theta, "rope_type": "yarn"}
    normalised = dsa.Indexer.from_hf_config({**HF_CONFIG, "rope_scaling": scaling}, **LIMITS,
                                            num_blocks=8)
    plain = dsa.Indexer.from_hf_config(HF_CONFIG, **LIMITS, num_blocks=8)
    assert torch.equal(normalised.rope_cos_sin, plain.rope_cos_sin)
    with pytest.raises(ValueError, match=r"'rope_scaling.rope_theta': "):
        dsa.Indexer.from_hf_config({**HF_CONFIG, "rope_scaling": {**scaling, "rope_theta": 1.0}},
                                   **LIMITS, num_blocks=8)


@pytest.mark.parametrize(("change", "error", "match"), [
    ({"rope_theta": 0.0}, ValueError, "`rope_theta` must be a positive finite number, got 0.0"),
    ({"rope_theta": "1e4"}, ValueError, "`rope_theta` must be a positive finite number"),
    ({"q_lora_rank": 0}, ValueError, "`q_lora_rank` must be a positive int, got 0"),
    ({"hidden_size": 7.0}, ValueError, "`hidden_size` must be a positive int, got 7.0"),
    ({"rope_scaling": {"factor": 4}}, TypeError, "`rope_scaling` must be a dsa.YarnScaling"),
    ({"dtype": torch.int32}, ValueError, "`dtype` must be one of"),
])
def test_indexer_checks_its_arguments(change, error, match):
    cfg = dsa.IndexerConfig(**LIMITS, num_blocks=8)
    args = {"hidden_size": 64, "q_lora_rank": 32, **change}
    with pytest.raises(error, match=f"Indexer: {match}"):
        dsa.Indexer(cfg, **args)
    with pytest.raises(TypeError, match=r"`cfg` must be a dsa\.IndexerConfig, got dict"):
        dsa.Indexer(dict(LIMITS), hidden_size=64, q_lora_rank=32)


def test_from_hf_config_scale_fmt():
    def layer(config, **overrides):
        return dsa.Indexer.from_hf_config(config, **LIMITS, num_blocks=8, **overrides)

    ue8m0 = {**HF_CONFIG, "quantization_config": {"quant_method": "fp8", "scale_fmt": "ue8m0"}}
    assert layer(ue8m0).cfg.ue8m0_scales
    assert not layer(ue8m0, ue8m0_scales=False).cfg.ue8m0_scales
    assert not layer(HF_CONFIG).cfg.ue8m0_scales
    assert not layer({**HF_CONFIG, "quantization_config": None}).cfg.ue8m0_scales
    assert layer(HF_CONFIG, ue8m0_scales=True).cfg.ue8m0_scales
    with pytest.raises(ValueError, match="scale_fmt must be 'ue8m0' or absent, got 'e5m2'"):
        layer({**HF_CONFIG, "quantization_config": {"scale_fmt": "e5m2"}})


def test_from_hf_config_rope_parameters():
    """transformers 5 writes rope_theta and the scaling into one rope_parameters dict."""
    flat = dsa.Indexer.from_hf_config(HF_CONFIG, **LIMITS, num_blocks=8)
    nested = {k: v for k, v in HF_CONFIG.items() if k not in ("rope_theta", "rope_scaling")}
    nested["rope_parameters"] = {"rope_theta": 10000, **V32_ROPE_SCALING}
    assert torch.equal(dsa.Indexer.from_hf_config(nested, **LIMITS, num_blocks=8).rope_cos_sin,
                       flat.rope_cos_sin)
    plain = {**nested, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}
    np.testing.assert_allclose(
        dsa.Indexer.from_hf_config(plain, **LIMITS, num_blocks=8).rope_cos_sin.numpy(),
        spec_table(8192, 64, 10000.0), atol=1e-6)
    with pytest.raises(ValueError, match="the config has no 'rope_theta' \\(nor rope_param"):
        dsa.Indexer.from_hf_config({**nested, "rope_parameters": {"rope_type": "default"}},
                                   **LIMITS, num_blocks=8)


def test_from_hf_config_glm5_style():
    """A GLM-5-style config (glm_moe_dsa): plain RoPE of theta 8e6 in rope_parameters, on
    interleaved pairs, ue8m0 scales."""
    config = {k: v for k, v in HF_CONFIG.items() if k not in ("rope_theta", "rope_scaling")}
    config.update(architectures=["GlmMoeDsaForCausalLM"], indexer_rope_interleave=True,
                  rope_parameters={"rope_theta": 8000000, "rope_type": "default"},
                  quantization_config={"quant_method": "fp8", "scale_fmt": "ue8m0"})
    layer = dsa.Indexer.from_hf_config(config, **LIMITS, num_blocks=8)
    assert layer.rope_interleaved and layer.cfg.ue8m0_scales
    np.testing.assert_allclose(layer.rope_cos_sin.numpy(), spec_table(8192, 64, 8e6), atol=1e-6)


def test_from_hf_config_rope_scaling():
    plain = dsa.Indexer.from_hf_config({**HF_CONFIG, "rope_scaling": None}, **LIMITS,
                                       num_blocks=8, block_size=32, next_n=2)
    assert (plain.cfg.block_size, plain.cfg.next_n) == (32, 2)
    np.testing.assert_allclose(plain.rope_cos_sin.numpy(), spec_table(8192, 64, 10000.0),
                               atol=1e-6)
    with pytest.raises(ValueError, match=r"must be one of .*got 'dynamic'"):
        dsa.Indexer.from_hf_config({**HF_CONFIG, "rope_scaling": {"type": "dynamic"}},
                                   **LIMITS, num_blocks=8)
