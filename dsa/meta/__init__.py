"""Metadata types and builders: the step's batch in, what the indexer ops need out."""

from dsa.meta.batch import Batch
from dsa.meta.chunking import split_prefill_chunks
from dsa.meta.decode import DecodeMetadata, build_decode_metadata
from dsa.meta.prefill import PrefillChunk, PrefillMetadata, build_prefill_metadata

__all__ = [
    "Batch",
    "DecodeMetadata",
    "PrefillChunk",
    "PrefillMetadata",
    "build_decode_metadata",
    "build_prefill_metadata",
    "split_prefill_chunks",
]
