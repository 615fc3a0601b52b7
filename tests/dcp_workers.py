"""Multi-process DCP checks (design §11), shared by the gloo (CPU) and NCCL (GPU) tests.

``spawn`` starts one process per rank (torch.multiprocessing, a FileStore in a temporary
directory, a deadline: a hang fails the test instead of stalling it). The workers compare
each rank's exact top-k against one process holding the unsharded rows or K cache.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import random
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from cuda_graphs import capture

import dsa
from dsa.distributed import NCCL_NO_MULTICAST, dcp_topk
from dsa.graphs import pad_batch
from dsa.ops.dcp import global_positions, local_share
from tests import reference_compute as ref

HIDDEN, Q_LORA_RANK = 32, 16


def spawn(fn: Callable, world: int, *args, timeout: float = 120.0) -> None:
    """Runs ``fn(rank, world, store_path, *args)`` in ``world`` processes; raises the first
    failure, or ``TimeoutError`` (after killing them) past ``timeout`` seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(fn, args=(world, os.path.join(tmp, "store"), *args),
                                     nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"{fn.__name__}: {world} processes still running after "
                                   f"{timeout:.0f} s")


def init(rank: int, world: int, store_path: str, backend: str) -> None:
    os.environ.update(NCCL_NO_MULTICAST)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))


def self_groups(world: int) -> dist.ProcessGroup:
    """A one-process group for every rank (made collectively); returns this rank's: the
    single-process reference runs the same code over it."""
    groups = [dist.new_group([r]) for r in range(world)]
    return groups[dist.get_rank()]


# --- the op path: topk_scored, all-gather, merge -------------------------------------------


