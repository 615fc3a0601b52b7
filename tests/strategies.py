"""Hypothesis strategies for a step's batch, shared by the metadata and builder tests, and
for the rows of a top-k case, shared by the top-k tests.

A ``BatchSpec`` holds host lists (for the loop reference) and builds the tensors the ops
take: ``tensors()`` gives the fields of ``dsa.meta.batch.Batch`` in its order, so
``Batch(*spec.tensors())`` works. Batch order follows design §1: decode requests, then
prefill requests, then padding requests (query_len 0, seq_len 0); ``num_tokens`` is the
static token capacity, so tokens past the real ones are graph padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

import torch
from hypothesis import strategies as st


class BatchTensors(NamedTuple):
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    block_table: torch.Tensor  # int32 [B, W]
    slot_mapping: torch.Tensor  # int64 [num_tokens], -1 for graph padding tokens
    positions: torch.Tensor  # int64 [num_tokens], 0 for graph padding tokens


@dataclass(frozen=True)
class BatchSpec:
    """One step's batch (host lists).

    query_lens, seq_lens: per request, decodes first (query_len 1..next_n), then prefills
        (query_len > next_n), then padding requests (0, 0). seq_len includes the query.
    block_table: ``[B][width]`` distinct block ids, wide enough for every request.
    num_tokens: token capacity (>= the real tokens; the rest is graph padding).
    """

    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    block_table: tuple[tuple[int, ...], ...]
    width: int
    num_tokens: int
    block_size: int
    next_n: int
    num_decodes: int
    num_prefills: int

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def query_start_loc(self) -> list[int]:
        return [0, *accumulate(self.query_lens)]

    @property
    def num_real_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def positions(self) -> list[int]:
        """Position of every token in its sequence; 0 for graph padding tokens."""
        pos = [s - q + i for q, s in zip(self.query_lens, self.seq_lens) for i in range(q)]
        return pos + [0] * (self.num_tokens - len(pos))

    @property
    def slot_mapping(self) -> list[int]:
        """Paged-cache slot of every token (design §1); -1 for graph padding tokens."""
        bs, slots = self.block_size, []
        for r, (q, s) in enumerate(zip(self.query_lens, self.seq_lens)):
            slots += [self.block_table[r][p // bs] * bs + p % bs for p in range(s - q, s)]
        return slots + [-1] * (self.num_tokens - len(slots))

    def tensors(self, device: str | torch.device = "cpu") -> BatchTensors:
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)
        i64 = lambda x: torch.tensor(x, dtype=torch.int64, device=device)
        table = i32(self.block_table).reshape(self.num_reqs, self.width)
        return BatchTensors(i32(self.query_start_loc), i32(self.seq_lens), table,
                            i64(self.slot_mapping), i64(self.positions))


@st.composite
def batches(
    draw: st.DrawFn,
    *,
    max_decodes: int = 4,
    max_prefills: int = 2,
    next_n: int | None = None,
    max_prefill_len: int = 8,
    max_context: int = 24,
    block_size: int | None = None,
    max_padding_reqs: int = 2,
    max_padding_tokens: int = 3,
) -> BatchSpec:
    """A mixed batch: 0..max_decodes decodes, 0..max_prefills prefills, padding.

    next_n: decode width (drawn from 1..4 when None); decode query_lens are 1..next_n,
        prefill query_lens next_n + 1..next_n + max_prefill_len.
    max_context: context tokens before the query, drawn per request from 0..max_context.
    block_size: tokens per block (drawn from 1, 2, 4, 8 when None).
    """
    next_n = draw(st.integers(1, 4)) if next_n is None else next_n
    block_size = draw(st.sampled_from([1, 2, 4, 8])) if block_size is None else block_size
    decode_lens = draw(st.lists(st.integers(1, next_n), max_size=max_decodes))
    prefill_lens = draw(st.lists(st.integers(next_n + 1, next_n + max_prefill_len),
                                 max_size=max_prefills))
    num_padding = draw(st.integers(0, max_padding_reqs))
    real = decode_lens + prefill_lens
    contexts = draw(st.lists(st.integers(0, max_context), min_size=len(real),
                             max_size=len(real)))
    query_lens = (*real, *[0] * num_padding)
    seq_lens = (*[q + c for q, c in zip(real, contexts)], *[0] * num_padding)

    num_reqs = len(query_lens)
    width = -(-(max_context + next_n + max_prefill_len) // block_size)
    # Distinct block ids, drawn from a pool twice the table's size.
    ids = draw(st.randoms(use_true_random=False)).sample(range(2 * num_reqs * width),
                                                         num_reqs * width)
    table = tuple(tuple(ids[r * width:(r + 1) * width]) for r in range(num_reqs))
    num_tokens = sum(query_lens) + draw(st.integers(0, max_padding_tokens))
    return BatchSpec(query_lens, seq_lens, table, width, num_tokens, block_size, next_n,
                 len(decode_lens), len(prefill_lens))


def decode_batches(max_reqs: int = 4, next_n: int | None = None, **kwargs) -> st.SearchStrategy:
    """Decode-only batches (query_len 1..next_n, then padding requests); see ``batches``."""
    return batches(max_decodes=max_reqs, max_prefills=0, next_n=next_n, **kwargs)


def prefill_batches(max_reqs: int = 4, **kwargs) -> st.SearchStrategy:
    """Prefill-only batches (query_len > next_n, then padding requests); see ``batches``."""
    return batches(max_decodes=0, max_prefills=max_reqs, **kwargs)


def dcp_configs(worlds: tuple[int, ...] = (1, 2, 4)) -> st.SearchStrategy:
    """(world, rank): every rank of every world size in ``worlds``."""
    return st.sampled_from([(w, k) for w in worlds for k in range(w)])


@st.composite
def topk_rows(draw: st.DrawFn, max_rows: int, max_cols: int,
              ks: tuple[int, ...]) -> tuple[int, int, int, torch.Generator, torch.Tensor]:
    """``(rows, n, k, gen, lengths)`` of a top-k case over ``[rows, n]`` logits: int32
    lengths around 0, k and n (negative and past n too), ``gen`` seeded for the values."""
    rows = draw(st.integers(1, max_rows))
    n = draw(st.integers(0, max_cols))
    k = draw(st.sampled_from(ks))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    lens = draw(st.lists(st.sampled_from([0, 1, k - 1, k, k + 1, n, n + 7, -3, None]),
                         min_size=rows, max_size=rows))
    lengths = torch.tensor([int(torch.randint(0, n + 1, (1,), generator=gen)) if v is None
                            else v for v in lens], dtype=torch.int32)
    return rows, n, k, gen, lengths
