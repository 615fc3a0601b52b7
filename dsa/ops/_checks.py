"""Argument validation shared by every op face (CPU, CUDA and fake).

Errors name the op, the argument, what was expected and what came, so a bad call fails at
trace time (the fake runs the same checks) instead of inside a kernel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

# What a symbolic size means to the user: dsa's outputs are sized by the batch's capacity.
STATIC_SIZES = ("dsa's ops take static sizes (compile with dynamic=False: one graph per batch "
                "capacity)")


def check_tensor(
    op: str,
    name: str,
    t: object,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    ndim: int | None = None,
    contiguous: bool = False,
    like: Tensor | None = None,
) -> Tensor:
    """Checks that ``t`` is a tensor with the given dtype(s), rank and layout.

    ``like``: ``t`` must live on the same device as this tensor.
    """
    if not isinstance(t, Tensor):
        raise TypeError(f"dsa.{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise TypeError(f"dsa.{op}: `{name}` must be {want}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(
            f"dsa.{op}: `{name}` must have {ndim} dimension(s), got shape {tuple(t.shape)}"
        )
    if contiguous and not t.is_contiguous():
        raise ValueError(f"dsa.{op}: `{name}` must be contiguous, got strides {t.stride()}")
    if like is not None and t.device != like.device:
        raise ValueError(f"dsa.{op}: `{name}` must be on {like.device}, got {t.device}")
    return t


def check_size(op: str, name: str, t: Tensor, dim: int, expected: int, what: str) -> None:
    """Checks ``t.shape[dim] == expected``; ``what`` explains where ``expected`` comes from."""
    if t.shape[dim] != expected:
        raise ValueError(
            f"dsa.{op}: `{name}` must have size {expected} ({what}) in dimension {dim}, "
            f"got shape {tuple(t.shape)}"
        )


def check_heads(op: str, name: str, t: Tensor, dim: int) -> None:
    """Checks that ``t`` has at least one head (``t.shape[dim] >= 1``)."""
    if t.shape[dim] < 1:
        raise ValueError(f"dsa.{op}: `{name}` must have num_heads >= 1 in dimension {dim}, "
                         f"got shape {tuple(t.shape)}")


def is_int(value: object) -> bool:
    """Whether ``value`` is an int, not a bool (an int to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value: object) -> bool:
    """Whether ``value`` is a finite int or float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_int(op: str, name: str, value: object, *, low: int | None = None) -> int:
    """Checks that ``value`` is an int (not a bool) and at least ``low``."""
    if isinstance(value, torch.SymInt):
        raise TypeError(f"dsa.{op}: `{name}` must be a static int, got a SymInt: {STATIC_SIZES}")
    if not is_int(value):
        raise TypeError(f"dsa.{op}: `{name}` must be an int, got {type(value).__name__}")
    if low is not None and value < low:
        raise ValueError(f"dsa.{op}: `{name}` must be >= {low}, got {value}")
    return value


def check_choice(op: str, name: str, value: object, choices: Sequence[object]) -> None:
    """Checks that ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"dsa.{op}: `{name}` must be one of {list(choices)}, got {value!r}")


def check_dcp(op: str, world: int, rank: int, interleave: int, prefix: str = "dcp_") -> None:
    """Validates a decode-context-parallel (world, rank, interleave) triple, named in errors
    as the op's arguments: ``prefix`` + world, rank, interleave."""
    check_int(op, f"{prefix}world", world, low=1)
    check_int(op, f"{prefix}rank", rank, low=0)
    check_int(op, f"{prefix}interleave", interleave, low=1)
    if rank >= world:
        raise ValueError(f"dsa.{op}: `{prefix}rank` must be < {prefix}world={world}, got {rank}")
    if world > 1 and interleave > 1:
        raise NotImplementedError(
            f"dsa.{op}: DCP interleave > 1 is not supported (validated only for interleave 1), "
            f"got {prefix}interleave={interleave}"
        )


def check_query_start_loc(op: str, query_start_loc: object) -> int:
    """int32 ``[num_reqs + 1]`` contiguous; returns ``num_reqs``."""
    check_tensor(op, "query_start_loc", query_start_loc, dtype=INDEX_DTYPES, ndim=1,
                 contiguous=True)
    if query_start_loc.numel() < 1:
        raise ValueError(f"dsa.{op}: `query_start_loc` must have num_reqs + 1 >= 1 entries, "
                         "got 0")
    return query_start_loc.numel() - 1


def check_seq_lens(op: str, seq_lens: object, query_start_loc: Tensor, num_reqs: int) -> None:
    """int32 ``[num_reqs]`` contiguous, on ``query_start_loc``'s device."""
    check_tensor(op, "seq_lens", seq_lens, dtype=INDEX_DTYPES, ndim=1, contiguous=True,
                 like=query_start_loc)
    check_size(op, "seq_lens", seq_lens, 0, num_reqs, "num_reqs = len(query_start_loc) - 1")


def check_block_table(op: str, block_table: object, like: Tensor | None = None,
                      num_reqs: int | None = None) -> tuple[int, int]:
    """int32 ``[num_reqs, W]`` whose rows are contiguous (row stride free); returns its shape."""
    check_tensor(op, "block_table", block_table, dtype=INDEX_DTYPES, ndim=2, like=like)
    if num_reqs is not None:
        check_size(op, "block_table", block_table, 0, num_reqs,
                   "num_reqs = len(query_start_loc) - 1")
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise ValueError(f"dsa.{op}: `block_table` rows must be contiguous (stride(1) == 1), "
                         f"got strides {block_table.stride()}")
    return block_table.shape[0], block_table.shape[1]


def check_paged_requests(op: str, query_start_loc: object, seq_lens: object,
                         block_table: object) -> tuple[int, int]:
    """A batch's requests with a paged cache: ``query_start_loc``, then ``seq_lens`` and
    ``block_table`` with one row per request on its device; returns ``(num_reqs, W)``."""
    num_reqs = check_query_start_loc(op, query_start_loc)
    check_seq_lens(op, seq_lens, query_start_loc, num_reqs)
    return check_block_table(op, block_table, query_start_loc, num_reqs)


def check_nonnegative(op: str, name: str, t: Tensor) -> None:
    """Value check for host tensors: every entry >= 0. Device tensors are not read (no sync)."""
    if t.device.type == "cpu" and t.numel() and not _is_fake(t) and bool((t < 0).any()):
        raise ValueError(f"dsa.{op}: `{name}` must be >= 0 everywhere, got min {int(t.min())}")


def values_readable(t: Tensor, *, debug: bool = False) -> bool:
    """Whether a value check may read ``t``: a real tensor (not fake or meta, not being traced
    by torch.compile) on the CPU, or, with ``debug``, on any device (a host sync)."""
    if torch.compiler.is_compiling() or _is_fake(t) or t.device.type == "meta":
        return False
    return debug or t.device.type == "cpu"


def _is_fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


INDEX_DTYPES = (torch.int32,)
POSITION_DTYPES = (torch.int32, torch.int64)
