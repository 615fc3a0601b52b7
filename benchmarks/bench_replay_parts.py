"""Where the host time of ``DecodeGraphRunner.replay`` goes, at bench_step's (1, 4K) shape.

    python benchmarks/bench_replay_parts.py

Host time: wall time of one call with the GPU drained first (median of 50); device time:
CUDA events around 200 back-to-back calls. One V3.2 indexer layer, next_n 1.
"""
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _report import host_us
from bench_leaves import random_cache

import dsa
from dsa.graphs import DecodeGraphRunner, live_outputs

batch, length, hidden_size, q_lora = 1, 4096, 7168, 1536
blocks = batch * length // 64
cfg = dsa.IndexerConfig(max_num_reqs=batch, max_num_batched_tokens=batch, max_model_len=length,
                        num_blocks=blocks)
layer = dsa.Indexer(cfg, hidden_size=hidden_size, q_lora_rank=q_lora, device="cuda")
layer.kv_cache.copy_(random_cache(blocks))
table = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, -1)
seq = torch.full((batch,), length, device="cuda", dtype=torch.int32)
pos = (seq - 1).long()
live = dsa.Batch(query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
                 seq_lens=seq, block_table=table, slot_mapping=pos.clone(), positions=pos)
inputs = {"hidden": torch.randn(batch, hidden_size, device="cuda", dtype=torch.bfloat16),
          "q_latent": torch.randn(batch, q_lora, device="cuda", dtype=torch.bfloat16)}
runner = DecodeGraphRunner(
    lambda b, hidden, q_latent: layer(hidden, q_latent, b.positions,
                                      dsa.build_decode_metadata(cfg, b)).slots,
    cfg, sizes=[batch], table_width=table.shape[1],
    token_inputs={"hidden": ((hidden_size,), torch.bfloat16),
                  "q_latent": ((q_lora,), torch.bfloat16)})
runner.capture()
static = runner._static[batch]
graph, outputs = runner._graphs[batch]


def device_us(fn, n=200):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1e3


print(f"load (one pad_batch_out launch, one copy of all inputs) "
      f"{host_us(lambda: static.load(live, **inputs)):.1f} us host")
print(f"graph.replay {host_us(graph.replay):.1f} us host, {device_us(graph.replay):.1f} us dev")
print(f"live_outputs {host_us(lambda: live_outputs(outputs, 1, 1)):.1f} us host")
print(f"runner.replay_in_place {host_us(lambda: runner.replay_in_place(batch)):.1f} us host")
print(f"runner.replay {host_us(lambda: runner.replay(live, **inputs)):.1f} us host")
