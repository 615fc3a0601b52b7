"""Padding a live batch into a captured bucket's static buffers, in one launch (design §9).

``dsa::pad_batch_out`` writes a live batch of R requests, T tokens and block-table width W
into buffers of capacity R' >= R requests, T' >= T tokens and width W' >= W::

    out_query_start_loc = query_start_loc, then query_start_loc[R] repeated R' - R times
    out_seq_lens        = seq_lens, then 0        (padding requests: query_len 0, seq_len 0)
    out_block_table     = the live rows in the first W columns, 0 everywhere else
    out_slot_mapping    = slot_mapping, then -1   (padding tokens write nothing)
    out_positions       = positions, then 0

One launch replaces the dozen small copies and fills ``StaticBatch.load`` used to make: a
Triton program per request of the bucket (its offset, length and table row) plus one per
block of tokens. Live tensors may be int32 or int64; the buffers keep their own dtypes,
and live values outside int32 never wrap into valid ones: offsets and lengths saturate at
int32's ends, block ids and positions become -1 (outside every cache and model length: they
select and write nothing). The live tensors may be prefix views of the buffers themselves
(``StaticBatch.pad``): a live entry is only ever rewritten with its own value, so padding in
place is exact on both faces. ``pad_batch_launch`` is the CUDA launch made ready for one
signature, relaunched at a fraction of a Triton launch's host time (what ``StaticBatch``
pads with: the op itself checks its arguments on every call).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsa.ops._checks import INDEX_DTYPES, POSITION_DTYPES, check_size, check_tensor
from dsa.ops._launch import FixedLaunch, block_for
from dsa.ops._registry import dsa_op

LIVE_DTYPES = (torch.int32, torch.int64)
_OP = "pad_batch_out"
_POINTERS = ["qsl_ptr", "seq_ptr", "table_ptr", "slot_ptr", "pos_ptr", "out_qsl_ptr",
             "out_seq_ptr", "out_table_ptr", "out_slot_ptr", "out_pos_ptr"]


@dsa_op(_OP, mutates_args=("out_query_start_loc", "out_seq_lens", "out_block_table",
                           "out_slot_mapping", "out_positions"))
def _check_pad_batch(query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor,
                     slot_mapping: Tensor, positions: Tensor, out_query_start_loc: Tensor,
                     out_seq_lens: Tensor, out_block_table: Tensor, out_slot_mapping: Tensor,
                     out_positions: Tensor) -> None:
    qsl = check_tensor(_OP, "query_start_loc", query_start_loc, dtype=LIVE_DTYPES, ndim=1,
                       contiguous=True)
    if qsl.shape[0] < 1:
        raise ValueError(f"dsa.{_OP}: `query_start_loc` must have num_reqs + 1 >= 1 entries, "
                         "got 0")
    reqs = qsl.shape[0] - 1
    live = {"seq_lens": (seq_lens, 1), "block_table": (block_table, 2),
            "slot_mapping": (slot_mapping, 1), "positions": (positions, 1)}
    for name, (t, ndim) in live.items():
        check_tensor(_OP, name, t, dtype=LIVE_DTYPES, ndim=ndim, contiguous=ndim == 1, like=qsl)
    check_size(_OP, "seq_lens", seq_lens, 0, reqs, "num_reqs = len(query_start_loc) - 1")
    check_size(_OP, "block_table", block_table, 0, reqs, "num_reqs = len(query_start_loc) - 1")
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError(f"dsa.{_OP}: `block_table` rows must be contiguous (stride(1) == 1), "
                         f"got strides {block_table.stride()}")
    tokens = slot_mapping.shape[0]
    check_size(_OP, "positions", positions, 0, tokens, "num_tokens = len(slot_mapping)")
    out = {"out_query_start_loc": (out_query_start_loc, INDEX_DTYPES, 1),
           "out_seq_lens": (out_seq_lens, INDEX_DTYPES, 1),
           "out_block_table": (out_block_table, INDEX_DTYPES, 2),
           "out_slot_mapping": (out_slot_mapping, torch.int64, 1),
           "out_positions": (out_positions, POSITION_DTYPES, 1)}
    for name, (t, dtype, ndim) in out.items():
        check_tensor(_OP, name, t, dtype=dtype, ndim=ndim, contiguous=True, like=qsl)
    cap_reqs, cap_tokens = out_seq_lens.shape[0], out_slot_mapping.shape[0]
    what = "capacity = len(out_seq_lens)"
    check_size(_OP, "out_query_start_loc", out_query_start_loc, 0, cap_reqs + 1, what + " + 1")
    check_size(_OP, "out_block_table", out_block_table, 0, cap_reqs, what)
    check_size(_OP, "out_positions", out_positions, 0, cap_tokens,
               "capacity = len(out_slot_mapping)")
    width, cap_width = block_table.shape[1], out_block_table.shape[1]
    if reqs > cap_reqs or tokens > cap_tokens or width > cap_width:
        raise ValueError(
            f"dsa.{_OP}: a batch of {reqs} requests, {tokens} tokens and block-table width "
            f"{width} does not fit capacity {cap_reqs} requests, {cap_tokens} tokens, width "
            f"{cap_width}"
        )


@_check_pad_batch.cpu
def _pad_batch_cpu(*tensors: Tensor) -> None:
    _check_pad_batch(*tensors)
    (query_start_loc, seq_lens, block_table, slot_mapping, positions, out_query_start_loc,
     out_seq_lens, out_block_table, out_slot_mapping, out_positions) = tensors
    reqs, width = block_table.shape
    query_start_loc = query_start_loc.clamp(_INT32_MIN, _INT32_MAX)
    out_query_start_loc[: reqs + 1].copy_(query_start_loc)
    out_query_start_loc[reqs + 1:].copy_(query_start_loc[reqs:].expand(
        out_query_start_loc.shape[0] - reqs - 1))
    _copy_and_fill(out_seq_lens, seq_lens.clamp(_INT32_MIN, _INT32_MAX), 0)
    out_block_table[:reqs, :width].copy_(_int32_or_minus_one(block_table))
    out_block_table[:reqs, width:].zero_()
    out_block_table[reqs:].zero_()
    _copy_and_fill(out_slot_mapping, slot_mapping, -1)
    _copy_and_fill(out_positions, _int32_or_minus_one(positions), 0)


_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _int32_or_minus_one(x: Tensor) -> Tensor:
    return torch.where((x >= _INT32_MIN) & (x <= _INT32_MAX), x, -1)


def _copy_and_fill(out: Tensor, src: Tensor, fill: int) -> None:
    out[: src.shape[0]].copy_(src)
    out[src.shape[0]:].fill_(fill)


@triton.jit
def _saturated_tl(x):
    """Triton: ``x`` clamped to int32's range (a no-op on int32 values)."""
    return tl.minimum(tl.maximum(x, -(2**31)), 2**31 - 1)


