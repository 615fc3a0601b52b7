"""Slow, obviously-correct loop reference of the metadata in design §4-§7.

Plain Python on lists, written from the text of docs/design.md and nothing else: one
request or one token at a time, no vectorisation, no torch. Every metadata op is checked
against these. Shared conventions: ``qsl`` is ``query_start_loc`` as a list; token ``t``
belongs to request ``r`` when ``qsl[r] <= t < qsl[r + 1]``; tokens past ``qsl[-1]`` are
padding.
"""

from __future__ import annotations

from collections.abc import Sequence

Rows = list[list[int]]


def token_owner(qsl: Sequence[int], t: int) -> tuple[int, int] | None:
    """(request, index within the request) of token ``t``, None for a padding token."""
    for r in range(len(qsl) - 1):
        if qsl[r] <= t < qsl[r + 1]:
            return r, t - qsl[r]
    return None


# --- §4 decode -----------------------------------------------------------------------------


def decode_token_lens(qsl: Sequence[int], seq_lens: Sequence[int], num_tokens: int) -> list[int]:
    """len(r, j) = max(seq_lens[r] - decode_len[r] + j + 1, 0); padding tokens 0."""
    out = []
    for t in range(num_tokens):
        owner = token_owner(qsl, t)
        if owner is None:
            out.append(0)
            continue
        r, j = owner
        decode_len = qsl[r + 1] - qsl[r]
        out.append(max(seq_lens[r] - decode_len + j + 1, 0))
    return out


def native_decode_lens(seq_lens: Sequence[int], next_n: int) -> Rows:
    """ctx[b][j] = max(seq_lens[b] - next_n + 1 + j, 0)."""
    return [[max(s - next_n + 1 + j, 0) for j in range(next_n)] for s in seq_lens]


def expand_block_table(qsl: Sequence[int], block_table: Rows, num_tokens: int,
                       width: int) -> Rows:
    """Each token gets its request's block-table row; padding tokens get zeros."""
    out = []
    for t in range(num_tokens):
        owner = token_owner(qsl, t)
        out.append(list(block_table[owner[0]]) if owner else [0] * width)
    return out


def decode_row_requests(qsl: Sequence[int], num_tokens: int) -> list[int]:
    """Request of each token; the k-th padding token gets num_reqs + k."""
    num_reqs, total = len(qsl) - 1, qsl[-1]
    out = []
    for t in range(num_tokens):
        owner = token_owner(qsl, t)
        out.append(owner[0] if owner else num_reqs + (t - total))
    return out


