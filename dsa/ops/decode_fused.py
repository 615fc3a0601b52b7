"""``dsa::decode_metadata``: a decode step's metadata tensors in one launch (design §4, §6).

It equals, bit for bit, this composition of the small ops (``T = len(slot_mapping)``)::

    token_requests = decode_row_requests(query_start_loc, T)
    valid_tokens   = real token (token_requests < B) at a position in [0, max_model_len)
    slot_mapping   = where(valid_tokens, slot_mapping, -1)
    native: global_lens = native_decode_lens(seq_lens, next_n)        rows: B requests
            block_table = block_table
    flat:   global_lens = decode_token_lens(query_start_loc, seq_lens, T).view(T, 1)
            block_table = expand_block_table(query_start_loc, block_table, T)  rows: T tokens
    global_lens  //= compress_ratio
    context_lens = cap_context_lens(dcp_local_lens(global_lens, ...), block_table, ...)
    select_lens  = where(token row * N + j is a valid token, context_lens[row, j], 0)
    deepgemm: block_table[:, 0] clamped into [0, num_blocks) (DeepGEMM reads a row's first
              block even at length 0); schedule_lens = context_lens.clamp(min=1);
              schedule = paged_mqa_schedule(context_lens, block_size)

``select_lens`` are the lengths top-k selects with when the logits rows are the tokens
(``DecodeMetadata.packed`` false): a token that is not valid selects nothing.

The Triton face is one kernel built from the small ops' ``@triton.jit`` helpers, plus
DeepGEMM's schedule kernel when ``deepgemm``; the CPU face composes their torch functions.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsa.ops._checks import (
    POSITION_DTYPES,
    check_dcp,
    check_int,
    check_paged_requests,
    check_size,
    check_tensor,
)
from dsa.ops._launch import block_for, pdl_enabled
from dsa.ops._registry import dsa_op
from dsa.ops._tokens import (
    lookup_requests,
    request_of,
    search_steps,
    valid_tokens,
    valid_tokens_tl,
)
from dsa.ops.dcp import local_share, local_share_tl
from dsa.ops.decode_meta import (
    capped_lens,
    capped_lens_tl,
    expanded_table,
    native_lens,
    native_lens_tl,
    row_requests,
    row_requests_tl,
    table_rows_tl,
    table_scan_block,
    token_lens,
    token_lens_tl,
)
from dsa.ops.logits import deepgemm as deepgemm_backend
from dsa.ops.logits.schedule import schedule_of_clamped


class _Args(NamedTuple):
    """The arguments of ``dsa::decode_metadata``, as both faces read them."""

    query_start_loc: Tensor
    seq_lens: Tensor
    block_table: Tensor
    positions: Tensor
    slot_mapping: Tensor
    native: bool
    next_n: int
    compress_ratio: int
    dcp_world: int
    dcp_rank: int
    dcp_interleave: int
    num_blocks: int
    block_size: int
    max_context_len: int
    max_model_len: int
    deepgemm: bool


class DecodeMetadataOutputs(NamedTuple):
    """The outputs of ``dsa::decode_metadata``, in order, named as the ``DecodeMetadata``
    fields they fill."""

    global_context_lens: Tensor
    context_lens: Tensor
    block_table: Tensor
    token_requests: Tensor
    valid_tokens: Tensor
    slot_mapping: Tensor
    select_lens: Tensor
    schedule_lens: Tensor
    schedule: Tensor


@dsa_op("decode_metadata")
def _decode_metadata_out(
    query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor, positions: Tensor,
    slot_mapping: Tensor, native: bool, next_n: int, compress_ratio: int, dcp_world: int,
    dcp_rank: int, dcp_interleave: int, num_blocks: int, block_size: int,
    max_context_len: int, max_model_len: int, deepgemm: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(global_context_lens, context_lens, block_table, token_requests, valid_tokens,
    slot_mapping, select_lens, schedule_lens, schedule)``: lengths int32 ``[B, next_n]``
    (native) or ``[T, 1]`` (flat), the block table per logits row, int32 ``[T]``, bool
    ``[T]``, int64 ``[T]``, lengths like ``context_lens`` (``schedule_lens``: ``[0, N]``
    without ``deepgemm``), and DeepGEMM's schedule ``[num_sms + 1, 2]`` (``[0, 2]`` without
    ``deepgemm``)."""
    op = "decode_metadata"
    num_reqs, width = check_paged_requests(op, query_start_loc, seq_lens, block_table)
    check_tensor(op, "slot_mapping", slot_mapping, dtype=torch.int64, ndim=1, contiguous=True,
                 like=query_start_loc)
    num_tokens = slot_mapping.shape[0]
    check_tensor(op, "positions", positions, dtype=POSITION_DTYPES, ndim=1, contiguous=True,
                 like=query_start_loc)
    check_size(op, "positions", positions, 0, num_tokens, "len(slot_mapping)")
    check_int(op, "next_n", next_n, low=1)
    check_int(op, "compress_ratio", compress_ratio, low=1)
    check_dcp(op, dcp_world, dcp_rank, dcp_interleave)
    check_int(op, "num_blocks", num_blocks, low=0)
    check_int(op, "block_size", block_size, low=1)
    check_int(op, "max_context_len", max_context_len, low=0)
    check_int(op, "max_model_len", max_model_len, low=0)

    rows, slots = (num_reqs, next_n) if native else (num_tokens, 1)
    lens = query_start_loc.new_empty((rows, slots), dtype=torch.int32)
    sms = deepgemm_backend.num_sms(query_start_loc.device) + 1 if deepgemm else 0
    return (
        lens,
        torch.empty_like(lens),
        block_table.new_empty((rows, width), dtype=torch.int32),
        query_start_loc.new_empty(num_tokens, dtype=torch.int32),
        query_start_loc.new_empty(num_tokens, dtype=torch.bool),
        torch.empty_like(slot_mapping),
        torch.empty_like(lens),
        lens.new_empty((rows if deepgemm else 0, slots)),
        query_start_loc.new_empty((sms, 2), dtype=torch.int32),
    )


