"""Capture sizes: the batch buckets a decode step is captured for."""

from __future__ import annotations

from collections.abc import Sequence

from dsa.ops._checks import is_int


def capture_sizes(max_num_reqs: int, *, step: int = 8) -> tuple[int, ...]:
    """Buckets 1, 2, 4, then multiples of ``step`` up to ``max_num_reqs`` (always included).

    Small batches get tight buckets (padding there costs the most, relatively); larger ones
    step linearly, as inference engines do.
    """
    if not all(is_int(v) and v >= 1 for v in (max_num_reqs, step)):
        raise ValueError(f"capture_sizes: max_num_reqs and step must be ints >= 1, got "
                         f"{max_num_reqs!r} and {step!r}")
    sizes = {s for s in (1, 2, 4) if s <= max_num_reqs}
    sizes.update(range(step, max_num_reqs + 1, step))
    sizes.add(max_num_reqs)
    return tuple(sorted(sizes))


def bucket_for(num_reqs: int, sizes: Sequence[int]) -> int:
    """The smallest capture size that holds ``num_reqs`` (>= 0) requests."""
    if not is_int(num_reqs) or num_reqs < 0:
        raise ValueError(f"bucket_for: num_reqs must be an int >= 0, got {num_reqs!r}")
    if not sizes:
        raise ValueError("bucket_for: no capture sizes")
    for size in sorted(sizes):
        if size >= num_reqs:
            return size
    raise ValueError(f"bucket_for: {num_reqs} requests exceed the largest capture size "
                     f"{max(sizes)}")
