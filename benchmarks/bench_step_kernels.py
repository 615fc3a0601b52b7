"""Where a captured decode step of one indexer layer spends its device time: each kernel's
start and duration.

    python benchmarks/bench_step_kernels.py [--shapes 1x4096,...] [--flush read] [--out F]

The layer, batch and graph of ``bench_step.py`` (bf16 weights; fp8 with ``--fp8-weights``),
replayed in place; torch.profiler over 15 replays, each after 256 MB read over (``--flush
read``: clean L2 lines, as a model's other layers leave it), written over (``write``) or
nothing (``none``: warm). Medians: a kernel's start from the first kernel's start, and its
duration; gaps are the starts' differences minus the durations. The span runs from the first
kernel's start to the last one's end (the graph's own launch is not in it).
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _report import (
    add_row,
    add_shapes_option,
    bench_parser,
    kernel_timeline,
    markdown_table,
    publish,
    report,
    shapes_flag,
)
from bench_step import SHAPES, captured_layer

FLUSHES = {"read": "256 MB read over", "write": "256 MB written over", "none": "nothing (L2 warm)"}


def timeline_rows(batch: int, length: int, fp8_weights: bool, flush: str | None
                  ) -> list[list[object]]:
    runner, _, _ = captured_layer(batch, length, fp8_weights)
    timeline = kernel_timeline(lambda: runner.replay_in_place(batch), flush=flush)
    *kernels, (_, _, span) = timeline
    return [*([batch, length, f"`{name[:60]}`", f"{start:.1f}", f"{duration:.1f}"]
              for name, start, duration in kernels),
            [batch, length, "span", "", f"{span:.1f}"]]


def main() -> None:
    parser = bench_parser()
    add_shapes_option(parser, SHAPES, what="BxL")
    parser.add_argument("--flush", choices=("read", "write", "none"), default="read",
                        help="the L2 before each replay (default: read over)")
    parser.add_argument("--fp8-weights", action="store_true",
                        help="the layer built with fp8 wq_b / wk (as DeepSeek ships them)")
    args = parser.parse_args()
    torch.manual_seed(0)
    flush = None if args.flush == "none" else args.flush
    rows = []
    for shape in args.shapes or SHAPES:
        for row in timeline_rows(*shape, args.fp8_weights, flush):
            add_row(rows, row)
        torch.cuda.empty_cache()
    flags = shapes_flag(args.shapes) + ("" if args.flush == "read" else f" --flush {args.flush}")
    flags += " --fp8-weights" if args.fp8_weights else ""
    text = report(
        "Where a layer step's device time goes: its kernels",
        markdown_table(["B", "L", "kernel", "start µs", "duration µs"], rows),
        notes=(f"bench_step.py's layer ({'fp8' if args.fp8_weights else 'bf16'} weights), "
               f"in place; 15 replays, {FLUSHES[args.flush]} before each; medians"),
        command="python benchmarks/bench_step_kernels.py" + flags,
    )
    publish(text, args.out)


if __name__ == "__main__":
    main()
