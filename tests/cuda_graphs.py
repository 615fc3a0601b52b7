"""CUDA-graph capture for the GPU tests."""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(fn: Callable, *args) -> tuple[Callable[[], object], object]:
    """``fn(*args)`` warmed up on a side stream, then captured as one CUDA graph; returns
    (replay, the graph's outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    return graph.replay, out
