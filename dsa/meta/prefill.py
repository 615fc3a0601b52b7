"""Prefill metadata: chunking on the host, per-chunk bounds on the device (design §5).

Prefill runs outside decode graphs, so chunking reads host copies of the lengths; every
tensor of a chunk is still built by ``torch.ops.dsa.*`` on the batch's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dsa._pytree import pytree_dataclass
from dsa.config import IndexerConfig
from dsa.meta.batch import (
    Batch,
    check_batch,
    check_batch_values,
    token_writes,
)
from dsa.meta.chunking import split_prefill_chunks
from dsa.ops._checks import is_int, values_readable
from dsa.ops.dcp import local_share
from dsa.ops.logits import ragged_backend

ops = torch.ops.dsa


@pytree_dataclass("req_start", "req_end", "token_start", "token_end", "num_rows",
                  "num_local_rows", "max_seqlen_k", "skip_gather")
@dataclass(frozen=True)
class PrefillChunk:
    """One chunk of prefill requests and a slice of their query tokens.

    Host ints:
        req_start, req_end: the chunk's requests ``[req_start, req_end)`` in the batch.
        token_start, token_end: the query tokens this chunk scores, as batch token indices.
        num_rows: K rows of the whole chunk (compressed states), gathered once per chunk.
        num_local_rows: the rows this DCP rank holds (``num_rows`` without DCP).
        max_seqlen_k: widest valid span ``ke - ks`` of any query row (>= 1).
        skip_gather: a later query slice of a chunk whose K is already gathered.
    Device tensors (int32):
        block_table: ``[n, W']`` the chunk's rows of the indexer block table.
        cu_seq_lens, local_cu_seq_lens: ``[n + 1]`` row offsets of each request (global,
            and on this rank).
        token_to_seq: ``[num_rows]`` chunk-relative request of each gathered row.
        ks, ke: ``[q]`` each query row's valid key rows ``[ks, ke)`` in the local workspace.
        global_lens: ``[q]`` each query row's global compressed context length.
    """

    req_start: int
    req_end: int
    token_start: int
    token_end: int
    num_rows: int
    num_local_rows: int
    max_seqlen_k: int
    skip_gather: bool
    block_table: Tensor
    cu_seq_lens: Tensor
    local_cu_seq_lens: Tensor
    token_to_seq: Tensor
    ks: Tensor
    ke: Tensor
    global_lens: Tensor


@pytree_dataclass("logits_backend", "built_for")
@dataclass(frozen=True)
class PrefillMetadata:
    """The chunks of a step's prefill requests and where their K goes.

    Attributes:
        chunks: chunks in token order; together they cover every prefill query token.
        slot_mapping: int64 ``[T]`` indexer K-cache slot of each token (-1: nowhere; always
            -1 outside ``valid_tokens``).
        request_block_table: int32 ``[B, W']`` the indexer block table per request.
        token_requests: int32 ``[T]`` request of each token (``B + k`` for padding tokens).
        valid_tokens: bool ``[T]``, a real token (not padding) at a position in
            ``[0, max_model_len)``; no other token writes K or selects keys.
        logits_backend: "deepgemm" or "triton", the ragged-logits implementation.
        built_for: ``cfg.metadata_key()`` of the config it was built from.
    """

    chunks: tuple[PrefillChunk, ...]
    slot_mapping: Tensor
    request_block_table: Tensor
    token_requests: Tensor
    valid_tokens: Tensor
    logits_backend: str
    built_for: tuple[tuple[str, object], ...]

    @property
    def num_blocks(self) -> int | None:
        """The K-cache size the block ids were checked against (``cfg.num_blocks``; None:
        unknown)."""
        return dict(self.built_for)["num_blocks"]


def build_prefill_metadata(
    cfg: IndexerConfig,
    batch: Batch,
    *,
    num_decodes: int = 0,
    seq_lens_cpu: Sequence[int] | Tensor | None = None,
    query_start_loc_cpu: Sequence[int] | Tensor | None = None,
) -> PrefillMetadata:
    """Chunks the prefill requests ``[num_decodes, B)`` of ``batch`` and builds each chunk.

    ``seq_lens_cpu`` / ``query_start_loc_cpu``: host copies of the batch's lengths, which an
    engine already has; without them they are copied from the device (one sync). When
    given, they are compared with the batch's tensors (one sync; prefill is never captured).
    The batch's values are checked wherever they live (``check_batch_values`` with a sync),
    block ids included when ``cfg.num_blocks`` is set: a prefill key on a block outside the
    cache would be gathered as zeros and could be selected.
    """
    op = "build_prefill_metadata"
    check_batch(op, cfg, batch)
    check_batch_values(op, cfg, batch, decode=False, sync=True)
    seq_host = _host_list(seq_lens_cpu if seq_lens_cpu is not None else batch.seq_lens)
    qsl_host = _host_list(
        query_start_loc_cpu if query_start_loc_cpu is not None else batch.query_start_loc
    )
    num_reqs = batch.num_reqs
    if len(seq_host) != num_reqs or len(qsl_host) != num_reqs + 1:
        raise ValueError(
            "dsa.build_prefill_metadata: host lengths must match the batch: "
            f"len(seq_lens_cpu)={len(seq_host)} (want {num_reqs}), "
            f"len(query_start_loc_cpu)={len(qsl_host)} (want {num_reqs + 1})"
        )
    if (seq_lens_cpu is not None or query_start_loc_cpu is not None) and values_readable(
        batch.seq_lens, debug=True
    ):
        _check_host_copies(batch, seq_host, qsl_host)
    if not is_int(num_decodes) or not 0 <= num_decodes <= num_reqs:
        raise ValueError(f"dsa.build_prefill_metadata: `num_decodes` must be in [0, {num_reqs}], "
                         f"got {num_decodes}")
    for r in range(num_decodes):  # design §9, as build_decode_metadata checks them
        if qsl_host[r + 1] - qsl_host[r] > cfg.next_n:
            raise ValueError(f"dsa.build_prefill_metadata: decode request {r} (of num_decodes="
                             f"{num_decodes}) must have at most next_n={cfg.next_n} query "
                             f"tokens, got {qsl_host[r + 1] - qsl_host[r]}")

    ratio = cfg.compress_ratio
    token_requests, valid, request_table, slot_mapping = token_writes(cfg, batch)

    states = [s // ratio for s in seq_host]
    local_states = local_share(torch.tensor(states, dtype=torch.int64), cfg.dcp_world,
                               cfg.dcp_rank, cfg.dcp_interleave).tolist()
    query_lens = [qsl_host[r + 1] - qsl_host[r] for r in range(num_reqs)]
    pieces = split_prefill_chunks(
        seq_host[num_decodes:], query_lens[num_decodes:], cfg.prefill_workspace_rows,
        cfg.max_logits_bytes, compress_ratio=ratio,
    )
    chunks = []
    for req_slice, query_slice in pieces:
        start, end = req_slice.start + num_decodes, req_slice.stop + num_decodes
        num_rows = sum(states[start:end])
        bounds = ops.prefill_chunk_bounds(
            batch.query_start_loc, batch.seq_lens, start, end, query_slice.start,
            query_slice.stop, num_rows, ratio, cfg.dcp_world, cfg.dcp_rank, cfg.dcp_interleave,
        )
        cu_seq_lens, local_cu_seq_lens, token_to_seq, ks, ke, global_lens = bounds
        chunks.append(
            PrefillChunk(
                req_start=start,
                req_end=end,
                token_start=qsl_host[start] + query_slice.start,
                token_end=qsl_host[start] + query_slice.stop,
                num_rows=num_rows,
                num_local_rows=sum(local_states[start:end]),
                max_seqlen_k=max([1, *local_states[start:end]]),
                skip_gather=query_slice.start > 0,
                block_table=request_table[start:end],
                cu_seq_lens=cu_seq_lens,
                local_cu_seq_lens=local_cu_seq_lens,
                token_to_seq=token_to_seq,
                ks=ks,
                ke=ke,
                global_lens=global_lens,
            )
        )
    return PrefillMetadata(
        chunks=tuple(chunks),
        slot_mapping=slot_mapping,
        request_block_table=request_table,
        token_requests=token_requests,
        valid_tokens=valid,
        logits_backend=ragged_backend(cfg.logits_backend, batch.seq_lens.device, cfg.num_heads,
                                      cfg.head_dim, op="build_prefill_metadata",
                                      arg="IndexerConfig.logits_backend"),
        built_for=cfg.metadata_key(),
    )


def _check_host_copies(batch: Batch, seq_host: list[int], qsl_host: list[int]) -> None:
    """The host lengths must equal the batch's tensors (one copy to the host, one compare)."""
    device = torch.cat([batch.seq_lens, batch.query_start_loc]).cpu().long()
    if not torch.equal(device, torch.tensor(seq_host + qsl_host, dtype=torch.long)):
        num_reqs = len(seq_host)
        raise ValueError(
            "dsa.build_prefill_metadata: `seq_lens_cpu` and `query_start_loc_cpu` must equal "
            f"the batch's `seq_lens` and `query_start_loc`, got {seq_host} and {qsl_host} "
            f"for {device[:num_reqs].tolist()} and {device[num_reqs:].tolist()}"
        )


def _host_list(x: Sequence[int] | Tensor) -> list[int]:
    """Host lengths as ints >= 0: a 1-D integer tensor or a sequence of ints."""
    if isinstance(x, Tensor) and (x.ndim != 1 or x.is_floating_point() or x.is_complex()):
        raise ValueError(f"dsa.build_prefill_metadata: host lengths must be a 1-D integer "
                         f"tensor or a sequence of ints, got a {x.dtype} tensor of shape "
                         f"{tuple(x.shape)}")
    values = x.tolist() if isinstance(x, Tensor) else list(x)
    if not all(is_int(v) and v >= 0 for v in values):
        raise ValueError(f"dsa.build_prefill_metadata: host lengths must be ints >= 0, got "
                         f"{values}")
    return values
