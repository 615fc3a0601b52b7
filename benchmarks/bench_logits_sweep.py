"""Paged MQA logits on a CUDA GPU (H = 64, D = 128, block 64): next_n 1-4 against the floors,
or a sweep of the Triton kernel's launch parameters.

    python benchmarks/bench_logits_sweep.py [--l2 read] [--shapes BxL,...] [--out F]  # table
    python benchmarks/bench_logits_sweep.py --sweep [--top 5]       # launch-parameter sweep

Table: for every (B, L) and next_n 1-4, each request at the full context (row j of a request
sees L - next_n + 1 + j keys), dsa's Triton kernel at its default launch and DeepGEMM where
it runs (next_n <= 2 on SM90, schedule precomputed): µs, achieved GB/s (K-cache bytes / time)
and % of the HBM floor (K-cache bytes / the copy bandwidth measured in the same run). The
fp8 compute floor (2·B·L·next_n·H·D flops at the fp8 GEMM rate measured in the run) bounds
next_n 3-4 too; "of floor" is against the larger of the two. Each time is the median of a
one-call CUDA graph replayed by ``triton.testing.do_bench``, which writes 256 MB before
every replay: L2 (50 MB) is cold where the working set fits in it and makes no difference
above, but its dirty lines are written back during the call. With ``--l2 read`` each time is
the median span of a one-call graph's kernels (torch.profiler) after 256 MB read over: L2
cold with clean lines, as a model's other layers leave it; the graph's launch not counted (as
``bench_step.py``'s "read over" column). Every launch is first checked against dsa's CPU
face (plain torch). "pure read" (at B·L >= 1M) is a kernel that only reads the call's
K-cache blocks (values and scales, through the block table) under the same timer: the share
of the HBM floor any kernel can show there (by default the replay's launch and the
write-back of the 256 MB's dirty lines count against every kernel).

Sweep: each launch captured ten times in one CUDA graph, the replay timed (median); per
shape the fastest configs, the default (``paged_logits_config``) and DeepGEMM.
"""

from __future__ import annotations

import functools
import itertools
import sys
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl

import dsa
from dsa.ops.logits import deepgemm, paged_backend
from dsa.ops.logits.paged import (
    SPLIT_ROWS_MAX_NEXT_N,
    PagedLogitsConfig,
    paged_logits_config,
    paged_logits_triton,
)

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _report import (
    add_row,
    add_shapes_option,
    bench_parser,
    captured,
    copy_bandwidth,
    graph_us,
    kernel_span_us,
    markdown_table,
    publish,
    report,
    shapes_flag,
)

HEADS, HEAD_DIM, BLOCK_SIZE = 64, 128, 64
L2_BYTES = 50 * 2**20
# (B, L): B·L >= 1M (the goals), then small shapes where L2 is cold.
TABLE_SHAPES = [(64, 16384), (64, 65536), (128, 32768), (8, 131072), (1, 1048576),
                (1, 4096), (1, 65536), (8, 32768)]
GOAL_KEYS = 1 << 20
NEXT_N = (1, 2, 3, 4)
SWEEP_SHAPES = [(1, 1, 4096), (1, 1, 65536), (8, 1, 32768), (64, 1, 65536), (128, 1, 32768),
                (64, 2, 32768), (64, 3, 32768), (64, 4, 16384), (8, 4, 131072),
                (1, 4, 1048576), (256, 1, 8192)]
CHECK_SHAPES = [(8, 2, 8229), (3, 4, 3001)]  # ragged tails
# (tile, num_warps) x num_stages x tiles_per_program (x split rows x key scales ahead x
# K by TMA, with or without direct stores)
TILE_WARPS = [(64, 4), (64, 8), (128, 8)]
STAGES = [2, 3, 4]
TILES_PER_PROGRAM = [1, 2, 4, 8, 16, 32, 64]
REPLAYS = 10


