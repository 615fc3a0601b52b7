"""Running one op face on CPU-side inputs, for tests that compare faces to the reference.

- ``"cpu"``: ``torch.ops.dsa.<op>`` on CPU tensors (the CPU face through the dispatcher).
- ``"kernel"``: the CUDA face. With a GPU, ``torch.ops.dsa.<op>`` on CUDA copies of the
  inputs; without one, the CUDA face called directly on the CPU tensors, which runs its
  Triton kernel under ``TRITON_INTERPRET=1`` (set by conftest).
- ``"fake"``: the op as tracing runs it, under FakeTensorMode (shapes and checks only).

Outputs always come back as CPU tensors. ``KERNEL_MARK`` marks kernel-face tests (``gpu``
on a CUDA machine, ``interpret`` elsewhere); ``FACE_NAMES`` parametrizes a test over the
CPU and kernel faces with that mark; ``CPU_EXAMPLES`` / ``KERNEL_EXAMPLES`` are the
hypothesis budgets of the two (the interpreter costs ~1 ms per Triton program).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis.strategies import SearchStrategy
from torch._subclasses.fake_tensor import FakeTensorMode

from dsa.ops import FACES

HAS_CUDA = torch.cuda.is_available()
KERNEL_MARK = pytest.mark.gpu if HAS_CUDA else pytest.mark.interpret
# ``@pytest.mark.parametrize("face", FACE_NAMES)``: the CPU face and the kernel face.
FACE_NAMES = ("cpu", pytest.param("kernel", marks=KERNEL_MARK))


def i32(x: Any) -> torch.Tensor:
    """An int32 CPU tensor of ``x`` (a number or nested lists)."""
    return torch.tensor(x, dtype=torch.int32)


def _to(x: Any, device: str) -> Any:
    if isinstance(x, torch.Tensor):  # keep the strides: kernels must honour them
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device).copy_(x)
    if isinstance(x, tuple):
        return tuple(_to(v, device) for v in x)
    return x


def to_cpu(x: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``x`` with the same strides (``.cpu()`` would make it contiguous)."""
    return _to(x, "cpu")


def run_op(face: str, name: str, *args: Any) -> Any:
    """Runs op ``name`` on ``face`` ("cpu", "kernel" or "fake"); returns CPU tensor(s)
    (fake tensors for "fake")."""
    if face == "cpu":
        return getattr(torch.ops.dsa, name)(*args)
    if face == "fake":
        return _run_fake(name, *args)
    if face != "kernel":
        raise ValueError(f"unknown face {face!r}")
    if HAS_CUDA:
        return _to(getattr(torch.ops.dsa, name)(*_to(args, "cuda")), "cpu")
    return FACES[name].cuda(*args)


def opcheck_test(cases: Sequence[tuple], *, op: str | None = None) -> Callable:
    """A test running ``torch.library.opcheck`` on each (op name, args) of ``cases`` (each
    args alone with ``op``). Assign it to a ``test_*`` name of the test module."""
    cases = [(op, args) for args in cases] if op is not None else list(cases)

    @pytest.mark.parametrize(("name", "args"), cases)
    def test(name: str, args: tuple) -> None:
        torch.library.opcheck(getattr(torch.ops.dsa, name), args)

    return test


def validation_test(cases: Sequence[tuple], *, op: str | None = None) -> Callable:
    """A test: each (op name, args, error type, message pattern) of ``cases`` (without the
    name with ``op``) raises that error eagerly (the CPU face) and at trace time (the fake
    face runs the same checks). Assign it to a ``test_*`` name of the test module."""
    cases = [(op, *case) for case in cases] if op is not None else list(cases)

    @pytest.mark.parametrize(("name", "args", "error", "match"), cases)
    @pytest.mark.parametrize("face", ["cpu", "fake"])
    def test(name: str, args: tuple, error: type[Exception], match: str, face: str) -> None:
        with pytest.raises(error, match=match):
            run_op(face, name, *args)

    return test


CPU_EXAMPLES = settings(max_examples=250)
KERNEL_EXAMPLES = settings(max_examples=25)


def face_tests(check: Callable[..., None], cpu: dict[str, SearchStrategy],
                    kernel: dict[str, SearchStrategy] | None = None) -> tuple[Callable, Callable]:
    """Two property tests of ``check(face, **drawn)``: the CPU face on the strategies of
    ``cpu`` (``CPU_EXAMPLES``), the kernel face on those of ``kernel`` (default: ``cpu``;
    smaller ones, since the interpreter is slow; ``KERNEL_EXAMPLES``, ``KERNEL_MARK``).
    Assign them to ``test_<op>_cpu, test_<op>_kernel`` of the test module."""

    def on_cpu(**drawn: Any) -> None:
        check("cpu", **drawn)

    def on_kernel(**drawn: Any) -> None:
        check("kernel", **drawn)

    for test, face in ((on_cpu, "cpu"), (on_kernel, "kernel")):
        test.__name__ = test.__qualname__ = f"{check.__name__}_{face}"
    return (CPU_EXAMPLES(given(**cpu)(on_cpu)),
            KERNEL_MARK(KERNEL_EXAMPLES(given(**(cpu if kernel is None else kernel))(on_kernel))))


def strided_rows(table: torch.Tensor, extra: int = 3) -> torch.Tensor:
    """The same values as ``table`` in a row-strided view (stride(0) > width). The entries
    past the width hold block 1, inside any test cache of two blocks or more: a kernel that
    reads past the width then writes or selects where it must not, visibly."""
    wide = torch.full((table.shape[0], table.shape[1] + extra), 1, dtype=table.dtype)
    wide[:, : table.shape[1]] = table
    return wide[:, : table.shape[1]]


def _run_fake(name: str, *args: Any) -> Any:
    """Runs op ``name`` as tracing does: under FakeTensorMode, on fake copies of ``args``."""
    mode = FakeTensorMode()
    fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
    with mode:
        return getattr(torch.ops.dsa, name)(*fake_args)
