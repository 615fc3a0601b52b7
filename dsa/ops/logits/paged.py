"""Paged MQA logits of decode rows (design §3): ``dsa::paged_mqa_logits`` (dsa's kernel:
Triton on CUDA, plain torch on the CPU) and ``dsa::paged_mqa_logits_deepgemm``.

q is ``[B, next_n, H, D]`` fp8, K is read from the paged cache through ``block_table``, and
row ``b * next_n + j`` of the ``[B * next_n, max_context_len]`` output has
``context_lens[b, j]`` valid columns. dsa's kernel writes -inf past a row's length and on
keys whose block entry is outside the table or the cache; DeepGEMM leaves those columns
unspecified (top-k masks by length) and trusts its caller: lengths <= ``max_context_len``
whose blocks are all inside the cache (``build_decode_metadata`` caps lengths that way when
``IndexerConfig.num_blocks`` is set). :func:`paged_logits` picks an implementation by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from dsa.ops._checks import (
    INDEX_DTYPES,
    check_block_table,
    check_heads,
    check_int,
    check_nonnegative,
    check_size,
    check_tensor,
)
from dsa.ops._l2 import prefetch_lines
from dsa.ops._launch import (
    CHAIN_KEYS,
    EARLY_ROWS,
    chain_pdl,
    has_tma,
    launch,
    on_nvidia_gpu,
    pdl_chain_wait,
    pdl_enabled,
    pdl_launch,
)
from dsa.ops._registry import dsa_op
from dsa.ops.kcache import SCALE_BYTES, check_kv_cache, kcache_views, padded_block_table
from dsa.ops.logits import deepgemm
from dsa.ops.logits.common import (
    alloc_logits,
    choose_backend,
    fp8_rows,
    relu_nan_zero,
    tile_logits,
)


@dataclass(frozen=True)
class PagedLogitsConfig:
    """Launch parameters of the Triton paged-logits kernel.

    A program handles one request and ``tiles_per_program`` consecutive tiles of ``tile``
    KV tokens (a power of two >= 16; it may span several cache blocks or part of one).
    """

    tile: int = 64
    tiles_per_program: int = 1
    num_warps: int = 4
    num_stages: int = 3
    split_rows: bool = False
    """One ``[tile, heads]`` MMA per query row of the request (next_n <= 4; the K tile is
    still read once for all of them) instead of one ``[tile, next_n * heads]`` MMA with
    next_n padded to a power of two."""
    scales_ahead: bool = False
    """Read a tile's key scales one tile ahead and carry them, like its block ids (they lie
    outside the K tile's copy); costs registers."""
    tma: bool = False
    """Copy K tiles by TMA (Hopper's tensor memory accelerator, one descriptor over the
    cache's rows of head_dim bytes) instead of per-thread async copies. Taken where it can
    run (:func:`tma_unsupported_reason`), else ignored."""
    direct_store: bool = False
    """Store a tile's logits from the MMA's register layout (``tl.store`` first moves them
    to a coalesced one through shared memory). NVIDIA GPUs only (inline PTX), else ignored."""
    keep_in_l2: bool = False
    """Store the logits with L2's evict-last policy, so the K cache streaming through L2
    does not evict them (writing them back mid-kernel) and the top-k reads them from L2.
    Direct stores take it too (inline PTX, as ``tl.store`` emits it)."""
    blocks_preloaded: bool = False
    """Read the block ids of a program's tiles in one load at its start, so no K copy waits
    on a table read issued in the loop. Taken where each tile lies within one block and a
    program takes at most ``PRELOAD_MAX_TILES`` tiles (a tile's id is then picked from
    registers cheaply), else ignored."""
    early_tiles: int = 0
    """Start while the kernel before it runs (programmatic dependent launch) and prefetch
    into L2 the K values and key scales of a program's first ``early_tiles`` tiles before
    waiting for that kernel's end, whose writes (q, the step's new keys) only the reads
    after the wait see. Taken for calls of more than ``CHAIN_KEYS`` keys (no chain of their
    own) of more than one row, on an NVIDIA GPU of compute capability 9 or more, with each
    tile within one block; else ignored."""


class PagedLaunch(NamedTuple):
    """The per-next_n part of :func:`paged_logits_config`: ``most_tiles``, the most tiles a
    program takes, then fields as in PagedLogitsConfig."""

    most_tiles: int
    split_rows: bool
    num_warps: int
    num_stages: int
    scales_ahead: bool
    tma: bool
    direct_store: bool
    keep_in_l2: bool
    blocks_preloaded: bool
    early_tiles: int


