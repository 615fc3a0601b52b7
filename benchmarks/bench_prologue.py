"""The indexer's q/k prologue on the GPU: the unfused chain against the fused ops.

    python benchmarks/bench_prologue.py [--out BENCHMARKS.md]
    python benchmarks/bench_prologue.py --tiles   # rows a program and warps, by T

For T = 1, 64, 128 tokens at DeepSeek V3.2's sizes (H 64, D 128, rope_dim 64, bf16, block
64): after the projections, RoPE, the Hadamard rotation, the fp8 quantisation of q (with the
head weights) and of k, and the K-cache write, as the unfused chain (``neox_rope``, the
Hadamard matmul, ``quantize_q``, ``quantize_and_cache_k``; ``torch.compile(fullgraph=True)``)
and as the two fused ops (``rope_hadamard_quantize_q``,
``rope_hadamard_quantize_and_cache_k``). Device µs from CUDA-graph replays (10 calls a
graph), the kernels one call launches (profiler), and the bytes floor (inputs read, outputs
written, at the measured copy bandwidth). Prints one table; with ``--out``, appends it.
``--tiles``: the q and k kernels alone by T over rows a program and warps (µs after 256 MB
written over, and warm), the defaults marked.
"""

from __future__ import annotations

import functools
import pathlib
import sys

import torch

from dsa.ops._launch import row_tile, tile_warps
from dsa.ops.prologue import K_TOKENS, Q_ROWS, k_prologue_triton, q_prologue_triton
from dsa.rope import rope_table

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _report import (  # noqa: E402
    add_row,
    bench_parser,
    copy_bandwidth,
    graph_us,
    kernel_span_us,
    markdown_table,
    publish,
    report,
)
from unfused import hadamard_matrix, unfused_prologue  # noqa: E402

TOKENS = (1, 64, 128)
TILE_TOKENS, TILE_ROWS, TILE_WARPS = (1, 64, 512, 4096), (1, 2, 4, 8, 16), (1, 2, 4)
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


def prologue_inputs(num_tokens: int) -> tuple:
    """q, k, weights, cache, slots, cos_sin, positions at V3.2's sizes, bf16."""
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
    return q, k, weights, cache, slots, cos_sin, positions


def bench_tokens(num_tokens: int, bandwidth: float) -> list[object]:
    q, k, weights, cache, slots, cos_sin, positions = prologue_inputs(num_tokens)
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


def sweep_tiles() -> None:
    """Prints µs of the q and k kernels by T, rows a program and warps (* the default)."""
    print("T | kernel | rows a program | warps | µs flushed | µs warm")
    for num_tokens in TILE_TOKENS:
        q, k, weights, cache, slots, cos_sin, positions = prologue_inputs(num_tokens)
        q_fp8, head_weights = ops.rope_hadamard_quantize_q(q, weights, cos_sin, positions)
        rotation = (cos_sin, positions, True, False)
        kernels = {
            "q": (row_tile(num_tokens * H, D, max_rows=Q_ROWS), "block_r",
                  functools.partial(q_prologue_triton, q, weights, *rotation, q_fp8, head_weights)),
            "k": (row_tile(num_tokens, D, max_rows=K_TOKENS), "block_t",
                  functools.partial(k_prologue_triton, k, cache, slots, *rotation)),
        }
        for name, (default_block, block_arg, kernel) in kernels.items():
            default = (default_block, tile_warps(default_block, D))
            for block in TILE_ROWS:
                for warps in TILE_WARPS:
                    call = functools.partial(kernel, **{block_arg: block}, num_warps=warps)
                    mark = "*" if (block, warps) == default else ""
                    print(f"{num_tokens} | {name} | {block}{mark} | {warps} | "
                          f"{kernel_span_us(call):.2f} | {graph_us(call):.2f}", flush=True)


def main() -> None:
    parser = bench_parser()
    parser.add_argument("--tiles", action="store_true", help="sweep the kernels' tiles")
    args = parser.parse_args()
    if args.tiles:
        sweep_tiles()
        return
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
