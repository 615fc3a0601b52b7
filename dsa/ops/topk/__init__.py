"""Top-k selection: ``select`` (Triton building blocks of an exact selection), ``indices``
(``dsa::topk_indices``, ``dsa::topk_indices_and_slots``), ``scored`` (``dsa::topk_scored``
and ``dsa::dcp_merge_topk``: top-k with scores in one total order, merged across DCP ranks),
``slots`` (``dsa::indices_to_slots``, positions to cache slots)."""

from dsa.ops.topk import indices, scored, select, slots

__all__ = ["indices", "scored", "select", "slots"]