def cap_context_lens(context_lens: Rows, block_table: Rows, num_blocks: int, block_size: int,
                     max_context_len: int) -> Rows:
    """Row r's lengths (negatives 0) cut at ``max_context_len`` and at ``c * block_size``
    for the first column c that a key of the row needs whose block entry is outside
    ``[0, num_blocks)`` or past the table: no length reaches a key on an invalid block."""
    out = []
    for lens, row in zip(context_lens, block_table, strict=True):
        lens = [min(max(n, 0), max_context_len) for n in lens]
        cap = max_context_len
        for c in range(-(-max(lens, default=0) // block_size)):
            if c >= len(row) or not 0 <= row[c] < num_blocks:
                cap = c * block_size
                break
        out.append([min(n, cap) for n in lens])
    return out


# --- §6 DCP --------------------------------------------------------------------------------


def dcp_local(n: int, world: int, rank: int, interleave: int) -> int:
    """design §6 formula; negative lengths count as 0."""
    n = max(n, 0)
    base = (n // interleave // world) * interleave
    rest = n - base * world
    return base + min(max(rest - rank * interleave, 0), interleave)


def dcp_owned(n: int, world: int, rank: int, interleave: int) -> int:
    """Brute force of the same thing: entries c < n dealt to ``rank`` in runs of
    ``interleave``, i.e. with ``(c // interleave) % world == rank``."""
    return sum(1 for c in range(max(n, 0)) if (c // interleave) % world == rank)


# --- §7 slot mappings ----------------------------------------------------------------------


def compressed_slot(pos: int, row: Sequence[int], block_size: int, ratio: int, world: int,
                    rank: int, interleave: int) -> int:
    """Slot written by the token at ``pos`` of a request with block-table row ``row``."""
    if pos < 0 or (pos + 1) % ratio != 0:
        return -1
    cpos = pos // ratio
    if world == 1:
        blk, offset = cpos // block_size, cpos % block_size
    else:
        blk = cpos // (block_size * world)
        v = cpos - blk * block_size * world
        if (v // interleave) % world != rank:
            return -1
        offset = (v // (world * interleave)) * interleave + v % interleave
    if blk >= len(row) or row[blk] < 0:
        return -1
    return row[blk] * block_size + offset


def compressed_slot_mapping(qsl: Sequence[int], seq_lens: Sequence[int], block_table: Rows,
                            num_tokens: int, block_size: int, ratio: int, world: int = 1,
                            rank: int = 0, interleave: int = 1) -> list[int]:
    """pos = seq_len - query_len + i; -1 for tokens that write no state of this rank."""
    out = [-1] * num_tokens
    for t in range(num_tokens):
        owner = token_owner(qsl, t)
        if owner is None:
            continue
        r, i = owner
        pos = seq_lens[r] - (qsl[r + 1] - qsl[r]) + i
        out[t] = compressed_slot(pos, block_table[r], block_size, ratio, world, rank,
                                 interleave)
    return out


def dcp_state_slots(num_states: int, row: Sequence[int], block_size: int, world: int,
                    rank: int, interleave: int) -> dict[int, int]:
    """Brute force of the DCP placement: walk each virtual block of ``block_size * world``
    states, hand them out in runs of ``interleave``, and give this rank's states the next
    free offsets of its own block. Returns compressed position -> slot."""
    slots = {}
    virtual = block_size * world
    for blk in range(-(-num_states // virtual)):
        mine = [c for c in range(blk * virtual, (blk + 1) * virtual)
                if ((c - blk * virtual) // interleave) % world == rank]
        for offset, c in enumerate(mine):
            if c < num_states and blk < len(row) and row[blk] >= 0:
                slots[c] = row[blk] * block_size + offset
    return slots


def kpool_tail_slot_mapping(qsl: Sequence[int], block_table: Rows, positions: Sequence[int],
                            kpool: int) -> list[int]:
    """block_table[r][0] * kpool + positions[t] % kpool; -1 for padding tokens, negative
    positions and negative block entries."""
    out = []
    for t, p in enumerate(positions):
        owner = token_owner(qsl, t)
        if owner is None or p < 0 or block_table[owner[0]][0] < 0:
            out.append(-1)
        else:
            out.append(block_table[owner[0]][0] * kpool + p % kpool)
    return out


def compress_block_table(block_table: Rows, factor: int) -> Rows:
    """block_table[:, ::factor] // factor, negative entries -1."""
    return [[e // factor if e >= 0 else -1 for e in row[::factor]] for row in block_table]


# --- §4 native packing ---------------------------------------------------------------------


def pack_decode_rows(rows: Sequence, qsl: Sequence[int], next_n: int, zero) -> list[list]:
    """out[r][next_n - d + i] = rows[qsl[r] + i] (d = decode_len); other slots ``zero``."""
    out = []
    for r in range(len(qsl) - 1):
        d = qsl[r + 1] - qsl[r]
        slots = [zero] * next_n
        for i in range(d):
            s, t = next_n - d + i, qsl[r] + i
            if s >= 0 and t < len(rows):
                slots[s] = rows[t]
        out.append(slots)
    return out


def unpack_decode_rows(packed: Sequence[Sequence], qsl: Sequence[int], num_tokens: int,
                       fill) -> list:
    """out[t] = packed[r][next_n - d + i] for token i of request r; otherwise ``fill``."""
    next_n = len(packed[0]) if packed else 0
    out = []
    for t in range(num_tokens):
        owner = token_owner(qsl, t)
        if owner is None:
            out.append(fill)
            continue
        r, i = owner
        s = next_n - (qsl[r + 1] - qsl[r]) + i
        out.append(packed[r][s] if s >= 0 else fill)
    return out


# --- §5 prefill ----------------------------------------------------------------------------


def prefill_chunk_bounds(qsl: Sequence[int], seq_lens: Sequence[int], req_start: int,
                         req_end: int, query_begin: int, query_end: int, num_rows: int,
                         ratio: int = 1, world: int = 1, rank: int = 0,
                         interleave: int = 1) -> tuple[list[int], ...]:
    """(cu_seq_lens, local_cu_seq_lens, token_to_seq, ks, ke, global_lens) of one chunk."""
    local = lambda n: dcp_local(n, world, rank, interleave)
    reqs = range(req_start, req_end)
    cu, local_cu = [0], [0]
    for r in reqs:  # a negative length (a device value, malformed) counts as 0
        cu.append(cu[-1] + max(seq_lens[r], 0) // ratio)
        local_cu.append(local_cu[-1] + local(max(seq_lens[r], 0) // ratio))

    token_to_seq = [-1] * num_rows
    for k in range(len(reqs)):
        for row in range(cu[k], cu[k + 1]):
            if row < num_rows:
                token_to_seq[row] = k

    per_query = []  # (ks, ke, global_len) of each query token of the chunk, in order
    for k, r in enumerate(reqs):
        qlen, seq = qsl[r + 1] - qsl[r], seq_lens[r]
        for j in range(qlen):
            glen = max(seq - qlen + 1 + j, 0) // ratio
            per_query.append((local_cu[k], local_cu[k] + local(glen), glen))
    ks, ke, global_lens = [], [], []
    for u in range(query_begin, query_end):
        a, b, g = per_query[u] if u < len(per_query) else (0, 0, 0)
        ks.append(a)
        ke.append(b)
        global_lens.append(g)
    return cu, local_cu, token_to_seq, ks, ke, global_lens


def split_prefill_chunks(seq_lens: Sequence[int], query_lens: Sequence[int],
                         workspace_rows: int, max_logits_bytes: int) -> list[tuple[slice, slice]]:
    """Greedy packing under both budgets; lone over-budget requests; query pieces."""
    fits = lambda q, s: s <= workspace_rows and q * s * 4 <= max_logits_bytes
    groups = []  # [first, last + 1) request ranges
    r = 0
    while r < len(seq_lens):
        end = r
        while end < len(seq_lens) and fits(sum(query_lens[r:end + 1]), sum(seq_lens[r:end + 1])):
            end += 1
        groups.append((r, max(end, r + 1)))
        r = max(end, r + 1)
    chunks = []
    for first, last in groups:
        total_q, total_s = sum(query_lens[first:last]), sum(seq_lens[first:last])
        piece = max(1, (max_logits_bytes // 4) // total_s) if total_s else max(1, total_q)
        q = 0
        while q < total_q:
            chunks.append((slice(first, last), slice(q, min(q + piece, total_q))))
            q += piece
    return chunks


# --- §9 padding ----------------------------------------------------------------------------


def pad_batch(qsl: Sequence[int], seq_lens: Sequence[int], block_table: Rows,
              slot_mapping: Sequence[int], positions: Sequence[int], num_reqs: int,
              num_tokens: int, width: int) -> tuple[list[int], list[int], Rows, list[int],
                                                    list[int]]:
    """A live batch in a bucket of ``num_reqs`` requests, ``num_tokens`` tokens and table
    ``width``: extra offsets repeat the live total, seq_len 0, table entries 0, slot -1,
    position 0."""
    live_reqs = len(seq_lens)
    out_qsl = [qsl[min(r, live_reqs)] for r in range(num_reqs + 1)]
    out_seq = [seq_lens[r] if r < live_reqs else 0 for r in range(num_reqs)]
    out_table = [[block_table[r][c] if r < live_reqs and c < len(block_table[r]) else 0
                  for c in range(width)] for r in range(num_reqs)]
    live_tokens = len(slot_mapping)
    out_slots = [slot_mapping[t] if t < live_tokens else -1 for t in range(num_tokens)]
    out_pos = [positions[t] if t < live_tokens else 0 for t in range(num_tokens)]
    return out_qsl, out_seq, out_table, out_slots, out_pos
