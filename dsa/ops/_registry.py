"""Registration of ``torch.ops.dsa.*``: one op, three faces.

An op is declared on its validate-and-allocate helper, whose annotations give the schema
and which is the op's fake face; the CPU face (plain torch) and the CUDA face (Triton or
DeepGEMM) attach to the declaration, and the op is registered once both are there::

    @dsa_op("decode_token_lens")
    def _decode_token_lens_out(query_start_loc: Tensor, seq_lens: Tensor,
                               num_tokens: int) -> Tensor:
        ...  # checks that name the op, the argument, what was expected and what came
        return query_start_loc.new_empty(num_tokens, dtype=torch.int32)

    @_decode_token_lens_out.cpu
    def _decode_token_lens_cpu(query_start_loc, seq_lens, num_tokens): ...

    @_decode_token_lens_out.cuda
    def _decode_token_lens_cuda(query_start_loc, seq_lens, num_tokens): ...

``FACES`` records every op's faces, so the tests run each one against the loop reference
(the CUDA face on CPU tensors under ``TRITON_INTERPRET=1``). This module is the only place
that knows how an op is registered with torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Faces:
    cpu: Callable
    cuda: Callable
    fake: Callable


FACES: dict[str, Faces] = {}


class OpDecl:
    """A declared op: call it to validate and allocate; ``.cpu`` / ``.cuda`` attach faces."""

    def __init__(self, name: str, alloc: Callable, mutates_args: Sequence[str]) -> None:
        functools.update_wrapper(self, alloc)
        self.name = name
        self.alloc = alloc
        self.mutates_args = tuple(mutates_args)
        self._faces: dict[str, Callable] = {}
        self.op: torch.library.CustomOpDef | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.alloc(*args, **kwargs)

    def cpu(self, fn: Callable) -> Callable:
        """Attaches the CPU face (plain torch)."""
        return self._attach("cpu", fn)

    def cuda(self, fn: Callable) -> Callable:
        """Attaches the CUDA face (a Triton kernel, or DeepGEMM)."""
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
        schema = torch.library.infer_schema(self.alloc, mutates_args=self.mutates_args)
        op = torch.library.custom_op(f"dsa::{self.name}", cpu, mutates_args=self.mutates_args,
                                     device_types="cpu", schema=schema)
        op.register_kernel("cuda")(cuda)
        op.register_fake(self.alloc)
        FACES[self.name] = Faces(cpu=cpu, cuda=cuda, fake=self.alloc)
        self.op = op


def dsa_op(name: str, *, mutates_args: Sequence[str] = ()) -> Callable[[Callable], OpDecl]:
    """Declares ``dsa::<name>`` on its validate-and-allocate helper (see the module doc)."""

    def declare(alloc: Callable) -> OpDecl:
        return OpDecl(name, alloc, mutates_args)

    return declare
