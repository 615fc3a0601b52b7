"""Top-k on the GPU: ``topk_indices``, ``topk_indices_and_slots`` and masked ``torch.topk``.

    python benchmarks/bench_topk_sweep.py [--quick | --overflow] [--variant NAME:K=V,...]
        [--seeds N] [--out FILE]

For each (rows, L) of ``SHAPES`` (k = 2048), both length patterns (all L, ~U[L/2, L]) and
both logits dtypes (fp32, bf16), logits are a ``[rows, L]`` view of a 256-aligned buffer
with junk (NaN, inf, huge values) past each row's length, as DeepGEMM leaves them. Timed,
each from a CUDA graph (how the decode step runs them):

- ``topk``: ``dsa::topk_indices``; ``topk+slots``: it, then ``dsa::indices_to_slots``
  (two launches, the path before the fused op); ``fused``: ``dsa::topk_indices_and_slots``
  (one launch); ``torch``: ``torch.topk`` on the logits with the columns past each length
  set to -inf (the mask it needs).
- warm: ``(T(11 calls) - T(1 call)) / 10`` for graphs of 11 and 1 calls: the logits stay
  in L2 across calls, and the graph's launch cancels out. flushed: a graph of one call
  after a 256 MB write (``triton.testing.do_bench`` clears L2 before every replay).

Every output is checked first (the top-k contract; the slots against ``indices_to_slots``
of the indices). Then the ``VARIANTS`` of :data:`dsa.ops.topk.indices.TUNING` (fused op,
fp32, all lengths) for tuning; the parameters in force are printed with the results.
With ``--seeds N`` each variant is timed on N random cases, mean / worst: a row whose
candidates overflow the select kernel's registers (a rare draw of the threshold's sample)
costs its case several times the usual time.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _report import (  # noqa: E402
    add_shapes_option,
    bench_parser,
    markdown_table,
    publish,
    report,
    shapes_flag,
)
from test_topk import check_topk  # noqa: E402

from dsa.ops.topk.indices import TUNING, SlotArgs, launch_topk  # noqa: E402

ops = torch.ops.dsa
TOPK = 2048
BLOCK_SIZE = 64
SHAPES = [(1, 4096), (64, 65536), (128, 32768)]
JUNK = (float("nan"), float("inf"), -float("inf"), 3.0e38, 1.0e30)

# name -> TUNING fields replaced (launch_topk keyword arguments)
VARIANTS: dict[str, dict] = {
    "default": {},
    "warps8": dict(num_warps=8),
    "programs512": dict(target_programs=512),
    "programs512+warps8": dict(target_programs=512, num_warps=8),
    "groups1024": dict(sample_groups=1024),
    # the sample's floor down to 64 groups: rows of 8K-16K columns sample only the ~128 keys
    # above the k-th they need (512-1024 keys instead of 2048); longer rows are unchanged
    "groups64": dict(sample_groups=64),
    "margin3": dict(margin=3.0),
    "block2048": dict(block=2048),
    "no-preload": dict(preload_rows=0),
    "finish1024": dict(finish_block=1024),
    "select-warps4": dict(select_warps=4),
    "select-warps16": dict(select_warps=16),
    "quintisect": dict(search="quintisect"),
    "radix": dict(search="radix"),
    "radix4": dict(search="radix4"),
    "late-load": dict(early_load=False),
    "radix+late-load": dict(search="radix", early_load=False),
    "sample-width4": dict(sample_width=4),
    # before 2026-12-03 (twenty-third): 512 groups of 4 keys, the first block loaded late
    "sample512x4+late-load": dict(sample_groups=512, sample_width=4, early_load=False),
    # more candidates than select_cap (about 3100 for k = 2048 at the long shapes, 4300-5200
    # with margin 12): the search streams them from the parts' regions; margin -100 (fewer
    # than k) streams the whole row, the fallback the others had before
    "overflow-cap2048": dict(select_cap=2048),
    "overflow-cap2048+radix": dict(select_cap=2048, streamed_search="radix"),
    "overflow-cap2048+quintisect": dict(select_cap=2048, streamed_search="quintisect"),
    "overflow-margin12": dict(margin=12.0),
    "overflow-margin12+radix": dict(margin=12.0, streamed_search="radix"),
    "overflow-margin12+cap8192": dict(margin=12.0, select_cap=8192),
    "row-streamed": dict(margin=-100.0),
    "row-streamed+radix": dict(margin=-100.0, streamed_search="radix"),
    "row-streamed+quintisect": dict(margin=-100.0, streamed_search="quintisect"),
    "cap8192": dict(select_cap=8192),
    # the threshold's sample at 512 groups of 4 whatever the row's length (before 2026-12-03
    # with several candidates programs a row): about 32 keys above the k-th at 128K columns
    "sample512": dict(sample_groups=512, sample_width=4, sample_expect=0),
}
QUICK = ("default",)
OVERFLOW = ("default", *(name for name in VARIANTS
                         if name.startswith(("overflow", "row-streamed", "cap8192"))))


def make_case(rows: int, n: int, full: bool, dtype: torch.dtype, seed: int = 0):
    """(logits, lengths [rows, 1], block table [rows, W], row requests [rows], num_blocks)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    width = -(-n // 256) * 256
    buffer = torch.randn(rows, width, device="cuda", generator=gen)
    lengths = torch.full((rows,), n, device="cuda") if full else \
        torch.randint(n // 2, n + 1, (rows,), device="cuda", generator=gen)
    cols = torch.arange(width, device="cuda")
    junk = torch.tensor(JUNK, device="cuda")[cols % len(JUNK)]
    buffer = torch.where(cols < lengths[:, None], buffer, junk).to(dtype)
    blocks = -(-n // BLOCK_SIZE)
    num_blocks = rows * blocks
    table = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    requests = torch.arange(rows, device="cuda", dtype=torch.int32)
    return (buffer.narrow(1, 0, n), lengths.to(torch.int32).view(rows, 1),
            table.view(rows, blocks), requests, num_blocks)


def masked_torch_topk(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    cols = torch.arange(logits.shape[1], device=logits.device)
    masked = logits.masked_fill(cols >= lengths.view(-1, 1), -float("inf"))
    return masked.topk(min(k, logits.shape[1]), dim=1).indices


def _graph(fn: Callable[[], object], calls: int) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles, allocates
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def _replay_us(graph: torch.cuda.CUDAGraph) -> float:
    return 1e3 * triton.testing.do_bench(graph.replay, warmup=10, rep=100,
                                         return_mode="median")


def warm_and_flushed_us(fn: Callable[[], object]) -> tuple[float, float]:
    """(warm µs, flushed µs) of one call of ``fn`` (see the module doc)."""
    one = _replay_us(_graph(fn, 1))
    eleven = _replay_us(_graph(fn, 11))
    return (eleven - one) / 10, one


def check_case(logits, lengths, table, requests, num_blocks) -> None:
    out = ops.topk_indices(logits, lengths, TOPK)
    check_topk(logits.float(), lengths, TOPK, None, out)
    fused, slots = ops.topk_indices_and_slots(logits, lengths, TOPK, table, requests,
                                              BLOCK_SIZE, num_blocks)
    check_topk(logits.float(), lengths, TOPK, None, fused)
    want = ops.indices_to_slots(fused, table, requests, BLOCK_SIZE, num_blocks)
    assert torch.equal(slots, want), "fused slots differ from indices_to_slots"


def bench_case(rows: int, n: int, full: bool, dtype: torch.dtype) -> list[str]:
    logits, lengths, table, requests, num_blocks = make_case(rows, n, full, dtype)
    check_case(logits, lengths, table, requests, num_blocks)
    fns = {
        "topk": lambda: ops.topk_indices(logits, lengths, TOPK),
        "topk+slots": lambda: ops.indices_to_slots(ops.topk_indices(logits, lengths, TOPK),
                                                   table, requests, BLOCK_SIZE, num_blocks),
        "fused": lambda: ops.topk_indices_and_slots(logits, lengths, TOPK, table, requests,
                                                    BLOCK_SIZE, num_blocks),
        "torch": lambda: masked_torch_topk(logits, lengths, TOPK),
    }
    times = {name: warm_and_flushed_us(fn) for name, fn in fns.items()}
    cells = []
    for mode in (0, 1):
        cells += [f"{times[name][mode]:.1f}" for name in fns]
        cells.append(f"{times['torch'][mode] / times['fused'][mode]:.1f}x")
    return [f"{rows}x{n}", "full" if full else "U[L/2,L]", str(dtype).removeprefix("torch."),
            *cells]


def time_variant(rows: int, n: int, tuning: dict, seed: int = 0) -> tuple[float, float]:
    """(warm, flushed) µs of the fused launch with ``tuning`` on the case of ``seed``."""
    logits, lengths, table, requests, num_blocks = make_case(rows, n, True, torch.float32, seed)
    out = torch.empty(rows, TOPK, dtype=torch.int32, device="cuda")
    slots = SlotArgs(torch.empty_like(out), table, requests, BLOCK_SIZE, num_blocks)

    def run():
        return launch_topk(logits, lengths, TOPK, out=out, slots=slots, **tuning)

    check_topk(logits, lengths, TOPK, None, run())
    want = ops.indices_to_slots(out, table, requests, BLOCK_SIZE, num_blocks)
    assert torch.equal(slots.out, want), "slots differ from indices_to_slots"
    return warm_and_flushed_us(run)


def bench_variant(rows: int, n: int, tuning: dict, seeds: int = 1) -> list[str]:
    """Warm and flushed µs of :func:`time_variant`; over ``seeds`` random cases (> 1), each
    as "mean / worst": the rare rows whose candidates overflow show there."""
    times = [time_variant(rows, n, tuning, seed) for seed in range(seeds)]
    if seeds == 1:
        return [f"{t:.1f}" for t in times[0]]
    return [f"{sum(col) / seeds:.1f} / {max(col):.1f}" for col in zip(*times)]


def parse_value(text: str) -> int | float | str:
    """A ``--variant`` value: an int, a float (with a dot) or a string (``search=radix``)."""
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        return text


def main() -> None:
    parser = bench_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only variants {QUICK}")
    parser.add_argument("--overflow", action="store_true",
                        help="only the variants timing the overflow paths: "
                        + ", ".join(OVERFLOW))
    parser.add_argument("--seeds", type=int, default=1, metavar="N",
                        help="time each variant on N random cases: mean / worst")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:K=V,...",
                        help="an extra variant, e.g. 'w4:num_warps=4,block=2048' or "
                        "'r:search=radix'")
    add_shapes_option(parser, SHAPES)
    args = parser.parse_args()
    if args.shapes:
        SHAPES[:] = args.shapes
    names = list(QUICK if args.quick else OVERFLOW if args.overflow else VARIANTS)
    for spec in args.variant:
        name, _, pairs = spec.partition(":")
        VARIANTS[name] = {key: parse_value(value) for key, value in
                          (pair.split("=") for pair in pairs.split(",") if pair)}
        names.append(name)
    started = time.time()
    table = []
    for rows, n in SHAPES:
        for full in (True, False):
            for dtype in (torch.float32, torch.bfloat16):
                table.append(bench_case(rows, n, full, dtype))
                print(f"done {rows}x{n} full={full} {dtype} ({time.time() - started:.0f}s)",
                      file=sys.stderr)
    ops_names = ("topk", "topk+slots", "fused", "torch")
    header = ["rows x L", "lengths", "logits",
              *(f"warm {name} µs" for name in ops_names), "warm torch/fused",
              *(f"flushed {name} µs" for name in ops_names), "flushed torch/fused"]
    variants = []
    for name in names:
        cells = []
        for rows, n in SHAPES:
            cells += bench_variant(rows, n, VARIANTS[name], args.seeds)
        variants.append([name, ", ".join(f"{k}={v}" for k, v in VARIANTS[name].items()) or "-",
                         *cells])
    notes = (f"k={TOPK}, block_size={BLOCK_SIZE}; µs per call from CUDA-graph replays "
             "(warm: logits in L2, (T(11 calls) - T(1)) / 10; flushed: one call after L2 is "
             f"cleared); TUNING: {dataclasses.asdict(TUNING)}; candidates programs per row: "
             + ", ".join(f"{rows}x{n}: {TUNING.parts(rows, n)}" for rows, n in SHAPES))
    seeds_note = (f"; each the mean / worst of {args.seeds} random cases" if args.seeds > 1
                  else "")
    variant_table = markdown_table(
        ["variant", "TUNING changes",
         *(f"{rows}x{n} {mode}" for rows, n in SHAPES for mode in ("warm", "flushed"))],
        variants)
    command = "python benchmarks/bench_topk_sweep.py" + (" --quick" if args.quick else "") \
        + (" --overflow" if args.overflow else "") \
        + (f" --seeds {args.seeds}" if args.seeds > 1 else "") \
        + shapes_flag(args.shapes) \
        + "".join(f" --variant {spec}" for spec in args.variant)
    publish(report("Top-k: topk_indices, topk_indices_and_slots, masked torch.topk",
                   markdown_table(header, table) + "\n\nVariants (fused op, fp32, all "
                   f"lengths; warm / flushed µs{seeds_note}):\n\n" + variant_table, notes,
                   command=command),
            args.out)


if __name__ == "__main__":
    main()
