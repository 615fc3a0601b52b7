"""GPU checks of the quantising and cache ops: the Triton faces equal the CPU faces byte for
byte on large inputs, and the cache write works on a module buffer under torch.compile and
CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from dsa.ops import FACES

pytestmark = pytest.mark.gpu


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int32)


def same_on_cpu_and_gpu(name: str, *args) -> None:
    """The op's CUDA face on ``args`` equals its CPU face on CPU copies, bit for bit."""
    gpu = FACES[name].cuda(*args)
    cpu = FACES[name].cpu(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    if isinstance(gpu, torch.Tensor):
        gpu, cpu = (gpu,), (cpu,)
    for g, c in zip(gpu, cpu, strict=True):
        assert torch.equal(_bytes(g).cpu(), _bytes(c))


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_q_gpu_equals_cpu(ue8m0, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = torch.logspace(-5, 3, 4096, device="cuda")[:, None, None]
    q = (torch.randn(4096, 64, 128, device="cuda", generator=gen) * scale).to(dtype)
    weights = torch.randn(4096, 64, device="cuda", generator=gen)
    same_on_cpu_and_gpu("quantize_q", q, weights, ue8m0)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_cache_write_gpu_equals_cpu(ue8m0):
    gen = torch.Generator(device="cuda").manual_seed(1)
    num_blocks, block_size, head_dim, tokens = 2048, 64, 128, 65536
    cache = torch.randint(0, 256, (num_blocks, block_size, 1, head_dim + 4), device="cuda",
                          dtype=torch.uint8, generator=gen)
    k = torch.randn(tokens, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    slots = torch.randperm(num_blocks * block_size + 1000, device="cuda", generator=gen)[:tokens]
    slots[::7] = -1  # and the ones past num_blocks * block_size are out of range
    cpu_cache = cache.cpu()
    FACES["quantize_and_cache_k"].cuda(k, cache, slots, ue8m0)
    FACES["quantize_and_cache_k"].cpu(k.cpu(), cpu_cache, slots.cpu(), ue8m0)
    assert torch.equal(cache.cpu(), cpu_cache)


def test_gather_k_gpu_equals_cpu():
    gen = torch.Generator(device="cuda").manual_seed(2)
    cache = torch.randint(0, 256, (512, 64, 1, 132), device="cuda", dtype=torch.uint8,
                          generator=gen)
    lens = torch.randint(0, 3000, (9,), device="cuda", generator=gen)
    cu = torch.zeros(10, dtype=torch.int32, device="cuda")
    cu[1:] = lens.cumsum(0)
    table = torch.randint(-1, 520, (9, 50), device="cuda", dtype=torch.int32, generator=gen)
    same_on_cpu_and_gpu("gather_k", cache, table, cu, int(cu[-1]) + 100)


def test_indices_to_slots_gpu_equals_cpu():
    gen = torch.Generator(device="cuda").manual_seed(3)
    indices = torch.randint(-1, 70000, (256, 2048), device="cuda", dtype=torch.int32,
                            generator=gen)
    table = torch.randint(-1, 100000, (64, 1024), device="cuda", dtype=torch.int32,
                          generator=gen)
    requests = torch.randint(-1, 66, (256,), device="cuda", dtype=torch.int32, generator=gen)
    table[:, ::97] = 2**30  # slots that would overflow int32
    # about a fifth of the entries lie at or past the cache's 80000 blocks
    same_on_cpu_and_gpu("indices_to_slots", indices, table, requests, 64, 80000)


class DecodeStep(torch.nn.Module):
    """Writes this step's K into the cache buffer, then scores the queries against it."""

    def __init__(self, num_blocks: int, max_len: int):
        super().__init__()
        self.register_buffer("kv_cache", torch.zeros(num_blocks, 64, 1, 132, dtype=torch.uint8,
                                                     device="cuda"))
        self.max_len = max_len

    def forward(self, k, slots, q, weights, lens, table):
        torch.ops.dsa.quantize_and_cache_k(k, self.kv_cache, slots)
        q_fp8, head_weights = torch.ops.dsa.quantize_q(q, weights)
        batch = lens.shape[0]
        return torch.ops.dsa.paged_mqa_logits(q_fp8.view(batch, 1, 64, 128), self.kv_cache,
                                              head_weights, lens, table, self.max_len)


def test_cache_write_on_module_buffer_compiled_with_cuda_graphs():
    batch, max_len, width = 8, 1024, 16
    eager, compiled = DecodeStep(batch * width, max_len), DecodeStep(batch * width, max_len)
    step = torch.compile(compiled, fullgraph=True, mode="reduce-overhead")
    gen = torch.Generator(device="cuda").manual_seed(4)
    table = torch.arange(batch * width, device="cuda", dtype=torch.int32).view(batch, width)
    for i in range(6):
        lens = torch.full((batch, 1), 100 * (i + 1), device="cuda", dtype=torch.int32)
        slots = (table.long()[:, (100 * (i + 1) - 1) // 64] * 64 + (100 * (i + 1) - 1) % 64)
        k = torch.randn(batch, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
        q = torch.randn(batch, 64, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
        weights = torch.randn(batch, 64, device="cuda", generator=gen)
        want = eager(k, slots, q, weights, lens, table)
        got = step(k, slots, q, weights, lens, table).clone()
        assert torch.equal(compiled.kv_cache, eager.kv_cache)
        assert torch.equal(got, want)
