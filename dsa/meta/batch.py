"""The per-step batch tensors an engine hands to the metadata builders."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dsa.config import IndexerConfig
from dsa.ops._checks import INDEX_DTYPES, POSITION_DTYPES, check_size, check_tensor

ops = torch.ops.dsa


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
    table = check_tensor(op, "block_table", batch.block_table, dtype=INDEX_DTYPES, ndim=2,
                         like=qsl)
    check_size(op, "block_table", table, 0, num_reqs, "len(query_start_loc) - 1")
    if table.stride(1) != 1:
        raise ValueError(f"dsa.{op}: `block_table` rows must be contiguous (stride(1) == 1), "
                         f"got strides {table.stride()}")
    needed = cfg.table_factor * -(-cfg.max_blocks_per_req // cfg.dcp_world)
    if table.shape[1] < needed:
        raise ValueError(
            f"dsa.{op}: `block_table` must have at least {needed} columns to cover "
            f"max_model_len={cfg.max_model_len} (block_size={cfg.block_size}, compress_ratio="
            f"{cfg.compress_ratio}, dcp_world={cfg.dcp_world}), got shape {tuple(table.shape)}"
        )
    slots = check_tensor(op, "slot_mapping", batch.slot_mapping, dtype=torch.int64, ndim=1,
                         contiguous=True, like=qsl)
    if slots.shape[0] > cfg.max_num_batched_tokens:
        raise ValueError(f"dsa.{op}: `slot_mapping` must have at most max_num_batched_tokens="
                         f"{cfg.max_num_batched_tokens} entries, got {slots.shape[0]}")
    positions = check_tensor(op, "positions", batch.positions, dtype=POSITION_DTYPES, ndim=1,
                             contiguous=True, like=qsl)
    check_size(op, "positions", positions, 0, slots.shape[0], "len(slot_mapping)")


def indexer_table_and_slots(cfg: IndexerConfig, batch: Batch) -> tuple[Tensor, Tensor]:
    """The indexer's block table per request (coarsened by ``cfg.table_factor``) and the
    slot each token's indexer K goes to (compressed states when R > 1; -1: nowhere)."""
    table = batch.block_table
    if cfg.table_factor > 1:
        table = ops.compress_block_table(table, cfg.table_factor)
    if cfg.compress_ratio == 1:
        return table, batch.slot_mapping
    slots = ops.compressed_slot_mapping(
        batch.query_start_loc, batch.seq_lens, table, batch.num_tokens, cfg.block_size,
        cfg.compress_ratio, cfg.dcp_world, cfg.dcp_rank, cfg.dcp_interleave,
    )
    return table, slots
