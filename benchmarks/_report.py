"""Shared benchmark helpers: timing on the GPU, the copy-bandwidth ceiling, markdown reports."""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import torch
import triton


def device_us(fn: Callable[[], object], *, warmup: int = 25, rep: int = 100) -> float:
    """Median device time of ``fn`` in µs (CUDA events, via triton.testing.do_bench)."""
    return 1e3 * triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def captured(fn: Callable[[], object], *, calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` calls of ``fn`` (after one warm-up call, which compiles and
    allocates)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def graph_us(fn: Callable[[], object], *, replays: int = 10) -> float:
    """Median device time of one ``fn`` in µs, from a CUDA graph of ``replays`` calls: how a
    captured decode step runs it, with no launch overhead."""
    return device_us(captured(fn, calls=replays).replay) / replays


def profiled_calls(fn: Callable[[], object], *, reps: int = 20, flush: str | None = "write"
                   ) -> list[list[torch.autograd.profiler_util.FunctionEvent]]:
    """The device events (kernels, copies) of ``reps`` calls of ``fn`` in start order, one
    list a call (torch.profiler), after one unprofiled call. Before each call 256 MB are
    written over (``flush="write"``: the L2 then holds dirty lines, which the call's reads
    evict by writing them back, as ``triton.testing.do_bench`` leaves it) or read over
    (``"read"``: clean lines, as a model's other layers leave it, streaming their weights),
    or nothing (None: L2 warm)."""
    if flush not in ("write", "read", None):
        raise ValueError(f"profiled_calls: `flush` must be 'write', 'read' or None, got {flush!r}")
    scratch = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if flush else None
    fn()
    calls = []
    for _ in range(reps):
        if flush == "write":
            scratch.zero_()
        elif flush == "read":
            scratch.sum()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                        key=lambda e: e.time_range.start)
        if not events:
            raise RuntimeError("profiled_calls: no device events in a call")
        calls.append(events)
    return calls


def kernel_span_us(fn: Callable[[], object], *, reps: int = 20, flush: str | None = "write"
                   ) -> float:
    """Median device time in µs from the start of ``fn``'s first kernel to the end of its
    last: what its kernels cost inside a longer graph (a model's step), without the launch
    latency of a graph of their own (``flush``: see :func:`profiled_calls`)."""
    return statistics.median(_span(events)
                             for events in profiled_calls(fn, reps=reps, flush=flush))


def _span(events: list[torch.autograd.profiler_util.FunctionEvent]) -> float:
    """µs from the first event's start (events in start order) to the last end."""
    return max(e.time_range.end for e in events) - events[0].time_range.start


def kernel_timeline(fn: Callable[[], object], *, reps: int = 15, flush: str | None = "read"
                    ) -> list[tuple[str, float, float]]:
    """Each kernel of ``fn`` in launch order: (name, median start µs from the first kernel's
    start, median duration µs) over ``reps`` calls (``flush``: see :func:`profiled_calls`),
    then ("span", 0, median first start to last end)."""
    calls = profiled_calls(fn, reps=reps, flush=flush)
    if len({len(events) for events in calls}) != 1:
        raise RuntimeError("kernel_timeline: the calls ran different numbers of kernels")
    rows = []
    for i, event in enumerate(calls[0]):
        starts = [events[i].time_range.start - events[0].time_range.start for events in calls]
        durations = [events[i].time_range.elapsed_us() for events in calls]
        rows.append((event.name, statistics.median(starts), statistics.median(durations)))
    return [*rows, ("span", 0.0, statistics.median(_span(events) for events in calls))]


def host_us(fn: Callable[[], object], *, iters: int = 50) -> float:
    """Median host time of one call of ``fn`` in µs: launch work only, the GPU drained first."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def host_us_per_call(fn: Callable[[], object], *, calls: int = 20, reps: int = 25) -> float:
    """Host time of one call of ``fn`` in µs when ``calls`` run back to back without a sync
    (the GPU drained before each batch of calls; median over ``reps`` batches): what the host
    spends per call while the GPU works through the queue."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def copy_bandwidth(num_bytes: int = 4 << 30) -> float:
    """Measured device-to-device copy bandwidth, counting bytes read plus bytes written."""
    buffers = torch.empty(2, num_bytes, dtype=torch.uint8, device="cuda")
    us = device_us(lambda: buffers[1].copy_(buffers[0]), warmup=5, rep=50)
    return 2 * num_bytes / (us * 1e-6)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def add_row(rows: list[Sequence[object]], row: Sequence[object]) -> None:
    """Appends ``row`` to a report's ``rows`` and prints it at once (long runs show progress)."""
    rows.append(row)
    print(" | ".join(str(c) for c in row), flush=True)


def report(title: str, table: str, notes: str = "", *, command: str | None = None) -> str:
    """A BENCHMARKS.md section: date, GPU, software, commit, command, table. ``command``:
    how the benchmark ran (default: ``python benchmarks/<this script>``)."""
    command = command or f"python benchmarks/{os.path.basename(sys.argv[0])}"
    commit = os.environ.get("DSA_COMMIT") or _git_commit()
    gpu = torch.cuda.get_device_name()
    header = (
        f"## {title}\n\n"
        f"- date: {datetime.date.today().isoformat()}\n"
        f"- GPU: {gpu}; torch {torch.__version__}, triton {triton.__version__}\n"
        f"- commit: {commit}\n"
        f"- command: `{command}`\n"
    )
    return header + (f"- {notes}\n" if notes else "") + "\n" + table + "\n"


def bench_parser(description: str | None = None) -> argparse.ArgumentParser:
    """A benchmark script's arguments: ``--out``, a markdown file to append its report to."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", help="append the report to this markdown file")
    return parser


def add_shapes_option(parser: argparse.ArgumentParser, shapes: list[tuple[int, int]],
                      what: str = "ROWSxL") -> None:
    """``--shapes A1xB1,A2xB2``: the (int, int) pairs a benchmark runs instead of ``shapes``."""
    parser.add_argument("--shapes", type=parse_shapes, default=None,
                        help=f"{what},... instead of " + ",".join(f"{a}x{b}" for a, b in shapes))


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"1x4096,64x65536"`` -> ``[(1, 4096), (64, 65536)]``."""
    return [(int(a), int(b)) for a, b in (item.split("x") for item in text.split(","))]


def shapes_flag(shapes: list[tuple[int, int]] | None) -> str:
    """The ``--shapes`` flag as given (for a report's command), or ""."""
    return " --shapes " + ",".join(f"{a}x{b}" for a, b in shapes) if shapes else ""


def publish(text: str, out: str | None) -> None:
    """Prints a report and, with ``out``, appends it as a section of that file."""
    print(text)
    if out:
        with open(out, "a") as f:
            f.write("\n" + text)


def _git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
