"""Launch helpers shared by the Triton faces.

Every Triton kernel of a ``.triton`` face launches through :func:`launch`: outside tracing it
is a plain launch; while torch traces the face (the decomposition of a ``triton_op`` under
``torch.compile`` / AOTInductor, or ``make_fx``) the kernel goes through
:func:`torch.library.wrap_triton`, so the graph holds the kernel call itself.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton
from torch.utils._python_dispatch import is_in_torch_dispatch_mode
from triton.compiler import CompiledKernel


def block_for(n: int, cap: int = 1024) -> int:
    """Power-of-two Triton block covering ``n`` elements, at most ``cap``."""
    return min(cap, triton.next_power_of_2(max(n, 1)))


def row_tile(num_rows: int, row_block: int, programs: int = 128,
             max_rows: int | None = None) -> int:
    """Rows a program for a kernel of independent rows of ``row_block`` (a power of two)
    elements: up to 2048 elements a program (16 rows of 128) and ``max_rows`` rows, fewer
    where that would make fewer than ``programs`` programs, down to one row: a small,
    latency-bound launch spreads over more SMs in programs that each finish sooner."""
    most = max(1, 2048 // row_block)
    if max_rows is not None:
        most = min(most, max_rows)
    return min(most, 1 << max(0, (num_rows // programs).bit_length() - 1))


def tile_warps(rows: int, row_block: int) -> int:
    """Warps of a program holding ``rows`` x ``row_block`` elements: one per 512 elements,
    one to four (a one-row program of 128 stays in one warp: no cross-warp exchange)."""
    return max(1, min(4, rows * row_block // 512))


# Programmatic dependent launch (SM90+): a kernel launched with it may start while the kernel
# before it runs, reads only weights until it waits (``gdc_wait``) for that kernel, and
# lets its own dependents start early (``gdc_launch_dependents``). ``DSA_PDL`` in the
# environment at import: 1 (default) the decode metadata and the projections' partial sums,
# and the rest of the step's chain (prologue, paged logits, top-k) where it is small: at most
# ``CHAIN_ROWS`` tokens or rows, paged logits of at most ``CHAIN_KEYS`` entries; 2 the chain
# at every size; 0 none. H200 (BENCHMARKS.md, "twenty-first"; a V3.2 layer's step, µs,
# level 1 without and with the bounded chain): (1, 4K) 30.7 / 30.2, (4, 16K) 45.0 / 42.7,
# (16, 16K) 55.6 / 54.3, (8, 64K) 69.2 / 68.4, (2, 128K) 134.8 / 132.9; the chain at every
# size costs 3-4 µs at (64, 64K) (prologue and top-k of 64 rows) and 10-15 at (16, 64K)
# and (32, 32K) (dsa's paged logits over 1M entries). A chain of one row lets each kernel's
# dependents start before it waits (``chain_pdl``; H200, BENCHMARKS.md, "twenty-sixth", µs
# waiting first / starting them first): (1, 4K) 29.50 / 29.44, (1, 16K) 37.44 / 37.12,
# (1, 128K) 54.62 / 53.90; with more rows the waiting programs of the dependents cost
# (2, 16K) 39.68 / 42.30 and (4, 16K) 41.54 / 48.38. Unchained, the prologue still lets its
# dependent start: a large paged-logits call starts early (``PagedLogitsConfig.early_tiles``).
PDL_LEVELS = ("0", "1", "2")


def pdl_level(value: str | None) -> int:
    """The level ``DSA_PDL`` asks for (None, unset: 1)."""
    if value is None:
        return 1
    if value.strip() not in PDL_LEVELS:
        raise ValueError(f"dsa: the environment's DSA_PDL must be one of {', '.join(PDL_LEVELS)} "
                         f"(programmatic dependent launch: off, default, the whole chain), got "
                         f"{value!r}")
    return int(value)


PDL = pdl_level(os.environ.get("DSA_PDL"))
CHAIN_ROWS = 16
CHAIN_KEYS = 256 * 1024
EARLY_ROWS = 1


def pdl_enabled(x: torch.Tensor, small: bool | None = None) -> bool:
    """Whether a kernel on ``x``'s device takes programmatic dependent launch: an NVIDIA GPU
    of SM90+ (its waits and triggers, and the early start's L2 prefetch, are PTX), outside
    tracing (``wrap_triton`` does not pass launch options), ``DSA_PDL`` at least 1; a
    kernel of the step's chain (``small`` given: whether it is within ``CHAIN_ROWS`` /
    ``CHAIN_KEYS``) at ``DSA_PDL`` 2, or 1 where ``small``."""
    wanted = PDL >= 1 if small is None else PDL >= 2 or (PDL == 1 and small)
    return (wanted and on_nvidia_gpu(x) and not is_in_torch_dispatch_mode()
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


def chain_pdl(x: torch.Tensor, small: bool, rows: int) -> int:
    """The ``PDL`` constexpr of a kernel of the step's chain (see :func:`pdl_chain_wait`) over
    ``rows`` tokens or rows: 0 without programmatic dependent launch (:func:`pdl_enabled`
    with ``small``), 2 where they are at most ``EARLY_ROWS``, else 1."""
    if not pdl_enabled(x, small):
        return 0
    return 2 if rows <= EARLY_ROWS else 1


@triton.jit
def pdl_chain_wait(PDL: tl.constexpr):
    """A chain kernel's start: 1 waits for the kernel before it, then lets its dependents
    start; 2 lets them start first (they still wait for its end, which comes after its
    wait). Starting the dependents first helps only a tiny chain: where a kernel of it takes
    many programs, the dependents' waiting programs hold the SMs it needs."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif PDL == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def has_tma(x: torch.Tensor) -> bool:
    """Whether kernels on ``x``'s device can copy tiles by TMA (Hopper's tensor memory
    accelerator): an NVIDIA GPU of compute capability 9 or more (ROCm's devices are "cuda"
    too), or the CPU, where the interpreter runs them."""
    return not x.is_cuda or (torch.version.hip is None
                             and torch.cuda.get_device_capability(x.device)[0] >= 9)


