"""One indexer layer's decode step: CUDA-graph replay vs eager with host-built metadata.

    python benchmarks/bench_step.py [--out BENCHMARKS.md]

(a) ``DecodeGraphRunner.replay``: input copy + one graph (metadata build, projections,
K write, logits, top-k, slots) + output copies. (b) the same layer run eagerly on metadata
built on the host each step (``host_metadata.py``, the way engines do it today). Host time
is the wall time of one call with the GPU drained first; device time is the CUDA-event time.
"""

from __future__ import annotations

import sys

import torch

import dsa
from dsa.graphs import DecodeGraphRunner

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _report import bench_parser, device_us, host_us, markdown_table, publish, report
from bench_leaves import random_cache
from host_metadata import host_built_decode_metadata

SHAPES = [(1, 4096), (64, 65536), (128, 32768)]
HIDDEN, Q_LORA_RANK = 7168, 1536  # DeepSeek V3.2


def bench_shape(batch: int, length: int) -> list[object]:
    blocks = batch * -(-length // 64)
    cfg = dsa.IndexerConfig(max_num_reqs=batch, max_num_batched_tokens=batch,
                            max_model_len=length, num_blocks=blocks)
    layer = dsa.Indexer(cfg, hidden_size=HIDDEN, q_lora_rank=Q_LORA_RANK, device="cuda")
    layer.kv_cache.copy_(random_cache(blocks))
    table = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    positions = (seq_lens - 1).long()
    slots = (table.gather(1, (positions // 64).view(-1, 1).int()).view(-1).long() * 64
             + positions % 64)
    qsl_cpu = torch.arange(batch + 1, dtype=torch.int32)
    live = dsa.Batch(query_start_loc=qsl_cpu.cuda(), seq_lens=seq_lens, block_table=table,
                     slot_mapping=slots, positions=positions)
    inputs = {"hidden": torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16),
              "q_latent": torch.randn(batch, Q_LORA_RANK, device="cuda", dtype=torch.bfloat16)}

    def step(b: dsa.Batch, hidden: torch.Tensor, q_latent: torch.Tensor):
        return layer(hidden, q_latent, b.positions, dsa.build_decode_metadata(cfg, b)).slots

    runner = DecodeGraphRunner(
        step, cfg, sizes=[batch], table_width=table.shape[1],
        token_inputs={"hidden": ((HIDDEN,), torch.bfloat16),
                      "q_latent": ((Q_LORA_RANK,), torch.bfloat16)},
    )
    runner.capture()
    graph_step = lambda: runner.replay(live, **inputs)

    def eager_step():
        meta = host_built_decode_metadata(cfg, live, qsl_cpu)
        return layer(inputs["hidden"], inputs["q_latent"], live.positions, meta).slots

    overlap = _overlap(graph_step(), eager_step())
    graph_host, eager_host = host_us(graph_step), host_us(eager_step)
    graph_dev, eager_dev = device_us(graph_step), device_us(eager_step)
    return [batch, length, f"{graph_host:.0f}", f"{graph_dev:.0f}", f"{eager_host:.0f}",
            f"{eager_dev:.0f}", f"{eager_host / graph_host:.1f}x",
            f"{eager_dev / graph_dev:.1f}x", f"{100 * overlap:.2f}%"]


def _overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of selected slots the two runs share (their bf16 projections round apart:
    inductor fuses them, eager does not, so near-ties may flip)."""
    shared = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1) & (a >= 0)
    return float(shared.sum() / (a >= 0).sum().clamp(min=1))


def main() -> None:
    out = bench_parser().parse_args().out
    torch.manual_seed(0)
    header = ["B", "L", "graph host µs", "graph device µs", "eager+host-meta host µs",
              "eager+host-meta device µs", "host ratio", "device ratio", "top-k overlap"]
    rows = []
    for shape in SHAPES:
        rows.append(bench_shape(*shape))
        print(" | ".join(str(c) for c in rows[-1]), flush=True)
        torch.cuda.empty_cache()
    text = report(
        "Decode step of one indexer layer: CUDA graph vs eager with host-built metadata",
        "python benchmarks/bench_step.py",
        markdown_table(header, rows),
        notes=(f"hidden {HIDDEN}, q_lora_rank {Q_LORA_RANK}, H=64, D=128, top-k 2048, "
               "next_n 1, full contexts, bf16, logits backend auto; ratio = eager / graph; "
               "top-k overlap: slots both runs select (their bf16 projections round "
               "differently: inductor fuses them)"),
    )
    publish(text, out)


if __name__ == "__main__":
    main()
