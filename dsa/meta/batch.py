"""The per-step batch tensors an engine hands to the metadata builders."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dsa._pytree import pytree_dataclass
from dsa.config import IndexerConfig
from dsa.ops._checks import (
    INDEX_DTYPES,
    POSITION_DTYPES,
    check_block_table,
    check_size,
    check_tensor,
    values_readable,
)
from dsa.ops._tokens import valid_tokens

ops = torch.ops.dsa


@pytree_dataclass()
@dataclass(frozen=True)
class Batch:
    """The engine's per-step inputs (for decode: at the captured batch's capacity).

    Attributes:
        query_start_loc: int32 ``[B + 1]``, token offsets of the requests (decode requests
            first, then prefill; padding requests have zero tokens and sit at the end).
        seq_lens: int32 ``[B]``, context length of each request including this step's tokens
            (0 for padding requests).
        block_table: int32 ``[B, W]``, the engine's block table.
        slot_mapping: int64 ``[T]``, K-cache slot of each token (-1: do not write).
        positions: ``[T]`` int64 or int32, position of each token in its sequence.
    """

    query_start_loc: Tensor
    seq_lens: Tensor
    block_table: Tensor
    slot_mapping: Tensor
    positions: Tensor

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


def check_batch(op: str, cfg: IndexerConfig, batch: Batch) -> None:
    """Validates a batch's tensors against ``cfg`` (types, shapes, capacities; no values)."""
    qsl = check_tensor(op, "query_start_loc", batch.query_start_loc, dtype=INDEX_DTYPES, ndim=1,
                       contiguous=True)
    num_reqs = qsl.shape[0] - 1
    if not 0 <= num_reqs <= cfg.max_num_reqs:
        raise ValueError(f"dsa.{op}: `query_start_loc` must have 1 to max_num_reqs + 1 = "
                         f"{cfg.max_num_reqs + 1} entries, got {qsl.shape[0]}")
    check_tensor(op, "seq_lens", batch.seq_lens, dtype=INDEX_DTYPES, ndim=1, contiguous=True,
                 like=qsl)
    check_size(op, "seq_lens", batch.seq_lens, 0, num_reqs, "len(query_start_loc) - 1")
    _, width = check_block_table(op, batch.block_table, qsl, num_reqs)
    if width < cfg.block_table_width:
        raise ValueError(
            f"dsa.{op}: `block_table` must have at least IndexerConfig.block_table_width = "
            f"{cfg.block_table_width} columns to cover max_model_len={cfg.max_model_len} "
            f"(block_size={cfg.block_size}, kernel_block_size={cfg.kernel_block_size}, "
            f"compress_ratio={cfg.compress_ratio}, dcp_world={cfg.dcp_world}), got width {width}"
        )
    slots = check_tensor(op, "slot_mapping", batch.slot_mapping, dtype=torch.int64, ndim=1,
                         contiguous=True, like=qsl)
    if slots.shape[0] > cfg.max_num_batched_tokens:
        raise ValueError(f"dsa.{op}: `slot_mapping` must have at most max_num_batched_tokens="
                         f"{cfg.max_num_batched_tokens} entries, got {slots.shape[0]}")
    positions = check_tensor(op, "positions", batch.positions, dtype=POSITION_DTYPES, ndim=1,
                             contiguous=True, like=qsl)
    check_size(op, "positions", positions, 0, slots.shape[0], "len(slot_mapping)")


