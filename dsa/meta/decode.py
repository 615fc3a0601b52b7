"""Decode metadata, built on the device from the step's batch tensors (design §4, §6, §7).

``build_decode_metadata`` is made of ``torch.ops.dsa.*`` calls: one ``decode_metadata``
launch (plus DeepGEMM's schedule kernel with that backend; a coarsened table, compressed
or kpool caches add their ops), no host sync, no data-dependent shapes, so it traces with
``torch.compile(fullgraph=True)`` and runs inside the decode step's CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dsa._pytree import pytree_dataclass
from dsa.config import IndexerConfig
from dsa.meta.batch import Batch, check_batch, check_batch_values, indexer_writes
from dsa.ops.decode_fused import DecodeMetadataOutputs
from dsa.ops.logits import paged_backend

ops = torch.ops.dsa


@pytree_dataclass("layout", "next_n", "logits_backend", "max_context_len", "built_for")
@dataclass(frozen=True)
class DecodeMetadata:
    """Everything the indexer's decode leaves need, shared by all layers of a step.

    Logits rows are ``[B, next_n]`` packed request rows (layout "native") or one row per
    token (layout "flat"); ``context_lens`` and ``block_table`` are given per logits row.

    Attributes:
        layout: "native" or "flat".
        next_n: query tokens per request in the native layout (1 in the flat layout).
        query_start_loc: int32 ``[B + 1]`` of the batch (packs and unpacks native rows).
        context_lens: int32 ``[B, next_n]`` or ``[T, 1]``: keys each logits row may attend to
            on this rank (compressed states when R > 1, DCP-local when sharded; at most
            ``max_context_len``).
        global_context_lens: the same before DCP localisation (equal without DCP).
        block_table: int32 indexer block table per logits row (``[B, W']`` or ``[T, W']``).
        request_block_table: int32 ``[B, W']``, the indexer block table per request.
        token_requests: int32 ``[T]``, request of each token; ``B + k`` for padding tokens.
        valid_tokens: bool ``[T]``, a real token (not padding) at a position in
            ``[0, max_model_len)``; no other token writes K or selects keys.
        slot_mapping: int64 ``[T]``, where each token's indexer K goes (-1: nowhere; always
            -1 outside ``valid_tokens``).
        select_lens: ``context_lens`` with 0 where the logits row's token (row ``r``, slot
            ``j``: token ``r * next_n + j``) is not in ``valid_tokens``: the lengths top-k
            selects with when the logits rows are the tokens (not ``packed``).
        kpool_slot_mapping: int64 ``[T]`` kpool tail slots (-1 outside ``valid_tokens``), or
            ``None`` without a tail cache.
        logits_backend: "deepgemm" or "triton", the paged-logits implementation chosen
            once for the step (``cfg.logits_backend`` resolved for this device and shape).
        schedule_lens: ``context_lens`` clamped to >= 1 when DeepGEMM computes the logits
            (the lengths its kernel and ``schedule`` see), else ``None``.
        schedule: DeepGEMM schedule for ``schedule_lens`` when DeepGEMM computes the logits.
        max_context_len: static width of a logits row.
        built_for: ``cfg.metadata_key()`` of the config it was built from (a layer refuses
            metadata built for another cache, layout or parallelism).
    """

    layout: str
    next_n: int
    query_start_loc: Tensor
    context_lens: Tensor
    global_context_lens: Tensor
    block_table: Tensor
    request_block_table: Tensor
    token_requests: Tensor
    valid_tokens: Tensor
    slot_mapping: Tensor
    select_lens: Tensor
    kpool_slot_mapping: Tensor | None
    logits_backend: str
    schedule_lens: Tensor | None
    schedule: Tensor | None
    max_context_len: int
    built_for: tuple[tuple[str, object], ...]

    @property
    def num_blocks(self) -> int | None:
        """The K-cache size the lengths were capped to (``cfg.num_blocks``; None: unknown,
        only negative block ids and the table width cap them)."""
        return dict(self.built_for)["num_blocks"]

    @property
    def num_tokens(self) -> int:
        return self.token_requests.shape[0]

    @property
    def packed(self) -> bool:
        """Whether token rows must be packed into ``[B, next_n]`` rows (and unpacked after)."""
        return self.layout == "native" and (
            self.next_n > 1 or self.num_tokens != self.context_lens.shape[0]
        )


def build_decode_metadata(cfg: IndexerConfig, batch: Batch) -> DecodeMetadata:
    """Builds the decode metadata of one step on the batch's device, without a host sync.

    Batch values are checked where they are on the host, or in the debug mode
    (``check_batch_values``).
    """
    check_batch("build_decode_metadata", cfg, batch)
    check_batch_values("build_decode_metadata", cfg, batch, decode=True)
    qsl = batch.query_start_loc
    native = cfg.layout == "native"
    next_n = cfg.next_n if native else 1
    rows = qsl.shape[0] - 1 if native else batch.positions.shape[0]
    width = max_context_len(cfg)
    backend = paged_backend(cfg.logits_backend, qsl.device, cfg.num_heads, cfg.head_dim,
                            cfg.block_size, next_n, rows, width, op="build_decode_metadata",
                            arg="IndexerConfig.logits_backend")
    request_table, slots = indexer_writes(cfg, batch)
    # One launch: lengths (compressed, DCP-local, capped so that no length reaches past its
    # logits row, its block table or onto a block outside the cache: DeepGEMM trusts its
    # lengths, top-k must never select such keys), the rows' block tables, the token
    # masks, the selection lengths, and with DeepGEMM its lengths and schedule.
    leaves = dict(zip(DecodeMetadataOutputs._fields, ops.decode_metadata(
        qsl, batch.seq_lens, request_table, batch.positions, slots, native, cfg.next_n,
        cfg.compress_ratio, cfg.dcp_world, cfg.dcp_rank, cfg.dcp_interleave,
        cfg.num_blocks if cfg.num_blocks is not None else UNKNOWN_NUM_BLOCKS,
        cfg.block_size, width, cfg.max_model_len, backend == "deepgemm",
    )))
    if backend != "deepgemm":
        leaves.update(schedule_lens=None, schedule=None)
    kpool_slots = None
    if cfg.kpool is not None:
        kpool_slots = torch.where(
            leaves["valid_tokens"],
            ops.kpool_tail_slot_mapping(qsl, batch.block_table, batch.positions, cfg.kpool), -1,
        )
    return DecodeMetadata(layout=cfg.layout, next_n=next_n, query_start_loc=qsl,
                          request_block_table=request_table, kpool_slot_mapping=kpool_slots,
                          logits_backend=backend, max_context_len=width,
                          built_for=cfg.metadata_key(), **leaves)


# Without ``cfg.num_blocks``, any non-negative block id counts as inside the cache.
UNKNOWN_NUM_BLOCKS = 2**31 - 1


def max_context_len(cfg: IndexerConfig) -> int:
    """Width of a decode logits row: the most keys one rank holds for one request."""
    states = cfg.max_model_len // cfg.compress_ratio
    return -(-states // cfg.dcp_world)
