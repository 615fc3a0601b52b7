"""Capture a compiled decode step once per batch bucket; replay it for live batches.

``dsa`` captures with ``torch.cuda.CUDAGraph`` around a ``torch.compile(fullgraph=True)``
step rather than relying on ``mode="reduce-overhead"``: the engine already owns fixed input
buffers (``StaticBatch``), so replay needs no extra input copies, warm-up is explicit (every
Triton and DeepGEMM JIT kernel compiles before capture), and one memory pool serves every
bucket. ``mode="reduce-overhead"`` works with the same step too (the K cache is a module
buffer, so its in-place write does not make cudagraph trees skip the graph).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from dsa.config import IndexerConfig
from dsa.graphs.sizes import bucket_for, capture_sizes
from dsa.graphs.static_batch import StaticBatch, TokenInputs
from dsa.meta.batch import Batch

Step = Callable[..., Any]


class DecodeGraphRunner:
    """One CUDA graph per batch bucket around ``step(batch, **token_inputs)``.

    Args:
        step: the decode step: builds metadata from ``batch`` (once) and runs every layer.
        cfg: the indexer config (``next_n`` sets tokens per request of each bucket).
        token_inputs: name -> (trailing shape, dtype) of each token-major model input.
        table_width: block-table columns of the static batches.
        sizes: batch buckets; default ``capture_sizes(cfg.max_num_reqs)``.
        compile_backend: ``torch.compile`` backend ("inductor"; "aot_eager" keeps eager
            numerics bit for bit), or ``None`` to capture the step uncompiled.
        device: a CUDA device (on the CPU, call the compiled step directly).

    The step may return any pytree of tensors, ``dsa``'s dataclasses included
    (``IndexerOutput``, ``DecodeMetadata``); see ``live_outputs``.
    """

    def __init__(
        self,
        step: Step,
        cfg: IndexerConfig,
        *,
        token_inputs: TokenInputs,
        table_width: int,
        sizes: Sequence[int] | None = None,
        compile_backend: str | None = "inductor",
        device: torch.device | str = "cuda",
    ) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"DecodeGraphRunner: CUDA graphs need a CUDA device, got "
                             f"{self.device}; on the CPU, call the compiled step directly")
        self.cfg = cfg
        self.sizes = tuple(sorted(sizes or capture_sizes(cfg.max_num_reqs)))
        self.step = step
        if compile_backend is not None:
            self.step = torch.compile(step, fullgraph=True, dynamic=False,
                                      backend=compile_backend)
        self._static = {
            size: StaticBatch(size, size * cfg.next_n, table_width, token_inputs=token_inputs,
                              device=self.device)
            for size in self.sizes
        }
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Any]] = {}

    def capture(self, warmup_iters: int = 2) -> None:
        """Warms up and captures every bucket, largest first (smaller ones reuse its pool)."""
        pool = torch.cuda.graph_pool_handle()
        limit = len(self.sizes) + 8
        with torch._dynamo.config.patch(recompile_limit=limit,
                                        accumulated_recompile_limit=limit * 4):
            for size in reversed(self.sizes):
                static = self._static[size]
                _fill_warmup_batch(static, self.cfg.next_n)
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(warmup_iters):
                        self.step(static.batch, **static.inputs)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    outputs = self.step(static.batch, **static.inputs)
                self._graphs[size] = (graph, outputs)
        torch.cuda.synchronize(self.device)

    def bucket(self, num_reqs: int) -> int:
        """The bucket a batch of ``num_reqs`` requests replays in."""
        return bucket_for(num_reqs, self.sizes)

    def replay(self, live: Batch, **token_inputs: Tensor) -> Any:
        """Runs ``live`` through its bucket's graph; returns the outputs of the real tokens
        (``live_outputs``: cut to the live tokens and cloned)."""
        size = self.bucket(live.num_reqs)
        if size not in self._graphs:
            raise RuntimeError(f"DecodeGraphRunner: bucket {size} is not captured; call "
                               "capture() first")
        static = self._static[size]
        static.load(live, **token_inputs)
        graph, outputs = self._graphs[size]
        graph.replay()
        return live_outputs(outputs, static.num_tokens, live.num_tokens)


def live_outputs(outputs: Any, capacity: int, live_tokens: int) -> Any:
    """A copy of a replay's ``outputs`` (any pytree) that the next replay cannot overwrite.

    Every tensor is cloned; a token-major one (leading dim = the bucket's token
    ``capacity``) keeps only its first ``live_tokens`` rows. Dataclasses must be pytree nodes
    (``dsa``'s are); any other one would come back uncut and shared, so it raises.
    """

    def cut(x: Any) -> Any:
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            raise TypeError(
                f"DecodeGraphRunner: the step returned a {type(x).__name__}, a dataclass that "
                "is not a pytree node, so its tensors cannot be cut and cloned; register it "
                "(torch.utils._pytree.register_dataclass) or return its tensors"
            )
        if not isinstance(x, Tensor):
            return x
        if x.dim() and x.shape[0] == capacity:
            x = x[:live_tokens]
        return x.clone()

    return tree_map(cut, outputs)


def _fill_warmup_batch(static: StaticBatch, next_n: int) -> None:
    """A full bucket of short requests, so warm-up launches every kernel on real work.

    Slots stay -1: warm-up never writes the K cache.
    """
    batch = static.batch
    reqs = static.num_reqs
    arange = torch.arange(reqs + 1, dtype=torch.int32, device=batch.seq_lens.device)
    batch.query_start_loc.copy_(arange * next_n)
    batch.seq_lens.fill_(next_n)
    batch.block_table.zero_()
    positions = torch.arange(static.num_tokens, device=batch.positions.device) % next_n
    batch.positions.copy_(positions)
    batch.slot_mapping.fill_(-1)
    for value in static.inputs.values():
        value.normal_() if value.is_floating_point() else value.zero_()
