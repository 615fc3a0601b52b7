"""Launch helpers shared by the Triton faces."""

from __future__ import annotations

from typing import Any

import triton


def block_for(n: int, cap: int = 1024) -> int:
    """Power-of-two Triton block covering ``n`` elements, at most ``cap``."""
    return min(cap, triton.next_power_of_2(max(n, 1)))


def launch_1d(kernel: Any, n: int, *args: Any, cap: int = 1024, **constexprs: Any) -> None:
    """Launches ``kernel`` over ``n`` elements, ``BLOCK = block_for(n, cap)`` per program;
    nothing when ``n == 0``."""
    if n:
        block = block_for(n, cap)
        kernel[(triton.cdiv(n, block),)](*args, BLOCK=block, **constexprs)
