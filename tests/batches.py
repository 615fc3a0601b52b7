"""Random live decode batches for the builder, step and graph tests (seeded, not hypothesis)."""

from __future__ import annotations

import random

import torch

from dsa.config import IndexerConfig
from dsa.meta.batch import Batch

# Decode configurations the compile and graph tests run (IndexerConfig overrides).
STEP_CONFIGS = {
    "next_n1": {"next_n": 1},
    "next_n2_native": {"next_n": 2},
    "next_n3_flat": {"next_n": 3, "decode_layout": "flat"},
    "next_n4_native": {"next_n": 4},
    "compress4": {"next_n": 2, "compress_ratio": 4},
}


def table_width(cfg: IndexerConfig) -> int:
    """Block-table columns the engine passes for ``cfg`` (kernel-block granularity)."""
    return cfg.block_table_width


def random_decode_batch(
    rng: random.Random,
    cfg: IndexerConfig,
    num_reqs: int,
    *,
    device: torch.device | str = "cpu",
    uneven: bool = True,
    min_seq_len: int | None = None,
) -> Batch:
    """``num_reqs`` live decode requests with 1..next_n (``uneven``) or next_n query tokens.

    Context lengths cover the extremes (the query tokens alone, ``max_model_len``) and random
    values between; each request owns distinct random blocks of a pool of
    ``num_reqs * width`` blocks.
    """
    width = table_width(cfg)
    query_lens, seq_lens = [], []
    for _ in range(num_reqs):
        q = rng.randint(1, cfg.next_n) if uneven else cfg.next_n
        low = max(q, min_seq_len or q)
        seq = rng.choice([low, cfg.max_model_len, rng.randint(low, cfg.max_model_len)])
        query_lens.append(q)
        seq_lens.append(seq)
    blocks = list(range(max(num_reqs, 1) * width))
    rng.shuffle(blocks)
    table = torch.tensor(blocks[: num_reqs * width], dtype=torch.int32).view(num_reqs, width)
    tokens_per_block = cfg.block_size // cfg.table_factor
    qsl, positions, slots = [0], [], []
    for r, (q, seq) in enumerate(zip(query_lens, seq_lens)):
        qsl.append(qsl[-1] + q)
        for pos in range(seq - q, seq):
            positions.append(pos)
            block = pos // tokens_per_block  # DCP tables are narrower: no local slot then
            slots.append(int(table[r, block]) * tokens_per_block + pos % tokens_per_block
                         if block < width else -1)
    return Batch(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
    )
