"""Decode context parallelism: the exact top-k over K caches sharded across ranks.

Each rank holds every request's keys c with ``c % world == rank`` (as its local keys
``c // world``), scores them, and ``dsa.distributed`` merges the ranks' candidates into the
top-k of the whole sequence. The compiled step (fullgraph; on GPUs one CUDA graph) returns
the selection as global positions, the same on every rank, and this rank's share of it as
local indices and cache slots. Launch one process per rank:

    torchrun --standalone --nproc-per-node 2 examples/dcp_decode.py                 # CPU, gloo
    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 2 examples/dcp_decode.py \\
        --device cuda                                                               # 2 GPUs
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import dsa

HIDDEN, Q_LORA_RANK = 256, 128


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--seq-lens", default="900,130,7", help="context of each request")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    os.environ.update(dsa.distributed.NCCL_NO_MULTICAST)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device(args.device, torch.cuda.current_device()) \
        if args.device == "cuda" else torch.device("cpu")

    seq_lens = [int(n) for n in args.seq_lens.split(",")]
    num_reqs = len(seq_lens)
    cfg = dsa.IndexerConfig(max_num_reqs=num_reqs, max_num_batched_tokens=2 * num_reqs,
                            max_model_len=1024, next_n=2, topk=64, dcp_world=world,
                            dcp_rank=rank, num_blocks=num_reqs * -(-16 // world))
    torch.manual_seed(0)  # the same weights on every rank
    layer = dsa.Indexer(cfg, hidden_size=HIDDEN, q_lora_rank=Q_LORA_RANK, device=device,
                        dtype=torch.float32, dcp_group=dist.group.WORLD)

    # This rank's share of each request's cache: the keys it owns, in its own blocks.
    width = cfg.block_table_width
    table = torch.arange(num_reqs * width, dtype=torch.int32, device=device).view(num_reqs, -1)

    def local_slot(r: int, pos: int) -> int:
        """Where this rank keeps key ``pos`` of request ``r`` (-1: another rank does)."""
        if pos % world != rank:
            return -1
        local = pos // world
        return int(table[r, local // cfg.block_size]) * cfg.block_size + local % cfg.block_size

    history = [(r, pos) for r, n in enumerate(seq_lens) for pos in range(n - 2)]
    keys = torch.randn(len(history), cfg.head_dim, generator=torch.Generator().manual_seed(1))
    slots = torch.tensor([local_slot(r, pos) for r, pos in history])
    torch.ops.dsa.quantize_and_cache_k(keys.to(device), layer.kv_cache, slots.to(device),
                                       ue8m0=False)

    # One decode step: two MTP tokens per request, at the end of each sequence.
    positions = [pos for n in seq_lens for pos in (n - 2, n - 1)]
    owners = [r for r in range(num_reqs) for _ in range(2)]
    on = lambda x, dtype: torch.tensor(x, dtype=dtype, device=device)
    batch = dsa.Batch(query_start_loc=on(list(range(0, 2 * num_reqs + 1, 2)), torch.int32),
                      seq_lens=on(seq_lens, torch.int32), block_table=table,
                      slot_mapping=on([local_slot(r, p) for r, p in zip(owners, positions)],
                                      torch.int64),
                      positions=on(positions, torch.int64))
    gen = torch.Generator().manual_seed(2)  # the same tokens on every rank
    hidden = torch.randn(2 * num_reqs, HIDDEN, generator=gen).to(device)
    q_latent = torch.randn(2 * num_reqs, Q_LORA_RANK, generator=gen).to(device)

    @torch.compile(fullgraph=True, dynamic=False)
    def step(batch: dsa.Batch, hidden: torch.Tensor, q_latent: torch.Tensor):
        meta = dsa.build_decode_metadata(cfg, batch)  # this rank's local lengths
        return layer(hidden, q_latent, batch.positions, meta)

    out = step(batch, hidden, q_latent)
    if args.device == "cuda":  # the whole step, all-gather included, as one CUDA graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step(batch, hidden, q_latent)
        graph.replay()
        assert torch.equal(captured.global_indices, out.global_indices)
        del graph  # NCCL keeps its communicator while a graph holding its collective exists

    # Every rank holds the same global selection; the owned shares partition it.
    shares = [torch.empty_like(out.indices) for _ in range(world)]
    dist.all_gather(shares, out.indices)
    covered = sum((share >= 0).int() for share in shares)
    assert torch.equal(covered, (out.global_indices >= 0).int())
    print(f"rank {rank}: token 0 selects {int((out.global_indices[0] >= 0).sum())} keys, "
          f"{int((out.indices[0] >= 0).sum())} of them here; first global positions "
          f"{out.global_indices[0, :6].tolist()}, local slots {out.slots[0, :6].tolist()}")
    dist.barrier()  # no rank tears its process group down while another still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
