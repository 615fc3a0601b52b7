"""Top-k launch sweep on the GPU: dsa's Triton top-k variants against masked torch.topk.

    python benchmarks/bench_topk_sweep.py [--quick] [--data positive] [--variant NAME:K=V,...]

For each (B, next_n, L) (rows = B * next_n, k = 2048) and two length patterns (~U[L/2, L]
and all L), logits are a ``[rows, L]`` view of a 256-aligned buffer with junk (NaN, inf,
huge values) past each row's length, as DeepGEMM leaves them. Every variant of
:func:`dsa.ops.topk.indices.launch_topk` is checked with the test suite's top-k checker, then timed
with ``triton.testing.do_bench`` (median, µs, eager launches: includes host launch cost when
it exceeds the device time); the baseline is ``torch.topk`` on the logits with invalid
columns set to -inf. Then ``torch.ops.dsa.topk_indices`` itself (the default variant
behind the dispatcher), and the ``GRAPHED`` variants and the baseline replayed from a CUDA
graph (``do_bench_cudagraph``): the decode step runs that way, and those are the numbers
that decide the defaults.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _report import markdown_table  # noqa: E402
from test_topk import check_topk  # noqa: E402

from dsa.ops.topk.indices import choose_parts, launch_topk  # noqa: E402

TOPK = 2048
SHAPES = [(1, 1, 4096), (1, 1, 65536), (8, 1, 32768), (32, 1, 32768), (64, 1, 65536),
          (128, 1, 32768), (64, 2, 32768), (256, 1, 8192)]
JUNK = (float("nan"), float("inf"), -float("inf"), 3.0e38, 1.0e30)


def _parts_times(factor: float) -> Callable[[int, int], dict]:
    return lambda rows, n: dict(parts=max(1, int(choose_parts(rows, n) * factor)))


# name -> (rows, L) -> launch_topk keyword arguments
VARIANTS: dict[str, Callable[[int, int], dict]] = {
    "default": lambda rows, n: {},
    "parts/2": _parts_times(0.5),
    "parts*2": _parts_times(2),
    "groups512": lambda rows, n: dict(sample_groups=512),
    "margin3": lambda rows, n: dict(margin=3.0),
    "warps4": lambda rows, n: dict(num_warps=4, select_warps=4),
    "row4k": lambda rows, n: dict(row_cols=4096),
    "block8k": lambda rows, n: dict(block=8192),
}
QUICK = ("default",)
# variants also replayed from a CUDA graph (the decode step runs that way)
GRAPHED = ("default", "groups512")


def make_case(rows: int, next_n: int, n: int, full: bool, data: str = "normal", seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    width = -(-n // 256) * 256
    buffer = torch.randn(rows, width, device="cuda", generator=gen)
    if data == "positive":  # one sign, wide range: the histogram bins key bits, not values
        buffer = torch.exp(2 * buffer)
    lengths = torch.full((rows,), n, device="cuda") if full else \
        torch.randint(n // 2, n + 1, (rows,), device="cuda", generator=gen)
    cols = torch.arange(width, device="cuda")
    junk = torch.tensor(JUNK, device="cuda")[cols % len(JUNK)]
    buffer = torch.where(cols < lengths[:, None], buffer, junk)
    return buffer.narrow(1, 0, n), lengths.to(torch.int32).view(rows // next_n, next_n)


def masked_torch_topk(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    cols = torch.arange(logits.shape[1], device=logits.device)
    masked = logits.masked_fill(cols >= lengths.view(-1, 1), -float("inf"))
    return masked.topk(min(k, logits.shape[1]), dim=1).indices


def us(fn: Callable[[], object], graph: bool = False) -> float:
    if graph:
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def bench_case(batch: int, next_n: int, n: int, full: bool, names: list[str],
               data: str = "normal") -> list[str]:
    """One table row: checks every variant, then times it, the baseline and the graphs."""
    rows = batch * next_n
    logits, lengths = make_case(rows, next_n, n, full, data)
    baseline = lambda: masked_torch_topk(logits, lengths, TOPK)
    base = us(baseline)
    times = {}
    for name in names:
        kwargs = VARIANTS[name](rows, n)
        run = lambda kw=kwargs: launch_topk(logits, lengths, TOPK, **kw)
        check_topk(logits, lengths, TOPK, None, run())
        times[name] = us(run)
    best = min(times, key=times.get)
    op = us(lambda: torch.ops.dsa.topk_indices(logits, lengths, TOPK))
    graph_base = us(baseline, graph=True)
    graphed = []
    for name in GRAPHED:
        kwargs = VARIANTS[name](rows, n)
        graphed.append(us(lambda kw=kwargs: launch_topk(logits, lengths, TOPK, **kw),
                          graph=True))
    return [
        f"{rows}x{n} (B={batch}, next_n={next_n})", "full" if full else "U[L/2,L]",
        str(choose_parts(rows, n)), f"{base:.1f}", f"{best} {times[best]:.1f}",
        f"{base / times[best]:.1f}x", *(f"{times[m]:.1f}" for m in names), f"{op:.1f}",
        f"{graph_base:.1f}", *(f"{t:.1f}" for t in graphed),
        *(f"{graph_base / t:.1f}x" for t in graphed),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only variants {QUICK}")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:K=V,...",
                        help="an extra variant, e.g. 'w16:block=8192,num_warps=16'")
    parser.add_argument("--data", choices=["normal", "positive"], default="normal",
                        help="logits ~ N(0, 1), or exp(2 N(0, 1))")
    args = parser.parse_args()
    names = list(QUICK if args.quick else VARIANTS)
    for spec in args.variant:
        name, _, pairs = spec.partition(":")
        extra = {key: float(value) if "." in value else int(value) for key, value in
                 (pair.split("=") for pair in pairs.split(",") if pair)}
        VARIANTS[name] = lambda rows, n, kw=extra: dict(kw)
        names.append(name)
    started = time.time()
    table = []
    for batch, next_n, n in SHAPES:
        for full in (False, True):
            table.append(bench_case(batch, next_n, n, full, names, args.data))
            print(f"done B={batch} next_n={next_n} L={n} full={full} "
                  f"({time.time() - started:.0f}s)", file=sys.stderr)
    header = ["rows x L", "lengths", "auto parts", "torch.topk µs", "best variant µs",
              "speedup", *names, "op µs", "graph: torch µs",
              *(f"graph: {m} µs" for m in GRAPHED), *(f"graph speedup {m}" for m in GRAPHED)]
    print(f"\nk={TOPK}, {args.data} logits, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, "
          f"triton {triton.__version__}; eager do_bench medians in µs unless marked graph\n")
    print(markdown_table(header, table))


if __name__ == "__main__":
    main()