@triton.jit
def _int32_or_minus_one_tl(x):
    """Triton: ``x`` where it fits int32, else -1."""
    return tl.where((x >= -(2**31)) & (x <= 2**31 - 1), x, -1)


# Pointers unspecialized on alignment: a ready launch (``pad_batch_launch``) serves any
# addresses of the same dtypes.
@triton.jit(do_not_specialize=["num_reqs", "num_tokens", "width", "table_stride", "row0",
                               "row1", "stride0", "stride1"],
            do_not_specialize_on_alignment=[*_POINTERS, "in0_ptr", "out0_ptr", "in1_ptr",
                                            "out1_ptr"])
def _pad_batch_kernel(qsl_ptr, seq_ptr, table_ptr, slot_ptr, pos_ptr,
                      out_qsl_ptr, out_seq_ptr, out_table_ptr, out_slot_ptr, out_pos_ptr,
                      in0_ptr, out0_ptr, in1_ptr, out1_ptr,
                      table_stride, num_reqs, num_tokens, width, cap_reqs, cap_tokens, cap_width,
                      row0, row1, stride0, stride1,
                      BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr, INPUTS: tl.constexpr,
                      BLOCK_R: tl.constexpr):
    pid = tl.program_id(0)
    token_blocks = tl.cdiv(cap_tokens, BLOCK_T)
    if pid == 0:
        tl.store(out_qsl_ptr, _saturated_tl(tl.load(qsl_ptr)))
    if pid < cap_reqs:
        real = pid < num_reqs
        tl.store(out_seq_ptr + pid, _saturated_tl(tl.load(seq_ptr + pid, mask=real, other=0)))
        tl.store(out_qsl_ptr + pid + 1,
                 _saturated_tl(tl.load(qsl_ptr + tl.minimum(pid + 1, num_reqs))))
        live_width = tl.where(real, width, 0)
        cols = tl.arange(0, BLOCK_W)
        src_row = table_ptr + pid.to(tl.int64) * table_stride
        dst_row = out_table_ptr + pid.to(tl.int64) * cap_width
        for start in range(0, cap_width, BLOCK_W):
            col = start + cols
            entry = tl.load(src_row + col, mask=col < live_width, other=0)
            tl.store(dst_row + col, _int32_or_minus_one_tl(entry), mask=col < cap_width)
    elif pid < cap_reqs + token_blocks:
        t = (pid - cap_reqs) * BLOCK_T + tl.arange(0, BLOCK_T)
        real_tok = t < num_tokens
        in_range = t < cap_tokens
        tl.store(out_slot_ptr + t, tl.load(slot_ptr + t, mask=real_tok, other=-1), mask=in_range)
        tl.store(out_pos_ptr + t,
                 _int32_or_minus_one_tl(tl.load(pos_ptr + t, mask=real_tok, other=0)),
                 mask=in_range)
    elif INPUTS > 0:  # a program per (token, input): the live token's row, copied
        r = pid - cap_reqs - token_blocks
        tok = (r // INPUTS).to(tl.int64)
        if tok < num_tokens:
            if r % INPUTS == 0:
                _copy_row(in0_ptr + tok * stride0, out0_ptr + tok * row0, row0, BLOCK_R)
            else:
                _copy_row(in1_ptr + tok * stride1, out1_ptr + tok * row1, row1, BLOCK_R)


@triton.jit
def _copy_row(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        col = start + offs
        tl.store(dst + col, tl.load(src + col, mask=col < n), mask=col < n)


@_check_pad_batch.cuda
def _pad_batch_cuda(*tensors: Tensor) -> None:
    _check_pad_batch(*tensors)
    reqs, width = tensors[2].shape
    launch_pad_batch(tensors, reqs, tensors[3].shape[0], width)


def launch_pad_batch(tensors: Sequence[Tensor], num_reqs: int, num_tokens: int,
                     width: int) -> None:
    """The CUDA face's launch, unchecked, with the live sizes given: ``tensors`` are the
    op's ten arguments, whose live half may be the buffers themselves (padding in place
    after the first ``num_reqs`` requests, ``num_tokens`` tokens and ``width`` columns)."""
    pad_batch_launch(tensors[5:], num_reqs, num_tokens, width, tensors[2].stride(0))(*tensors)


def pad_batch_launch(out: Sequence[Tensor], num_reqs: int, num_tokens: int, width: int,
                     table_stride: int, rows: Sequence[tuple[Tensor, int]] = ()
                     ) -> FixedLaunch:
    """``launch_pad_batch`` into the buffers ``out`` (the op's last five arguments) of live
    batches of these sizes and block-table row stride, ready to relaunch: call it with the
    op's ten arguments, then for each of ``rows`` the live token input and its buffer. Keep
    one per signature the caller checked (sizes and dtypes): its relaunches skip Triton's
    per-call JIT work.

    rows: up to ``MAX_ROW_INPUTS`` token inputs copied in the same launch, each as (its
    buffer, the live input's row stride); a live row and a buffer row hold the buffer's
    ``numel() // len(buffer)`` contiguous elements.
    """
    if len(rows) > MAX_ROW_INPUTS:
        raise ValueError(f"pad_batch_launch: at most {MAX_ROW_INPUTS} token inputs, got "
                         f"{len(rows)}")
    out_table = out[2]
    cap_reqs, cap_width = out_table.shape
    cap_tokens = out[3].shape[0]
    block_t = block_for(cap_tokens)
    lengths = [buffer.numel() // max(buffer.shape[0], 1) for buffer, _ in rows]
    row_args: dict[str, object] = {}
    for i in range(MAX_ROW_INPUTS):  # unused inputs: placeholder pointers, never read
        used = i < len(rows)
        if not used:
            row_args.update({f"in{i}_ptr": out[1], f"out{i}_ptr": out[1]})
        row_args.update({f"row{i}": lengths[i] if used else 0,
                         f"stride{i}": rows[i][1] if used else 0})
    grid = (max(1, cap_reqs + triton.cdiv(cap_tokens, block_t) + len(rows) * cap_tokens),)
    return FixedLaunch(_pad_batch_kernel, grid, table_stride=table_stride, num_reqs=num_reqs,
                       num_tokens=num_tokens, width=width, cap_reqs=cap_reqs,
                       cap_tokens=cap_tokens, cap_width=cap_width, **row_args,
                       BLOCK_W=block_for(cap_width), BLOCK_T=block_t, INPUTS=len(rows),
                       BLOCK_R=block_for(max(lengths, default=1), 2048))


# Token inputs one pad launch copies (``pad_batch_launch``); a StaticBatch copies the rest
# in one ``torch._foreach_copy_``.
MAX_ROW_INPUTS = 2
