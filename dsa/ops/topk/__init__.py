"""Top-k selection: ``select`` (Triton building blocks of an exact selection), ``indices``
(``dsa::topk_indices``, ``dsa::topk_indices_and_slots``), ``slots``
(``dsa::indices_to_slots``, positions to cache slots)."""

from dsa.ops.topk import indices, select, slots

__all__ = ["indices", "select", "slots"]
