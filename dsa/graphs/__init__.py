"""Capture and replay whole decode steps as CUDA graphs (one per batch bucket)."""

from dsa.graphs.runner import DecodeGraphRunner, live_outputs
from dsa.graphs.sizes import bucket_for, capture_sizes
from dsa.graphs.static_batch import StaticBatch, pad_batch

__all__ = ["DecodeGraphRunner", "StaticBatch", "bucket_for", "capture_sizes", "live_outputs",
           "pad_batch"]
