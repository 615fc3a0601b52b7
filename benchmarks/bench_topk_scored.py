"""Top-k with scores and the DCP merge on one GPU (design §3, §11).

    python benchmarks/bench_topk_scored.py [--out BENCHMARKS.md]

Per (B, N): ``topk_indices`` against ``topk_scored`` as a set (``sorted=False``, what the
DCP step runs) and sorted, on fp32 rows of N random normal logits; and ``dcp_merge_topk``
of two ranks' [B, k] candidates (this row's set and a second rank's, scores shifted up so
that both ranks win keys), as a set and sorted, read in place from the ``[2, B, 2k]`` pairs
an all-gather returns. CUDA-graph replay medians (10 calls per graph), L2 warm.
"""

from __future__ import annotations

import os
import sys

import torch

import dsa  # noqa: F401  (registers torch.ops.dsa)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import add_row, bench_parser, graph_us, markdown_table, publish, report

ops = torch.ops.dsa
TOPK, WORLD = 2048, 2
SHAPES = [(1, 4096), (1, 65536), (8, 65536), (64, 65536), (64, 131072)]


def gathered_pairs(batch: int, n: int) -> torch.Tensor:
    """``[2, B, 2k]`` int32: per rank the scores' bits, then the global positions."""
    logits = torch.randn(batch, n, device="cuda")
    lens = torch.full((batch,), n, device="cuda", dtype=torch.int32)
    indices, scores = ops.topk_scored(logits, lens, TOPK, False)
    other = torch.randn(batch, TOPK, device="cuda") + 2.0
    return torch.stack([torch.cat([scores.view(torch.int32), indices * WORLD], 1),
                        torch.cat([other.view(torch.int32), indices * WORLD + 1], 1)])


def bench_shape(batch: int, n: int) -> list[object]:
    logits = torch.randn(batch, n, device="cuda")
    lens = torch.full((batch,), n, device="cuda", dtype=torch.int32)
    pairs = gathered_pairs(batch, n)
    scores, positions = pairs[..., :TOPK].view(torch.float32), pairs[..., TOPK:]
    times = [graph_us(lambda: ops.topk_indices(logits, lens, TOPK)),
             graph_us(lambda: ops.topk_scored(logits, lens, TOPK, False)),
             graph_us(lambda: ops.topk_scored(logits, lens, TOPK, True)),
             graph_us(lambda: ops.dcp_merge_topk(scores, positions, False)),
             graph_us(lambda: ops.dcp_merge_topk(scores, positions, True))]
    merged = [ops.dcp_merge_topk(scores, positions, ordered)[0].sort(dim=1).values
              for ordered in (False, True)]
    assert torch.equal(*merged), "the merge's set differs from its sorted form"
    return [batch, n, *(f"{t:.1f}" for t in times)]


def main() -> None:
    out = bench_parser().parse_args().out
    torch.manual_seed(0)
    header = ["B", "N", "topk_indices µs", "topk_scored set µs", "topk_scored sorted µs",
              f"merge W={WORLD} set µs", "merge sorted µs"]
    rows: list[list[object]] = []
    for shape in SHAPES:
        add_row(rows, bench_shape(*shape))
    text = report("Top-k with scores and the DCP merge (one GPU)", markdown_table(header, rows),
                  notes=(f"k {TOPK}, fp32 random normal rows of N columns, full lengths; "
                         "merge: two ranks' k candidates per row, read in place from the "
                         "gathered pairs; CUDA-graph replay medians (10 calls per graph), "
                         "L2 warm"))
    publish(text, out)


if __name__ == "__main__":
    main()
