"""Prefill metadata: row bounds of one chunk of requests in the gathered K workspace.

design §5. A chunk is the requests ``[req_start, req_end)`` (n of them); their compressed K
(``seq_len // R`` rows each) is gathered back to back into a workspace. For the chunk's
query tokens ``[query_begin, query_end)`` (counted from the chunk's first query token),
the j-th query token of request r (query_len qlen, seq_len L) sees::

    global_len = (L - qlen + 1 + j) // R
    ks = local_cu_seq_lens[r],  ke = ks + local_share(global_len)

where ``local_share`` is this rank's DCP share (identity without DCP), and
``local_cu_seq_lens`` the cumulative shares of the compressed lengths. Query rows past the
chunk's tokens get ``ks = ke = global_len = 0``; workspace rows past the gathered ones get
``token_to_seq = -1``. Runs outside CUDA graphs, but still without host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsa.ops._checks import check_dcp, check_int, check_query_start_loc, check_seq_lens
from dsa.ops._launch import block_for, launch
from dsa.ops._registry import dsa_op
from dsa.ops._tokens import request_of, search_steps, token_offset
from dsa.ops.dcp import local_share, local_share_tl

_OP = "prefill_chunk_bounds"

ChunkBounds = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


@dsa_op(_OP)
def _prefill_chunk_bounds_out(
    query_start_loc: Tensor, seq_lens: Tensor, req_start: int, req_end: int,
    query_begin: int, query_end: int, num_rows: int, compress_ratio: int = 1,
    dcp_world: int = 1, dcp_rank: int = 0, dcp_interleave: int = 1,
) -> ChunkBounds:
    num_reqs = check_query_start_loc(_OP, query_start_loc)
    check_seq_lens(_OP, seq_lens, query_start_loc, num_reqs)
    check_int(_OP, "req_start", req_start, low=0)
    check_int(_OP, "req_end", req_end, low=req_start)
    if req_end > num_reqs:
        raise ValueError(f"dsa.{_OP}: `req_end` must be <= num_reqs={num_reqs}, got {req_end}")
    check_int(_OP, "query_begin", query_begin, low=0)
    check_int(_OP, "query_end", query_end, low=query_begin)
    check_int(_OP, "num_rows", num_rows, low=0)
    check_int(_OP, "compress_ratio", compress_ratio, low=1)
    check_dcp(_OP, dcp_world, dcp_rank, dcp_interleave)
    n, q = req_end - req_start, query_end - query_begin
    new = lambda size: query_start_loc.new_empty(size, dtype=torch.int32)
    return new(n + 1), new(n + 1), new(num_rows), new(q), new(q), new(q)


@_prefill_chunk_bounds_out.cpu
def _prefill_chunk_bounds_cpu(
    query_start_loc: Tensor, seq_lens: Tensor, req_start: int, req_end: int,
    query_begin: int, query_end: int, num_rows: int, compress_ratio: int = 1,
    dcp_world: int = 1, dcp_rank: int = 0, dcp_interleave: int = 1,
) -> ChunkBounds:
    outs = _prefill_chunk_bounds_out(
        query_start_loc, seq_lens, req_start, req_end, query_begin, query_end, num_rows,
        compress_ratio, dcp_world, dcp_rank, dcp_interleave,
    )
    cu, local_cu, token_to_seq, ks, ke, global_lens = outs
    n, device = req_end - req_start, query_start_loc.device
    share = lambda x: local_share(x, dcp_world, dcp_rank, dcp_interleave)
    seq = seq_lens[req_start:req_end].long()
    compressed = seq.clamp(min=0) // compress_ratio
    zero = compressed.new_zeros(1)
    cu.copy_(torch.cat([zero, compressed.cumsum(0).clamp_(max=2**31 - 1)]))
    local_cu.copy_(torch.cat([zero, share(compressed).cumsum(0).clamp_(max=2**31 - 1)]))

    rows = torch.arange(num_rows, device=device)
    row_req = torch.searchsorted(cu, rows.int(), right=True) - 1
    token_to_seq.copy_(torch.where(rows < cu[n], row_req, -1))

    qsl = query_start_loc[req_start:req_end + 1].long()
    qsl = qsl - qsl[0]
    u = torch.arange(query_begin, query_end, device=device)
    req = (torch.searchsorted(qsl, u, right=True) - 1).clamp_(0, n)
    real = req < n
    # Query rows past the chunk read a zero-length request appended at index n.
    ends = torch.cat([qsl[1:], qsl[n:]])
    query_len = ends[req] - qsl[req]
    seq_len = torch.cat([seq, zero])[req]
    glen = (seq_len - query_len + 1 + u - qsl[req]).clamp(min=0) // compress_ratio
    glen = torch.where(real, glen, 0)
    start = torch.where(real, local_cu[req], 0)
    ks.copy_(start)
    ke.copy_(start + share(glen))
    global_lens.copy_(glen)
    return outs


@triton.jit
def _chunk_offsets_kernel(seq_lens_ptr, cu_ptr, local_cu_ptr, req_start, n, ratio, world,
                          rank, interleave, BLOCK: tl.constexpr):
    """One program: ``cu`` / ``local_cu`` = [0, cumsum(compressed lens / their shares)],
    summed in int64 and saturated at 2**31 - 1 (still non-decreasing past int32)."""
    first = tl.arange(0, BLOCK) == 0
    total = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), 0)
    local_total = total
    tl.store(cu_ptr + tl.arange(0, BLOCK), tl.zeros([BLOCK], dtype=tl.int32), mask=first)
    tl.store(local_cu_ptr + tl.arange(0, BLOCK), tl.zeros([BLOCK], dtype=tl.int32), mask=first)
    for base in range(0, n, BLOCK):
        i = base + tl.arange(0, BLOCK)
        in_range = i < n
        seq = tl.load(seq_lens_ptr + req_start + i, mask=in_range, other=0)
        compressed = (tl.maximum(seq, 0) // ratio).to(tl.int64)
        share = local_share_tl(compressed, world, rank, interleave)
        tl.store(cu_ptr + 1 + i, tl.minimum(total + tl.cumsum(compressed, 0), 2**31 - 1),
                 mask=in_range)
        tl.store(local_cu_ptr + 1 + i, tl.minimum(local_total + tl.cumsum(share, 0), 2**31 - 1),
                 mask=in_range)
        total += tl.sum(compressed, 0)
        local_total += tl.sum(share, 0)


@triton.jit
def _chunk_rows_kernel(
    qsl_ptr, seq_lens_ptr, cu_ptr, local_cu_ptr, token_to_seq_ptr, ks_ptr, ke_ptr,
    global_lens_ptr, req_start, n, num_rows, num_queries, query_begin, ratio, world, rank,
    interleave, SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Workspace row i -> its request; query row i -> its [ks, ke) and global length."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    qsl_ptr += req_start  # the chunk's own query_start_loc and seq_lens
    seq_lens_ptr += req_start

    row_req = request_of(cu_ptr, i, n, SEARCH_STEPS)
    tl.store(token_to_seq_ptr + i, tl.where(row_req < n, row_req, -1), mask=i < num_rows)

    is_query = i < num_queries
    u = tl.load(qsl_ptr) + query_begin + i
    req, real, back = token_offset(qsl_ptr, u, is_query, n, SEARCH_STEPS)
    seq = tl.load(seq_lens_ptr + req, mask=real, other=0)
    glen = tl.maximum(seq.to(tl.int64) + back + 1, 0) // ratio  # int64, as the torch face
    glen = tl.where(real, glen, 0)
    ks = tl.load(local_cu_ptr + req, mask=real, other=0)
    tl.store(ks_ptr + i, ks, mask=is_query)
    tl.store(ke_ptr + i, ks + local_share_tl(glen, world, rank, interleave), mask=is_query)
    tl.store(global_lens_ptr + i, glen, mask=is_query)


@_prefill_chunk_bounds_out.triton
def _prefill_chunk_bounds_cuda(
    query_start_loc: Tensor, seq_lens: Tensor, req_start: int, req_end: int,
    query_begin: int, query_end: int, num_rows: int, compress_ratio: int = 1,
    dcp_world: int = 1, dcp_rank: int = 0, dcp_interleave: int = 1,
) -> ChunkBounds:
    outs = _prefill_chunk_bounds_out(
        query_start_loc, seq_lens, req_start, req_end, query_begin, query_end, num_rows,
        compress_ratio, dcp_world, dcp_rank, dcp_interleave,
    )
    cu, local_cu, token_to_seq, ks, ke, global_lens = outs
    n, q = req_end - req_start, query_end - query_begin
    dcp = (dcp_world, dcp_rank, dcp_interleave)
    # Whole tensors plus an offset: a slice starting at their end may be an invalid pointer.
    launch(_chunk_offsets_kernel, (1,),
        seq_lens, cu, local_cu, req_start, n, compress_ratio, *dcp, BLOCK=block_for(n)
    )
    rows = max(num_rows, q)
    if rows:
        block = block_for(rows)
        launch(_chunk_rows_kernel, (triton.cdiv(rows, block),),
            query_start_loc, seq_lens, cu, local_cu, token_to_seq, ks, ke, global_lens,
            req_start, n, num_rows, q, query_begin, compress_ratio, *dcp,
            SEARCH_STEPS=search_steps(n), BLOCK=block,
        )
    return outs