def on_nvidia_gpu(x: torch.Tensor) -> bool:
    """Whether ``x`` lives on an NVIDIA GPU (ROCm's devices are "cuda" too), which runs
    kernels' inline PTX."""
    return x.is_cuda and torch.version.hip is None


def pdl_launch(pdl: bool) -> dict[str, bool]:
    """The launch option of a kernel launched with programmatic dependent launch or not."""
    return {"launch_pdl": True} if pdl else {}


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> Any:
    """``kernel[grid](*args, **kwargs)``, traceable: wrapped by ``wrap_triton`` while a torch
    dispatch mode is active (tracing), launched directly otherwise (no dispatch cost).
    Returns what the launch returns (Triton's ``CompiledKernel`` on a GPU)."""
    if is_in_torch_dispatch_mode():
        kernel = wrap_triton(kernel)
    return kernel[grid](*args, **kwargs)


class FixedLaunch:
    """``kernel[grid](*tensors, **fixed)`` for calls that differ only in ``tensors``' data.

    The first call launches through Triton's JIT and keeps the ``CompiledKernel`` it returns;
    later calls relaunch that directly (``CompiledKernel[grid]``), skipping the per-call
    argument binding, specialization and cache lookup of ``JITFunction.run``: most of a
    small launch's host time. Valid while ``tensors`` keep their dtypes, which the caller
    keys on; the kernel must not specialize on their alignment
    (``do_not_specialize_on_alignment``). The interpreter, tracing and another current device
    go through ``launch``.
    """

    def __init__(self, kernel: Any, grid: tuple[int, ...], **fixed: Any) -> None:
        self._kernel, self._grid, self._fixed = kernel, grid, fixed
        self._relaunch: Any = None
        self._device = -1
        self._tail: tuple[Any, ...] = ()

    def __call__(self, *tensors: Any) -> None:
        if self._relaunch is not None and not is_in_torch_dispatch_mode():
            device = torch.cuda.current_device()
            if device == self._device:  # the stream given: no lookup through Triton's driver
                self._relaunch(*tensors, *self._tail, stream=current_raw_stream(device))
                return
        compiled = launch(self._kernel, self._grid, *tensors, **self._fixed)
        if self._relaunch is None and isinstance(compiled, CompiledKernel):
            # A compiled kernel takes every argument in declaration order, constexprs too.
            self._tail = tuple(self._fixed[name]
                               for name in self._kernel.arg_names[len(tensors):])
            self._device = torch.cuda.current_device()
            self._relaunch = compiled[(*self._grid, 1, 1)[:3]]  # it reads three dims


def current_raw_stream(device: int) -> int:
    """The handle of ``device``'s current CUDA stream (what Triton's launcher takes)."""
    return torch._C._cuda_getCurrentRawStream(device)


def launch_1d(kernel: Any, n: int, *args: Any, cap: int = 1024, **constexprs: Any) -> None:
    """Launches ``kernel`` over ``n`` elements, ``BLOCK = block_for(n, cap)`` per program;
    nothing when ``n == 0``."""
    if n:
        block = block_for(n, cap)
        launch(kernel, (triton.cdiv(n, block),), *args, BLOCK=block, **constexprs)
