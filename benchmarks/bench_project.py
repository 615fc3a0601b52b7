"""The indexer's k and head-weight projections on the GPU: the torch ops against
``dsa::project_k_and_weights``.

    python benchmarks/bench_project.py [--out BENCHMARKS.md]

For T = 1, 2, 4 and 8 tokens at DeepSeek V3.2's sizes (hidden 7168, D 128, H 64, bf16
hidden and ``wk``, fp32 ``weights_proj`` and LayerNorm): ``wk`` + LayerNorm + the cast and
the fp32 ``weights_proj`` GEMM as the layer computed them (``torch.compile(fullgraph=True)``)
against the op (its two kernels up to ``SMALL_TOKENS`` tokens, the same torch ops above).
Device µs from CUDA-graph replays: L2 warm (10 calls a graph) and L2 flushed (one call,
256 MB written before each replay; the weights, 3.7 MB, fit in L2); the kernels one call
launches (profiler); the floor: bytes read and written at the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
import torch.nn.functional as F

import dsa  # noqa: F401  (registers torch.ops.dsa)
from dsa.ops.project import SMALL_TOKENS

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _report import add_row, copy_bandwidth, graph_us, markdown_table, publish, report  # noqa: E402
from bench_prologue import kernels_per_call  # noqa: E402

TOKENS = (1, 2, 4, 8)
HIDDEN, D, H = 7168, 128, 64


def torch_projection(hidden, wk, norm_weight, norm_bias, weights_proj):
    k = F.linear(hidden, wk)
    k = F.layer_norm(k.float(), (D,), norm_weight, norm_bias, 1e-6).to(hidden.dtype)
    return k, F.linear(hidden.float(), weights_proj)


def op_projection(hidden, wk, norm_weight, norm_bias, weights_proj):
    return torch.ops.dsa.project_k_and_weights(hidden, wk, norm_weight, norm_bias, 1e-6,
                                               weights_proj)


def bench_tokens(tokens: int, bandwidth: float) -> list[object]:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    hidden = torch.randn(tokens, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    wk = (torch.randn(D, HIDDEN, generator=gen, device="cuda") * HIDDEN**-0.5).to(torch.bfloat16)
    norm_weight = torch.rand(D, generator=gen, device="cuda") + 0.5
    norm_bias = torch.randn(D, generator=gen, device="cuda") * 0.1
    weights_proj = torch.randn(H, HIDDEN, generator=gen, device="cuda") * HIDDEN**-0.5
    args = (hidden, wk, norm_weight, norm_bias, weights_proj)
    calls = {"torch": torch.compile(torch_projection, fullgraph=True),
             "op": torch.compile(op_projection, fullgraph=True)}
    warm = {name: graph_us(lambda fn=fn: fn(*args)) for name, fn in calls.items()}
    flushed = {name: graph_us(lambda fn=fn: fn(*args), replays=1) for name, fn in calls.items()}
    launches = {name: kernels_per_call(lambda fn=fn: fn(*args)) for name, fn in calls.items()}
    (k_torch, w_torch), (k_op, w_op) = (fn(*args) for fn in calls.values())
    moved = (wk.numel() * 2 + weights_proj.numel() * 4 + hidden.numel() * 2 + D * 8
             + tokens * (D * 2 + H * 4))
    floor_us = moved / bandwidth * 1e6
    return [tokens, f"{warm['torch']:.1f}", f"{flushed['torch']:.1f}", launches["torch"],
            f"{warm['op']:.1f}", f"{flushed['op']:.1f}", launches["op"],
            f"{flushed['torch'] / flushed['op']:.1f}x", f"{floor_us:.2f}",
            f"{(k_op.float() - k_torch.float()).abs().max().item():.3g}",
            f"{((w_op - w_torch).abs().max() / w_torch.abs().max()).item():.1e}"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="append the report to this markdown file")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    header = ["T", "torch warm µs", "torch flushed µs", "torch kernels", "op warm µs",
              "op flushed µs", "op kernels", "flushed speed-up", "bytes floor µs",
              "k: max abs diff", "weights: max rel. diff"]
    rows = []
    for tokens in TOKENS:
        add_row(rows, bench_tokens(tokens, bandwidth))
    notes = (f"hidden {HIDDEN}, D={D}, H={H}; bf16 hidden and wk, fp32 weights_proj and "
             "LayerNorm; torch = F.linear + layer_norm + cast + fp32 F.linear under "
             "torch.compile; op = dsa::project_k_and_weights under torch.compile (its kernels "
             f"up to {SMALL_TOKENS} tokens); medians of CUDA-graph replays (warm: 10 calls per "
             "graph; flushed: one call after 256 MB written); kernels: device activities of "
             f"one call (profiler); copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    title = "Indexer projections: wk + LayerNorm and weights_proj"
    publish(report(title, markdown_table(header, rows), notes), args.out)


if __name__ == "__main__":
    main()