@_decode_metadata_out.cpu
def _decode_metadata_cpu(*args: object) -> tuple[Tensor, ...]:
    a, out = _Args(*args), DecodeMetadataOutputs(*_decode_metadata_out(*args))
    num_reqs, num_tokens = a.seq_lens.numel(), a.slot_mapping.numel()
    requests = row_requests(a.query_start_loc, num_tokens)
    valid = valid_tokens(requests, a.positions, num_reqs, a.max_model_len)
    if a.native:
        global_lens, table = native_lens(a.seq_lens, a.next_n), a.block_table
    else:
        global_lens = token_lens(a.query_start_loc, a.seq_lens, num_tokens).view(num_tokens, 1)
        table = expanded_table(a.query_start_loc, a.block_table, num_tokens)
    global_lens = global_lens // a.compress_ratio
    local = local_share(global_lens, a.dcp_world, a.dcp_rank, a.dcp_interleave)
    out.context_lens.copy_(capped_lens(local, table, a.num_blocks, a.block_size,
                                       a.max_context_len))
    out.block_table.copy_(table)
    if a.deepgemm:
        out.block_table[:, :1].clamp_(0, a.num_blocks - 1)
        out.schedule_lens.copy_(out.context_lens.clamp(min=1))
    out.select_lens.copy_(selection_lens(out.context_lens, valid))
    out.global_context_lens.copy_(global_lens)
    out.token_requests.copy_(requests)
    out.valid_tokens.copy_(valid)
    out.slot_mapping.copy_(torch.where(valid, a.slot_mapping, -1))
    out.schedule.zero_()
    return tuple(out)


def selection_lens(lens: Tensor, valid_tokens: Tensor) -> Tensor:
    """Torch: ``lens`` ``[rows, N]`` with 0 where token ``row * N + j`` is missing or not in
    ``valid_tokens``."""
    valid = valid_tokens.new_zeros(lens.numel())
    shared = min(valid.numel(), valid_tokens.numel())
    valid[:shared] = valid_tokens[:shared]
    return torch.where(valid.view_as(lens), lens, 0)


@triton.jit
def _token_valid(qsl_ptr, positions_ptr, t, t_ok, num_reqs, max_model_len,
                 SEARCH_STEPS: tl.constexpr, REQS: tl.constexpr):
    """Requests of the tokens ``t`` (where ``t_ok``) and whether each is a valid token."""
    requests = row_requests_tl(qsl_ptr, t, num_reqs, SEARCH_STEPS, REQS)
    positions = tl.load(positions_ptr + t, mask=t_ok, other=-1)
    return requests, t_ok & valid_tokens_tl(requests, positions, num_reqs, max_model_len)


@triton.jit(do_not_specialize=["table_stride", "num_reqs", "num_rows", "num_tokens", "width",
                               "num_blocks", "max_context_len", "max_model_len"])
