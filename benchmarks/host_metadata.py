"""The baseline dsa replaces: decode metadata built on the host every step, as engines do.

Reads host copies of the batch (``.item()`` on host lengths, host-sized
``repeat_interleave``), then launches one small device op per step of the build. The
result is the same ``DecodeMetadata`` that ``dsa.build_decode_metadata`` produces on the
device, so the same layer consumes either.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsa import Batch, DecodeMetadata, IndexerConfig
from dsa.meta.decode import max_context_len
from dsa.ops.decode_fused import selection_lens
from dsa.ops.logits import deepgemm, paged_backend


def host_built_decode_metadata(cfg: IndexerConfig, batch: Batch, query_start_loc_cpu: Tensor
                               ) -> DecodeMetadata:
    """Native layout, no DCP, no compression: the plain decode step of the benchmark."""
    device = batch.seq_lens.device
    decode_lens_cpu = torch.diff(query_start_loc_cpu)
    num_reqs = int(decode_lens_cpu.shape[0])
    real_tokens = int(decode_lens_cpu.sum().item())
    max_decode_len = int(decode_lens_cpu.max().item())
    decode_lens = torch.diff(batch.query_start_loc)
    offsets = torch.arange(cfg.next_n, device=device, dtype=torch.int32)
    context_lens = (batch.seq_lens.unsqueeze(1) - max_decode_len + 1 + offsets).clamp_(min=0)
    requests = torch.repeat_interleave(torch.arange(num_reqs, device=device, dtype=torch.int32),
                                       decode_lens, output_size=real_tokens)
    padding = batch.num_tokens - real_tokens
    if padding:
        extra = num_reqs + torch.arange(padding, device=device, dtype=torch.int32)
        requests = torch.cat([requests, extra])
    positions = batch.positions
    valid = (requests < num_reqs) & (positions >= 0) & (positions < cfg.max_model_len)
    backend = paged_backend(cfg.logits_backend, device, cfg.num_heads, cfg.head_dim,
                            cfg.block_size, cfg.next_n, num_reqs, max_context_len(cfg))
    schedule_lens = schedule = None
    if backend == "deepgemm":
        schedule_lens = context_lens.clamp(min=1)
        schedule = deepgemm.call("get_paged_mqa_logits_metadata", context_lens=schedule_lens,
                                 block_kv=cfg.block_size, num_sms=deepgemm.num_sms(device))
    return DecodeMetadata(
        layout="native",
        next_n=cfg.next_n,
        query_start_loc=batch.query_start_loc,
        context_lens=context_lens,
        global_context_lens=context_lens,
        block_table=batch.block_table,
        request_block_table=batch.block_table,
        token_requests=requests,
        valid_tokens=valid,
        slot_mapping=torch.where(valid, batch.slot_mapping, -1),
        select_lens=selection_lens(context_lens, valid),
        kpool_slot_mapping=None,
        logits_backend=backend,
        schedule_lens=schedule_lens,
        schedule=schedule,
        max_context_len=max_context_len(cfg),
        built_for=cfg.metadata_key(),
    )
