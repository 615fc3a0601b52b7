"""Decode leaves on the GPU: paged MQA logits per backend, top-k, against the HBM floor.

    python benchmarks/bench_leaves.py [--out BENCHMARKS.md]

For each (B, next_n, L) with H=64, D=128, block 64, full contexts: dsa's Triton
``paged_mqa_logits`` and DeepGEMM's ``paged_mqa_logits_deepgemm``, ``topk_indices`` vs
masked ``torch.topk`` (the -inf fill past each row's length that DeepGEMM's junk needs,
then the top-k) and vs ``torch.topk`` alone on logits already masked, and the HBM floor
(K-cache bytes / measured copy bandwidth). Every time is taken inside a CUDA graph, as a
decode step runs. Prints one table; with ``--out``, appends it as a section of that file.
"""

from __future__ import annotations

import sys

import torch

import dsa
from dsa.ops.logits.deepgemm import deepgemm_paged_supported

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _report import add_row, bench_parser, copy_bandwidth, graph_us, markdown_table, publish, report

SHAPES = [(1, 1, 4096), (1, 1, 65536), (8, 1, 32768), (32, 1, 32768), (64, 1, 65536),
          (128, 1, 32768), (64, 2, 32768), (256, 1, 8192)]
H, D, BS, TOPK = 64, 128, 64, 2048
ops = torch.ops.dsa


def random_cache(num_blocks: int) -> torch.Tensor:
    """A K cache of random fp8 values and positive scales, in the design §2 layout."""
    cache = torch.empty(num_blocks, BS, 1, D + 4, dtype=torch.uint8, device="cuda")
    flat = cache.view(num_blocks, BS * (D + 4))
    values = torch.randn(num_blocks, BS * D, device="cuda").to(torch.float8_e4m3fn)
    flat[:, : BS * D].copy_(values.view(torch.uint8))
    scales = torch.rand(num_blocks, BS, device="cuda") * 0.01 + 1e-3
    flat[:, BS * D :].copy_(scales.view(torch.uint8).view(num_blocks, BS * 4))
    return cache


def bench_shape(batch: int, next_n: int, length: int, bandwidth: float) -> list[object]:
    blocks_per_req = length // BS
    cache = random_cache(batch * blocks_per_req)
    table = torch.randperm(batch * blocks_per_req, device="cuda", dtype=torch.int32)
    table = table.view(batch, blocks_per_req)
    q = torch.randn(batch, next_n, H, D, device="cuda").to(torch.float8_e4m3fn)
    weights = torch.rand(batch * next_n, H, device="cuda")
    lens = (length - next_n + 1 + torch.arange(next_n, device="cuda", dtype=torch.int32))
    lens = lens.expand(batch, next_n).contiguous()

    args = (q, cache, weights, lens, table, length)
    triton_us = graph_us(lambda: ops.paged_mqa_logits(*args))
    deepgemm_us = None
    if deepgemm_paged_supported(cache.device, H, D, BS, next_n):
        schedule = ops.paged_mqa_schedule(lens, BS)
        deepgemm_us = graph_us(lambda: ops.paged_mqa_logits_deepgemm(*args, schedule))

    scores = ops.paged_mqa_logits(*args)  # -inf past each row's length (full rows here)
    cols = torch.arange(length, device="cuda")
    dsa_topk_us = graph_us(lambda: ops.topk_indices(scores, lens, TOPK))
    torch_topk_us = graph_us(lambda: torch.topk(scores, TOPK, dim=-1))
    masked_topk_us = graph_us(lambda: torch.topk(
        scores.masked_fill(cols >= lens.view(-1, 1), -float("inf")), TOPK, dim=-1))

    floor_us = batch * length * (D + 4) / bandwidth * 1e6
    fmt = lambda us: "n/a" if us is None else f"{us:.1f}"
    pct = lambda us: "n/a" if us is None else f"{100 * floor_us / us:.0f}%"
    best_logits = min(u for u in (triton_us, deepgemm_us) if u is not None)
    baseline = (deepgemm_us if deepgemm_us is not None else triton_us) + masked_topk_us
    return [batch, next_n, length, f"{floor_us:.1f}", fmt(triton_us), pct(triton_us),
            fmt(deepgemm_us), pct(deepgemm_us), fmt(dsa_topk_us), fmt(masked_topk_us),
            f"{masked_topk_us / dsa_topk_us:.1f}x", fmt(torch_topk_us),
            f"{torch_topk_us / dsa_topk_us:.1f}x", f"{best_logits + dsa_topk_us:.1f}",
            f"{baseline:.1f}"]


def main() -> None:
    out = bench_parser().parse_args().out
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    header = ["B", "next_n", "L", "HBM floor µs", "dsa Triton logits µs", "of floor",
              "DeepGEMM logits µs", "of floor", "dsa top-k µs", "masked torch.topk µs",
              "speed-up", "torch.topk alone µs", "speed-up", "dsa logits + top-k µs",
              "DeepGEMM + masked torch.topk µs"]
    rows = []
    for shape in SHAPES:
        add_row(rows, bench_shape(*shape, bandwidth))
        torch.cuda.empty_cache()
    table = markdown_table(header, rows)
    text = report(
        "Decode leaves: paged MQA logits and top-k",
        table,
        notes=(f"H={H}, D={D}, block {BS}, top-k {TOPK}, full contexts; copy bandwidth "
               f"{bandwidth / 1e12:.2f} TB/s (read + write); medians of CUDA-graph replays "
               f"(10 calls per graph); masked torch.topk = masked_fill of the columns past "
               f"each length + torch.topk, torch.topk alone = on logits already masked; "
               f"dsa v{dsa.__version__}"),
    )
    publish(text, out)


if __name__ == "__main__":
    main()
