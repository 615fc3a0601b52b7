"""The indexer's q/k prologue on the GPU: the unfused chain against the fused ops.

    python benchmarks/bench_prologue.py [--out BENCHMARKS.md]

For T = 1, 64, 128 tokens at DeepSeek V3.2's sizes (H 64, D 128, rope_dim 64, bf16, block
64): after the projections, RoPE, the Hadamard rotation, the fp8 quantisation of q (with the
head weights) and of k, and the K-cache write, as the unfused chain (``neox_rope``, the
Hadamard matmul, ``quantize_q``, ``quantize_and_cache_k``; ``torch.compile(fullgraph=True)``)
and as the two fused ops (``rope_hadamard_quantize_q``,
``rope_hadamard_quantize_and_cache_k``). Device µs from CUDA-graph replays (10 calls a
graph), the kernels one call launches (profiler), and the bytes floor (inputs read, outputs
written, at the measured copy bandwidth). Prints one table; with ``--out``, appends it.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

from dsa.rope import rope_table

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _report import add_row, copy_bandwidth, graph_us, markdown_table, publish, report  # noqa: E402
from unfused import hadamard_matrix, unfused_prologue  # noqa: E402

TOKENS = (1, 64, 128)
H, D, ROPE_DIM, BS, MAX_LEN = 64, 128, 64, 64, 131072
ops = torch.ops.dsa


def fused_prologue(q, k, weights, kv_cache, slot_mapping, cos_sin, positions):
    ops.rope_hadamard_quantize_and_cache_k(k, kv_cache, slot_mapping, cos_sin, positions)
    return ops.rope_hadamard_quantize_q(q, weights, cos_sin, positions)


def kernels_per_call(fn) -> int:
    """Device activities (kernels, copies) of one call, from the profiler."""
    fn()
    torch.cuda.synchronize()
    activity = torch.profiler.ProfilerActivity.CUDA
    with torch.profiler.profile(activities=[activity]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def bench_tokens(num_tokens: int, bandwidth: float) -> list[object]:
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    q = torch.randn(num_tokens, H, D, generator=gen, **bf16)
    k = torch.randn(num_tokens, D, generator=gen, **bf16)
    weights = torch.randn(num_tokens, H, generator=gen, device="cuda")
    num_blocks = 1024
    cache = torch.zeros(num_blocks, BS, 1, D + 4, dtype=torch.uint8, device="cuda")
    slots = torch.randperm(num_blocks * BS, generator=gen, device="cuda")[:num_tokens]
    positions = torch.randint(0, MAX_LEN, (num_tokens,), generator=gen, device="cuda")
    cos_sin = rope_table(MAX_LEN, ROPE_DIM, 10000.0, device="cuda")
    hadamard = hadamard_matrix(D, torch.bfloat16, "cuda")

    unfused = torch.compile(unfused_prologue, fullgraph=True)
    fused = torch.compile(fused_prologue, fullgraph=True)
    calls = {
        "unfused": lambda: unfused(q, k, weights, cache, slots, cos_sin, positions, hadamard),
        "fused": lambda: fused(q, k, weights, cache, slots, cos_sin, positions),
    }
    us = {name: graph_us(fn) for name, fn in calls.items()}
    launches = {name: kernels_per_call(fn) for name, fn in calls.items()}
    moved = num_tokens * (H * D * 2 + D * 2 + H * 4 + 8 + 2 * ROPE_DIM * 4  # read
                          + H * D + H * 4 + D + 4)  # written
    floor_us = moved / bandwidth * 1e6
    return [num_tokens, f"{us['unfused']:.1f}", launches["unfused"], f"{us['fused']:.1f}",
            launches["fused"], f"{us['unfused'] / us['fused']:.1f}x", f"{floor_us:.2f}"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="append the report to this markdown file")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    header = ["T", "unfused µs", "unfused kernels", "fused µs", "fused kernels", "speed-up",
              "bytes floor µs"]
    rows = []
    for num_tokens in TOKENS:
        add_row(rows, bench_tokens(num_tokens, bandwidth))
    notes = (f"H={H}, D={D}, rope_dim={ROPE_DIM}, bf16, block {BS}; unfused = neox_rope, Hadamard "
             "matmul, quantize_q, quantize_and_cache_k under torch.compile; fused = "
             "rope_hadamard_quantize_q + rope_hadamard_quantize_and_cache_k; medians of "
             "CUDA-graph replays (10 calls per graph); kernels: device activities of one call "
             f"(profiler); copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    title = "Indexer prologue: RoPE + Hadamard + fp8 quantisation + K-cache write"
    table = markdown_table(header, rows)
    publish(report(title, table, notes), args.out)


if __name__ == "__main__":
    main()
