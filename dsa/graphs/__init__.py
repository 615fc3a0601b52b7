"""Capture and replay whole decode steps as CUDA graphs (one per batch bucket)."""

from dsa.graphs.runner import DecodeGraphRunner
from dsa.graphs.sizes import bucket_for, capture_sizes
from dsa.graphs.static_batch import StaticBatch, pad_batch

__all__ = ["DecodeGraphRunner", "StaticBatch", "bucket_for", "capture_sizes", "pad_batch"]