def make_inputs(batch: int, next_n: int, context: int, seed: int = 0):
    """Random fp8 cache (finite values, positive scales), distinct blocks per request."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    width = -(-context // BLOCK_SIZE)
    num_blocks = batch * width
    cache = torch.randint(0, 0x7F, (num_blocks, BLOCK_SIZE, 1, HEAD_DIM + 4), device="cuda",
                          dtype=torch.uint8, generator=gen)
    cache |= torch.randint(0, 2, cache.shape, device="cuda", dtype=torch.uint8,
                           generator=gen) << 7
    scales = cache.view(num_blocks, -1)[:, BLOCK_SIZE * HEAD_DIM:].view(torch.float32)
    scales.copy_(torch.rand(scales.shape, device="cuda", generator=gen) * 0.01 + 1e-3)
    table = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    table = table.view(batch, width)
    lens = torch.arange(next_n, device="cuda", dtype=torch.int32) + (context - next_n + 1)
    lens = lens.expand(batch, next_n).contiguous()
    q = torch.randn(batch, next_n, HEADS, HEAD_DIM, device="cuda", generator=gen)
    weights = torch.randn(batch * next_n, HEADS, device="cuda", generator=gen)
    return (q.to(torch.float8_e4m3fn), cache, weights, lens, table), context


def kcache_bytes(batch: int, context: int) -> int:
    """Bytes of the K-cache blocks a call reads (values and scales)."""
    return batch * -(-context // BLOCK_SIZE) * BLOCK_SIZE * (HEAD_DIM + 4)


@triton.jit
def _paged_read_kernel(cache_ptr, table_ptr, out_ptr, width, table_stride, parts,
                       BLOCK_WORDS: tl.constexpr, VALUE_WORDS: tl.constexpr,
                       SCALE_WORDS: tl.constexpr, BLOCKS: tl.constexpr):
    """Program (part, request): the int32 (wrapping) sum of the words of ``BLOCKS`` of the
    request's K-cache blocks, values and scales, read through its block-table row."""
    part = tl.program_id(0)
    row = tl.program_id(1)
    v = tl.arange(0, VALUE_WORDS)
    w = tl.arange(0, SCALE_WORDS)
    values = tl.zeros([VALUE_WORDS], tl.int32)
    scales = tl.zeros([SCALE_WORDS], tl.int32)
    for j in range(BLOCKS):
        i = part * BLOCKS + j
        block = tl.load(table_ptr + row * table_stride + i, mask=i < width, other=0)
        base = cache_ptr + block.to(tl.int64) * BLOCK_WORDS
        # masks as wide as the loads (the interpreter takes no scalar mask on a tensor load)
        values += tl.load(base + v, mask=i + v * 0 < width, other=0)
        scales += tl.load(base + VALUE_WORDS + w, mask=i + w * 0 < width, other=0)
    tl.store(out_ptr + row * parts + part, tl.sum(values, 0) + tl.sum(scales, 0))


READ_BLOCKS = 16  # blocks a program of the pure read (8 warps; H200: 4.41 TB/s at 4M keys)


