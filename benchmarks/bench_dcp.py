"""Decode context parallelism on 2 GPUs: the exact cross-rank top-k (design §11).

    python benchmarks/bench_dcp.py [--out BENCHMARKS.md] [--shapes 1x131072,8x262144]

One process per GPU (NCCL, NVLink multicast off). Per (B, L): (a) one indexer layer's decode
step on each rank holding half of every request's K cache (metadata, K write, logits,
``topk_scored``, all-gather, ``dcp_merge_topk``, ownership, slots), (b) the same step on one
GPU holding the whole context (``topk_indices``), (c) the exchange and merge alone (the
all-gather of [B, 2k] (score, position) pairs and the merge), (d) ``topk_scored`` and
``topk_indices`` on one rank's logits. Every time is the device time of a CUDA-graph replay
(the step compiled with ``fullgraph=True``), median of fixed repetitions run in lockstep by
both ranks; the leaves are captured ten times per graph, the step once. The step keeps the
selection as a set (``sorted=False``: no sort in ``topk_scored`` nor in the merge); the
sorted variants are timed next to it.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dsa
from dsa.distributed import NCCL_NO_MULTICAST, all_gather
from dsa.ops.dcp import global_positions

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _report import add_shapes_option, bench_parser, markdown_table, publish, report, shapes_flag
from bench_leaves import random_cache

SHAPES = [(b, n) for n in (131072, 262144) for b in (1, 8, 64)]
# the leaves timed per shape: name -> column
LEAVES = {"all-gather": "all-gather µs", "exchange": "all-gather + merge µs",
          "exchange sorted": "… merge sorted µs", "scored": "topk_scored µs",
          "scored sorted": "… sorted µs", "indices": "topk_indices µs"}
HIDDEN, Q_LORA_RANK, TOPK, BS, WORLD = 7168, 1536, 2048, 64, 2
LEAF_CALLS = 10  # calls per leaf graph


def graph_of(fn, calls: int = 1):
    """``fn`` warmed up on a side stream, then captured ``calls`` times in one graph;
    returns the graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    return graph


def replay_us(graph, *, collective: bool, rounds: int = 15, reps: int = 10,
              calls: int = 1) -> float:
    """Median device time in µs of one of the ``calls`` captured in ``graph`` (a replay
    divided by ``calls``: the leaves are captured ten times, which leaves out the few µs
    between two replays). Fixed counts: with a collective inside, both ranks replay the same
    number of times (a barrier first)."""
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(rounds):
        if collective:
            dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / (reps * calls))
    return statistics.median(times)


