"""torch.export and AOTInductor of a whole decode step (metadata + N Indexer layers).

The step is a module whose layers hold their K caches as buffers: the exported program
writes them in place (the ``quantize_and_cache_k`` mutation survives export), so each step
reads the K of the steps before it, as eager does. CPU here; the GPU variants run each
logits backend and check that the AOTInductor package holds dsa's Triton kernels.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import zipfile

import pytest
import torch

import dsa
from dsa.graphs import pad_batch
from dsa.ops._registry import TRITON_OP
from dsa.ops.logits.deepgemm import deepgemm_paged_supported
from tests.batches import random_decode_batch, table_width

HIDDEN, Q_LORA_RANK, LAYERS, CAPACITY, STEPS = 64, 32, 2, 4, 4


class DecodeStep(torch.nn.Module):
    """One decode step: the metadata built once, then every layer."""

    def __init__(self, cfg: dsa.IndexerConfig, layers: list[dsa.Indexer]) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, batch: dsa.Batch, hidden: torch.Tensor,
                q_latent: torch.Tensor) -> list[dsa.IndexerOutput]:
        meta = dsa.build_decode_metadata(self.cfg, batch)
        return [layer(hidden, q_latent, batch.positions, meta) for layer in self.layers]


def make_cfg(**overrides) -> dsa.IndexerConfig:
    cfg = dsa.IndexerConfig(max_num_reqs=CAPACITY, max_num_batched_tokens=16, max_model_len=512,
                            next_n=2, topk=32, **overrides)
    return dataclasses.replace(cfg, num_blocks=CAPACITY * table_width(cfg))


def make_step(device: str, **overrides) -> DecodeStep:
    cfg = make_cfg(**overrides)
    torch.manual_seed(0)
    layers = [dsa.Indexer(cfg, hidden_size=HIDDEN, q_lora_rank=Q_LORA_RANK, dtype=torch.float32,
                          device=device) for _ in range(LAYERS)]
    return DecodeStep(cfg, layers)


def step_inputs(cfg: dsa.IndexerConfig, device: str) -> list[tuple]:
    """STEPS padded batches (one capacity: one program) over one block pool, with inputs."""
    rng = random.Random(0)
    capacity = (CAPACITY, CAPACITY * cfg.next_n, table_width(cfg))
    steps = []
    for num_reqs in [CAPACITY, 2, 0, 3][:STEPS]:
        batch = pad_batch(random_decode_batch(rng, cfg, num_reqs, device=device), *capacity)
        steps.append((batch, torch.randn(batch.num_tokens, HIDDEN, device=device),
                      torch.randn(batch.num_tokens, Q_LORA_RANK, device=device)))
    return steps


def run_steps(fn, steps: list[tuple]) -> list[torch.Tensor]:
    outs = []
    for args in steps:
        outs += [t for o in fn(*args) for t in (o.indices, o.slots)]
    return outs


def kv_caches(module: torch.nn.Module) -> list[torch.Tensor]:
    return [module.get_buffer(f"layers.{i}.kv_cache") for i in range(LAYERS)]


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor], *, bitwise: bool) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if bitwise:
            assert torch.equal(g, w)
        else:  # Inductor's fused projections may round differently: the same selected sets
            assert torch.equal(g.sort(-1).values, w.sort(-1).values)


def check_export(device: str, tmp_path, **overrides) -> None:
    step = make_step(device, **overrides)
    eager = copy.deepcopy(step)
    steps = step_inputs(step.cfg, device)
    program = torch.export.export(step, steps[0])
    mutated = set(program.run_decompositions().graph_signature.buffers_to_mutate.values())
    assert {f"layers.{i}.kv_cache" for i in range(LAYERS)} <= mutated
    torch.export.save(program, tmp_path / "step.pt2")
    loaded = torch.export.load(tmp_path / "step.pt2").module()
    want = run_steps(eager, steps)
    assert_same(run_steps(loaded, steps), want, bitwise=True)
    assert all(torch.equal(a, b) for a, b in zip(kv_caches(loaded), kv_caches(eager)))


def check_aoti(device: str, tmp_path, **overrides) -> str:
    """Packages the exported step, loads it with the K caches as caller-owned tensors, runs
    STEPS steps against eager; returns the package path."""
    step = make_step(device, **overrides)
    eager = copy.deepcopy(step)
    steps = step_inputs(step.cfg, device)
    path = torch._inductor.aoti_compile_and_package(
        torch.export.export(step, steps[0]), package_path=str(tmp_path / "step.pt2"))
    package = torch._inductor.aoti_load_package(path)
    caches = {f"layers.{i}.kv_cache": torch.zeros_like(c) for i, c in enumerate(kv_caches(step))}
    package.load_constants(caches, check_full_update=False, user_managed=True)
    want = run_steps(eager, steps)
    assert_same(run_steps(package, steps), want, bitwise=False)
    for cache, ref in zip(caches.values(), kv_caches(eager)):  # the same blocks written
        written = ref.ne(0).any(dim=(1, 2, 3))
        assert written.any() and torch.equal(cache.ne(0).any(dim=(1, 2, 3)), written)
    return path


def test_exported_step_matches_eager(tmp_path):
    check_export("cpu", tmp_path)


@pytest.mark.slow
def test_aoti_package_matches_eager(tmp_path):
    check_aoti("cpu", tmp_path)


BACKENDS = ["triton", pytest.param("deepgemm", marks=pytest.mark.deepgemm)]


def _skip_without(backend: str) -> None:
    cfg = make_cfg()
    if backend == "deepgemm" and not deepgemm_paged_supported(
            torch.device("cuda"), cfg.num_heads, cfg.head_dim, cfg.block_size, cfg.next_n):
        pytest.skip("DeepGEMM's paged logits cannot run here")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_exported_step_matches_eager_gpu(tmp_path, backend):
    _skip_without(backend)
    check_export("cuda", tmp_path, logits_backend=backend)


@pytest.mark.gpu
@pytest.mark.skipif(torch.__version__ < "2.12", reason="torch 2.11: loading a CUDA AOTInductor "
                    "package of the step segfaults in aoti_load_package (H200, README)")
@pytest.mark.parametrize("backend", BACKENDS)
def test_aoti_package_matches_eager_gpu(tmp_path, backend):
    """... and, with triton_op, dsa's Triton kernels are compiled into the package (no call
    back into Python for them); DeepGEMM's stay custom-op calls."""
    _skip_without(backend)
    path = check_aoti("cuda", tmp_path, logits_backend=backend)
    with zipfile.ZipFile(path) as package:
        blob = b"".join(package.read(name) for name in package.namelist())
    kernels = [b"_select_kernel", b"_candidates_kernel"]
    if backend == "triton":
        kernels.append(b"_paged_logits_kernel")
    missing = [k.decode() for k in kernels if k not in blob]
    assert not missing or not TRITON_OP, f"not compiled into the package: {missing}"