def paged_read(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Checksums ``[B, parts]`` of every K-cache block ``table`` names: a kernel that reads
    the bytes a paged-logits call must read and does nothing else."""
    words = cache.view(cache.shape[0], -1).view(torch.int32)
    batch, width = table.shape
    parts = triton.cdiv(width, READ_BLOCKS)
    out = torch.empty(batch, parts, dtype=torch.int32, device=cache.device)
    _paged_read_kernel[(parts, batch)](words, table, out, width, table.stride(0), parts,
                                       BLOCK_WORDS=words.shape[1],
                                       VALUE_WORDS=BLOCK_SIZE * HEAD_DIM // 4,
                                       SCALE_WORDS=BLOCK_SIZE, BLOCKS=READ_BLOCKS, num_warps=8)
    return out


def check_paged_read() -> None:
    """The pure read's checksums against torch's on a small cache: it reads every byte."""
    inputs, _ = make_inputs(3, 1, 40 * BLOCK_SIZE + 5, seed=2)
    cache, table = inputs[1], inputs[4]
    words = cache.view(cache.shape[0], -1).view(torch.int32).long()
    per_block = words[table].sum(dim=-1)  # [B, width]
    pad = -table.shape[1] % READ_BLOCKS
    want = torch.nn.functional.pad(per_block, (0, pad)).view(table.shape[0], -1, READ_BLOCKS)
    want = want.sum(dim=-1) & 0xFFFFFFFF
    got = paged_read(cache, table).long() & 0xFFFFFFFF
    if not torch.equal(got, want):
        raise AssertionError("the pure read's checksums differ from torch's")


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def check_configs(configs: list[PagedLogitsConfig | None]) -> list[PagedLogitsConfig | None]:
    """Configs (None: the default) that run and match the CPU face (plain torch, on CPU
    copies) on every CHECK_SHAPES; a mismatch raises, a config the GPU cannot launch (e.g.
    out of shared memory) is dropped with a note."""
    runnable = list(configs)
    for shape in CHECK_SHAPES:
        inputs, context = make_inputs(*shape, seed=1)
        want = torch.ops.dsa.paged_mqa_logits(*(t.cpu() for t in inputs), context).cuda()
        valid = torch.isfinite(want)
        for config in list(runnable):
            try:
                got = paged_logits_triton(*inputs, context, config=config)
            except triton.runtime.errors.OutOfResources as error:
                print(f"skipping {config}: {error}")
                runnable.remove(config)
                continue
            if not torch.equal(torch.isneginf(got), ~valid):
                raise AssertionError(f"{config} on {shape}: -inf mask differs from the CPU face")
            error = relative_error(got[valid], want[valid])
            if not error < 1e-5:
                raise AssertionError(f"{config} on {shape}: relative error {error:.2e} against "
                                     "the CPU face")
    print(f"checked {len(runnable)} configs against the CPU face on {CHECK_SHAPES}")
    return runnable


# --- the next_n 1-4 table --------------------------------------------------------------------


def written_over_us(fn: Callable[[], object]) -> float:
    """Median device time of one ``fn`` in µs with L2 written over before it: a one-call CUDA
    graph (no launch overhead), timed by do_bench, which clears its cache before each replay."""
    return graph_us(fn, replays=1)


def read_over_us(fn: Callable[[], object]) -> float:
    """Median µs from the first kernel's start to the last one's end of one ``fn`` captured in
    a CUDA graph (no host gaps between its kernels), with 256 MB read over before each replay
    (clean L2 lines, as a model's other layers leave it)."""
    return kernel_span_us(captured(fn).replay, flush="read")


# --l2: how the table times a call, and the report's words for it.
Timer = Callable[[Callable[[], object]], float]
TIMERS: dict[str, tuple[Timer, str]] = {
    "written": (written_over_us, "medians of a one-call CUDA graph replayed by do_bench with "
                "256 MB written before each replay (L2 cold, its dirty lines written back "
                "during the call)"),
    "read": (read_over_us, "medians of the span of a one-call CUDA graph's kernels "
             "(torch.profiler, the graph's launch not in it) with 256 MB read before each "
             "replay (L2 cold, its lines clean)"),
}


def fp8_flops_per_s(n: int = 8192) -> float:
    """Measured dense fp8 GEMM rate (``torch._scaled_mm``, n x n x n); nan where it fails."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major
    one = torch.ones((), device="cuda")
    try:
        us = graph_us(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                               out_dtype=torch.bfloat16))
    except (RuntimeError, TypeError, NotImplementedError) as error:
        print(f"no fp8 GEMM rate: {error}")
        return float("nan")
    return 2 * n**3 / (us * 1e-6)


def pure_read_us(batch: int, context: int, timer: Timer) -> float:
    """:func:`paged_read` of a (B, L) call's cache, timed as the table's kernels are; nan
    below B·L = GOAL_KEYS, where its programs of READ_BLOCKS blocks leave SMs idle (H200:
    13.7 µs at 1×4K against the logits' 6.6) and it bounds nothing."""
    if batch * context < GOAL_KEYS:
        return float("nan")
    inputs, _ = make_inputs(batch, 1, context)
    us = timer(functools.partial(paged_read, inputs[1], inputs[4]))
    del inputs
    torch.cuda.empty_cache()
    return us


def table_row(batch: int, context: int, next_n: int, bandwidth: float, flops: float,
              read_us: float, device: torch.device, timer: Timer) -> tuple[list, dict]:
    inputs, _ = make_inputs(batch, next_n, context)
    k_bytes = kcache_bytes(batch, context)
    working_set = k_bytes + batch * next_n * context * 4
    floor_us = k_bytes / bandwidth * 1e6
    compute_us = 2 * batch * context * next_n * HEADS * HEAD_DIM / flops * 1e6
    bound_us = max(floor_us, compute_us)
    triton_us = timer(functools.partial(paged_logits_triton, *inputs, context))
    dg_us = float("nan")
    if deepgemm.deepgemm_paged_supported(device, HEADS, HEAD_DIM, BLOCK_SIZE, next_n):
        schedule = torch.ops.dsa.paged_mqa_schedule(inputs[3], BLOCK_SIZE)
        dg_us = timer(functools.partial(torch.ops.dsa.paged_mqa_logits_deepgemm, *inputs,
                                        context, schedule))
    auto = paged_backend("auto", device, HEADS, HEAD_DIM, BLOCK_SIZE, next_n, batch, context)
    config = paged_logits_config(batch, next_n, context)
    row = [batch, context, next_n, f"{working_set / 2**20:.0f}",
           "cold" if working_set <= L2_BYTES else "over L2", f"{floor_us:.1f}",
           f"{compute_us:.1f}", f"{triton_us:.1f}", f"{k_bytes / triton_us / 1e3:.0f}",
           f"{floor_us / triton_us:.0%}", f"{bound_us / triton_us:.0%}", f"{read_us:.1f}",
           f"{floor_us / read_us:.0%}", f"{dg_us:.1f}",
           f"{k_bytes / dg_us / 1e3:.0f}", f"{floor_us / dg_us:.0%}",
           f"{dg_us / triton_us:.2f}", auto,
           f"{'split' if config.split_rows else 'fused'}/{config.tiles_per_program}/"
           f"{config.num_warps}/{config.num_stages}{'/TMA' if config.tma else ''}"]
    stats = {"next_n": next_n, "goal": batch * context >= GOAL_KEYS,
             "of_floor": bound_us / triton_us, "vs_deepgemm": dg_us / triton_us,
             "read_of_floor": floor_us / read_us}
    del inputs
    torch.cuda.empty_cache()
    return row, stats


def goal_lines(stats: list[dict]) -> list[str]:
    """The issue's goals at B·L >= 1M: Triton's worst % of the floor per next_n, and its
    worst throughput against DeepGEMM's at next_n 1."""
    lines = []
    for next_n in NEXT_N:
        rows = [s for s in stats if s["goal"] and s["next_n"] == next_n]
        if rows:
            worst = min(s["of_floor"] for s in rows)
            lines.append(f"next_n {next_n}: Triton at least {worst:.0%} of the floor, the "
                         "larger of HBM and fp8 compute (goal >= 75% for next_n 2-4)")
    reads = [s["read_of_floor"] for s in stats if s["goal"] and s["next_n"] == 1]
    if reads:
        lines.append(f"a pure read of the K cache: {min(reads):.0%}-{max(reads):.0%} of the HBM "
                     "floor under this timer")
    ratios = [s["vs_deepgemm"] for s in stats
              if s["goal"] and s["next_n"] == 1 and s["vs_deepgemm"] == s["vs_deepgemm"]]
    if ratios:
        lines.append(f"next_n 1: Triton at least {min(ratios):.2f}x DeepGEMM's throughput "
                     "(goal >= 0.9x)")
    return lines


def run_table(out: str | None, l2: str, shapes: list[tuple[int, int]] | None) -> None:
    device = torch.device("cuda")
    timer, timing = TIMERS[l2]
    check_configs([None])
    check_paged_read()
    bandwidth = copy_bandwidth()
    flops = fp8_flops_per_s()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, fp8 GEMM {flops / 1e12:.0f} TFLOP/s")
    header = ["B", "L", "next_n", "working set MB", "L2", "HBM floor µs", "fp8 compute floor µs",
              "Triton µs", "Triton GB/s", "of HBM floor", "of floor", "pure read µs",
              "pure read of HBM floor", "DeepGEMM µs",
              "DeepGEMM GB/s", "of HBM floor", "Triton / DeepGEMM throughput", "auto picks",
              "Triton MMA/tiles/warps/stages(/TMA)"]
    rows, stats = [], []
    for batch, context in shapes or TABLE_SHAPES:
        read_us = pure_read_us(batch, context, timer)
        for next_n in NEXT_N:
            row, stat = table_row(batch, context, next_n, bandwidth, flops, read_us, device,
                                  timer)
            add_row(rows, row)
            stats.append(stat)
    goals = goal_lines(stats)
    text = report(
        "Paged logits for next_n 1-4 (MTP): Triton vs DeepGEMM against the floors",
        markdown_table(header, rows) + "\n\n" + "\n".join(f"- {g}" for g in goals),
        notes=(f"H={HEADS}, D={HEAD_DIM}, block {BLOCK_SIZE}, full contexts (row j sees "
               f"L - next_n + 1 + j keys); copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + "
               f"write), fp8 GEMM {flops / 1e12:.0f} TFLOP/s, both measured in this run; "
               f"{timing}; dsa v{dsa.__version__}"),
        command=("python benchmarks/bench_logits_sweep.py"
                 + (f" --l2 {l2}" if l2 != "written" else "") + shapes_flag(shapes)),
    )
    publish(text, out)


# --- the launch-parameter sweep ----------------------------------------------------------------


def candidates(next_n: int, context: int) -> list[PagedLogitsConfig]:
    configs = []
    split_options = (False, True) if 1 < next_n <= SPLIT_ROWS_MAX_NEXT_N else (False,)
    for (tile, warps), stages, split_rows, scales_ahead, (tma, direct) in itertools.product(
            TILE_WARPS, STAGES, split_options, (False, True),
            ((False, False), (True, False), (True, True))):
        tiles = -(-context // tile)
        seen = set()
        for per_program in TILES_PER_PROGRAM:
            splits = -(-tiles // per_program)
            if per_program > tiles or splits in seen:
                continue
            seen.add(splits)
            configs.append(PagedLogitsConfig(tile, per_program, warps, stages, split_rows,
                                             scales_ahead, tma, direct))
    return configs


def bench_shape(shape, configs, device, top, bandwidth):
    batch, next_n, context = shape
    inputs, _ = make_inputs(*shape)
    floor_us = kcache_bytes(batch, context) / bandwidth * 1e6
    run = functools.partial(paged_logits_triton, *inputs, context)
    times = sorted(((graph_us(functools.partial(run, config=c), replays=REPLAYS), c)
                    for c in configs), key=lambda tc: tc[0])
    default = paged_logits_config(batch, next_n, context)
    default_us = graph_us(functools.partial(run, config=default), replays=REPLAYS)
    dg_us = float("nan")
    if deepgemm.deepgemm_paged_supported(device, HEADS, HEAD_DIM, BLOCK_SIZE, next_n):
        schedule = torch.ops.dsa.paged_mqa_schedule(inputs[3], BLOCK_SIZE)
        dg_us = graph_us(functools.partial(torch.ops.dsa.paged_mqa_logits_deepgemm, *inputs,
                                           context, schedule), replays=REPLAYS)
    print(f"\nB={batch} N={next_n} L={context}: floor {floor_us:.1f} us, "
          f"DeepGEMM {dg_us:.1f} us, default {default_us:.1f} us {default}")
    for us, config in times[:top]:
        print(f"  {us:9.1f} us  {floor_us / us:5.0%} of floor  {config}")
    del inputs
    torch.cuda.empty_cache()
    return shape, times[0], default_us, dg_us, floor_us


def run_sweep(top: int) -> None:
    device = torch.device("cuda")
    start = time.time()
    bandwidth = copy_bandwidth()
    per_shape = {shape: candidates(shape[1], shape[2]) for shape in SWEEP_SHAPES}
    runnable = set(check_configs(sorted(
        {c for cs in per_shape.values() for c in cs},
        key=lambda c: (c.tile, c.num_warps, c.num_stages, c.tiles_per_program,
                       c.split_rows, c.scales_ahead, c.tma, c.direct_store))))
    per_shape = {shape: [c for c in cs if c in runnable] for shape, cs in per_shape.items()}
    dg = deepgemm.deepgemm_paged_supported(device, HEADS, HEAD_DIM, BLOCK_SIZE, 1)
    print(f"device {torch.cuda.get_device_name()}, DeepGEMM {'yes' if dg else 'no'}, "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    summary = [bench_shape(shape, configs, device, top, bandwidth)
               for shape, configs in per_shape.items()]
    print("\nshape                best us  default us  DeepGEMM us  floor us  best config")
    for (batch, next_n, context), (best_us, best), default_us, dg_us, floor_us in summary:
        print(f"({batch:3d},{next_n},{context:7d})  {best_us:8.1f}  {default_us:10.1f}  "
              f"{dg_us:11.1f}  {floor_us:8.1f}  {best}")
    print(f"\nsweep took {time.time() - start:.0f} s")


def main() -> None:
    parser = bench_parser()
    parser.add_argument("--sweep", action="store_true", help="sweep the launch parameters")
    parser.add_argument("--top", type=int, default=5, help="fastest configs shown per shape")
    parser.add_argument("--l2", choices=sorted(TIMERS), default="written",
                        help="the table's L2 before each call: 256 MB written over (do_bench's "
                        "flush) or read over (clean lines, as a model's other layers leave it)")
    add_shapes_option(parser, TABLE_SHAPES, "BxL")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_logits_sweep needs a CUDA GPU")
    if args.sweep:
        run_sweep(args.top)
    else:
        run_table(args.out, args.l2, args.shapes)


if __name__ == "__main__":
    main()