def check_batch_values(op: str, cfg: IndexerConfig, batch: Batch, *, decode: bool,
                       sync: bool = False) -> None:
    """Raises on an impossible batch (design §9), reading its values where that is free.

    Host tensors (not fake) are always checked. Device tensors are checked in the debug
    mode (``cfg.debug``) or when the caller syncs anyway (``sync``: prefill), by copying them
    to the host: a debug step cannot be captured in a CUDA graph. Under torch.compile the
    check is skipped while tracing.

    Checks: ``query_start_loc`` starts at 0, never decreases and ends within the tokens;
    ``seq_lens`` in ``[query length, max_model_len]``; a decode request has at most
    ``next_n`` tokens; real tokens' positions are in ``[0, max_model_len)``; with
    ``cfg.num_blocks``, the indexer blocks each request spans are in ``[0, num_blocks)`` and,
    without compression, real tokens' slots are -1 or inside the cache.
    """
    if not values_readable(batch.query_start_loc, debug=cfg.debug or sync):
        return
    where = f"dsa.{op}:"
    qsl, seq, positions = (t.cpu().long()
                           for t in (batch.query_start_loc, batch.seq_lens, batch.positions))
    if qsl[0] != 0:
        raise ValueError(f"{where} `query_start_loc` must start at 0, got {int(qsl[0])}")
    query_lens = qsl[1:] - qsl[:-1]
    if (r := _first(query_lens < 0)) is not None:
        raise ValueError(f"{where} `query_start_loc` must be non-decreasing, got "
                         f"{int(qsl[r + 1])} after {int(qsl[r])} (request {r})")
    if qsl[-1] > batch.num_tokens:
        raise ValueError(f"{where} `query_start_loc` must end at most at the {batch.num_tokens} "
                         f"tokens of the batch (len(slot_mapping)), got {int(qsl[-1])}")
    if (r := _first(seq < 0)) is not None:
        raise ValueError(f"{where} `seq_lens` must be >= 0, got {int(seq[r])} for request {r}")
    if (r := _first(seq < query_lens)) is not None:
        raise ValueError(f"{where} `seq_lens` of request {r} must be >= its query length "
                         f"{int(query_lens[r])}, got {int(seq[r])}")
    if (r := _first(seq > cfg.max_model_len)) is not None:
        raise ValueError(f"{where} `seq_lens` must be <= max_model_len={cfg.max_model_len}, got "
                         f"{int(seq[r])} for request {r}")
    if decode and (r := _first(query_lens > cfg.next_n)) is not None:
        raise ValueError(f"{where} decode request {r} must have at most next_n={cfg.next_n} "
                         f"query tokens, got {int(query_lens[r])}")
    real_tokens = int(qsl[-1])
    outside = (positions[:real_tokens] < 0) | (positions[:real_tokens] >= cfg.max_model_len)
    if (t := _first(outside)) is not None:
        raise ValueError(f"{where} `positions` of real token {t} must be in [0, max_model_len="
                         f"{cfg.max_model_len}), got {int(positions[t])}")
    if cfg.num_blocks is not None:
        _check_block_ids(where, cfg, batch.block_table.cpu(), seq)
        if cfg.compress_ratio == 1:
            slots = batch.slot_mapping[:real_tokens].cpu()
            cache = cfg.num_blocks * cfg.block_size
            if (t := _first((slots != -1) & ((slots < 0) | (slots >= cache)))) is not None:
                raise ValueError(f"{where} `slot_mapping` of real token {t} must be -1 or in "
                                 f"[0, num_blocks * block_size = {cache}), got {int(slots[t])}")


def _check_block_ids(where: str, cfg: IndexerConfig, table: Tensor, seq: Tensor) -> None:
    """The indexer blocks each request's states span must be in ``[0, cfg.num_blocks)``."""
    factor = cfg.table_factor
    if factor > 1:
        table = ops.compress_block_table(table, factor)
    per_block = cfg.block_size * cfg.dcp_world
    needed = (seq // cfg.compress_ratio + per_block - 1) // per_block
    used = torch.arange(table.shape[1]) < needed[:, None]
    bad = used & ((table < 0) | (table >= cfg.num_blocks))
    if (rc := _first(bad)) is not None:
        r, c = rc
        raise ValueError(
            f"{where} `block_table` row {r} (request {r}) must map its first {int(needed[r])} "
            f"indexer blocks into [0, num_blocks={cfg.num_blocks}), got indexer block "
            f"{int(table[r, c])} at column {c * factor}"
        )


def _first(mask: Tensor) -> int | tuple[int, ...] | None:
    """Index of the first True entry of a host mask (a tuple for 2-D masks), or None."""
    hits = mask.nonzero()
    if not hits.shape[0]:
        return None
    first = tuple(int(i) for i in hits[0])
    return first[0] if mask.dim() == 1 else first


def token_writes(cfg: IndexerConfig, batch: Batch) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What the prefill builder derives per token, on the device without a sync (the decode
    builder gets the same from ``dsa::decode_metadata``).

    Returns ``(token_requests, valid_tokens, request_table, slot_mapping)``: the request of
    each token (``B + k`` for padding tokens); bool ``[T]``, a real token at a position in
    ``[0, max_model_len)``; the indexer's block table per request (coarsened by
    ``cfg.table_factor``); and the slot each token's indexer K goes to (compressed states
    when R > 1; -1: nowhere, which every token outside ``valid_tokens`` gets).
    """
    token_requests = ops.decode_row_requests(batch.query_start_loc, batch.num_tokens)
    valid = valid_tokens(token_requests, batch.positions, batch.num_reqs, cfg.max_model_len)
    table, slots = indexer_writes(cfg, batch)
    return token_requests, valid, table, torch.where(valid, slots, -1)


def indexer_writes(cfg: IndexerConfig, batch: Batch) -> tuple[Tensor, Tensor]:
    """The indexer's block table per request (coarsened by ``cfg.table_factor``) and the
    slot each token's indexer K goes to, before masking by ``valid_tokens`` (compressed
    states when R > 1)."""
    table = batch.block_table
    if cfg.table_factor > 1:
        table = ops.compress_block_table(table, cfg.table_factor)
    slots = batch.slot_mapping
    if cfg.compress_ratio > 1:
        slots = ops.compressed_slot_mapping(
            batch.query_start_loc, batch.seq_lens, table, batch.num_tokens, cfg.block_size,
            cfg.compress_ratio, cfg.dcp_world, cfg.dcp_rank, cfg.dcp_interleave,
        )
    return table, slots
