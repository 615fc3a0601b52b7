"""What each of dsa's measured launch options is worth in a layer's decode step on this GPU:
``bench_step.py``'s layer with one option turned off at a time, side by side with the
defaults.

    python benchmarks/bench_step_options.py [--shapes 1x4096,...] [--fp8-weights] [--rounds 2]
                                            [--only DISCARD_Q_PARTIALS,...] [--out BENCHMARKS.md]

The options are module settings read when a kernel is launched, so each variant is the
step's CUDA graph captured again (then the batch written back into its bucket) and replayed
in place. Every round measures the defaults and each variant in turn: µs of device time
(do_bench, 256 MB written over before each replay) and kernel spans (first kernel's start
to last one's end) after 256 MB written over and read over. An option's worth is the
variant's mean minus the defaults' mean over the rounds: positive where the option saves
time. The top-k's slots are compared with the defaults' (equal, or the share selected by
both). Options chosen on one GPU may not pay on another: run this where a step will run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

import dsa
import dsa.ops._launch as launch_settings
import dsa.ops.project as project
import dsa.ops.topk.indices as topk
from dsa.graphs import DecodeGraphRunner
from dsa.ops.logits import paged

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _report import (
    add_row,
    add_shapes_option,
    bench_parser,
    device_us,
    kernel_span_us,
    markdown_table,
    publish,
    report,
    shapes_flag,
)
from bench_step import HIDDEN, Q_LORA_RANK, SHAPES, captured_layer, fill_bucket, slot_overlap

DEFAULTS = "defaults"


@contextlib.contextmanager
def _setting(module: Any, name: str, value: object) -> Iterator[None]:
    """``module.name`` set to ``value`` inside the block."""
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _one_token_logits(**fields: object) -> contextlib.AbstractContextManager:
    """The paged logits' launch at next_n 1 with ``fields`` replaced."""
    launches = dict(paged.PAGED_LAUNCH)
    launches[1] = launches[1]._replace(**fields)
    return _setting(paged, "PAGED_LAUNCH", launches)


# Each option: (what turns it off, whether the layer must have fp8 weights for it to matter).
OPTIONS: dict[str, tuple[Callable[[], contextlib.AbstractContextManager], bool]] = {
    "logits started early (`PagedLaunch.early_tiles`)":
        (lambda: _one_token_logits(early_tiles=0), False),
    "logits kept in L2 (`PagedLaunch.keep_in_l2`)":
        (lambda: _one_token_logits(keep_in_l2=False), False),
    "top-k's unmasked candidates (`Tuning.unmasked_rows`)":
        (lambda: _setting(topk, "TUNING", dataclasses.replace(topk.TUNING, unmasked_rows=None)),
         False),
    "q partial sums dropped from L2 (`project.DISCARD_Q_PARTIALS_FROM`)":
        (lambda: _setting(project, "DISCARD_Q_PARTIALS_FROM", project.KERNEL_TOKENS + 1), False),
    "fp8 weight tiles by TMA (`project.FP8_WEIGHTS_BY_TMA`)":
        (lambda: _setting(project, "FP8_WEIGHTS_BY_TMA", False), True),
    "programmatic dependent launch (`DSA_PDL`)":
        (lambda: _setting(launch_settings, "PDL", 0), False),
}


def _measure(runner: DecodeGraphRunner, live: dsa.Batch, inputs: dict[str, torch.Tensor]
             ) -> tuple[tuple[float, float, float], torch.Tensor]:
    """The step captured again as the settings stand now: (device µs, kernels µs after 256 MB
    written over, after 256 MB read over) and its slots."""
    runner.capture()
    fill_bucket(runner, live, inputs)
    batch = live.num_reqs
    slots = runner.replay_in_place(batch).clone()

    def step() -> object:
        return runner.replay_in_place(batch)

    return (device_us(step), kernel_span_us(step, flush="write"),
            kernel_span_us(step, flush="read")), slots


def _agreement(got: torch.Tensor, want: torch.Tensor) -> str:
    return "equal" if torch.equal(got, want) else f"{100 * slot_overlap(got, want):.2f}% shared"


def bench_shape(batch: int, length: int, fp8_weights: bool, rounds: int,
                only: list[str] | None = None) -> list[list[object]]:
    runner, live, inputs = captured_layer(batch, length, fp8_weights)
    options = {name: off for name, (off, fp8_only) in OPTIONS.items()
               if (fp8_weights or not fp8_only)
               and (only is None or any(key in name for key in only))}
    times: dict[str, list[tuple[float, float, float]]] = {DEFAULTS: []}
    times.update({name: [] for name in options})
    agreement: dict[str, str] = {DEFAULTS: "-"}
    for _ in range(rounds):
        measured, want = _measure(runner, live, inputs)
        times[DEFAULTS].append(measured)
        for name, off in options.items():
            with off():
                measured, slots = _measure(runner, live, inputs)
            times[name].append(measured)
            agreement[name] = _agreement(slots, want)
    base = [statistics.mean(t[i] for t in times[DEFAULTS]) for i in range(3)]
    rows = []
    for name, measured in times.items():
        means = [statistics.mean(t[i] for t in measured) for i in range(3)]
        cells = [", ".join(f"{t[i]:.1f}" for t in measured) for i in range(3)]
        worth = ("" if name == DEFAULTS
                 else f"{means[0] - base[0]:+.1f} / {means[2] - base[2]:+.1f}")
        rows.append([batch, length, name if name == DEFAULTS else f"{name} off", *cells,
                     worth, agreement[name]])
    return rows


def main() -> None:
    parser = bench_parser()
    add_shapes_option(parser, SHAPES, what="BxL")
    parser.add_argument("--fp8-weights", action="store_true",
                        help="the layer with fp8 wq_b / wk (as DeepSeek ships them)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every variant")
    parser.add_argument("--only", type=lambda text: text.split(","), default=None,
                        help="comma-separated parts of option names (e.g. DSA_PDL): "
                             "only the options whose names contain one")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_step_options needs a CUDA GPU")
    torch.manual_seed(0)
    rows = []
    for shape in args.shapes or SHAPES:
        for row in bench_shape(*shape, args.fp8_weights, args.rounds, args.only):
            add_row(rows, row)
        torch.cuda.empty_cache()
    header = ["B", "L", "variant", "device µs", "kernels µs, L2 written over",
              "kernels µs, L2 read over", "option's worth µs (device / read over)",
              "top-k slots vs defaults"]
    text = report(
        "Decode step of one indexer layer: what each launch option is worth",
        markdown_table(header, rows),
        notes=(f"hidden {HIDDEN}, q_lora_rank {Q_LORA_RANK}, H=64, D=128, top-k 2048, "
               f"next_n 1, ue8m0 scales, full contexts, {'fp8' if args.fp8_weights else 'bf16'}"
               f" `wq_b` / `wk`; the step captured again for every variant, {args.rounds} "
               "rounds (one figure a round); worth: the variant's mean minus the defaults'"),
        command=("python benchmarks/bench_step_options.py" + shapes_flag(args.shapes)
                 + (" --fp8-weights" if args.fp8_weights else "")
                 + (f" --rounds {args.rounds}" if args.rounds != 2 else "")
                 + (f" --only {','.join(args.only)}" if args.only else "")),
    )
    publish(text, args.out)


if __name__ == "__main__":
    main()
