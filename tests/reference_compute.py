"""Float64 references of the indexer compute (design §2-§3), written from docs/design.md.

Nothing here uses dsa: fp8 e4m3 codes are decoded from their bit fields, the cache is read
and written byte by byte at the offsets design §2 gives, and the logits are the formula of
design §3 in float64 numpy. Arrays in, arrays out (convert torch tensors with ``.numpy()``).
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

FP8_MAX = 448.0
AMAX_FLOOR = float(np.float32(1e-4))  # the fp32 value of 1e-4, as the kernels hold it


# --- fp8 e4m3fn ----------------------------------------------------------------------------


def _e4m3_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


E4M3_VALUES = np.array([_e4m3_value(c) for c in range(256)])  # indexed by code
_POSITIVE = E4M3_VALUES[:0x7F]  # codes 0..126: every finite value >= 0, increasing


def fp8_decode(codes: np.ndarray) -> np.ndarray:
    """float64 values of e4m3fn codes (uint8)."""
    return E4M3_VALUES[np.asarray(codes, dtype=np.uint8)]


def fp8_encode(x: np.ndarray) -> np.ndarray:
    """e4m3fn codes of ``x``: nearest value, ties to the even code, saturating at ±448."""
    x = np.asarray(x, dtype=np.float64)
    a = np.minimum(np.abs(x), FP8_MAX)
    hi = np.clip(np.searchsorted(_POSITIVE, a), 0, len(_POSITIVE) - 1)
    lo = np.maximum(hi - 1, 0)
    below, above = a - _POSITIVE[lo], _POSITIVE[hi] - a
    code = np.where(below < above, lo, np.where(above < below, hi, np.where(lo % 2 == 0, lo, hi)))
    return (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


# --- quantisation (design §2) -----------------------------------------------------------------


FP32_MAX = float(np.finfo(np.float32).max)


def quantize_row(x: np.ndarray, ue8m0: bool) -> tuple[np.ndarray, np.float32]:
    """One row's (e4m3 codes, fp32 scale). NaN counts as 0 and ±inf as ±fp32 max; the
    division ``x / scale`` is done in fp32, as the kernels do it; the scale is the fp32
    rounding of ``amax / 448``."""
    x = np.nan_to_num(np.asarray(x, dtype=np.float64), nan=0.0, posinf=FP32_MAX,
                      neginf=-FP32_MAX)
    amax = max(float(np.max(np.abs(x))), AMAX_FLOOR)
    scale = np.float32(amax / FP8_MAX)
    if ue8m0:
        scale = np.float32(2.0 ** math.ceil(math.log2(float(scale))))
    quotient = x.astype(np.float32) / scale
    return fp8_encode(quotient), scale


def quantize_q(q: np.ndarray, weights: np.ndarray, ue8m0: bool
               ) -> tuple[np.ndarray, np.ndarray]:
    """(codes [T, H, D], head weights [T, H] float64) of design §3's q quantisation."""
    num_tokens, num_heads, head_dim = q.shape
    codes = np.zeros(q.shape, dtype=np.uint8)
    head_weights = np.zeros((num_tokens, num_heads))
    for t in range(num_tokens):
        for h in range(num_heads):
            codes[t, h], scale = quantize_row(q[t, h], ue8m0)
            head_weights[t, h] = weights[t, h] * num_heads**-0.5 * head_dim**-0.5 * float(scale)
    return codes, head_weights


def nonfinite_rows(head_dim: int, seed: int = 0) -> torch.Tensor:
    """float32 ``[8, head_dim]`` (head_dim >= 8) of random values with a NaN, a +inf, a
    -inf, a mix of the three, a row of NaN, a row of ±inf, two +inf, and a finite row."""
    nan, inf = float("nan"), float("inf")
    x = torch.randn(8, head_dim, generator=torch.Generator().manual_seed(seed)) * 3
    x[0, 1] = nan
    x[1, 2] = inf
    x[2, 0] = -inf
    x[3, :5] = torch.tensor([nan, inf, -inf, nan, 1e30])
    x[4] = nan
    x[5, ::2], x[5, 1::2] = inf, -inf
    x[6, [3, 7]] = inf
    return x


