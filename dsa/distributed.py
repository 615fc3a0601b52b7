"""The exact top-k across decode-context-parallel ranks, on torch.distributed (design §11).

Each rank scores its shard of every request's keys (interleave 1: global key ``c`` is rank
``c % W``'s local key ``c // W``), takes its local top-k with scores
(``dsa::topk_scored``), and the ranks all-gather their (score, global position) pairs in one
collective; ``dsa::dcp_merge_topk`` picks the global top-k from the ``W * k`` candidates,
identically on every rank. The result is the top-k set of the unsharded row under the same
order (score descending, ties to the lower position); sorted on request.

The all-gather is a functional collective (``torch.ops._c10d_functional``): it traces under
``torch.compile(fullgraph=True)`` and, on NCCL, captures in a CUDA graph (run one step
before capturing, so the communicator exists). Any backend works: NCCL on GPUs, gloo on CPU.
NCCL keeps a communicator alive while any CUDA graph that captured one of its collectives
exists: drop those graphs before ``destroy_process_group()``, which otherwise waits forever.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from dsa.ops._checks import check_dcp, check_int
from dsa.ops.dcp import global_positions
from dsa.ops.topk.scored import check_merge_size

ops = torch.ops.dsa

# Environment that keeps NCCL and symmetric memory off NVLink multicast (NVLS), for hosts
# where it is unavailable or unwanted; set it in every process before the first collective.
NCCL_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                     "NVSHMEM_DISABLE_NVLS": "1"}


def check_dcp_group(op: str, group: dist.ProcessGroup, world: int, rank: int,
                    interleave: int = 1) -> None:
    """Checks that ``group`` is a DCP group of ``world`` ranks in which this process is rank
    ``rank`` (interleave 1 only); raises naming ``op`` otherwise."""
    check_dcp(op, world, rank, interleave)
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"dsa.{op}: `group` must be a torch.distributed.ProcessGroup, got "
                        f"{type(group).__name__}")
    size = dist.get_world_size(group)
    if size != world:
        raise ValueError(f"dsa.{op}: `group` must have dcp_world={world} ranks, got a group "
                         f"of {size}")
    own = dist.get_rank(group)
    if own != rank:
        raise ValueError(f"dsa.{op}: this process must be rank dcp_rank={rank} of `group`, "
                         f"got rank {own}")


def all_gather(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``[W, *x.shape]``: ``x`` of every rank of ``group``, in group-rank order."""
    world = dist.get_world_size(group)
    out = torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), world,
                                                            group.group_name)
    return torch.ops._c10d_functional.wait_tensor(out).view(world, *x.shape)


def dcp_topk(logits: Tensor, lengths: Tensor, k: int, group: dist.ProcessGroup, *,
             world: int, rank: int, interleave: int = 1, sorted: bool = False
             ) -> tuple[Tensor, Tensor]:
    """The exact top-k of every row across the ranks of ``group``.

    Args:
        logits: fp32 ``[rows, N]`` this rank's logits; column j is its local key j.
        lengths: int32, one per row: this rank's valid keys of the row (DCP-local).
        k: keys per row.
        group: the DCP process group; ``world``, ``rank``, ``interleave``: the config's DCP
            triple, checked against it.
        sorted: order each row (score descending, ties to the lower position); the
            default leaves the order free (the same on every rank), which skips two sorts.

    Returns:
        ``(indices, scores)``, int32 and fp32 ``[rows, k]``, the same on every rank: the
        global positions of the row's top-k keys (ties at the k-th score to the lower
        positions), then -1 (scores -inf).
    """
    check_dcp_group("dcp_topk", group, world, rank, interleave)
    # before any collective: a rank that raises later would leave the others waiting
    check_merge_size("dcp_topk", world, check_int("dcp_topk", "k", k, low=1), sorted)
    local, scores = ops.topk_scored(logits, lengths, k, sorted)
    pairs = torch.cat([scores.view(torch.int32), global_positions(local, world, rank)], dim=1)
    gathered = all_gather(pairs, group)  # [W, rows, 2k], read in place by the merge
    return ops.dcp_merge_topk(gathered[..., :k].view(torch.float32), gathered[..., k:],
                              sorted)