# By next_n, from H200 runs (H 64, D 128, tile 64, 1M and 4M keys; BENCHMARKS.md, the
# sessions named). The MMA: next_n 2 and 3 one per query row (next_n 3 not padded to 4 rows;
# 64.4 against 69.8 us at 1M keys, next_n 2, "sixth"), next_n 4 one [64, 256] (split rows
# 380.3 against 357.1 us at 4M, "fifteenth"). K by TMA at every next_n ("fifteenth": 150.6
# against 155.1 us at 4M keys, next_n 1). Key scales a tile ahead but at next_n 4 ("fourteenth",
# "fifteenth"). Direct stores at next_n 3 (274.1 against 306.2 us, "fifteenth"). Tiles a
# program: up to 128 at next_n 3 and 4 (a program's pipeline fills once; 269.4-283.7 against
# 278.3-305.8 us with 16 at next_n 3, "eighteenth"), 32 at next_n 1 and 2 with 3 stages.
# Logits kept in L2 ("twenty-ninth", kernel us after 256 MB read over): at 64x65536, next_n
# 1, the logits' stores cost 12.5 of 144 us (a pure read of the cache takes 125.6), as the K
# cache streaming through L2 evicts them and they are written back mid-kernel; kept in L2
# 138.5, block ids preloaded too 137.3, and 32 tiles in 3 stages 135.5 (DeepGEMM 141.0 plus
# its schedule 3.1); next_n 2 176.0 against 181.6 (1M keys: 45.3 against 47.8); next_n 4 at
# 1M keys 83.3 against 86.1; next_n 3 slower with 64-128 block ids preloaded (145.9 against
# 130.4 at 2M keys), its direct stores kept in L2 ("thirtieth", inline PTX): 249.2 against
# 252.5 us at 64x65536, 65.0 against 65.9 at 16x65536. Started early with 2 tiles a program
# prefetched, next_n 1 ("forty-fifth", H100, bench_step's layer, us off the device time in
# two processes of two rounds each): 64x65536 0.8-1.5 and 0.2-0.8, 128x32768 0.9-1.4 and
# 0.4-0.9 (kernels read over 0.1-2.1); 4 tiles 1.3-2.5 slower.
# Fixed, not autotuned: the interpreter cannot autotune and a captured graph needs the launch
# decided before capture.
PAGED_LAUNCH = {1: PagedLaunch(32, False, 4, 3, True, True, False, True, True, 2),
                2: PagedLaunch(32, True, 4, 3, True, True, False, True, True, 0),
                3: PagedLaunch(128, True, 4, 3, True, True, True, True, False, 0),
                4: PagedLaunch(128, False, 4, 4, False, True, False, True, True, 0)}
SPLIT_ROWS_MAX_NEXT_N = 4
PRELOAD_MAX_TILES = 32