def check_nonfinite_codes(x: torch.Tensor, codes: np.ndarray, scales: np.ndarray,
                          ue8m0: bool) -> None:
    """What non-finite inputs must give: finite scales, NaN -> 0 (0x00), and ±inf the
    code of ±fp32 max over its row's scale: ±448 (0x7E / 0xFE), or ±256 (0x78 / 0xF8) with
    ue8m0 scales (fp32 max / 448 rounded up to 2**120)."""
    x = x.float().numpy()
    assert np.isfinite(scales).all()
    top = 0x78 if ue8m0 else 0x7E
    assert (codes[np.isposinf(x)] == top).all()
    assert (codes[np.isneginf(x)] == top | 0x80).all()
    assert (codes[np.isnan(x)] == 0x00).all()


# --- the q/k prologue (design §2, "Prologue") ------------------------------------------------


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``x`` rounded to ``dtype`` ("float32", "float16" or "bfloat16"; nearest even)
    and back to float32; bf16 from the fp32 bits."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype != "bfloat16":
        return x
    bits = x.view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return np.where(np.isnan(x), x, bits.view(np.float32))


def rope_hadamard_row(x: np.ndarray, cos_sin: np.ndarray, hadamard: bool, dtype: str,
                      interleaved: bool = False) -> np.ndarray:
    """One row (values of ``dtype``) after RoPE with the fp32 ``cos_sin`` row (frequency i
    rotates dims i and i + rope_dim / 2, NeoX; or 2i and 2i + 1, ``interleaved``) and the
    Hadamard rotation, one fp32 operation at a time in design §2's order."""
    f32 = np.float32
    x = np.asarray(x, dtype=f32).copy()
    half = cos_sin.shape[0] // 2
    out = x.copy()
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(half):
            cos, sin = f32(cos_sin[i]), f32(cos_sin[half + i])
            a, b = (2 * i, 2 * i + 1) if interleaved else (i, half + i)
            out[a] = f32(x[a] * cos) - f32(x[b] * sin)
            out[b] = f32(x[b] * cos) + f32(x[a] * sin)
        x = round_to(out, dtype)
        if not hadamard:
            return x
        dim = x.shape[0]
        stride = 1
        while stride < dim:
            y = x.copy()
            for i in range(dim):
                if not i & stride:
                    y[i], y[i + stride] = x[i] + x[i + stride], x[i] - x[i + stride]
            x, stride = y, 2 * stride
        scale = round_to(np.array([dim**-0.5]), dtype)[0]
        return round_to(x * scale, dtype)


# --- the paged K cache (design §2) -----------------------------------------------------------


def _value_offset(block: int, offset: int, block_size: int, head_dim: int) -> int:
    return block * block_size * (head_dim + 4) + offset * head_dim


def _scale_offset(block: int, offset: int, block_size: int, head_dim: int) -> int:
    return block * block_size * (head_dim + 4) + block_size * head_dim + 4 * offset


def write_cache(cache: np.ndarray, k: np.ndarray, slot_mapping: np.ndarray, block_size: int,
                ue8m0: bool) -> np.ndarray:
    """A copy of the flat uint8 ``cache`` after writing token ``t`` of ``k`` to its slot."""
    out = np.array(cache, dtype=np.uint8).reshape(-1)
    head_dim = k.shape[1]
    num_slots = out.size // (head_dim + 4)
    for t, slot in enumerate(np.asarray(slot_mapping).tolist()):
        if not 0 <= slot < num_slots:
            continue
        codes, scale = quantize_row(k[t], ue8m0)
        block, offset = divmod(slot, block_size)
        v = _value_offset(block, offset, block_size, head_dim)
        out[v:v + head_dim] = codes
        s = _scale_offset(block, offset, block_size, head_dim)
        out[s:s + 4] = np.frombuffer(np.float32(scale).astype("<f4").tobytes(), dtype=np.uint8)
    return out


