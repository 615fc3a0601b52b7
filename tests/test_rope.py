"""The indexer's RoPE table (design §10): plain and YaRN, against a float64 transcription of the
design's equations, and the Hugging Face ``rope_scaling`` parsing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import dsa
from dsa.rope import (
    YarnScaling,
    interleaved_rope,
    neox_rope,
    rope_scaling_from_hf,
    rope_table,
)

V32_ROPE_SCALING = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def yarn_bounds(d: int, base: float, l0: int, beta_fast: float, beta_slow: float
                ) -> tuple[float, float]:
    def corr(r):
        return d * math.log(l0 / (2 * math.pi * r)) / (2 * math.log(base))

    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), d - 1)
    return low, high + 0.001 if low == high else high


def spec_table(max_len: int, d: int, base: float, yarn: dict | None = None) -> np.ndarray:
    """float64 ``[max_len, d]`` (cos, then sin) of design §10, one frequency at a time."""
    positions = np.arange(max_len, dtype=np.float64)
    out = np.empty((max_len, d))
    amplitude = 1.0
    if yarn is not None:
        s = yarn["factor"]

        def get_mscale(m):
            return 0.1 * m * math.log(s) + 1 if s > 1 else 1.0

        amplitude = get_mscale(yarn["mscale"]) / get_mscale(yarn["mscale_all_dim"])
        low, high = yarn_bounds(d, base, yarn["original_max_position_embeddings"],
                                yarn["beta_fast"], yarn["beta_slow"])
    for i in range(d // 2):
        freq = base ** (-2 * i / d)
        if yarn is not None:
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)
            freq = freq / s * ramp + freq * (1 - ramp)
        out[:, i] = amplitude * np.cos(positions * freq)
        out[:, d // 2 + i] = amplitude * np.sin(positions * freq)
    return out


YARN_CASES = {
    "deepseek-v3.2": (64, 10000.0, V32_ROPE_SCALING),
    "other-numbers": (32, 50000.0, {"type": "yarn", "factor": 4, "beta_fast": 16,
                                    "original_max_position_embeddings": 256, "beta_slow": 2,
                                    "mscale": 1.0, "mscale_all_dim": 0.0}),
    "low-equals-high": (64, 10000.0, {**V32_ROPE_SCALING, "original_max_position_embeddings": 6}),
    "high-clamped": (64, 10000.0, {**V32_ROPE_SCALING, "beta_fast": 1e5,
                                   "original_max_position_embeddings": 10**9}),
}


@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_table_matches_spec(case):
    d, base, hf = YARN_CASES[case]
    scaling = rope_scaling_from_hf(hf)
    table = rope_table(8192, d, base, scaling)
    assert table.dtype == torch.float32 and table.shape == (8192, d)
    want = spec_table(8192, d, base, hf)
    np.testing.assert_allclose(table.numpy(), want, rtol=0, atol=1e-6)
    assert not np.allclose(want, spec_table(8192, d, base), atol=1e-3)  # YaRN did something


def test_the_cases_reach_the_corners():
    low, high = yarn_bounds(64, 10000.0, 4096, 32, 1)
    assert (low, high) == (10, 23)
    assert yarn_bounds(64, 10000.0, 6, 32, 1) == (0, 0.001)
    assert yarn_bounds(64, 10000.0, 10**9, 1e5, 1) == (25, 63)
    assert YarnScaling(40, 4096, mscale=1.0, mscale_all_dim=1.0).amplitude == 1.0
    assert YarnScaling(40, 4096).amplitude == pytest.approx(1 + 0.1 * math.log(40))


def test_plain_table_is_unchanged():
    table = rope_table(4096, 64, 10000.0)
    np.testing.assert_allclose(table.numpy(), spec_table(4096, 64, 10000.0), rtol=0, atol=1e-6)
    np.testing.assert_allclose(rope_table(4096, 64, 10000.0, YarnScaling(1.0, 4096)).numpy(),
                               table.numpy(), rtol=0, atol=1e-7)


def test_indexer_takes_the_scaling():
    cfg = dsa.IndexerConfig(max_num_reqs=2, max_num_batched_tokens=8, max_model_len=512,
                            num_heads=4, head_dim=64, topk=8, num_blocks=4)
    kwargs = {"hidden_size": 16, "q_lora_rank": 16, "rope_dim": 32}
    plain = dsa.Indexer(cfg, **kwargs)
    assert torch.equal(plain.rope_cos_sin, rope_table(512, 32, 10000.0))
    # engines scale whenever the config says yarn, also when max_model_len <= L0
    yarn = dsa.Indexer(cfg, rope_scaling=rope_scaling_from_hf(V32_ROPE_SCALING), **kwargs)
    np.testing.assert_allclose(yarn.rope_cos_sin.numpy(),
                               spec_table(512, 32, 10000.0, V32_ROPE_SCALING), atol=1e-6)


def test_hf_rope_scaling_spellings():
    want = YarnScaling(factor=40, original_max_position_embeddings=4096, beta_fast=32,
                       beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
    assert rope_scaling_from_hf(V32_ROPE_SCALING) == want
    hf = {k: v for k, v in V32_ROPE_SCALING.items() if k != "type"}
    assert rope_scaling_from_hf({**hf, "rope_type": "yarn"}) == want
    assert rope_scaling_from_hf({**hf, "rope_type": "yarn", "type": "yarn"}) == want
    defaults = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    assert rope_scaling_from_hf(defaults) == YarnScaling(4.0, 1024)
    for plain in (None, {"type": "default"}, {"rope_type": "none"}):
        assert rope_scaling_from_hf(plain) is None


@pytest.mark.parametrize("hf, match", [
    ({"type": "linear", "factor": 2.0},
     r"must be one of \['default', 'none', 'yarn'\], got 'linear'"),
    ({"factor": 2.0}, r"'type' \(or 'rope_type'\) must be one of .*got None"),
    ({"type": "yarn", "factor": 40}, "yarn needs the key 'original_max_position_embeddings'"),
    ({**V32_ROPE_SCALING, "attention_factor": 2.0},
     r"unsupported yarn keys \['attention_factor'\]"),
    ({**V32_ROPE_SCALING, "factor": 0.5}, "factor must be >= 1"),
    ({**V32_ROPE_SCALING, "factor": "40"}, "factor must be a finite number, got '40'"),
    ({**V32_ROPE_SCALING, "mscale": float("nan")}, "mscale must be a finite number, got nan"),
])
def test_bad_rope_scaling_raises(hf, match):
    with pytest.raises(ValueError, match=match):
        rope_scaling_from_hf(hf)


@pytest.mark.parametrize("rope_dim, head_dim", [(2, 2), (4, 8), (64, 128), (6, 10)])
def test_interleaved_rope_is_neox_on_paired_dims(rope_dim, head_dim):
    """Interleaved pairs (2i, 2i + 1) rotate as NeoX halves (i, i + rope_dim / 2) of the dims
    gathered evens first, bit for bit; the dims past rope_dim stay."""
    gen = torch.Generator().manual_seed(rope_dim)
    x = torch.randn(5, 3, head_dim, generator=gen).bfloat16()
    cos_sin = rope_table(5, rope_dim, 10000.0)[:, None]
    evens_first = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2),
                             torch.arange(rope_dim, head_dim)])
    back = torch.argsort(evens_first)
    want = neox_rope(x[..., evens_first], cos_sin, rope_dim)[..., back]
    assert torch.equal(interleaved_rope(x, cos_sin, rope_dim), want)
    assert not torch.equal(want, neox_rope(x, cos_sin, rope_dim)) or rope_dim == 2
