"""A model's decode step at DeepSeek V3.2 sizes: 61 indexer layers in one CUDA graph.

    python benchmarks/bench_model.py [--shapes 1x4096,64x65536] [--freqs 1 4] [--out BENCHMARKS.md]

The step of ``examples/model_decode.py``: the metadata built once, then every layer (its
indexer, or for a shared layer the top-k of the nearest full layer before it, then the
stand-in attention that reads the selected slots of its latent cache), compiled with
``torch.compile(fullgraph=True)`` and captured as one CUDA graph. Device time of one replay
divided by the layers is the time per layer with the metadata amortised. Every full layer
has its own random fp8 K cache of B * L / 64 blocks (next_n 1, full contexts), as bench_step's.
"""

from __future__ import annotations

import gc
import pathlib
import sys

import torch

import dsa

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from _report import (
    add_row,
    add_shapes_option,
    bench_parser,
    graph_us,
    markdown_table,
    publish,
    report,
    shapes_flag,
)
from bench_leaves import random_cache
from model_decode import V32, Model

LAYERS = 61  # DeepSeek V3.2
SHAPES = [(1, 4096), (64, 65536)]


def bench(batch: int, length: int, share: dsa.IndexShare) -> list[object]:
    blocks = batch * length // 64
    cfg = dsa.IndexerConfig(max_num_reqs=batch, max_num_batched_tokens=batch,
                            max_model_len=length, num_heads=V32.num_heads,
                            head_dim=V32.head_dim, topk=V32.topk,
                            ue8m0_scales=V32.ue8m0_scales, num_blocks=blocks)
    model = Model(cfg, V32, share, device="cuda", dtype=torch.bfloat16)
    cache = random_cache(blocks)
    for layer in model.layers:
        if layer.indexer is not None:
            layer.indexer.kv_cache.copy_(cache)
    del cache
    table = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    positions = (seq_lens - 1).long()
    slots = (table.gather(1, (positions // 64).view(-1, 1).int()).view(-1).long() * 64
             + positions % 64)
    live = dsa.Batch(
        query_start_loc=torch.arange(batch + 1, device="cuda", dtype=torch.int32),
        seq_lens=seq_lens, block_table=table, slot_mapping=slots, positions=positions)
    hidden = torch.randn(batch, V32.hidden, device="cuda", dtype=torch.bfloat16)
    held = torch.cuda.memory_allocated() / 2**30  # weights, K and latent caches, inputs
    torch.cuda.reset_peak_memory_stats()

    @torch.compile(fullgraph=True, dynamic=False)
    def step(b: dsa.Batch, h: torch.Tensor) -> torch.Tensor:
        return model(h, b.positions, dsa.build_decode_metadata(cfg, b))[0]

    for _ in range(2):  # compile, then Triton / DeepGEMM JIT and autotuning
        step(live, hidden)
    torch.cuda.synchronize()
    step_us = graph_us(lambda: step(live, hidden), replays=1)
    peak = torch.cuda.max_memory_allocated() / 2**30
    full = share.pattern.count("F")
    return [batch, length, share.num_layers, full, f"{step_us:.0f}",
            f"{step_us / share.num_layers:.1f}", f"{step_us / full:.1f}", f"{held:.1f}",
            f"{peak:.1f}"]


def main() -> None:
    parser = bench_parser()
    add_shapes_option(parser, SHAPES, what="BxL")
    parser.add_argument("--freqs", nargs="+", type=int, default=[1, 4],
                        help="index_topk_freq of the layer pattern (1: every layer indexes)")
    parser.add_argument("--layers", type=int, default=LAYERS)
    args = parser.parse_args()
    torch.manual_seed(0)
    header = ["B", "L", "layers", "full layers", "step device µs", "µs per layer",
              "µs per full layer", "held GiB", "peak GiB"]
    rows = []
    for batch, length in args.shapes or SHAPES:
        for freq in args.freqs:
            add_row(rows, bench(batch, length, dsa.IndexShare.every(args.layers, freq)))
            torch._dynamo.reset()  # the last model's compiled code, then its caches
            gc.collect()
            torch.cuda.empty_cache()
    text = report(
        f"A model's decode step: {args.layers} indexer layers in one CUDA graph",
        markdown_table(header, rows),
        command=f"python benchmarks/bench_model.py{shapes_flag(args.shapes)} --freqs "
        + " ".join(map(str, args.freqs)) + f" --layers {args.layers}",
        notes=(f"DeepSeek V3.2 sizes (hidden {V32.hidden}, q_lora_rank {V32.q_lora_rank}, "
               f"H={V32.num_heads}, D={V32.head_dim}, top-k {V32.topk}, ue8m0 scales), next_n 1, "
               "full contexts, bf16, logits backend auto; metadata built once per step; full "
               "layers: IndexShare.every(layers, index_topk_freq) (offset 2); each layer's "
               f"stand-in attention gathers its {V32.latent_dim}-wide latent rows at the "
               "selected slots; device time of one graph replay; held: GPU memory after "
               "set-up (weights, caches), peak: its maximum during compile, warm-up and "
               "capture"),
    )
    publish(text, args.out)


if __name__ == "__main__":
    main()
