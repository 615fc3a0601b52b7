"""Indexer logits: ``common`` (output layout, backend choice), ``paged`` (decode rows from the
paged cache), ``ragged`` (prefill rows from a gathered workspace), ``schedule`` (DeepGEMM's
paged schedule), ``deepgemm`` (the optional DeepGEMM backend)."""

from dsa.ops.logits import common, deepgemm, paged, ragged, schedule
from dsa.ops.logits.paged import paged_backend, paged_logits
from dsa.ops.logits.ragged import ragged_backend, ragged_logits

__all__ = [
    "common",
    "deepgemm",
    "paged",
    "paged_backend",
    "paged_logits",
    "ragged",
    "ragged_backend",
    "ragged_logits",
    "schedule",
]
