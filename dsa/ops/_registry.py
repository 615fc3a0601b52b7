"""Registration of ``torch.ops.dsa.*``: one op, three faces.

Every op is a ``torch.library.custom_op`` with

- a CPU face in plain torch (the schema is inferred from its annotations),
- a CUDA face (a Triton kernel, or DeepGEMM),
- a fake face, usually the same validate-and-allocate helper the real faces call,

recorded in ``FACES`` so the tests can run each face against the loop reference (the
CUDA face on CPU tensors under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Faces:
    cpu: Callable
    cuda: Callable
    fake: Callable


FACES: dict[str, Faces] = {}


def register(
    name: str,
    *,
    cpu: Callable,
    cuda: Callable,
    fake: Callable,
    mutates_args: Sequence[str] = (),
) -> torch.library.CustomOpDef:
    """Defines ``dsa::<name>`` from its three faces and returns the op."""
    op = torch.library.custom_op(
        f"dsa::{name}", cpu, mutates_args=tuple(mutates_args), device_types="cpu"
    )
    op.register_kernel("cuda")(cuda)
    op.register_fake(fake)
    FACES[name] = Faces(cpu=cpu, cuda=cuda, fake=fake)
    return op