def _decode_metadata_kernel(
    qsl_ptr, seq_lens_ptr, table_ptr, table_stride, positions_ptr, slots_ptr,
    global_ptr, lens_ptr, select_ptr, clamped_ptr, table_out_ptr, requests_ptr, valid_ptr,
    slots_out_ptr, num_reqs, num_rows, num_tokens, width, world, rank, interleave, num_blocks,
    max_context_len, max_model_len,
    NATIVE: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, RATIO: tl.constexpr,
    DEEPGEMM: tl.constexpr, BS: tl.constexpr, SEARCH_STEPS: tl.constexpr, REQS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    """Program (p, c): columns block c of logits row p's block table; with c == 0 also row
    p's lengths and the token block p. Tokens' requests: ``request_of`` with SEARCH_STEPS
    and REQS. PDL: a kernel launched after it with programmatic dependent launch may start
    at once (it waits before it reads these outputs)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    p = tl.program_id(0)
    c = tl.program_id(1)
    row = p + tl.arange(0, 1)
    row_ok = row < num_rows
    if NATIVE:
        src = row
        src_ok = row_ok
    else:
        src = request_of(qsl_ptr, row, num_reqs, SEARCH_STEPS, REQS)
        src_ok = row_ok & (src < num_reqs)
    col = c * BLOCK_C + tl.arange(0, BLOCK_C)
    entries = table_rows_tl(table_ptr, table_stride, src, src_ok, col, width)
    if DEEPGEMM:
        first = tl.minimum(tl.maximum(entries, 0), num_blocks - 1)
        entries = tl.where((col == 0)[None, :], first, entries)
    dst = table_out_ptr + row.to(tl.int64)[:, None] * width + col[None, :]
    tl.store(dst, entries, mask=row_ok[:, None] & (col < width)[None, :])

    if c == 0:
        j = tl.arange(0, NP)
        slot_ok = (j < N) & row_ok
        if NATIVE:
            seq = tl.load(seq_lens_ptr + row, mask=row_ok, other=0)
            global_lens = tl.where(slot_ok, native_lens_tl(seq, j, N), 0)
        else:
            global_lens, _, _ = token_lens_tl(qsl_ptr, seq_lens_ptr, p + j, slot_ok, num_reqs,
                                              SEARCH_STEPS, REQS)
        global_lens = global_lens // RATIO
        local = local_share_tl(global_lens, world, rank, interleave)
        row_ptr = table_ptr + tl.max(src, axis=0).to(tl.int64) * table_stride
        lens = capped_lens_tl(local, row_ptr, width, num_blocks, max_context_len, BS, BLOCK_W)
        out = p * N + j
        tl.store(global_ptr + out, global_lens, mask=slot_ok)
        tl.store(lens_ptr + out, lens, mask=slot_ok)
        if DEEPGEMM:
            tl.store(clamped_ptr + out, tl.maximum(lens, 1), mask=slot_ok)
        _, out_valid = _token_valid(qsl_ptr, positions_ptr, out, slot_ok & (out < num_tokens),
                                    num_reqs, max_model_len, SEARCH_STEPS, REQS)
        tl.store(select_ptr + out, tl.where(out_valid, lens, 0), mask=slot_ok)

        t = p * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < num_tokens
        requests, valid = _token_valid(qsl_ptr, positions_ptr, t, t_ok, num_reqs, max_model_len,
                                       SEARCH_STEPS, REQS)
        slots = tl.load(slots_ptr + t, mask=t_ok, other=-1)
        tl.store(requests_ptr + t, requests, mask=t_ok)
        tl.store(valid_ptr + t, valid, mask=t_ok)
        tl.store(slots_out_ptr + t, tl.where(valid, slots, -1), mask=t_ok)


@_decode_metadata_out.cuda
def _decode_metadata_cuda(*args: object) -> tuple[Tensor, ...]:
    a, out = _Args(*args), DecodeMetadataOutputs(*_decode_metadata_out(*args))
    num_reqs, num_tokens = a.seq_lens.numel(), a.slot_mapping.numel()
    (rows, slots_per_row), width = out.context_lens.shape, a.block_table.shape[1]
    # schedule_lens is not written without DeepGEMM
    clamped = out.schedule_lens if a.deepgemm else out.context_lens
    # the tokens spread over the rows' programs (a few each: their requests in one read)
    block_t = block_for(triton.cdiv(num_tokens, max(rows, 1)))
    grid = (max(rows, triton.cdiv(num_tokens, block_t)),
            max(1, triton.cdiv(width, block_for(width))))
    if grid[0]:
        _decode_metadata_kernel[grid](
            a.query_start_loc, a.seq_lens, a.block_table, a.block_table.stride(0), a.positions,
            a.slot_mapping, out.global_context_lens, out.context_lens, out.select_lens, clamped,
            out.block_table, out.token_requests, out.valid_tokens, out.slot_mapping, num_reqs,
            rows, num_tokens, width, a.dcp_world, a.dcp_rank, a.dcp_interleave, a.num_blocks,
            a.max_context_len, a.max_model_len, NATIVE=a.native, N=slots_per_row,
            NP=triton.next_power_of_2(slots_per_row), RATIO=a.compress_ratio,
            DEEPGEMM=a.deepgemm, BS=a.block_size, SEARCH_STEPS=search_steps(num_reqs),
            REQS=lookup_requests(num_reqs, max(block_t, slots_per_row)),
            BLOCK_T=block_t, BLOCK_W=table_scan_block(width), BLOCK_C=block_for(width),
            PDL=pdl_enabled(a.block_table),
        )
    if a.deepgemm:
        out = out._replace(schedule=schedule_of_clamped(out.schedule_lens, a.block_size,
                                                        out.schedule))
    return tuple(out)
