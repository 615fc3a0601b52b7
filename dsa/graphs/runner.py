"""Capture a compiled decode step once per batch bucket; replay it for live batches.

``dsa`` captures with ``torch.cuda.CUDAGraph`` around a ``torch.compile(fullgraph=True)``
step rather than relying on ``mode="reduce-overhead"``: the engine can own the fixed input
buffers (``StaticBatch``) and write each step there, so a replay needs no input copies;
warm-up is explicit (every Triton and DeepGEMM JIT kernel compiles before capture), and one
memory pool serves every bucket. ``mode="reduce-overhead"`` works with the same step too
(the K cache is a module buffer, so its in-place write does not make cudagraph trees skip
the graph).
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
        buffers: input buffers the engine owns instead (a ``StaticBatch`` of at least the
            largest bucket's requests and tokens, on ``device``); then ``token_inputs`` and
            ``table_width`` come from it.
        sizes: batch buckets; default ``capture_sizes(cfg.max_num_reqs)``.
        compile_backend: ``torch.compile`` backend ("inductor"; "aot_eager" keeps eager
            numerics bit for bit), or ``None`` to capture the step uncompiled.
        device: a CUDA device (on the CPU, call the compiled step directly).

    Every bucket reads a prefix of one set of input buffers (``buffers``): its first
    ``bucket`` requests and ``bucket * cfg.next_n`` tokens. Three ways to replay, cheapest
    first: write the step's batch into ``static_batch(bucket)`` in place and call
    ``replay_in_place(bucket)``; ``load`` a live batch (one padding launch, which also
    copies up to two token inputs; one copy of the others) then ``replay_in_place``; or
    ``replay`` (load, replay, and copies of the live rows of the outputs).

    The step may return any pytree of tensors, ``dsa``'s dataclasses included
    (``IndexerOutput``, ``DecodeMetadata``); see ``live_outputs``.
    """

    def __init__(
        self,
        step: Step,
        cfg: IndexerConfig,
        *,
        token_inputs: TokenInputs | None = None,
        table_width: int | None = None,
        buffers: StaticBatch | None = None,
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
        if self.sizes[-1] > cfg.max_num_reqs:
            raise ValueError(f"DecodeGraphRunner: bucket {self.sizes[-1]} takes more requests "
                             f"than IndexerConfig.max_num_reqs={cfg.max_num_reqs}")
        too_many = [size for size in self.sizes if size * cfg.next_n > cfg.max_num_batched_tokens]
        if too_many:
            raise ValueError(f"DecodeGraphRunner: bucket {too_many[0]} takes {too_many[0]} * "
                             f"next_n = {too_many[0] * cfg.next_n} tokens, more than "
                             f"IndexerConfig.max_num_batched_tokens={cfg.max_num_batched_tokens}"
                             f" (raise it, or pass smaller sizes)")
        width = table_width if buffers is None else buffers.batch.block_table.shape[1]
        if width is not None and width < cfg.block_table_width:
            raise ValueError(f"DecodeGraphRunner: the block table width (`table_width` or "
                             f"`buffers`') must be at least IndexerConfig.block_table_width = "
                             f"{cfg.block_table_width}, got {width}")
        if not torch.cuda.is_available():
            raise RuntimeError("DecodeGraphRunner: CUDA graphs need a CUDA device, and torch "
                               "finds none; on the CPU, call the compiled step directly")
        if self.device.index is None:  # "cuda": the current one
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.step = step
        if compile_backend is not None:
            self.step = torch.compile(step, fullgraph=True, dynamic=False,
                                      backend=compile_backend)
        self.buffers = _input_buffers(buffers, token_inputs, table_width, self.sizes[-1],
                                      cfg.next_n, self.device)
        self._static = {size: self.buffers.prefix(size, size * cfg.next_n)
                        for size in self.sizes}
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

    def static_batch(self, bucket: int) -> StaticBatch:
        """The input buffers ``bucket``'s graph reads: views of the first ``bucket`` requests
        and ``bucket * cfg.next_n`` tokens of ``buffers``. Write a step's batch (padding
        included, design §9) and token inputs there, then ``replay_in_place(bucket)``."""
        if bucket not in self._static:
            raise ValueError(f"DecodeGraphRunner: {bucket} is not a bucket; buckets are "
                             f"{list(self.sizes)}")
        return self._static[bucket]

    def load(self, live: Batch, **token_inputs: Tensor) -> int:
        """Pads ``live`` (and its token inputs) into its bucket's static batch with one
        launch (``dsa::pad_batch_out``, which also copies up to two token inputs on CUDA)
        and one copy of the other inputs (``StaticBatch.load``); returns the bucket."""
        size = self.bucket(live.num_reqs)
        self._static[size].load(live, **token_inputs)
        return size

    def replay_in_place(self, bucket: int) -> Any:
        """Replays ``bucket``'s graph on what its static batch holds, nothing else (no copy,
        no check).

        Returns the graph's own outputs: tensors at the bucket's capacity (rows past the
        live tokens are padding: indices and slots -1), overwritten by the next replay of
        any bucket (all buckets share one memory pool). Read or copy them before then.
        """
        try:
            graph, outputs = self._graphs[bucket]
        except KeyError:
            raise RuntimeError(f"DecodeGraphRunner: bucket {bucket} is not captured; call "
                               "capture() first") from None
        graph.replay()
        return outputs

    def replay(self, live: Batch, **token_inputs: Tensor) -> Any:
        """Runs ``live`` through its bucket's graph; returns the outputs of the real tokens
        (``live_outputs``: cut to the live tokens and cloned)."""
        size = self.bucket(live.num_reqs)
        if size not in self._graphs:
            raise RuntimeError(f"DecodeGraphRunner: bucket {size} is not captured; call "
                               "capture() first")
        self._static[size].load(live, **token_inputs)
        outputs = self.replay_in_place(size)
        return live_outputs(outputs, self._static[size].num_tokens, live.num_tokens)


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

    Slots and block ids stay -1 (block-derived slots, as compressed caches take, are -1 too):
    warm-up never writes the K cache.
    """
    batch = static.batch
    reqs = static.num_reqs
    arange = torch.arange(reqs + 1, dtype=torch.int32, device=batch.seq_lens.device)
    batch.query_start_loc.copy_(arange * next_n)
    batch.seq_lens.fill_(next_n)
    batch.block_table.fill_(-1)
    positions = torch.arange(static.num_tokens, device=batch.positions.device) % next_n
    batch.positions.copy_(positions)
    batch.slot_mapping.fill_(-1)
    for value in static.inputs.values():
        value.normal_() if value.is_floating_point() else value.zero_()


def _input_buffers(buffers: StaticBatch | None, token_inputs: TokenInputs | None,
                   table_width: int | None, max_reqs: int, next_n: int,
                   device: torch.device) -> StaticBatch:
    """The engine's ``buffers``, checked to hold the largest bucket; else new ones."""
    if buffers is None:
        if table_width is None:
            raise ValueError("DecodeGraphRunner: pass `table_width` (and `token_inputs`), or "
                             "`buffers`")
        return StaticBatch(max_reqs, max_reqs * next_n, table_width,
                           token_inputs=token_inputs, device=device)
    if token_inputs is not None or table_width is not None:
        raise ValueError("DecodeGraphRunner: `buffers` fixes the token inputs and the table "
                         "width; pass `token_inputs` and `table_width` only without it")
    if buffers.num_reqs < max_reqs or buffers.num_tokens < max_reqs * next_n:
        raise ValueError(f"DecodeGraphRunner: `buffers` hold {buffers.num_reqs} requests and "
                         f"{buffers.num_tokens} tokens; the largest bucket needs {max_reqs} and "
                         f"{max_reqs * next_n}")
    if buffers.batch.seq_lens.device != device:
        raise ValueError(f"DecodeGraphRunner: `buffers` must be on {device}, got "
                         f"{buffers.batch.seq_lens.device}")
    return buffers