def read_cache(cache: np.ndarray, block_size: int, head_dim: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """(value codes uint8 [nb, bs, D], scales float64 [nb, bs]) of a flat uint8 cache: each
    block is bs * D value bytes (token-major), then bs little-endian fp32 scales."""
    flat = np.asarray(cache, dtype=np.uint8).reshape(-1)
    blocks = flat.reshape(-1, block_size * (head_dim + 4))
    codes = blocks[:, : block_size * head_dim].reshape(-1, block_size, head_dim)
    scales = np.ascontiguousarray(blocks[:, block_size * head_dim:]).view("<f4")
    with np.errstate(invalid="ignore"):  # random test bytes may hold signalling NaNs
        return codes.copy(), scales.astype(np.float64)


def gather(cache: np.ndarray, block_size: int, head_dim: int, block_table: np.ndarray,
           cu_seq_lens: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [num_rows, D], scales float64 [num_rows]) of design §2's K gather; rows
    of no request or with an invalid block are zero."""
    codes, scales = read_cache(cache, block_size, head_dim)
    out_codes = np.zeros((num_rows, head_dim), dtype=np.uint8)
    out_scales = np.zeros(num_rows)
    num_reqs, width = block_table.shape
    for r in range(num_reqs):
        for i in range(int(cu_seq_lens[r + 1]) - int(cu_seq_lens[r])):
            row = int(cu_seq_lens[r]) + i
            if not 0 <= row < num_rows or i // block_size >= width:
                continue
            block = int(block_table[r, i // block_size])
            if 0 <= block < codes.shape[0]:
                out_codes[row] = codes[block, i % block_size]
                out_scales[row] = scales[block, i % block_size]
    return out_codes, out_scales


# --- logits (design §3) -----------------------------------------------------------------------


def _logits(q: np.ndarray, weights: np.ndarray, k: np.ndarray, k_scale: np.ndarray
            ) -> np.ndarray:
    """``k_scale[s] * sum_h w[h] * relu(q[h] . k[s])`` for one query: q [H, D], k [S, D]."""
    return k_scale * (np.maximum(q @ k.T, 0.0) * weights[:, None]).sum(axis=0)


def paged_logits(q: np.ndarray, weights: np.ndarray, context_lens: np.ndarray,
                 block_table: np.ndarray, max_context_len: int, values: np.ndarray,
                 scales: np.ndarray, requests: list[int] | None = None) -> np.ndarray:
    """Decode logits ``[B * N, max_context_len]``, -inf where invalid (past the row's
    context, block column past the table, block entry outside the cache).

    q [B, N, H, D], weights [B * N, H], values [nb, bs, D] and scales [nb, bs] (float64).
    ``requests``: compute only these requests' rows (others stay nan).
    """
    batch, next_n = q.shape[:2]
    num_blocks, block_size = scales.shape
    width = block_table.shape[1]
    table = np.pad(block_table, ((0, 0), (0, 1)), constant_values=-1)  # column `width`: -1
    out = np.full((batch * next_n, max_context_len), np.nan)
    pos = np.arange(max_context_len)
    col = np.minimum(pos // block_size, width)
    for b in range(batch) if requests is None else requests:
        blk = table[b, col]
        ok = (blk >= 0) & (blk < num_blocks)
        blk = np.where(ok, blk, 0)
        k, k_scale = values[blk, pos % block_size], scales[blk, pos % block_size]
        for j in range(next_n):
            row = b * next_n + j
            logits = _logits(q[b, j], weights[row], k, k_scale)
            out[row] = np.where(ok & (pos < context_lens[b, j]), logits, -np.inf)
    return out


def mqa_logits(q: np.ndarray, k: np.ndarray, k_scale: np.ndarray, weights: np.ndarray,
               ks: np.ndarray, ke: np.ndarray, max_seqlen_k: int,
               rows: list[int] | None = None) -> np.ndarray:
    """Ragged prefill logits in the compressed layout: column j of row i is key
    ``ks[i] + j``, valid for ``j < ke[i] - ks[i]`` and keys inside ``k``; -inf elsewhere."""
    out = np.full((q.shape[0], max_seqlen_k), np.nan)
    j = np.arange(max_seqlen_k)
    for i in range(q.shape[0]) if rows is None else rows:
        key = int(ks[i]) + j
        ok = (j < int(ke[i]) - int(ks[i])) & (key >= 0) & (key < k.shape[0])
        key = np.where(ok, key, 0)
        logits = _logits(q[i], weights[i], k[key], k_scale[key]) if k.shape[0] else 0.0
        out[i] = np.where(ok, logits, -np.inf)
    return out


# --- slot transform (design §3) ---------------------------------------------------------------


def indices_to_slots(indices: np.ndarray, block_table: np.ndarray, row_requests: np.ndarray,
                     block_size: int, num_blocks: int) -> np.ndarray:
    """Cache slot of each selected position; -1 for negative positions, rows of no request,
    block columns past the table and block entries outside ``[0, num_blocks)``."""
    out = np.full(indices.shape, -1, dtype=np.int64)
    num_reqs, width = block_table.shape
    for t in range(indices.shape[0]):
        r = int(row_requests[t])
        for c in range(indices.shape[1]):
            i = int(indices[t, c])
            if i < 0 or not 0 <= r < num_reqs or i // block_size >= width:
                continue
            block = int(block_table[r, i // block_size])
            if 0 <= block < num_blocks:
                out[t, c] = block * block_size + i % block_size
    return out


# --- top-k in one total order (design §3, §11) -----------------------------------------------


def score_key(x: float) -> int:
    """The rank of fp32 ``x`` in the selection order: its bits as a signed int, the negative
    ones' magnitude bits flipped (so -0 < +0, -NaN below -inf, +NaN above +inf)."""
    bits = int(np.array(x, dtype=np.float32).view(np.int32))
    return bits ^ 0x7FFFFFFF if bits < 0 else bits


def first_k(candidates: list[tuple[np.float32, int]], k: int) -> list[tuple[int, float]]:
    """(position, score) of the first k of ``(score, position)`` candidates: higher score
    first, ties to the lower position; padded with (-1, -inf) to k. Scores stay np.float32,
    so a NaN keeps its payload bits."""
    ranked = sorted(candidates, key=lambda c: (-score_key(c[0]), c[1]))[:k]
    return [(p, s) for s, p in ranked] + [(-1, -math.inf)] * (k - len(ranked))


def topk_scored(logits: np.ndarray, lengths: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
    """Per row: the first k of the columns ``[0, length)`` (clipped to the row)."""
    return [first_k([(row[c], c) for c in range(min(max(int(n), 0), len(row)))], k)
            for row, n in zip(logits, lengths.reshape(-1))]


def merge_topk(scores: np.ndarray, indices: np.ndarray) -> list[list[tuple[int, float]]]:
    """Per token: the first k of the candidates of every rank (``[W, T, k]``; index < 0: none)."""
    world, tokens, k = scores.shape
    return [first_k([(scores[w, t, j], int(indices[w, t, j])) for w in range(world)
                     for j in range(k) if indices[w, t, j] >= 0], k) for t in range(tokens)]


# --- comparisons ------------------------------------------------------------------------------


def in_position_order(indices: torch.Tensor, scores: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (index, score) entries by index, -1 entries last: a top-k set whose
    order inside a row is free (``sorted=False``) in one canonical order."""
    order = torch.where(indices < 0, 2**31 - 1, indices).argsort(dim=-1, stable=True)
    return indices.gather(-1, order), scores.gather(-1, order)


def relative_error(x: np.ndarray, y: np.ndarray) -> float:
    """``1 - 2 sum(xy) / sum(x^2 + y^2)`` (0 when equal; scale-free)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    denominator = float((x * x + y * y).sum())
    return 0.0 if denominator == 0 else 1.0 - 2.0 * float((x * y).sum()) / denominator


@contextlib.contextmanager
def poisoned_empty():
    """Within: torch.empty fills new memory with NaN / max ints, so unwritten outputs show."""
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn_only)
