"""Triton faces as ``torch.library.triton_op``: Inductor sees their kernels on CUDA inputs,
CPU graphs keep the op, ``DSA_TRITON_OP=0`` keeps every op opaque (dsa/ops/_registry.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsa.ops import FACES
from dsa.ops._registry import TRITON_OP
from tests.graph_ops import metadata_graph_calls

ROOT = Path(__file__).resolve().parents[1]
# DeepGEMM; the fused metadata (DeepGEMM's schedule inside); the writes of mutable state;
# the no-FMA prologue (README, "Triton kernels Inductor can see").
OPAQUE = {"paged_mqa_logits_deepgemm", "mqa_logits_deepgemm", "paged_mqa_schedule",
          "decode_metadata", "quantize_and_cache_k", "pad_batch_out", "rope_hadamard_quantize_q",
          "rope_hadamard_quantize_and_cache_k", "project_quantize_and_cache_k",
          "topk_indices_and_slots_consume"}


def test_triton_faces_register_as_triton_ops():
    assert all(not FACES[name].traceable for name in OPAQUE)
    for name in ("decode_token_lens", "gather_k", "paged_mqa_logits", "topk_indices_and_slots",
                 "topk_scored", "dcp_merge_topk", "mqa_logits", "topk_indices",
                 "indices_to_slots"):
        assert FACES[name].traceable == TRITON_OP, name


def test_ops_that_mutate_stay_opaque():
    from dsa.ops._registry import dsa_op

    mutating = {name for name in FACES
                if getattr(torch.ops.dsa, name).default._schema.is_mutable}
    assert mutating == {"quantize_and_cache_k", "rope_hadamard_quantize_and_cache_k",
                        "project_quantize_and_cache_k", "pad_batch_out",
                        "topk_indices_and_slots_consume"}
    assert not any(FACES[name].traceable for name in mutating)

    @dsa_op("_mutating_probe", mutates_args=("out",))
    def _probe_out(out: torch.Tensor) -> None:
        pass

    with pytest.raises(RuntimeError, match=r"dsa::_mutating_probe mutates \('out',\): attach"):
        _probe_out.triton(lambda out: None)


def test_cpu_graph_keeps_the_ops():
    assert metadata_graph_calls("cpu") == {"dsa": 3, "triton": 0}


def with_real_triton(module: str, *args: str, **env: str) -> object:
    """The JSON a test module (``python -m tests.<module> *args``) prints last, run in a
    subprocess without TRITON_INTERPRET: real Triton kernels, not the interpreter's."""
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, **env,
           "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", f"tests.{module}", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("triton_op", ["1", "0"])
def test_cuda_graph_holds_the_kernels(triton_op):
    """On (fake) CUDA inputs the metadata ops decompose into their kernel calls; opaque
    with DSA_TRITON_OP=0."""
    calls = with_real_triton("graph_ops", "cuda", DSA_TRITON_OP=triton_op)
    assert calls == ({"dsa": 0, "triton": 3} if triton_op == "1" else {"dsa": 3, "triton": 0})


def test_inductor_copies_of_the_kernels_are_self_contained():
    """Inductor compiles a traced triton_op's kernels from copies of their sources
    (tests/kernel_sources.py): every global a copy loads is in it."""
    result = with_real_triton("kernel_sources")
    assert result["kernels"] >= 20
    assert result["undefined"] == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU only")
def test_launch_runs_the_raw_kernel_outside_tracing():
    """Tests call the Triton face directly on CPU tensors (interpreter): no wrap there."""
    from tests.faces import i32

    out = FACES["decode_token_lens"].cuda(i32([0, 2, 3]), i32([5, 1]), 4)
    assert out.tolist() == [4, 5, 1, 0]
