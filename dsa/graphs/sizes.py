"""Capture sizes: the batch buckets a decode step is captured for."""

from __future__ import annotations

from collections.abc import Sequence


def capture_sizes(max_num_reqs: int, *, step: int = 8) -> tuple[int, ...]:
    """Buckets 1, 2, 4, then multiples of ``step`` up to ``max_num_reqs`` (always included).

    Small batches get tight buckets (padding there costs the most, relatively); larger ones
    step linearly, as inference engines do.
    """
    if max_num_reqs < 1 or step < 1:
        raise ValueError(f"capture_sizes: max_num_reqs and step must be >= 1, got "
                         f"{max_num_reqs} and {step}")
    sizes = {s for s in (1, 2, 4) if s <= max_num_reqs}
    sizes.update(range(step, max_num_reqs + 1, step))
    sizes.add(max_num_reqs)
    return tuple(sorted(sizes))


def bucket_for(num_reqs: int, sizes: Sequence[int]) -> int:
    """The smallest capture size that holds ``num_reqs`` requests."""
    for size in sorted(sizes):
        if size >= num_reqs:
            return size
    raise ValueError(f"bucket_for: {num_reqs} requests exceed the largest capture size "
                     f"{max(sizes)}")
