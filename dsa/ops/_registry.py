"""Registration of ``torch.ops.dsa.*``: one op, three faces.

An op is declared on its validate-and-allocate helper, whose annotations give the schema
and which is the op's fake face; the CPU face (plain torch) and the CUDA face attach to the
declaration, and the op is registered once both are there::

    @dsa_op("decode_token_lens")
    def _decode_token_lens_out(query_start_loc: Tensor, seq_lens: Tensor,
                               num_tokens: int) -> Tensor:
        ...  # checks that name the op, the argument, what was expected and what came
        return query_start_loc.new_empty(num_tokens, dtype=torch.int32)

    @_decode_token_lens_out.cpu
    def _decode_token_lens_cpu(query_start_loc, seq_lens, num_tokens): ...

    @_decode_token_lens_out.triton
    def _decode_token_lens_cuda(query_start_loc, seq_lens, num_tokens): ...

The CUDA face attaches as ``.triton`` when it is only torch ops and Triton kernels launched
through ``dsa.ops._launch.launch``: the op is then a ``torch.library.triton_op``, which
``torch.compile`` and AOTInductor decompose on CUDA tensors into the kernel calls themselves
(Inductor sees, schedules and compiles them; an AOTInductor package holds their binaries);
``torch.export`` keeps the op. Any other CUDA face (DeepGEMM) attaches as ``.cuda`` and the
op is an opaque ``torch.library.custom_op``. The ``.triton`` registration is opt-in:
``DSA_TRITON_OP=1`` in the environment at import; by default every op is opaque (measured on
the H200, README "Triton kernels Inductor can see").

``FACES`` records every op's faces, so the tests run each one against the loop reference
(the CUDA face on CPU tensors under ``TRITON_INTERPRET=1``). This module is the only place
that knows how an op is registered with torch.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.utils._pytree import tree_any

TRITON_OP = os.environ.get("DSA_TRITON_OP", "0") == "1"


@dataclass(frozen=True)
class Faces:
    cpu: Callable
    cuda: Callable
    fake: Callable
    traceable: bool  # registered as a triton_op: compile and AOTInductor see its kernels


FACES: dict[str, Faces] = {}


class OpDecl:
    """A declared op: call it to validate and allocate; ``.cpu`` / ``.cuda`` attach faces."""

    def __init__(self, name: str, alloc: Callable, mutates_args: Sequence[str]) -> None:
        functools.update_wrapper(self, alloc)
        self.name = name
        self.alloc = alloc
        self.mutates_args = tuple(mutates_args)
        self._faces: dict[str, Callable] = {}
        self._traceable = False
        self.op: torch.library.CustomOpDef | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.alloc(*args, **kwargs)

    def cpu(self, fn: Callable) -> Callable:
        """Attaches the CPU face (plain torch)."""
        return self._attach("cpu", fn)

    def cuda(self, fn: Callable) -> Callable:
        """Attaches an opaque CUDA face (DeepGEMM, or anything torch may not trace)."""
        return self._attach("cuda", fn)

    def triton(self, fn: Callable) -> Callable:
        """Attaches a CUDA face made of torch ops and Triton kernels launched through
        ``dsa.ops._launch.launch``, which torch may trace into (see the module doc). Not for
        an op that mutates: a compiled graph's writes through a ``triton_op`` went wrong
        (README, "Triton kernels Inductor can see")."""
        if self.mutates_args:
            raise RuntimeError(f"dsa::{self.name} mutates {self.mutates_args}: attach its CUDA "
                               f"face with .cuda (an opaque op), not .triton")
        self._traceable = True
        return self._attach("cuda", fn)

    def _attach(self, device: str, fn: Callable) -> Callable:
        if device in self._faces:
            raise RuntimeError(f"dsa::{self.name}: a {device} face is already attached")
        self._faces[device] = fn
        if len(self._faces) == 2:
            self._register()
        return fn

    def _register(self) -> None:
        cpu, cuda = self._faces["cpu"], self._faces["cuda"]
        qualname = f"dsa::{self.name}"
        schema = torch.library.infer_schema(self.alloc, mutates_args=self.mutates_args)
        traceable = self._traceable and TRITON_OP
        if traceable:
            op = _triton_op(qualname, cuda, self.mutates_args, schema)
            op.register_kernel("cpu")(cpu)
        else:
            op = torch.library.custom_op(qualname, cpu, mutates_args=self.mutates_args,
                                         device_types="cpu", schema=schema)
            op.register_kernel("cuda")(cuda)
        op.register_fake(self.alloc)
        FACES[self.name] = Faces(cpu=cpu, cuda=cuda, fake=self.alloc, traceable=traceable)
        self.op = op


def _triton_op(qualname: str, cuda: Callable, mutates_args: tuple[str, ...],
               schema: str) -> torch.library.CustomOpDef:
    """``torch.library.triton_op`` of the CUDA face, decomposed on CUDA tensors only.

    ``triton_op`` runs its function for every device and decomposes it under
    ``FunctionalTensorMode`` whatever the inputs' device; a dsa op has its own CPU face,
    which must stay one op in a CPU graph, so the decomposition is kept for CUDA inputs.
    """
    inferred = torch.library.infer_schema(cuda, mutates_args=mutates_args)
    if inferred != schema:
        raise TypeError(f"{qualname}: the Triton face's signature {inferred} differs from "
                        f"the declaration's {schema}")
    op = torch.library.triton_op(qualname, cuda, mutates_args=mutates_args)
    decompose = op._torch_dispatch_fns[FunctionalTensorMode]

    def on_cuda(mode: FunctionalTensorMode, func: Any, types: Any, args: tuple,
                kwargs: dict) -> Any:
        if tree_any(lambda x: isinstance(x, torch.Tensor) and x.is_cuda, (args, kwargs)):
            return decompose(mode, func, types, args, kwargs)
        return mode.__torch_dispatch__(func, types, args, kwargs)

    op.register_torch_dispatch(FunctionalTensorMode, on_cuda)
    _record_kernels(qualname, cuda)
    return op


def _record_kernels(qualname: str, face: Callable) -> None:
    """Lists the Triton kernels of the face's module as the op's kernels (compile caches
    key on their source): ``triton_op`` finds only those named in ``wrap_triton(...)``
    calls of the face's own source, and dsa's faces launch through a helper."""
    from triton.runtime.jit import JITFunction

    by_op = getattr(torch._library.triton, "triton_ops_to_kernels", None)
    if by_op is None:  # a torch without the table keys its caches otherwise
        return
    kernels = by_op.setdefault(qualname, [])
    kernels.extend(v for v in face.__globals__.values()
                   if isinstance(v, JITFunction) and v not in kernels)


def dsa_op(name: str, *, mutates_args: Sequence[str] = ()) -> Callable[[Callable], OpDecl]:
    """Declares ``dsa::<name>`` on its validate-and-allocate helper (see the module doc)."""

    def declare(alloc: Callable) -> OpDecl:
        return OpDecl(name, alloc, mutates_args)

    return declare
