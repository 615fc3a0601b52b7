"""Prefill chunking (design §5): which requests and queries the indexer handles at once.

A request's K rows are its compressed states, ``seq // compress_ratio`` (``seq`` with no
compression). Requests are packed greedily, in order, while the chunk's gathered K fits the
workspace (``sum(seq) <= workspace_rows``) and its fp32 logits fit the budget
(``sum(query) * sum(seq) * 4 <= max_logits_bytes``). A request that fits in no chunk on its
own becomes a chunk by itself. Each chunk is then cut along its queries into pieces of
``max(1, (max_logits_bytes // 4) // sum(seq))`` queries (one piece when ``sum(seq) == 0``),
so even a request over budget keeps its logits bounded. A chunk without queries yields no
piece: there is nothing to compute for it.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from dsa.ops._checks import is_int

LOGIT_BYTES = 4  # fp32


def _lengths(name: str, values: Sequence[int]) -> list[int]:
    try:
        lengths = [operator.index(v) for v in values]
    except TypeError:
        raise TypeError(f"dsa.split_prefill_chunks: `{name}` must be a sequence of ints, "
                        f"got {values!r}") from None
    if any(v < 0 for v in lengths):
        raise ValueError(f"dsa.split_prefill_chunks: `{name}` must be >= 0 everywhere, "
                         f"got {lengths}")
    return lengths


def _budget(name: str, value: int) -> int:
    if not is_int(value):
        raise TypeError(f"dsa.split_prefill_chunks: `{name}` must be an int, "
                        f"got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"dsa.split_prefill_chunks: `{name}` must be >= 1, got {value}")
    return value


def split_prefill_chunks(
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    workspace_rows: int,
    max_logits_bytes: int,
    *,
    compress_ratio: int = 1,
) -> list[tuple[slice, slice]]:
    """Plans the prefill chunks of a batch of requests.

    ``seq_lens`` are token counts (each including its query); a request's K rows are
    ``seq_lens // compress_ratio``. Returns ``(requests, queries)`` pairs: a slice of request
    indices, and a slice of query tokens counted from the first query token of those
    requests. Pieces of one chunk share the same request slice and cover its queries in order.
    """
    tokens = _lengths("seq_lens", seq_lens)
    queries = _lengths("query_lens", query_lens)
    if len(tokens) != len(queries):
        raise ValueError(f"dsa.split_prefill_chunks: `seq_lens` and `query_lens` must have "
                         f"the same length, got {len(tokens)} and {len(queries)}")
    for r, (s, q) in enumerate(zip(tokens, queries)):
        if q > s:
            raise ValueError(f"dsa.split_prefill_chunks: `seq_lens` of request {r} must be >= "
                             f"its query length {q}, got {s}")
    ratio = _budget("compress_ratio", compress_ratio)
    seqs = [s // ratio for s in tokens]
    workspace_rows = _budget("workspace_rows", workspace_rows)
    max_logit_elems = _budget("max_logits_bytes", max_logits_bytes) // LOGIT_BYTES

    chunks: list[tuple[slice, slice]] = []
    start = 0
    while start < len(seqs):
        end, chunk_q, chunk_seq = start, 0, 0
        while end < len(seqs):
            q, s = chunk_q + queries[end], chunk_seq + seqs[end]
            if s > workspace_rows or q * s > max_logit_elems:
                break
            end, chunk_q, chunk_seq = end + 1, q, s
        if end == start:  # over budget on its own
            end, chunk_q, chunk_seq = start + 1, queries[start], seqs[start]
        piece = max(1, max_logit_elems // chunk_seq) if chunk_seq else max(1, chunk_q)
        chunks.extend(
            (slice(start, end), slice(q, min(q + piece, chunk_q)))
            for q in range(0, chunk_q, piece)
        )
        start = end
    return chunks
