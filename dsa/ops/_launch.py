"""Launch helpers shared by the Triton faces.

Every Triton kernel of a ``.triton`` face launches through :func:`launch`: outside tracing it
is a plain launch; while torch traces the face (the decomposition of a ``triton_op`` under
``torch.compile`` / AOTInductor, or ``make_fx``) the kernel goes through
:func:`torch.library.wrap_triton`, so the graph holds the kernel call itself.
"""

from __future__ import annotations

from typing import Any

import triton
from torch.library import wrap_triton
from torch.utils._python_dispatch import is_in_torch_dispatch_mode


def block_for(n: int, cap: int = 1024) -> int:
    """Power-of-two Triton block covering ``n`` elements, at most ``cap``."""
    return min(cap, triton.next_power_of_2(max(n, 1)))


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``, traceable: wrapped by ``wrap_triton`` while a torch
    dispatch mode is active (tracing), launched directly otherwise (no dispatch cost)."""
    if is_in_torch_dispatch_mode():
        kernel = wrap_triton(kernel)
    kernel[grid](*args, **kwargs)


def launch_1d(kernel: Any, n: int, *args: Any, cap: int = 1024, **constexprs: Any) -> None:
    """Launches ``kernel`` over ``n`` elements, ``BLOCK = block_for(n, cap)`` per program;
    nothing when ``n == 0``."""
    if n:
        block = block_for(n, cap)
        launch(kernel, (triton.cdiv(n, block),), *args, BLOCK=block, **constexprs)
