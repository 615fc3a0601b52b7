"""Shared indexer layers: layers that reuse an earlier layer's top-k instead of indexing.

IndexCache (Bai et al., "IndexCache: Accelerating Sparse Attention via Cross-Layer Index
Reuse", arXiv:2603.12201) splits a DSA model's layers into *full* layers, which run their own
indexer, and *shared* layers, which run none and reuse the top-k of the nearest full layer
before them. GLM-5.2 ships it as IndexShare (``indexer_types`` in its config: shared layers
have no indexer weights); vLLM and SGLang take it as ``index_topk_pattern`` (one "F" or "S"
per layer) or ``index_topk_freq`` with ``index_skip_topk_offset``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsa.config import hf_config_dict, hf_switch
from dsa.ops._checks import is_int

FULL, SHARED = "F", "S"
SKIP_TOPK_OFFSET = 2  # vLLM's and SGLang's default ``index_skip_topk_offset``


@dataclass(frozen=True)
class IndexShare:
    """Which indexer layers are full ("F") and which are shared ("S").

    A shared layer runs no indexer: its top-k (``IndexerOutput``: indices and slots) is the
    one its source layer computed in the same step, the nearest full layer before it. It
    has no indexer weights and no indexer K cache: no layer reads what it would write.
    Slots stay valid across layers because every layer of a step pages its caches through
    the same block table.

    Attributes:
        pattern: one "F" or "S" per indexer layer, first layer "F" (e.g. "FFSFSSSF...").
    """

    pattern: str

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern or set(self.pattern) - {
                FULL, SHARED}:
            raise ValueError(f"IndexShare: pattern must be a non-empty string of 'F' (full) "
                             f"and 'S' (shared), got {self.pattern!r}")
        if self.pattern[0] != FULL:
            raise ValueError(f"IndexShare: the first layer must be full ('F'): a shared layer "
                             f"needs a full layer before it, got {self.pattern!r}")

    @classmethod
    def every(cls, num_layers: int, freq: int, offset: int = SKIP_TOPK_OFFSET) -> IndexShare:
        """vLLM's and SGLang's ``index_topk_freq`` rule: layer i is full iff
        ``max(i - offset + 1, 0) % freq == 0`` (``offset`` = ``index_skip_topk_offset``).

        ``freq=1``: every layer full. ``freq=4, offset=2`` (the default offset) gives
        "FFSSSFSSSF...".
        """
        for name, value, low in (("num_layers", num_layers, 1), ("freq", freq, 1),
                                 ("offset", offset, 0)):
            if not is_int(value) or value < low:
                raise ValueError(f"IndexShare.every: {name} must be an int >= {low}, "
                                 f"got {value!r}")
        if freq > 1 and offset == 0:
            raise ValueError(f"IndexShare.every: offset 0 with freq {freq} makes the first "
                             f"layer shared, which needs a full layer before it; offset must "
                             f"be >= 1")
        return cls("".join(FULL if max(i - offset + 1, 0) % freq == 0 else SHARED
                           for i in range(num_layers)))

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> IndexShare:
        """The layers of a HF ``config.json`` dict (``num_hidden_layers`` of them).

        In order: GLM-5.2's ``indexer_types`` ("full" / "shared" per layer, what its
        checkpoint holds); with ``use_index_cache`` (vLLM's switch), ``index_topk_pattern``
        or else ``index_topk_freq`` and ``index_skip_topk_offset``; otherwise every layer
        full (DeepSeek V3.2 as shipped).
        """
        config = hf_config_dict(config, "IndexShare.from_hf_config")
        num_layers = config.get("num_hidden_layers")
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"IndexShare.from_hf_config: the config needs num_hidden_layers "
                             f"(a positive int), got {num_layers!r}")
        kinds = config.get("indexer_types")
        if kinds is not None:
            names = {"full": FULL, "shared": SHARED}
            if len(kinds) != num_layers or set(kinds) - set(names):
                raise ValueError(f"IndexShare.from_hf_config: indexer_types must list 'full' "
                                 f"or 'shared' for each of the {num_layers} layers, got "
                                 f"{kinds!r}")
            return cls("".join(names[kind] for kind in kinds))
        if not hf_switch(config, "use_index_cache", "IndexShare.from_hf_config"):
            return cls(FULL * num_layers)
        pattern = config.get("index_topk_pattern")
        if pattern is not None:
            if len(pattern) != num_layers:
                raise ValueError(f"IndexShare.from_hf_config: index_topk_pattern must have one "
                                 f"'F' or 'S' per layer ({num_layers}), got {len(pattern)}")
            return cls(pattern)
        freq, offset = config.get("index_topk_freq"), config.get("index_skip_topk_offset")
        return cls.every(num_layers, 1 if freq is None else freq,
                         SKIP_TOPK_OFFSET if offset is None else offset)

    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    def is_full(self, layer: int) -> bool:
        """Whether ``layer`` (``0 .. num_layers - 1``) runs its own indexer."""
        if not is_int(layer) or not 0 <= layer < self.num_layers:
            raise ValueError(f"IndexShare.is_full: layer must be an int in [0, "
                             f"{self.num_layers}), got {layer!r}")
        return self.pattern[layer] == FULL

    @property
    def sources(self) -> tuple[int, ...]:
        """Each layer's source: itself when full, else the nearest full layer before it."""
        sources, last = [], 0
        for layer, kind in enumerate(self.pattern):
            if kind == FULL:
                last = layer
            sources.append(last)
        return tuple(sources)
