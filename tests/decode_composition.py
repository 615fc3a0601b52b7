"""``dsa::decode_metadata`` as the composition of the small decode-metadata ops it fuses (how
``build_decode_metadata`` built a step's metadata before the fused op): the tests' oracle for
the fused op and the benchmark's baseline."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ops = torch.ops.dsa


def composed_decode_metadata(
    query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor, positions: Tensor,
    slot_mapping: Tensor, native: bool, next_n: int, compress_ratio: int, dcp_world: int,
    dcp_rank: int, dcp_interleave: int, num_blocks: int, block_size: int,
    max_context_len: int, max_model_len: int, deepgemm: bool,
) -> tuple[Tensor, ...]:
    """The outputs of ``torch.ops.dsa.decode_metadata`` from one op per step."""
    num_reqs, num_tokens = seq_lens.shape[0], slot_mapping.shape[0]
    requests = ops.decode_row_requests(query_start_loc, num_tokens)
    valid = (requests < num_reqs) & (positions >= 0) & (positions < max_model_len)
    slots = torch.where(valid, slot_mapping, -1)
    if native:
        global_lens, table = ops.native_decode_lens(seq_lens, next_n), block_table
    else:
        global_lens = ops.decode_token_lens(query_start_loc, seq_lens, num_tokens)
        global_lens = global_lens.view(num_tokens, 1)
        table = ops.expand_block_table(query_start_loc, block_table, num_tokens)
    if compress_ratio > 1:
        global_lens = torch.div(global_lens, compress_ratio, rounding_mode="floor")
    local = global_lens
    if dcp_world > 1:
        local = ops.dcp_local_lens(global_lens, dcp_world, dcp_rank, dcp_interleave)
    lens = ops.cap_context_lens(local, table, num_blocks, block_size, max_context_len)
    row_valid = F.pad(valid.int(), (0, max(0, lens.numel() - num_tokens)))[:lens.numel()]
    select_lens = torch.where(row_valid.view_as(lens) == 1, lens, 0)  # token row * N + j
    schedule_lens, schedule = lens[:0], query_start_loc.new_zeros((0, 2))
    if deepgemm:
        table = torch.cat([table[:, :1].clamp(0, num_blocks - 1), table[:, 1:]], dim=1)
        schedule_lens = lens.clamp(min=1)
        schedule = ops.paged_mqa_schedule(lens, block_size)
    return (global_lens, lens, table, requests, valid, slots, select_lens, schedule_lens,
            schedule)
