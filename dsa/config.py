"""Static configuration of one indexer: scheduler limits, model sizes, cache and parallelism."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from dsa.ops._checks import is_int
from dsa.ops.logits.common import LOGITS_BACKENDS
from dsa.ops.logits.deepgemm import PAGED_NEXT_N as DEEPGEMM_NEXT_N

KV_CACHE_DTYPES = ("fp8", "mxfp4")
DECODE_LAYOUTS = ("auto", "native", "flat")
# next_n values "auto" lays out natively: dsa's kernel (Triton, plain torch) takes any next_n
# and is sized for 1..4 (at most 256 q rows of 64 heads); DeepGEMM's SM90 kernel takes 1..2
# (DEEPGEMM_NEXT_N).
NATIVE_NEXT_N = (1, 2, 3, 4)


@dataclass(frozen=True)
class IndexerConfig:
    """Everything about an indexer that is fixed for the life of an engine.

    Per-step buffers and every op's output capacity derive from these numbers, so a captured
    decode step never sees a new shape.

    Attributes:
        max_num_reqs: most requests in one step (the largest captured batch).
        max_num_batched_tokens: most tokens in one step.
        max_model_len: longest sequence, in tokens.
        num_heads: index heads H (DeepSeek V3.2: 64).
        head_dim: index head dim D (DeepSeek V3.2: 128).
        topk: tokens selected per query (DeepSeek V3.2: 2048).
        block_size: tokens (states, when compressed) per block of the indexer K cache.
        kernel_block_size: block size of the block table the engine passes. When it divides
            ``block_size`` by a factor f > 1, the indexer table is ``block_table[:, ::f] // f``.
            ``None``: the same as ``block_size``.
        next_n: query tokens per decode request (1 + speculative tokens).
        compress_ratio: tokens per compressed state R (DeepSeek V4); 1 = no compression.
        dcp_world, dcp_rank, dcp_interleave: decode context parallelism (interleave 1 only).
        kpool: slots of the GLM kpool tail cache per request; ``None`` = no tail cache.
        kv_cache_dtype: "fp8" (SM90 layout); "mxfp4" (Blackwell sm_10x) is planned: rejected
            off sm_10x, NotImplementedError on it.
        ue8m0_scales: round quantisation scales up to powers of two.
        logits_backend: "auto" (dsa's Triton kernel where the H200 or H100 measured it
            faster, as ``paged.auto_triton_max_keys``, else DeepGEMM where it can run, else
            Triton),
            "triton", "deepgemm".
        decode_layout: "native" ([B, next_n] rows, each K block read once for a request's
            next_n rows; next_n <= 2 on DeepGEMM), "flat" (one row per query token, any
            next_n), or "auto" (native for next_n <= 4, <= 2 with ``logits_backend``
            "deepgemm").
        num_blocks: blocks of the indexer K cache. When set, decode lengths stop at the first
            block-table entry outside the cache, so no key there is read or selected, and
            the value checks reject such entries.
        workspace_rows: prefill K workspace rows; ``None``: ``40 * max_model_len``.
        max_logits_bytes: prefill logits budget per chunk (default 512 MiB).
        debug: check values that only the device knows (with a host sync; not inside CUDA-graph
            capture, and skipped while torch.compile traces: the checks run where the
            builders run eagerly). Default: ``DSA_DEBUG`` set to 1 (or true, yes, on) in the
            environment at construction.
    """

    max_num_reqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_heads: int = 64
    head_dim: int = 128
    topk: int = 2048
    block_size: int = 64
    kernel_block_size: int | None = None
    next_n: int = 1
    compress_ratio: int = 1
    dcp_world: int = 1
    dcp_rank: int = 0
    dcp_interleave: int = 1
    kpool: int | None = None
    kv_cache_dtype: str = "fp8"
    ue8m0_scales: bool = False
    logits_backend: str = "auto"
    decode_layout: str = "auto"
    num_blocks: int | None = None
    workspace_rows: int | None = None
    max_logits_bytes: int = 512 * 1024 * 1024
    debug: bool = field(default_factory=lambda: os.environ.get("DSA_DEBUG", "").lower() in (
        "1", "true", "yes", "on"))

    def __post_init__(self) -> None:
        for name in ("max_num_reqs", "max_num_batched_tokens", "max_model_len", "num_heads",
                     "head_dim", "topk", "block_size", "next_n", "compress_ratio", "dcp_world",
                     "dcp_interleave", "max_logits_bytes"):
            _positive(name, getattr(self, name))
        for name in ("kernel_block_size", "kpool", "num_blocks", "workspace_rows"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.compress_ratio > self.max_model_len:
            raise ValueError(
                f"IndexerConfig: compress_ratio must be <= max_model_len={self.max_model_len} "
                f"(else no sequence has a compressed state to select), got {self.compress_ratio}"
            )
        for name in ("debug", "ue8m0_scales"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"IndexerConfig: {name} must be a bool, got "
                                 f"{getattr(self, name)!r}")
        if not is_int(self.dcp_rank) or not (
            0 <= self.dcp_rank < self.dcp_world
        ):
            raise ValueError(
                f"IndexerConfig: dcp_rank must be in [0, dcp_world={self.dcp_world}), "
                f"got {self.dcp_rank!r}"
            )
        if self.dcp_world > 1 and self.dcp_interleave > 1:
            raise NotImplementedError(
                "IndexerConfig: DCP interleave > 1 is not supported (only interleave 1 is "
                f"validated end to end), got dcp_interleave={self.dcp_interleave}"
            )
        kernel_block = self.kernel_block_size or self.block_size
        if kernel_block > self.block_size or self.block_size % kernel_block:
            raise ValueError(
                f"IndexerConfig: kernel_block_size must divide block_size={self.block_size}, "
                f"got {self.kernel_block_size}"
            )
        if self.max_num_batched_tokens < self.max_num_reqs:
            raise ValueError(
                "IndexerConfig: max_num_batched_tokens must be >= max_num_reqs "
                f"({self.max_num_reqs}), got {self.max_num_batched_tokens}"
            )
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.kv_cache_dtype == "mxfp4" and not _is_sm10x():
            raise ValueError(
                "IndexerConfig: kv_cache_dtype='mxfp4' needs a Blackwell datacenter GPU "
                f"(sm_10x, e.g. B200/GB200); this machine has {_device_name()}"
            )
        if self.kv_cache_dtype == "mxfp4":
            raise NotImplementedError("IndexerConfig: the mxfp4 K cache is not implemented yet")
        _choice("logits_backend", self.logits_backend, LOGITS_BACKENDS)
        _choice("decode_layout", self.decode_layout, DECODE_LAYOUTS)
        if self.decode_layout == "native" and self.logits_backend == "deepgemm" and (
            self.next_n not in DEEPGEMM_NEXT_N
        ):
            raise ValueError(
                f"IndexerConfig: DeepGEMM's native decode layout takes next_n in "
                f"{DEEPGEMM_NEXT_N}, got next_n={self.next_n}; use decode_layout='flat' or "
                "'auto'"
            )

    @property
    def table_factor(self) -> int:
        """Engine block-table entries per indexer block."""
        return self.block_size // (self.kernel_block_size or self.block_size)

    @property
    def layout(self) -> str:
        """The decode layout in use: "native" or "flat"."""
        if self.decode_layout != "auto":
            return self.decode_layout
        native = DEEPGEMM_NEXT_N if self.logits_backend == "deepgemm" else NATIVE_NEXT_N
        return "native" if self.next_n in native else "flat"

    @property
    def max_blocks_per_req(self) -> int:
        """Indexer blocks a request of ``max_model_len`` tokens spans."""
        states = self.max_model_len // self.compress_ratio
        return -(-states // self.block_size)

    @property
    def block_table_width(self) -> int:
        """Columns a batch's ``block_table`` needs at least (engine blocks of
        ``kernel_block_size``): enough for ``max_model_len`` on this DCP rank."""
        return self.table_factor * -(-self.max_blocks_per_req // self.dcp_world)

    @property
    def prefill_workspace_rows(self) -> int:
        """Rows of the prefill K workspace (each D + 4 bytes)."""
        return self.workspace_rows or 40 * self.max_model_len

    def metadata_key(self) -> tuple[tuple[str, object], ...]:
        """``(name, value)`` of everything the metadata builders' outputs depend on, defaults
        resolved (``kernel_block_size``, ``layout``): a layer may use metadata built from any
        config with the same key."""
        resolved = {"kernel_block_size": self.kernel_block_size or self.block_size,
                    "layout": self.layout}
        return tuple((name, resolved.get(name, getattr(self, name))) for name in METADATA_FIELDS)


# What shapes the metadata's lengths, tables and slots (IndexerConfig.metadata_key).
METADATA_FIELDS = ("max_model_len", "block_size", "kernel_block_size", "next_n",
                   "compress_ratio", "dcp_world", "dcp_rank", "dcp_interleave", "kpool",
                   "num_blocks", "layout")


def hf_config_dict(config: object, caller: str) -> Mapping[str, Any]:
    """A HF ``config.json`` as a mapping: a dict as it is, a ``transformers`` config object
    through its ``to_dict()``."""
    if isinstance(config, Mapping):
        return config
    if callable(getattr(config, "to_dict", None)):
        return config.to_dict()
    raise TypeError(f"{caller}: `config` must be a config.json dict (or an object with "
                    f"to_dict(), as transformers' configs), got {type(config).__name__}")


def hf_switch(config: Mapping[str, Any], key: str, caller: str) -> bool:
    """A HF config's boolean switch ``key``: true or false, absent as false (a string such as
    "false" is refused, not read as true)."""
    value = config.get(key)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{caller}: {key} must be true, false or absent, got {value!r}")
    return bool(value)


def _positive(name: str, value: object) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"IndexerConfig: {name} must be a positive int, got {value!r}")


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"IndexerConfig: {name} must be one of {list(choices)}, got {value!r}")


def _is_sm10x() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


def _device_name() -> str:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    return f"{torch.cuda.get_device_name()} (sm_{major}{minor})"
