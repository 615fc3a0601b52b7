"""What the logits ops share: the output layout, fp8 decoding, a K tile's logits in the
kernels and the backend choice.

For query row t and key s (``w`` already folds q's scale, see :mod:`dsa.ops.quant`)::

    logits[t, s] = k_scale[s] * sum_h w[t, h] * relu(dot(q[t, h], k[s]))

A NaN dot product (a NaN fp8 code in q or K, which quantisation never writes: a cache slot
never written) counts as 0 after the relu on every face, as the GPU's ``max`` gives it.

Outputs are ``[rows, cols]`` views of buffers whose row stride is ``align(cols, 256)``
floats, as DeepGEMM allocates them; :func:`alloc_logits` makes them for every face.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsa.ops._checks import check_choice

LOGITS_ALIGN = 256
LOGITS_BACKENDS = ("auto", "triton", "deepgemm")


def alloc_logits(rows: int, cols: int, device: torch.device) -> Tensor:
    """fp32 ``[rows, cols]`` view of a ``[rows, align(cols, 256)]`` buffer (DeepGEMM's layout)."""
    width = (cols + LOGITS_ALIGN - 1) // LOGITS_ALIGN * LOGITS_ALIGN
    return torch.empty(rows, width, dtype=torch.float32, device=device).narrow(1, 0, cols)


@triton.jit
def tile_logits(k, k_scale, q_t, w, TILE: tl.constexpr, ROWS: tl.constexpr, HP: tl.constexpr):
    """``[TILE, ROWS]`` logits of a K tile against ROWS query rows: ``[TILE, ROWS * HP]``
    scores, keys on the MMA's M side (each key's head sums stay within a thread and its
    quad); row i's heads are the HP consecutive columns ``i * HP + h`` of ``q_t`` (q
    transposed, ``[D, ROWS * HP]``: transposed once before a loop over tiles, q is staged in
    shared memory once, not for every tile) and ``w``, summed in one reduction for all
    rows."""
    s = tl.maximum(tl.dot(k, q_t), 0.0) * w[None, :]
    return tl.sum(tl.reshape(s, (TILE, ROWS, HP)), axis=2) * k_scale[:, None]


def relu_nan_zero(scores: Tensor) -> Tensor:
    """Torch, in place: relu with NaN as 0 (the kernels' ``tl.maximum(x, 0)``)."""
    return scores.relu_().nan_to_num_(nan=0.0)


def fp8_rows(value_bytes: Tensor) -> Tensor:
    """float32 values of fp8 e4m3 bytes."""
    return value_bytes.view(torch.float8_e4m3fn).float()


def choose_backend(op: str, arg: str, backend: str,
                   deepgemm_reason: Callable[[], str | None]) -> str:
    """The implementation a logits call runs: "deepgemm" or "triton" (dsa's own kernel:
    Triton on CUDA, plain torch on the CPU).

    ``backend`` (the caller ``op``'s argument ``arg``) is one of ``LOGITS_BACKENDS``;
    ``deepgemm_reason()`` says why DeepGEMM cannot take the call (None: it can), asked only
    when ``backend`` is not "triton". "auto" takes DeepGEMM where it can run; an explicit
    "deepgemm" that cannot run raises with the reason.
    """
    check_choice(op, arg, backend, LOGITS_BACKENDS)
    if backend == "triton":
        return backend
    reason = deepgemm_reason()
    if backend == "deepgemm" and reason is not None:
        raise ValueError(f"dsa.{op}: {arg}='deepgemm' cannot run this call: {reason}")
    return "deepgemm" if reason is None else "triton"