def paged_logits_config(batch: int, next_n: int, max_context_len: int) -> PagedLogitsConfig:
    """Default launch parameters for a shape: 64-token tiles (one cache block of 64 per
    tile), about 512 programs or more, each taking at most ``most_tiles`` tiles of its
    request's context (so one long request still spreads over every SM), and the MMA shape,
    warps, stages, key-scale prefetch, K copies, stores and early start from ``PAGED_LAUNCH``
    (next_n past 4: next_n 4's)."""
    tile = 64
    tiles = batch * max(1, triton.cdiv(max_context_len, tile))
    launch = PAGED_LAUNCH[min(max(next_n, 1), 4)]
    fields = launch._asdict()
    most = fields.pop("most_tiles")
    return PagedLogitsConfig(tile=tile, tiles_per_program=max(1, min(most, tiles // 512)),
                             **fields)


def tma_unsupported_reason(kv_cache: Tensor, tile: int) -> str | None:
    """Why the Triton kernel cannot copy this cache's K tiles by TMA (None: it can): TMA
    needs compute capability 9 or more, a contiguous cache at a 16-byte aligned offset whose
    rows of head_dim bytes tile every block (values first), tiles within one block, and
    box sides of at most 256 (head_dim a power of two from 32, the kernel's operand)."""
    num_blocks, block_size, _, width = kv_cache.shape
    head_dim = width - SCALE_BYTES
    if not has_tma(kv_cache):
        return "the GPU has no TMA (an NVIDIA GPU of compute capability 9 or more has)"
    if not kv_cache.is_contiguous() or kv_cache.storage_offset() % 16:
        return "the cache is not contiguous at a 16-byte aligned offset"
    if not 32 <= head_dim <= 256 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two in [32, 256]"
    if (block_size * width) % head_dim or block_size % tile or tile > 256:
        return (f"tiles of {tile} keys do not split blocks of {block_size} into rows of "
                f"head_dim {head_dim} bytes")
    if num_blocks * block_size * width // head_dim >= 2**31:
        return "the cache has 2**31 rows of head_dim bytes or more"
    return None


def _check_paged(op: str, q_fp8: Tensor, kv_cache: Tensor, weights: Tensor,
                 context_lens: Tensor, block_table: Tensor, max_context_len: int) -> None:
    check_tensor(op, "q_fp8", q_fp8, dtype=torch.float8_e4m3fn, ndim=4, contiguous=True)
    batch, next_n, num_heads, head_dim = q_fp8.shape
    check_heads(op, "q_fp8", q_fp8, 2)
    check_kv_cache(op, kv_cache, like=q_fp8)
    check_size(op, "kv_cache", kv_cache, 3, head_dim + 4, "head_dim + 4 = q_fp8.shape[3] + 4")
    check_tensor(op, "weights", weights, dtype=torch.float32, ndim=2, like=q_fp8)
    check_size(op, "weights", weights, 0, batch * next_n, "batch * next_n of q_fp8")
    check_size(op, "weights", weights, 1, num_heads, "num_heads = q_fp8.shape[2]")
    check_tensor(op, "context_lens", context_lens, dtype=INDEX_DTYPES, ndim=2, contiguous=True,
                 like=q_fp8)
    check_size(op, "context_lens", context_lens, 0, batch, "batch = q_fp8.shape[0]")
    check_size(op, "context_lens", context_lens, 1, next_n, "next_n = q_fp8.shape[1]")
    check_nonnegative(op, "context_lens", context_lens)
    check_block_table(op, block_table, q_fp8)
    check_size(op, "block_table", block_table, 0, batch, "batch = q_fp8.shape[0]")
    check_int(op, "max_context_len", max_context_len, low=0)


# --- dsa::paged_mqa_logits -------------------------------------------------------------------


@dsa_op("paged_mqa_logits")
def _paged_mqa_logits_out(q_fp8: Tensor, kv_cache: Tensor, weights: Tensor,
                          context_lens: Tensor, block_table: Tensor,
                          max_context_len: int) -> Tensor:
    _check_paged("paged_mqa_logits", q_fp8, kv_cache, weights, context_lens, block_table,
                 max_context_len)
    return alloc_logits(q_fp8.shape[0] * q_fp8.shape[1], max_context_len, q_fp8.device)


@_paged_mqa_logits_out.cpu
def _paged_mqa_logits_cpu(q_fp8: Tensor, kv_cache: Tensor, weights: Tensor,
                          context_lens: Tensor, block_table: Tensor,
                          max_context_len: int) -> Tensor:
    args = (q_fp8, kv_cache, weights, context_lens, block_table)
    return _paged_logits_torch(*args, _paged_mqa_logits_out(*args, max_context_len))


def _paged_logits_torch(q_fp8: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor,
                        block_table: Tensor, out: Tensor) -> Tensor:
    batch, next_n, num_heads, _ = q_fp8.shape
    values, scales = kcache_views(kv_cache)
    value_bytes = values.view(torch.uint8)  # indexed as bytes: fp8 indexing is not everywhere
    num_blocks, block_size = scales.shape
    pos = torch.arange(out.shape[1], device=out.device)
    col = (pos // block_size).clamp_(max=block_table.shape[1])
    table = padded_block_table(block_table)
    w = weights.view(batch, next_n, num_heads, 1)
    for b in range(batch):
        blk = table[b, col].long()
        ok = (blk >= 0) & (blk < num_blocks)
        blk, off = torch.where(ok, blk, 0), pos % block_size
        scores = torch.einsum("nhd,ld->nhl", q_fp8[b].float(), fp8_rows(value_bytes[blk, off]))
        logits = (relu_nan_zero(scores) * w[b]).sum(dim=1) * scales[blk, off]
        valid = ok & (pos < context_lens[b, :, None])
        out[b * next_n:(b + 1) * next_n] = torch.where(valid, logits, float("-inf"))
    return out


@triton.jit
def _tile_blocks(bt_row, t, longest, width, num_blocks, cols, ids, c0, BS: tl.constexpr,
                 TILE: tl.constexpr, PRELOAD: tl.constexpr):
    """Cache block of tile ``t``'s tokens (0, always present, where invalid) and whether
    each token is valid: one table entry when the tile lies in one block, else one each.
    PRELOAD (tiles within one block): the entry is picked from ``ids``, the program's
    entries from table column ``c0`` on (-1 past the table), instead of loaded."""
    if BS % TILE == 0:
        bt_col = t * TILE // BS
        if PRELOAD:
            blk = tl.sum(tl.where(tl.arange(0, ids.shape[0]) == bt_col - c0, ids, 0), axis=0)
        else:
            blk = tl.load(bt_row + bt_col, mask=bt_col < width, other=-1)
        ok = (blk >= 0) & (blk < num_blocks)
        return tl.where(ok, blk, 0).to(tl.int64), ok & (cols >= 0)
    else:
        pos = t * TILE + cols
        bt_col = pos // BS
        ok = (pos < longest) & (bt_col < width)
        blk = tl.load(bt_row + bt_col, mask=ok, other=-1)
        ok = ok & (blk >= 0) & (blk < num_blocks)
        return tl.where(ok, blk, 0).to(tl.int64), ok


@triton.jit
def _query_row(q_ptr, w_ptr, w_stride0, w_stride1, row0, h, d, J: tl.constexpr,
               H: tl.constexpr, D: tl.constexpr):
    """Query row ``row0 + J``: its ``[HP, BLOCK_D]`` q operand (padding zero) and head
    weights."""
    qrow = (row0 + J).to(tl.int64)
    q = tl.load(q_ptr + (qrow * H + h)[:, None] * D + d[None, :],
                mask=(h < H)[:, None] & (d < D)[None, :], other=0.0)
    w = tl.load(w_ptr + qrow * w_stride0 + h * w_stride1, mask=h < H, other=0.0)
    return q, w


@triton.jit
def _row_logits(k, k_scale, q_t, w):
    """One query row's logits over the K tile: ``[TILE, HP]`` scores, keys on the MMA's M
    side, summed over heads within a thread and its quad (``q_t``: the row's q transposed,
    as :func:`~dsa.ops.logits.common.tile_logits` takes it)."""
    s = tl.maximum(tl.dot(k, q_t), 0.0) * w[None, :]
    return tl.sum(s, axis=1) * k_scale


@triton.jit
def _prefetch_tiles(value_ptr, scale_ptr, bt_row, t_begin, t_end, width, num_blocks, cols,
                    TILES: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr,
                    VALUE_STRIDE: tl.constexpr, SCALE_STRIDE: tl.constexpr):
    """L2 prefetch (inline PTX, nothing waits on it) of the values and key scales of tiles
    ``t_begin .. t_begin + TILES - 1`` before ``t_end``, tiles within one block; a tile past
    the table or of a block outside the cache prefetches block 0's lines."""
    for i in tl.static_range(TILES):
        t = t_begin + i
        # tiles within one block, entries loaded: `longest`, `ids` and `c0` go unread
        blk, _ = _tile_blocks(bt_row, t, 0, width, num_blocks, cols, cols, 0, BS, TILE, False)
        blk = tl.where(t < t_end, blk, 0)
        off = (t * TILE + cols) % BS
        prefetch_lines(value_ptr + blk * VALUE_STRIDE + off * D)
        prefetch_lines(scale_ptr + blk * SCALE_STRIDE + off)


@triton.jit
def _store_in_place(ptrs, values, mask, EVICTION: tl.constexpr):
    """Masked fp32 store from the values' own layout (one st.global per element and thread
    holding it): ``tl.store`` first converts a tile to a coalesced layout, through shared
    memory and a barrier. EVICTION "evict_last": with L2's evict-last policy, as
    ``tl.store`` emits it."""
    if EVICTION == "evict_last":
        asm: tl.constexpr = (
            "{ .reg .pred p; .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, "
            "1.0; setp.ne.b32 p, $3, 0; @p st.global.L1::evict_last.L2::cache_hint.b32 [$1], "
            "$2, pol; mov.b32 $0, 0; }")
    else:
        asm: tl.constexpr = (
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; mov.b32 $0, 0; }")
    tl.inline_asm_elementwise(
        asm, "=r,l,r,r", [ptrs, values.to(tl.int32, bitcast=True), mask.to(tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)


# Runtime ints that vary with the batch stay unspecialised: one compile per config and shape
# family, not one per context length.
@triton.jit(do_not_specialize=["bt_stride", "width", "num_blocks", "max_context_len",
                               "tiles_per_program"])
def _paged_logits_kernel(q_ptr, value_ptr, k_desc, scale_ptr, w_ptr, w_stride0, w_stride1,
                         ctx_ptr, bt_ptr, bt_stride, out_ptr, out_stride, width, num_blocks,
                         max_context_len, tiles_per_program,
                         N: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                         VALUE_STRIDE: tl.constexpr, SCALE_STRIDE: tl.constexpr,
                         NP: tl.constexpr, HP: tl.constexpr, BLOCK_D: tl.constexpr,
                         TILE: tl.constexpr, SPLIT_ROWS: tl.constexpr,
                         SCALES_AHEAD: tl.constexpr, TMA: tl.constexpr,
                         DIRECT_STORE: tl.constexpr, PRELOAD: tl.constexpr,
                         SPAN: tl.constexpr, EVICTION: tl.constexpr, PDL: tl.constexpr,
                         EARLY_TILES: tl.constexpr):
    split = tl.program_id(0)
    b = tl.program_id(1)
    if EARLY_TILES:  # launched with PDL, no chain (PDL 0): the wait after the prefetch
        _prefetch_tiles(value_ptr, scale_ptr, bt_ptr + b.to(tl.int64) * bt_stride,
                        split * tiles_per_program, (split + 1) * tiles_per_program, width,
                        num_blocks, tl.arange(0, TILE), EARLY_TILES, D, BS, TILE, VALUE_STRIDE,
                        SCALE_STRIDE)
        tl.extra.cuda.gdc_wait()
    pdl_chain_wait(PDL)
    # The request's next_n rows: context lengths (clamped to the output width).
    jn = tl.arange(0, NP)
    ctx = tl.load(ctx_ptr + b * N + jn, mask=jn < N, other=0)
    ctx = tl.minimum(tl.maximum(ctx, 0), max_context_len)
    longest = tl.max(ctx, axis=0)
    t_begin = split * tiles_per_program
    t_end = tl.minimum(t_begin + tiles_per_program, tl.cdiv(max_context_len, TILE))
    t_mid = tl.maximum(tl.minimum(tl.cdiv(longest, TILE), t_end), t_begin)
    out_rows = out_ptr + (b * N + jn).to(tl.int64) * out_stride
    store_rows = (jn < N)[None, :]
    cols = tl.arange(0, TILE)

    # q of all (row, head) pairs as one [NP * HP, D] operand (row r = j * HP + h, padding
    # rows zero) and its head weights, or with SPLIT_ROWS one [HP, D] operand per query row:
    # every K tile is read once for all of the request's rows. Transposed here, before the
    # loop, so each is staged in shared memory once (Triton 3.9 stages a transpose taken
    # inside the loop again for every tile).
    d = tl.arange(0, BLOCK_D)
    if SPLIT_ROWS:
        h = tl.arange(0, HP)
        q0, w0 = _query_row(q_ptr, w_ptr, w_stride0, w_stride1, b * N, h, d, 0, H, D)
        q0 = tl.trans(q0)
        if N > 1:
            q1, w1 = _query_row(q_ptr, w_ptr, w_stride0, w_stride1, b * N, h, d, 1, H, D)
            q1 = tl.trans(q1)
        if N > 2:
            q2, w2 = _query_row(q_ptr, w_ptr, w_stride0, w_stride1, b * N, h, d, 2, H, D)
            q2 = tl.trans(q2)
        if N > 3:
            q3, w3 = _query_row(q_ptr, w_ptr, w_stride0, w_stride1, b * N, h, d, 3, H, D)
            q3 = tl.trans(q3)
    else:
        r = tl.arange(0, NP * HP)
        row_ok = (r // HP < N) & (r % HP < H)
        qrow = b * N + r // HP
        q = tl.load(q_ptr + (qrow * H + r % HP).to(tl.int64)[:, None] * D + d[None, :],
                    mask=row_ok[:, None] & (d < D)[None, :], other=0.0)
        w = tl.load(w_ptr + qrow.to(tl.int64) * w_stride0 + (r % HP) * w_stride1,
                    mask=row_ok, other=0.0)
        q = tl.trans(q)

    # Block ids are read one tile ahead and carried (with PRELOAD, picked from the program's
    # ids, read in one load here): K addresses then do not wait on a load issued in their
    # own iteration, and the pipeliner keeps num_stages - 1 K tiles in flight. With
    # SCALES_AHEAD a tile's key scales too (a separate line of its block, not in the K copy):
    # they arrive while the previous tile's MMAs run.
    bt_row = bt_ptr + b.to(tl.int64) * bt_stride
    c0 = t_begin * TILE // BS
    ids = c0  # no preloaded ids
    if PRELOAD:
        span = tl.arange(0, SPAN)
        ids = tl.load(bt_row + c0 + span, mask=c0 + span < width, other=-1)
    blk_next, ok_next = _tile_blocks(bt_row, t_begin, longest, width, num_blocks, cols, ids, c0,
                                     BS, TILE, PRELOAD)
    if SCALES_AHEAD:
        scale_next = tl.load(scale_ptr + blk_next * SCALE_STRIDE + (t_begin * TILE + cols) % BS)
    for t in range(t_begin, t_mid):
        pos = t * TILE + cols
        blk, ok = blk_next, ok_next
        blk_next, ok_next = _tile_blocks(bt_row, t + 1, longest, width, num_blocks, cols, ids,
                                         c0, BS, TILE, PRELOAD)
        off = pos % BS
        if SCALES_AHEAD:
            k_scale = scale_next
            scale_next = tl.load(scale_ptr + blk_next * SCALE_STRIDE + (pos + TILE) % BS)
        if TMA:  # rows of D bytes: a block's first row, then the tile's offset in it
            k = k_desc.load([(blk * (VALUE_STRIDE // D) + (t * TILE) % BS).to(tl.int32), 0])
        else:
            src = blk * VALUE_STRIDE + off * D
            if BLOCK_D == D:
                k = tl.load(value_ptr + src[:, None] + d[None, :])
            else:
                k = tl.load(value_ptr + src[:, None] + d[None, :], mask=(d < D)[None, :],
                            other=0.0)
        if not SCALES_AHEAD:  # after the K load: issued first, next_n 3 is 6% slower
            k_scale = tl.load(scale_ptr + blk * SCALE_STRIDE + off)
        if SPLIT_ROWS:
            # The rows' logits joined into one [TILE, NP] tile (rows past N -inf, not
            # stored): one layout conversion for the store instead of one per row.
            l0 = _row_logits(k, k_scale, q0, w0)
            l1 = _row_logits(k, k_scale, q1, w1) if N > 1 else l0
            if NP == 2:
                logits = tl.join(l0, l1)
            elif NP == 4:
                l2 = _row_logits(k, k_scale, q2, w2)
                l3 = _row_logits(k, k_scale, q3, w3) if N > 3 else l2
                logits = tl.reshape(tl.join(tl.join(l0, l2), tl.join(l1, l3)), (TILE, NP))
            else:
                logits = l0[:, None]
        else:
            logits = tile_logits(k, k_scale, q, w, TILE, NP, HP)
        value = tl.where(ok[:, None] & (pos[:, None] < ctx[None, :]), logits, float("-inf"))
        ptrs = out_rows[None, :] + pos[:, None]
        keep = store_rows & (pos < max_context_len)[:, None]
        if DIRECT_STORE:
            _store_in_place(ptrs, value, keep, EVICTION)
        else:
            tl.store(ptrs, value, mask=keep, eviction_policy=EVICTION)
    for t in range(t_mid, t_end):
        pos = t * TILE + cols
        tl.store(out_rows[None, :] + pos[:, None],
                 tl.full((TILE, NP), float("-inf"), tl.float32),
                 mask=store_rows & (pos < max_context_len)[:, None], eviction_policy=EVICTION)


def _paged_logits_launch(q_fp8: Tensor, kv_cache: Tensor, weights: Tensor,
                         context_lens: Tensor, block_table: Tensor, out: Tensor,
                         config: PagedLogitsConfig | None) -> Tensor:
    batch, next_n, num_heads, head_dim = q_fp8.shape
    max_context_len = out.shape[1]
    if out.numel() == 0:
        return out
    if config is None:
        config = paged_logits_config(batch, next_n, max_context_len)
    if (config.tile < 16 or config.tile & (config.tile - 1) or config.tiles_per_program < 1
            or (config.split_rows and next_n > SPLIT_ROWS_MAX_NEXT_N)):
        raise ValueError(f"dsa.paged_mqa_logits: bad Triton launch config {config} for "
                         f"next_n {next_n} (split_rows takes next_n <= {SPLIT_ROWS_MAX_NEXT_N})")
    values, scales = kcache_views(kv_cache)
    num_blocks, block_size = scales.shape
    k_desc = None  # the cache as rows of head_dim bytes; a tile is a box of them
    if config.tma and tma_unsupported_reason(kv_cache, config.tile) is None:
        rows = kv_cache.view(-1, head_dim).view(torch.float8_e4m3fn)
        k_desc = TensorDescriptor.from_tensor(rows, [config.tile, head_dim])
    np_ = triton.next_power_of_2(next_n)
    # The MMA's N side (heads, or rows x heads) is at least 16.
    hp = max(triton.next_power_of_2(num_heads), 16 if config.split_rows else triton.cdiv(16, np_))
    num_tiles = triton.cdiv(max_context_len, config.tile)
    grid = (triton.cdiv(num_tiles, config.tiles_per_program), batch)
    small = batch * next_n * max_context_len <= CHAIN_KEYS
    pdl = chain_pdl(q_fp8, small, batch * next_n)
    early = (config.early_tiles if not small and batch * next_n > EARLY_ROWS
             and block_size % config.tile == 0 and pdl_enabled(q_fp8) else 0)
    # SPAN is a compile-time size: only launches that preload compile per span.
    preload = (config.blocks_preloaded and block_size % config.tile == 0
               and config.tiles_per_program <= PRELOAD_MAX_TILES)
    launch(_paged_logits_kernel, grid,
        q_fp8, values, k_desc, scales, weights, weights.stride(0), weights.stride(1),
        context_lens, block_table, block_table.stride(0), out, out.stride(0), block_table.shape[1],
        num_blocks, max_context_len, config.tiles_per_program,
        N=next_n, H=num_heads, D=head_dim, BS=block_size, VALUE_STRIDE=values.stride(0),
        SCALE_STRIDE=scales.stride(0), NP=np_, HP=hp,
        BLOCK_D=max(32, triton.next_power_of_2(head_dim)), TILE=config.tile,
        SPLIT_ROWS=config.split_rows, SCALES_AHEAD=config.scales_ahead,
        TMA=k_desc is not None, DIRECT_STORE=config.direct_store and on_nvidia_gpu(q_fp8),
        PRELOAD=preload, SPAN=triton.next_power_of_2(config.tiles_per_program) if preload else 1,
        EVICTION="evict_last" if config.keep_in_l2 else "",
        num_warps=config.num_warps, num_stages=config.num_stages, PDL=pdl, EARLY_TILES=early,
        **pdl_launch(pdl > 0 or early > 0),
    )
    return out


@_paged_mqa_logits_out.triton
def _paged_mqa_logits_cuda(q_fp8: Tensor, kv_cache: Tensor, weights: Tensor,
                           context_lens: Tensor, block_table: Tensor,
                           max_context_len: int) -> Tensor:
    args = (q_fp8, kv_cache, weights, context_lens, block_table)
    return _paged_logits_launch(*args, _paged_mqa_logits_out(*args, max_context_len), None)


def paged_logits_triton(q_fp8: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor,
                        block_table: Tensor, max_context_len: int,
                        config: PagedLogitsConfig | None = None) -> Tensor:
    """The Triton kernel with explicit launch parameters (None: :func:`paged_logits_config`),
    for benchmark sweeps; validates like the op."""
    args = (q_fp8, kv_cache, weights, context_lens, block_table)
    return _paged_logits_launch(*args, _paged_mqa_logits_out(*args, max_context_len), config)


# --- dsa::paged_mqa_logits_deepgemm ----------------------------------------------------------


@dsa_op("paged_mqa_logits_deepgemm")
def _paged_deepgemm_out(q_fp8: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor,
                        block_table: Tensor, max_context_len: int,
                        schedule: Tensor | None = None, lens_clamped: bool = False) -> Tensor:
    """``schedule``: DeepGEMM's schedule of these lengths (None: built here).
    ``lens_clamped``: the caller vouches that every length is already in
    ``[1, max(max_context_len, 1)]`` (``DecodeMetadata.schedule_lens``), so they go to DeepGEMM
    as they are; by default they are clamped there first (a length of 0 makes DeepGEMM read
    out of bounds)."""
    op = "paged_mqa_logits_deepgemm"
    _check_paged(op, q_fp8, kv_cache, weights, context_lens, block_table, max_context_len)
    _, next_n, num_heads, head_dim = q_fp8.shape
    reason = deepgemm.paged_unsupported_reason(q_fp8.device, num_heads, head_dim,
                                               kv_cache.shape[1], next_n)
    if reason is not None:
        raise ValueError(f"dsa.{op}: DeepGEMM cannot run this call: {reason}")
    if schedule is not None:
        check_tensor(op, "schedule", schedule, dtype=INDEX_DTYPES, ndim=2, contiguous=True,
                     like=q_fp8)
        check_size(op, "schedule", schedule, 0, deepgemm.num_sms(q_fp8.device) + 1,
                   "num_sms + 1, as dsa.paged_mqa_schedule makes it")
        check_size(op, "schedule", schedule, 1, 2, "DeepGEMM's schedule layout")
    return alloc_logits(q_fp8.shape[0] * next_n, max_context_len, q_fp8.device)


@_paged_deepgemm_out.cpu
def _paged_deepgemm_cpu(q_fp8: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor,
                        block_table: Tensor, max_context_len: int,
                        schedule: Tensor | None = None, lens_clamped: bool = False) -> Tensor:
    # Raises: DeepGEMM needs CUDA tensors.
    return _paged_deepgemm_out(q_fp8, kv_cache, weights, context_lens, block_table,
                               max_context_len, schedule, lens_clamped)


@_paged_deepgemm_out.cuda
def _paged_deepgemm_cuda(q_fp8: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor,
                         block_table: Tensor, max_context_len: int,
                         schedule: Tensor | None = None, lens_clamped: bool = False) -> Tensor:
    out = _paged_deepgemm_out(q_fp8, kv_cache, weights, context_lens, block_table,
                              max_context_len, schedule, lens_clamped)
    if out.numel() == 0:
        return out
    # Lengths of 0 make the kernel read out of bounds; the schedule and the kernel must see
    # the same lengths (dsa.paged_mqa_schedule clamps the same way), at most the row width.
    lens = context_lens if lens_clamped else context_lens.clamp(1, max(max_context_len, 1))
    if schedule is None:
        schedule = deepgemm.call("get_paged_mqa_logits_metadata", context_lens=lens,
                                 block_kv=kv_cache.shape[1],
                                 num_sms=deepgemm.num_sms(q_fp8.device))
    return deepgemm.call("fp8_fp4_paged_mqa_logits", q=(q_fp8, None), kv_cache=kv_cache,
                         weights=deepgemm.tma_weights(weights), context_lens=lens,
                         block_table=block_table, schedule_meta=schedule,
                         max_context_len=max_context_len)


# --- choosing ------------------------------------------------------------------------------


# Where "auto" runs dsa's kernel although DeepGEMM could take the call: next_n -> the most
# keys a call may read (logits rows x max_context_len) at which dsa's kernel beat DeepGEMM
# plus its schedule kernel (2-3 us) on the H200 (BENCHMARKS.md, us Triton vs DeepGEMM without
# the schedule). next_n 1 at every size ("twenty-ninth", bench_logits_sweep.py, 256 MB
# written over: 1x4K 6.8 vs 9.4, 8x32K 18.2 vs 20.8, 1M keys 46.4-46.9 vs 49.2-49.8, 4M
# 152.3 vs 152.1-152.8; read over, a probe: 4M 135.5 vs 141.0, 8M 277.2 vs 277.5). next_n 2
# (00001a1): 1x4K 7.1 vs 9.6, 1x64K 11.4 vs 12.4, 8x32K 22.7 vs 21.8; 1M keys and up to
# DeepGEMM ("twenty-ninth", read over: 45.3 vs 40.4 at 1M, 176.0 vs 149.5 at 4M). Elsewhere
# "auto" takes DeepGEMM wherever it runs (next_n <= 2 on SM90) and dsa's kernel where it
# does not (next_n 3 and 4, other GPUs, the CPU).
AUTO_TRITON_MAX_KEYS: dict[int, float] = {1: math.inf, 2: 256 * 1024}
# The same rule for GPUs whose name holds the key, where measured otherwise. The H100 (3.0
# TB/s, where next_n 2 is bound by HBM, not by the MMAs): next_n 2 at every size ("forty-
# sixth", probe_tmp/auto_n2.py, bench_logits_sweep.py's timer, us dsa vs DeepGEMM with its
# schedule: 1x4K 6.8-7.2 vs 14.5-14.9, 8x32K 23.4-23.5 vs 30.7-31.2, 1M keys 63.0-64.2 vs
# 72.9-73.6, 4M 220.1-220.9 vs 224.7-225.6).
AUTO_TRITON_MAX_KEYS_BY_GPU: dict[str, dict[int, float]] = {
    "H100": {1: math.inf, 2: math.inf},
}


@torch.compiler.assume_constant_result
def _gpu_name(device: torch.device) -> str:
    """The CUDA device's name ("" for any other device, or where CUDA is absent): a constant
    to torch.compile."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return ""
    return torch.cuda.get_device_name(device)


def auto_triton_max_keys(device: torch.device) -> dict[int, float]:
    """``AUTO_TRITON_MAX_KEYS``, or the rule of ``AUTO_TRITON_MAX_KEYS_BY_GPU`` whose key
    ``device``'s name holds."""
    name = _gpu_name(device)
    for key, rule in AUTO_TRITON_MAX_KEYS_BY_GPU.items():
        if key in name:
            return rule
    return AUTO_TRITON_MAX_KEYS


def paged_backend(backend: str, device: torch.device, num_heads: int, head_dim: int,
                  block_size: int, next_n: int, batch: int | None = None,
                  max_context_len: int | None = None, *, op: str = "paged_mqa_logits",
                  arg: str = "backend") -> str:
    """"deepgemm" or "triton": the implementation ``backend`` ("auto", "triton" or
    "deepgemm") runs for this shape on ``device``. ``batch`` (logits rows of ``next_n``
    queries, q_fp8.shape[0]) and ``max_context_len`` (the row width) size the call for
    :func:`auto_triton_max_keys`; without them "auto" takes DeepGEMM wherever it runs. Pure
    host logic on static sizes: a captured step decides once per bucket. ``op`` and ``arg``
    name the caller and its argument in errors."""
    if (backend == "auto" and batch is not None and max_context_len is not None
            and batch * max_context_len <= auto_triton_max_keys(device).get(next_n, -1)):
        return "triton"
    return choose_backend(op, arg, backend, lambda: deepgemm.paged_unsupported_reason(
        device, num_heads, head_dim, block_size, next_n))


def paged_logits(q_fp8: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor,
                 block_table: Tensor, max_context_len: int, *, backend: str = "auto",
                 schedule: Tensor | None = None) -> Tensor:
    """Paged logits on the implementation :func:`paged_backend` picks (``schedule``: a
    DeepGEMM schedule for these lengths, used when DeepGEMM runs)."""
    batch, next_n, num_heads, head_dim = q_fp8.shape
    args = (q_fp8, kv_cache, weights, context_lens, block_table, max_context_len)
    if paged_backend(backend, q_fp8.device, num_heads, head_dim, kv_cache.shape[1], next_n,
                     batch, max_context_len) == "deepgemm":
        return torch.ops.dsa.paged_mqa_logits_deepgemm(*args, schedule)
    return torch.ops.dsa.paged_mqa_logits(*args)