def random_rows(rng: torch.Generator, rows: int, n: int, k: int) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """Logits with many ties and junk (NaN, +inf) past each row's length; lengths around 0,
    k and n (padding rows have length 0)."""
    kind = int(torch.randint(3, (1,), generator=rng))
    if kind == 0:
        x = torch.randn(rows, n, generator=rng)
    else:  # few distinct values
        x = torch.randint(-kind, kind + 1, (rows, n), generator=rng).float()
    choices = torch.tensor([0, 1, k - 1, k, k + 1, n, n // 2])
    lengths = choices[torch.randint(len(choices), (rows,), generator=rng)].int()
    junk = torch.tensor([float("nan"), float("inf")])[torch.randint(2, (rows, n), generator=rng)]
    x = torch.where(torch.arange(n) < lengths[:, None], x, junk)
    return x, lengths


def check_sharded_rows(rank: int, world: int, logits: torch.Tensor, lengths: torch.Tensor,
                       k: int, group: dist.ProcessGroup, topk: Callable = dcp_topk,
                       ordered: bool = False) -> None:
    """This rank's shard through ``topk`` equals topk_scored (the CPU face) over the whole
    rows: position for position when ``ordered``, else as sets."""
    local = logits[:, rank::world].contiguous()
    lens = local_share(lengths, world, rank, 1).int()
    indices, scores = topk(local, lens, k, group, world=world, rank=rank, sorted=ordered)
    indices, scores = indices.cpu(), scores.cpu()
    want_indices, want_scores = torch.ops.dsa.topk_scored(logits.cpu(), lengths.cpu(), k)
    if not ordered:
        indices, scores = ref.in_position_order(indices, scores)
        want_indices, want_scores = ref.in_position_order(want_indices, want_scores)
    assert torch.equal(indices, want_indices), (indices, want_indices)
    assert torch.equal(scores.view(torch.int32), want_scores.view(torch.int32))


def op_worker(rank: int, world: int, store_path: str, backend: str, cases: int) -> None:
    init(rank, world, store_path, backend)
    device = "cuda" if backend == "nccl" else "cpu"
    group = dist.group.WORLD
    rng = torch.Generator().manual_seed(1234)  # the same cases on every rank
    for case in range(cases):
        rows = int(torch.randint(1, 6, (1,), generator=rng))
        n = int(torch.randint(0, 90, (1,), generator=rng))
        k = [1, 4, 16][int(torch.randint(3, (1,), generator=rng))]
        logits, lengths = random_rows(rng, rows, n, k)
        check_sharded_rows(rank, world, logits.to(device), lengths.to(device), k, group,
                           ordered=case % 2 == 1)
    logits, lengths = random_rows(rng, 4, 64, 8)
    compiled = torch.compile(dcp_topk, fullgraph=True, backend="aot_eager")
    check_sharded_rows(rank, world, logits.to(device), lengths.to(device), 8, group, compiled)
    check_errors(rank, world, group, logits.to(device), lengths.to(device))
    dist.destroy_process_group()


def check_errors(rank: int, world: int, group: dist.ProcessGroup, logits: torch.Tensor,
                 lengths: torch.Tensor) -> None:
    """A wrong world, a wrong rank or interleave > 1 raise before any collective, eagerly
    and while tracing."""
    bad = [({"world": world + 1, "rank": rank}, ValueError, "must have dcp_world="),
           ({"world": world, "rank": (rank + 1) % world}, ValueError, "must be rank dcp_rank="),
           ({"world": world, "rank": rank, "interleave": 2}, NotImplementedError,
            "interleave > 1")]
    traced = torch.compile(dcp_topk, fullgraph=True, backend="eager")
    for i, (kwargs, error, match) in enumerate(bad):
        for fn, expected in ((dcp_topk, error), (traced, RuntimeError))[: 2 if i == 0 else 1]:
            try:
                fn(logits, lengths, 8, group, **kwargs)
            except expected as e:
                assert match in str(e), str(e)
            else:
                raise AssertionError(f"no error for {kwargs}")
    try:  # a merge too large: before any collective, so no rank waits on the others
        dcp_topk(logits, lengths, 32768 // world + 1, group, world=world, rank=rank)
    except ValueError as e:
        assert "takes W * k <= 32768 candidates per token" in str(e), str(e)
    else:
        raise AssertionError("dcp_topk took a merge too large")
    cfg = dsa.IndexerConfig(max_num_reqs=1, max_num_batched_tokens=1, max_model_len=64,
                            num_heads=4, head_dim=32, dcp_world=world + 1, dcp_rank=rank,
                            num_blocks=8)
    try:
        dsa.Indexer(cfg, hidden_size=HIDDEN, q_lora_rank=Q_LORA_RANK, dcp_group=group)
    except ValueError as e:
        assert "must have dcp_world=" in str(e)
    else:
        raise AssertionError("Indexer took a group of the wrong size")
    cfg = dataclasses.replace(cfg, dcp_world=world, topk=32768 // world + 1)
    try:
        dsa.Indexer(cfg, hidden_size=HIDDEN, q_lora_rank=Q_LORA_RANK, dcp_group=group)
    except ValueError as e:
        assert "takes W * k <= 32768 candidates per token (dcp_world * topk)" in str(e), str(e)
    else:
        raise AssertionError("Indexer took a group whose merge is too large")


# --- the whole decode step ------------------------------------------------------------------


@dataclasses.dataclass
class ShardedStep:
    """One decode step, as the single process holding every key and as one DCP rank."""

    full_cfg: dsa.IndexerConfig
    rank_cfg: dsa.IndexerConfig
    full_batch: dsa.Batch
    rank_batch: dsa.Batch
    hidden: torch.Tensor
    q_latent: torch.Tensor
    full_slots: torch.Tensor  # [B, keys] where each cached key lives, in each cache
    rank_slots: torch.Tensor
    keys: torch.Tensor  # [B, keys, head_dim] the cached keys


def step_configs(world: int, rank: int, **overrides) -> tuple[dsa.IndexerConfig,
                                                             dsa.IndexerConfig]:
    base = dict(max_num_reqs=4, max_num_batched_tokens=16, max_model_len=256, num_heads=4,
                head_dim=32, topk=16, block_size=16, **overrides)
    full = dsa.IndexerConfig(**base)
    full = dataclasses.replace(full, num_blocks=4 * full.max_blocks_per_req)
    shard = dsa.IndexerConfig(**base, dcp_world=world, dcp_rank=rank)
    return full, dataclasses.replace(shard, num_blocks=4 * -(-shard.max_blocks_per_req // world))


def sharded_step(seed: int, world: int, rank: int, device: str, **overrides) -> ShardedStep:
    """A random decode step (uneven lengths, short rows, a padding request, requests whose
    keys repeat a few vectors so that many logits are equal), the same on every rank."""
    full_cfg, rank_cfg = step_configs(world, rank, **overrides)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    ratio, bs = full_cfg.compress_ratio, full_cfg.block_size
    live = rng.randint(1, 3)
    query_lens = [rng.randint(1, full_cfg.next_n) for _ in range(live)]
    seq_lens = [rng.choice([q, rng.randint(q, 40 * ratio), full_cfg.max_model_len])
                for q in query_lens]
    num_keys = full_cfg.max_model_len // ratio
    keys = torch.randn(live, num_keys, full_cfg.head_dim, generator=gen)
    for r in range(live):
        if rng.random() < 0.5:  # three distinct keys, repeated
            keys[r] = keys[r, torch.randint(3, (num_keys,), generator=gen)]
    full_width = full_cfg.max_blocks_per_req
    rank_width = -(-full_width // world)
    full_table = torch.arange(4 * full_width, dtype=torch.int32).view(4, full_width)[:live]
    rank_table = torch.arange(4 * rank_width, dtype=torch.int32).view(4, rank_width)[:live]
    c = torch.arange(num_keys)
    full_slots = full_table[:, c // bs].long() * bs + c % bs
    local = c // world
    rank_slots = torch.where(c % world == rank,
                             rank_table[:, (local // bs).clamp(max=rank_width - 1)].long() * bs
                             + local % bs, -1)

    def batch(table: torch.Tensor, slots: torch.Tensor, width: int) -> dsa.Batch:
        qsl, positions, slot_mapping = [0], [], []
        for r, (q, seq) in enumerate(zip(query_lens, seq_lens)):
            qsl.append(qsl[-1] + q)
            for pos in range(seq - q, seq):
                positions.append(pos)
                slot_mapping.append(int(slots[r, pos]) if ratio == 1 else -1)
        live_batch = dsa.Batch(torch.tensor(qsl, dtype=torch.int32),
                               torch.tensor(seq_lens, dtype=torch.int32), table.contiguous(),
                               torch.tensor(slot_mapping), torch.tensor(positions))
        return pad_batch(live_batch, 4, 4 * full_cfg.next_n, width)

    tokens = 4 * full_cfg.next_n
    hidden = torch.randn(tokens, HIDDEN, generator=gen)
    q_latent = torch.randn(tokens, Q_LORA_RANK, generator=gen)
    on = lambda b: dsa.Batch(*(getattr(b, f.name).to(device) for f in dataclasses.fields(b)))
    return ShardedStep(full_cfg, rank_cfg, on(batch(full_table, full_slots, full_width)),
                       on(batch(rank_table, rank_slots, rank_width)), hidden.to(device),
                       q_latent.to(device), full_slots, rank_slots, keys)


def make_layer(cfg: dsa.IndexerConfig, group: dist.ProcessGroup, device: str,
               step: ShardedStep, slots: torch.Tensor) -> dsa.Indexer:
    """The same weights on every rank; the step's cached keys written at ``slots``."""
    torch.manual_seed(0)
    layer = dsa.Indexer(cfg, hidden_size=HIDDEN, q_lora_rank=Q_LORA_RANK, rope_dim=16,
                        dcp_group=group, dtype=torch.float32).to(device)
    keys = step.keys.flatten(0, 1).to(device)
    torch.ops.dsa.quantize_and_cache_k(keys, layer.kv_cache, slots.flatten().to(device),
                                       ue8m0=False)
    return layer


def step_fn(cfg: dsa.IndexerConfig, layer: dsa.Indexer) -> Callable:
    def step(batch: dsa.Batch, hidden: torch.Tensor, q_latent: torch.Tensor):
        meta = dsa.build_decode_metadata(cfg, batch)
        return layer(hidden, q_latent, batch.positions, meta)

    return step


def check_step_outputs(rank: int, world: int, step: ShardedStep, out: dsa.IndexerOutput,
                       want: dsa.IndexerOutput) -> None:
    """Every rank holds the single process's selection (as a set), in the same order on
    every rank; the ranks' owned keys partition it, as local indices whose slots are this
    rank's cache slots of those keys."""
    selected = out.global_indices.cpu()
    same = [torch.equal(selected, other) for other in dist_all_gather(out.global_indices)]
    assert all(same), "ranks hold different selections"
    canonical = lambda x: ref.in_position_order(x, x)[0]
    assert torch.equal(canonical(selected), canonical(want.global_indices.cpu()))
    indices = out.indices.cpu()
    owned = dist_all_gather(global_positions(out.indices, world, rank))
    union = torch.full_like(indices, -1)
    for mine in owned:
        assert bool(((mine < 0) | (union < 0)).all()), "a key owned by two ranks"
        union = torch.where(mine >= 0, mine, union)
    assert torch.equal(union, selected)
    requests = step.rank_batch.query_start_loc.cpu()
    token_req = torch.searchsorted(requests[1:], torch.arange(len(indices)), right=True)
    token_req = token_req.clamp(max=step.rank_slots.shape[0] - 1)
    global_idx = global_positions(indices, world, rank).long()
    expect = torch.where(indices >= 0, step.rank_slots[token_req[:, None],
                                                       global_idx.clamp(min=0)], -1)
    assert torch.equal(out.slots.cpu().long(), expect)


def dist_all_gather(x: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return [p.cpu() for p in parts]


STEP_CONFIGS = [{"next_n": 1}, {"next_n": 2}, {"next_n": 2, "compress_ratio": 4},
                {"next_n": 3, "decode_layout": "flat"}]


def step_worker(rank: int, world: int, store_path: str, backend: str, steps: int,
                compile_backend: str | None) -> None:
    init(rank, world, store_path, backend)
    device = "cuda" if backend == "nccl" else "cpu"
    alone = self_groups(world)
    for i in range(steps):
        overrides = STEP_CONFIGS[i % len(STEP_CONFIGS)]
        step = sharded_step(100 + i, world, rank, device, **overrides)
        full = make_layer(step.full_cfg, alone, device, step, step.full_slots)
        mine = make_layer(step.rank_cfg, dist.group.WORLD, device, step, step.rank_slots)
        run = step_fn(step.rank_cfg, mine)
        if compile_backend is not None and i == len(STEP_CONFIGS) - 2:  # R = 4, MTP
            run = torch.compile(run, fullgraph=True, dynamic=False, backend=compile_backend)
        want = step_fn(step.full_cfg, full)(step.full_batch, step.hidden, step.q_latent)
        out = run(step.rank_batch, step.hidden, step.q_latent)
        check_step_outputs(rank, world, step, out, want)
    dist.destroy_process_group()


# --- GPU: NCCL, torch.compile, one CUDA graph per rank ---------------------------------------


def gpu_worker(rank: int, world: int, store_path: str, compile_backend: str) -> None:
    init(rank, world, store_path, "nccl")
    group = dist.group.WORLD
    rng = torch.Generator().manual_seed(99)
    for rows, n, k in ((8, 2 * 32768, 2048), (64, 2 * 8192, 2048), (3, 5000, 2048)):
        logits, lengths = random_rows(rng, rows, n, k)
        for ordered in (False, True):
            check_sharded_rows(rank, world, logits.cuda(), lengths.cuda(), k, group,
                               ordered=ordered)
    alone = self_groups(world)
    compile_step = lambda fn: torch.compile(fn, fullgraph=True, dynamic=False,
                                            backend=compile_backend)
    for i, overrides in enumerate(STEP_CONFIGS):
        step = sharded_step(200 + i, world, rank, "cuda", **overrides)
        args = (step.rank_batch, step.hidden, step.q_latent)
        full = make_layer(step.full_cfg, alone, "cuda", step, step.full_slots)
        want = compile_step(step_fn(step.full_cfg, full))(step.full_batch, step.hidden,
                                                          step.q_latent)
        run = compile_step(step_fn(step.rank_cfg, make_layer(step.rank_cfg, group, "cuda",
                                                             step, step.rank_slots)))
        uncaptured = run(*args)
        replay, out = capture(run, *args)
        replays = []
        for _ in range(20):
            replay()
            replays.append([t.clone() for t in (out.indices, out.slots, out.global_indices)])
        torch.cuda.synchronize()
        for again in replays:
            for got, expect in zip(again, (uncaptured.indices, uncaptured.slots,
                                           uncaptured.global_indices)):
                assert torch.equal(got, expect), f"config {overrides}: replay != uncaptured"
        check_step_outputs(rank, world, step, out, want)
    # NCCL keeps the communicator while a graph that captured its all-gather exists
    del replay, out
    torch.cuda.synchronize()
    dist.barrier()
    dist.destroy_process_group()