def step_graph(cfg: dsa.IndexerConfig, batch: int, length: int, rank: int,
               group: dist.ProcessGroup | None):
    """The captured decode step of one layer: full contexts of ``length`` tokens, this rank's
    share of the cache (all of it when ``cfg.dcp_world == 1``)."""
    layer = dsa.Indexer(cfg, hidden_size=HIDDEN, q_lora_rank=Q_LORA_RANK, device="cuda",
                        dcp_group=group)
    layer.kv_cache.copy_(random_cache(cfg.num_blocks))
    width = cfg.num_blocks // batch
    table = torch.randperm(cfg.num_blocks, device="cuda", dtype=torch.int32).view(batch, width)
    seq_lens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    positions = (seq_lens - 1).long()
    local = positions // cfg.dcp_world
    slots = (table.gather(1, (local // BS).view(-1, 1)).view(-1).long() * BS + local % BS)
    slots = torch.where(positions % cfg.dcp_world == rank, slots, -1)
    live = dsa.Batch(query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
                     seq_lens=seq_lens, block_table=table, slot_mapping=slots,
                     positions=positions)
    hidden = torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16)
    q_latent = torch.randn(batch, Q_LORA_RANK, device="cuda", dtype=torch.bfloat16)

    def step():
        meta = dsa.build_decode_metadata(cfg, live)
        return layer(hidden, q_latent, live.positions, meta).slots

    torch._dynamo.reset()  # a fresh compile per shape, not a recompile
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    return graph_of(compiled), layer, live, hidden, q_latent


def leaf_graphs(cfg: dsa.IndexerConfig, batch: int, group: dist.ProcessGroup
                ) -> dict[str, tuple[torch.cuda.CUDAGraph, bool]]:
    """Graphs (and whether they hold a collective) of the all-gather, the all-gather and
    merge (set, sorted), and the top-k variants on one rank's logits."""
    width = -(-cfg.max_model_len // cfg.dcp_world)
    logits = torch.randn(batch, width, device="cuda")
    lens = torch.full((batch,), width, device="cuda", dtype=torch.int32)
    indices, scores = torch.ops.dsa.topk_scored(logits, lens, TOPK)
    positions = global_positions(indices, cfg.dcp_world, cfg.dcp_rank)  # as the step's
    pairs = torch.cat([scores.view(torch.int32), positions], dim=1)

    def exchange(ordered: bool):
        gathered = all_gather(pairs, group)
        return torch.ops.dsa.dcp_merge_topk(gathered[..., :TOPK].view(torch.float32),
                                            gathered[..., TOPK:], ordered)

    calls = LEAF_CALLS
    return {"all-gather": (graph_of(lambda: all_gather(pairs, group), calls), True),
            "exchange": (graph_of(lambda: exchange(False), calls), True),
            "exchange sorted": (graph_of(lambda: exchange(True), calls), True),
            "scored": (graph_of(lambda: torch.ops.dsa.topk_scored(logits, lens, TOPK, False),
                                calls), False),
            "scored sorted": (graph_of(lambda: torch.ops.dsa.topk_scored(logits, lens, TOPK),
                                       calls), False),
            "indices": (graph_of(lambda: torch.ops.dsa.topk_indices(logits, lens, TOPK),
                                 calls), False)}


def bench_shape(rank: int, batch: int, length: int, group: dist.ProcessGroup) -> list[object]:
    blocks = -(-length // BS)
    base = dict(max_num_reqs=batch, max_num_batched_tokens=batch, max_model_len=length,
                topk=TOPK)
    cfg = dsa.IndexerConfig(**base, dcp_world=WORLD, dcp_rank=rank,
                            num_blocks=batch * -(-blocks // WORLD))
    graph, *keep = step_graph(cfg, batch, length, rank, group)
    sharded = replay_us(graph, collective=True)
    del graph, keep
    graphs = leaf_graphs(cfg, batch, group)
    leaf_us = {name: replay_us(graph, collective=collective, calls=LEAF_CALLS)
               for name, (graph, collective) in graphs.items()}
    del graphs
    torch.cuda.empty_cache()
    dist.barrier()
    whole = float("nan")
    if rank == 0:  # one GPU holding every key
        one = dsa.IndexerConfig(**base, num_blocks=batch * blocks)
        graph, *keep = step_graph(one, batch, length, 0, None)
        whole = replay_us(graph, collective=False)
        del graph, keep
        torch.cuda.empty_cache()
    dist.barrier()
    return [batch, length, f"{sharded:.0f}", f"{whole:.0f}", f"{whole / sharded:.2f}x",
            *(f"{leaf_us[name]:.1f}" for name in LEAVES)]


def worker(rank: int, store_path: str, shapes: list[tuple[int, int]], out: str | None,
           command: str) -> None:
    os.environ.update(NCCL_NO_MULTICAST)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, WORLD), rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=600))
    group = dist.group.WORLD
    header = ["B", "L (global)", "DCP step µs / rank", "1-GPU step µs", "speed-up",
              *LEAVES.values()]
    rows = []
    torch.manual_seed(rank)
    for batch, length in shapes:
        try:
            rows.append(bench_shape(rank, batch, length, group))
        except torch.cuda.OutOfMemoryError:
            traceback.print_exc()
            rows.append([batch, length] + ["OOM"] * (len(header) - 2))
            torch.cuda.empty_cache()
            dist.barrier()
        if rank == 0:
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
    if rank == 0:
        text = report(
            "Decode context parallelism on 2 GPUs: exact cross-rank top-k",
            markdown_table(header, rows), command=command,
            notes=(f"one indexer layer, hidden {HIDDEN}, q_lora_rank {Q_LORA_RANK}, H=64, "
                   f"D=128, top-k {TOPK}, next_n 1, full contexts, bf16, logits backend "
                   "auto; each rank holds half of every context; CUDA-graph replay device "
                   "time (the step: one per graph; the leaves: ten per graph, per call); "
                   "the step's selection is a set (sorted=False); all-gather: the "
                   "[B, 2k] int32 pairs; merge and topk_scored: as sets, then sorted (…); "
                   "topk_scored / topk_indices: one rank's logits (L / 2 columns)"),
        )
        publish(text, out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = bench_parser()
    add_shapes_option(parser, SHAPES, what="BxL")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the run")
    args = parser.parse_args()
    if torch.cuda.device_count() < WORLD:
        sys.exit(f"bench_dcp: needs {WORLD} GPUs, found {torch.cuda.device_count()}")
    os.environ.update(NCCL_NO_MULTICAST)
    command = "python benchmarks/bench_dcp.py" + shapes_flag(args.shapes)
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            worker, args=(os.path.join(tmp, "store"), args.shapes or SHAPES, args.out, command),
            nprocs=WORLD, join=False, start_method="spawn")
        deadline = time.monotonic() + args.timeout
        while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                sys.exit(f"bench_dcp: still running after {args.timeout:.0f} s, killed")


if __name__ == "__main__":
    main()
