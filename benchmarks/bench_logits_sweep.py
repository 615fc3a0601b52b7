"""Sweep the Triton paged-logits launch parameters on a CUDA GPU (H = 64, D = 128, bs = 64).

For each decode shape (batch, next_n, context) every request is at the full context. Each
launch is captured ten times in one CUDA graph and the replay timed with
``triton.testing.do_bench`` (median), so Python launch overhead does not count. Printed per
shape: the fastest configs, the current default (``paged_logits_config``), DeepGEMM (kernel
only, schedule precomputed) when it imports, and the HBM floor (K-cache bytes / 4.3 TB/s).
Every config is first checked against dsa's CPU face (plain torch) on one shape.

    python benchmarks/bench_logits_sweep.py [--top 5]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import time

import torch
import triton
from triton.testing import do_bench

import dsa  # noqa: F401  (registers torch.ops.dsa)
from dsa.ops.logits import deepgemm
from dsa.ops.logits.paged import PagedLogitsConfig, paged_logits_config, paged_logits_triton

HEADS, HEAD_DIM, BLOCK_SIZE = 64, 128, 64
HBM_BYTES_PER_S = 4.3e12
SHAPES = [(1, 1, 4096), (1, 1, 65536), (8, 1, 32768), (32, 1, 32768), (64, 1, 65536),
          (128, 1, 32768), (64, 2, 32768), (256, 1, 8192)]
CHECK_SHAPE = (8, 2, 8229)  # a ragged tail and next_n = 2
# (tile, num_warps) x num_stages x tiles_per_program
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


def candidates(batch: int, context: int) -> list[PagedLogitsConfig]:
    configs = []
    for (tile, warps), stages in itertools.product(TILE_WARPS, STAGES):
        tiles = -(-context // tile)
        seen = set()
        for per_program in TILES_PER_PROGRAM:
            splits = -(-tiles // per_program)
            if per_program > tiles or splits in seen:
                continue
            seen.add(splits)
            configs.append(PagedLogitsConfig(tile, per_program, warps, stages))
    return configs


def time_us(fn) -> float:
    """Median GPU time of one call, from a CUDA graph of REPLAYS calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPLAYS):
            fn()
    ms = do_bench(graph.replay, warmup=5, rep=25, return_mode="median")
    return ms * 1000 / REPLAYS


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def check_configs(configs: list[PagedLogitsConfig]) -> list[PagedLogitsConfig]:
    """Configs that run and match the CPU face (plain torch, on CPU copies); a mismatch
    raises, a config the GPU cannot launch (e.g. out of shared memory) is dropped with a
    note."""
    inputs, context = make_inputs(*CHECK_SHAPE, seed=1)
    want = torch.ops.dsa.paged_mqa_logits(*(t.cpu() for t in inputs), context).cuda()
    valid = torch.isfinite(want)
    runnable = []
    for config in configs:
        try:
            got = paged_logits_triton(*inputs, context, config=config)
        except triton.runtime.errors.OutOfResources as error:
            print(f"skipping {config}: {error}")
            continue
        if not torch.equal(torch.isneginf(got), ~valid):
            raise AssertionError(f"{config}: -inf mask differs from the CPU face")
        error = relative_error(got[valid], want[valid])
        if not error < 1e-5:
            raise AssertionError(f"{config}: relative error {error:.2e} against the CPU face")
        runnable.append(config)
    print(f"checked {len(runnable)} configs against the CPU face on {CHECK_SHAPE}")
    return runnable


def bench_shape(shape, configs, device, top):
    batch, next_n, context = shape
    inputs, _ = make_inputs(*shape)
    floor_us = batch * -(-context // BLOCK_SIZE) * BLOCK_SIZE * (HEAD_DIM + 4) / HBM_BYTES_PER_S
    floor_us *= 1e6
    run = functools.partial(paged_logits_triton, *inputs, context)
    times = sorted(((time_us(functools.partial(run, config=c)), c) for c in configs),
                   key=lambda tc: tc[0])
    default = paged_logits_config(batch, next_n, HEADS, context)
    default_us = time_us(functools.partial(run, config=default))
    dg_us = float("nan")
    if deepgemm.deepgemm_paged_supported(device, HEADS, HEAD_DIM, BLOCK_SIZE, next_n):
        schedule = torch.ops.dsa.paged_mqa_schedule(inputs[3], BLOCK_SIZE)
        dg_us = time_us(functools.partial(torch.ops.dsa.paged_mqa_logits_deepgemm, *inputs,
                                          context, schedule))
    print(f"\nB={batch} N={next_n} L={context}: floor {floor_us:.1f} us, "
          f"DeepGEMM {dg_us:.1f} us, default {default_us:.1f} us {default}")
    for us, config in times[:top]:
        print(f"  {us:9.1f} us  {floor_us / us:5.0%} of floor  {config}")
    return shape, times[0], default_us, dg_us, floor_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--top", type=int, default=5, help="fastest configs shown per shape")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_logits_sweep needs a CUDA GPU")
    device = torch.device("cuda")
    start = time.time()
    per_shape = {shape: candidates(shape[0], shape[2]) for shape in SHAPES}
    runnable = set(check_configs(sorted(
        {c for cs in per_shape.values() for c in cs},
        key=lambda c: (c.tile, c.num_warps, c.num_stages, c.tiles_per_program))))
    per_shape = {shape: [c for c in cs if c in runnable] for shape, cs in per_shape.items()}
    dg = deepgemm.deepgemm_paged_supported(device, HEADS, HEAD_DIM, BLOCK_SIZE, 1)
    print(f"device {torch.cuda.get_device_name()}, DeepGEMM {'yes' if dg else 'no'}")
    summary = [bench_shape(shape, configs, device, args.top)
               for shape, configs in per_shape.items()]
    print("\nshape              best us  default us  DeepGEMM us  floor us  best config")
    for (batch, next_n, context), (best_us, best), default_us, dg_us, floor_us in summary:
        print(f"({batch:3d},{next_n},{context:6d})  {best_us:8.1f}  {default_us:10.1f}  "
              f"{dg_us:11.1f}  {floor_us:8.1f}  {best}")
    print(f"\nsweep took {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
