"""The indexer's RoPE (design §10): cos/sin tables, plain or YaRN-scaled, and the rotation of
NeoX halves (DeepSeek) or interleaved pairs (GLM-5)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dsa.ops._checks import is_finite_number

PLAIN_ROPE_TYPES = ("default", "none")
ROPE_TYPES = (*PLAIN_ROPE_TYPES, "yarn")
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim")


@dataclass(frozen=True)
class YarnScaling:
    """DeepSeek's YaRN rope scaling (design §10), as a Hugging Face ``rope_scaling`` gives it.

    Applied whenever it is set, whatever ``max_model_len`` is, as serving engines do
    (DeepSeek's own reference applies it only past ``original_max_position_embeddings``).
    Defaults are those of the engines for keys a config leaves out.

    Attributes:
        factor: context extension factor s (DeepSeek V3.2: 40).
        original_max_position_embeddings: the pre-extension length L0 (DeepSeek V3.2: 4096).
        beta_fast, beta_slow: rotation counts bounding the interpolation ramp.
        mscale, mscale_all_dim: cos/sin amplitude ``get_mscale(s, mscale) /
            get_mscale(s, mscale_all_dim)`` with ``get_mscale(s, m) = 0.1 m ln(s) + 1``.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        for name in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                     "mscale", "mscale_all_dim"):
            value = getattr(self, name)
            if not is_finite_number(value):
                raise ValueError(f"YarnScaling: {name} must be a finite number, got {value!r}")
        if not self.factor >= 1:
            raise ValueError(f"YarnScaling: factor must be >= 1, got {self.factor!r}")
        if self.original_max_position_embeddings < 1:
            raise ValueError("YarnScaling: original_max_position_embeddings must be >= 1, got "
                             f"{self.original_max_position_embeddings!r}")
        if not self.beta_fast > 0 or not self.beta_slow > 0:
            raise ValueError(f"YarnScaling: beta_fast and beta_slow must be > 0, got "
                             f"{self.beta_fast!r} and {self.beta_slow!r}")

    @property
    def amplitude(self) -> float:
        """The factor applied to cos and sin (1 when ``mscale == mscale_all_dim``)."""
        return _mscale(self.factor, self.mscale) / _mscale(self.factor, self.mscale_all_dim)

    def scale_inv_freq(self, inv_freq: Tensor, theta: float) -> Tensor:
        """Blends interpolated (``/ factor``) and original frequencies along the YaRN ramp."""
        rope_dim = 2 * inv_freq.shape[0]

        def corr(rotations: float) -> float:
            return (rope_dim * math.log(self.original_max_position_embeddings
                                        / (2 * math.pi * rotations)) / (2 * math.log(theta)))

        low = max(math.floor(corr(self.beta_fast)), 0)
        high = min(math.ceil(corr(self.beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001
        i = torch.arange(inv_freq.shape[0], dtype=inv_freq.dtype, device=inv_freq.device)
        ramp = ((i - low) / (high - low)).clamp(0, 1)
        return inv_freq / self.factor * ramp + inv_freq * (1 - ramp)


def rope_scaling_from_hf(rope_scaling: Mapping[str, Any] | None) -> YarnScaling | None:
    """A Hugging Face ``rope_scaling`` dict (``type`` or ``rope_type``) -> ``YarnScaling``,
    or ``None`` for plain RoPE (no dict, "default" or "none")."""
    if rope_scaling is None:
        return None
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind in PLAIN_ROPE_TYPES:
        return None
    if kind != "yarn":
        raise ValueError(f"rope_scaling: 'type' (or 'rope_type') must be one of "
                         f"{list(ROPE_TYPES)}, got {kind!r}")
    unknown = sorted(set(rope_scaling) - {"type", "rope_type", *_YARN_KEYS})
    if unknown:
        raise ValueError(f"rope_scaling: unsupported yarn keys {unknown}; supported: "
                         f"{list(_YARN_KEYS)}")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in rope_scaling:
            raise ValueError(f"rope_scaling: yarn needs the key {key!r}, got {dict(rope_scaling)}")
    return YarnScaling(**{k: rope_scaling[k] for k in _YARN_KEYS if k in rope_scaling})


def rope_table(max_len: int, rope_dim: int, theta: float, scaling: YarnScaling | None = None,
               device: torch.device | str | None = None) -> Tensor:
    """fp32 ``[max_len, rope_dim]``: cos of each frequency, then its sin (computed in fp64)."""
    inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64, device=device)
                         / rope_dim)
    amplitude = 1.0
    if scaling is not None:
        inv_freq, amplitude = scaling.scale_inv_freq(inv_freq, theta), scaling.amplitude
    angles = torch.arange(max_len, dtype=torch.float64, device=device)[:, None] * inv_freq
    return (torch.cat([angles.cos(), angles.sin()], dim=-1) * amplitude).float()


def neox_rope(x: Tensor, cos_sin: Tensor, rope_dim: int) -> Tensor:
    """NeoX-style rotation of the first ``rope_dim`` dims of ``x`` (halves, not pairs)."""
    half = rope_dim // 2
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    x1, x2 = x[..., :half].float(), x[..., half:rope_dim].float()
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rotated, x[..., rope_dim:]], dim=-1)


def interleaved_rope(x: Tensor, cos_sin: Tensor, rope_dim: int) -> Tensor:
    """GPT-J-style rotation of the first ``rope_dim`` dims of ``x``: dims ``2i`` and ``2i + 1``
    at frequency ``i`` (GLM-5's indexer)."""
    half = rope_dim // 2
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    pairs = x[..., :rope_dim].float().unflatten(-1, (half, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([rotated.to(x.dtype), x[..., rope_dim:]], dim=-1)


def _mscale(factor: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0
