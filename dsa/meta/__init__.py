"""Host-side metadata planning (pure Python on host-known lengths)."""

from dsa.meta.chunking import split_prefill_chunks

__all__ = ["split_prefill_chunks"]
