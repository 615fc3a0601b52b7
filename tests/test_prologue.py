"""dsa::rope_hadamard_quantize_q and dsa::rope_hadamard_quantize_and_cache_k (design §2,
"Prologue"): both faces byte for byte against a reference of the documented rounding order,
within fp8 precision of float64, and within one fp8 step of the unfused path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import reference_compute as ref
import torch
from faces import FACE_NAMES, HAS_CUDA, face_tests, opcheck_test, run_op, validation_test
from hypothesis import strategies as st
from test_kcache import random_cache, random_slots, write_cache
from unfused import hadamard_matrix, unfused_prologue

from dsa.ops import FACES
from dsa.ops._launch import row_tile, tile_warps
from dsa.ops.kcache import kcache_views
from dsa.ops.prologue import k_prologue_triton, q_prologue_triton
from dsa.rope import rope_table

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
Q_OP, K_OP = "rope_hadamard_quantize_q", "rope_hadamard_quantize_and_cache_k"


def random_rows(gen, shape, dtype):
    """Rows (along the last dim) of magnitudes from 1e-5 to 1e3."""
    rows = math.prod(shape[:-1])
    magnitude = torch.logspace(-5, 3, max(rows, 1))[torch.randperm(rows, generator=gen)]
    return (torch.randn(shape, generator=gen) * magnitude.view(*shape[:-1], 1)).to(dtype)


def rotation_case(gen, num_tokens, head_dim, rope_dim, max_len=16):
    """A RoPE table and positions, some outside it (clamped into it by the ops)."""
    cos_sin = rope_table(max_len, rope_dim, 10000.0)
    positions = torch.randint(-3, max_len + 3, (num_tokens,), generator=gen)
    return cos_sin, positions


def reference_rotation(x, cos_sin, positions, hadamard, interleaved=False):
    """float64 ``x.shape`` of design §2's prologue rounding order, row by row."""
    rows = cos_sin[positions.long().clamp(0, cos_sin.shape[0] - 1)].numpy()
    flat = x.float().reshape(x.shape[0], math.prod(x.shape[1:-1]), x.shape[-1]).numpy()
    out = np.zeros(flat.shape)
    for t, token_rows in enumerate(flat):
        for i, row in enumerate(token_rows):
            out[t, i] = ref.rope_hadamard_row(row, rows[t], hadamard, DTYPE_NAMES[x.dtype],
                                              interleaved)
    return out.reshape(x.shape)


def exact_rotation(x, cos_sin, positions, hadamard):
    """float64 ``x.shape``: RoPE and the Hadamard rotation without rounding."""
    half = cos_sin.shape[1] // 2
    rows = cos_sin[positions.long().clamp(0, cos_sin.shape[0] - 1)].double()
    rows = rows.view(rows.shape[0], *[1] * (x.ndim - 2), rows.shape[1])
    cos, sin = rows[..., :half], rows[..., half:]
    x = x.double()
    x1, x2 = x[..., :half], x[..., half:2 * half]
    x = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half:]], -1)
    return x @ hadamard_matrix(x.shape[-1], torch.float64) if hadamard else x


_SIZES = {"head_dim": st.sampled_from([8, 16, 64]), "rope_div": st.sampled_from([1, 2, 4]),
          "dtype": st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
          "hadamard": st.booleans(), "ue8m0": st.booleans(), "interleaved": st.booleans(),
          "seed": st.integers(0, 2**31)}


def check_q_prologue(face, num_tokens, num_heads, head_dim, rope_div, dtype, hadamard, ue8m0,
                     interleaved, seed):
    gen = torch.Generator().manual_seed(seed)
    q = random_rows(gen, (num_tokens, num_heads, head_dim), dtype)
    weights = torch.randn(num_tokens, num_heads, generator=gen)
    cos_sin, positions = rotation_case(gen, num_tokens, head_dim, head_dim // rope_div)
    with ref.poisoned_empty():
        q_fp8, head_weights = run_op(face, Q_OP, q, weights, cos_sin, positions, hadamard,
                                     ue8m0, interleaved)
    codes, want = ref.quantize_q(reference_rotation(q, cos_sin, positions, hadamard,
                                                    interleaved),
                                 weights.double().numpy(), ue8m0)
    np.testing.assert_array_equal(q_fp8.view(torch.uint8).numpy(), codes)
    np.testing.assert_allclose(head_weights.numpy(), want, rtol=1e-6, atol=0)


test_q_prologue_cpu, test_q_prologue_kernel = face_tests(
    check_q_prologue, {"num_tokens": st.integers(0, 5), "num_heads": st.sampled_from([1, 3, 8]),
                       **_SIZES},
    {"num_tokens": st.integers(0, 3), "num_heads": st.sampled_from([1, 3]), **_SIZES},
)


def check_k_prologue(face, num_tokens, block_size, head_dim, rope_div, dtype, hadamard, ue8m0,
                     interleaved, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 3
    cache = random_cache(gen, num_blocks, block_size, head_dim)
    k = random_rows(gen, (num_tokens, head_dim), dtype)
    slots = random_slots(gen, num_tokens, num_blocks * block_size)
    cos_sin, positions = rotation_case(gen, num_tokens, head_dim, head_dim // rope_div)
    rotated = reference_rotation(k, cos_sin, positions, hadamard, interleaved)
    want = ref.write_cache(cache.numpy(), rotated, slots.numpy(), block_size, ue8m0)
    write_cache(face, k, cache, slots, cos_sin, positions, hadamard, ue8m0, interleaved,
                op=K_OP)
    np.testing.assert_array_equal(cache.view(-1).numpy(), want)


test_k_prologue_cpu, test_k_prologue_kernel = face_tests(
    check_k_prologue, {"num_tokens": st.integers(0, 12), "block_size": st.sampled_from([1, 4]),
                       **_SIZES},
    {"num_tokens": st.integers(0, 5), "block_size": st.sampled_from([1, 4]), **_SIZES},
)


@pytest.mark.parametrize("face", FACE_NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prologue_within_fp8_precision_of_float64(face, dtype):
    """Dequantised q and k within an fp8 rounding (2**-4 relative) plus the layer dtype's
    roundings of the exact rotation."""
    gen = torch.Generator().manual_seed(0)
    num_tokens, head_dim = 3, 64
    q = random_rows(gen, (num_tokens, 4, head_dim), dtype)
    k = random_rows(gen, (num_tokens, head_dim), dtype)
    cos_sin, positions = rotation_case(gen, num_tokens, head_dim, 32)
    slots = torch.arange(num_tokens)
    cache = random_cache(gen, 1, num_tokens, head_dim)
    q_fp8, head_weights = run_op(face, Q_OP, q, torch.ones(num_tokens, 4), cos_sin, positions)
    write_cache(face, k, cache, slots, cos_sin, positions, op=K_OP)
    values, scales = kcache_views(cache)
    got_q = q_fp8.double() * head_weights.double()[..., None] * (4 * head_dim) ** 0.5
    got_k = values[0].double() * scales[0].double()[:, None]
    for got, x in ((got_q, q), (got_k, k)):
        exact = exact_rotation(x, cos_sin, positions, True)
        amax = exact.abs().amax(-1, keepdim=True)
        assert ((got - exact).abs() <= exact.abs() * 2.0**-4 + amax * 2.0**-6).all()


def random_prologue_inputs(num_tokens, device, *, num_heads=64, head_dim=128, rope_dim=64,
                           num_blocks=64, block_size=64, max_len=1 << 17):
    """V3.2's sizes, bf16: q, k, weights, cache, slots (every 5th -1), table, positions."""
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    bf16 = {"device": device, "dtype": torch.bfloat16}
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen, **bf16)
    k = torch.randn(num_tokens, head_dim, generator=gen, **bf16)
    weights = torch.randn(num_tokens, num_heads, generator=gen, device=device)
    cache = torch.zeros(num_blocks, block_size, 1, head_dim + 4, dtype=torch.uint8,
                        device=device)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=device)[:num_tokens]
    slots[::5] = -1
    positions = torch.randint(0, max_len, (num_tokens,), generator=gen, device=device)
    return q, k, weights, cache, slots, rope_table(max_len, rope_dim, 10000.0, device=device), \
        positions


def signed_steps(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes as signed integers: adjacent values differ by one."""
    magnitude = (codes.view(torch.uint8) & 0x7F).int()
    return torch.where(codes.view(torch.uint8) >= 0x80, -magnitude, magnitude)


def compare_with_unfused(num_tokens: int, device: str) -> None:
    """The fused ops against the unfused path: fp8 codes within one step, q scales (in the
    head weights) and k scales within one bf16 rounding, nearly every row bitwise."""
    q, k, weights, cache, slots, cos_sin, positions = random_prologue_inputs(num_tokens, device)
    old_cache = cache.clone()
    old = unfused_prologue(q, k, weights, old_cache, slots, cos_sin, positions,
                           hadamard_matrix(128, torch.bfloat16, device))
    new = torch.ops.dsa.rope_hadamard_quantize_q(q, weights, cos_sin, positions)
    torch.ops.dsa.rope_hadamard_quantize_and_cache_k(k, cache, slots, cos_sin, positions)
    (old_values, old_scales), (values, scales) = kcache_views(old_cache), kcache_views(cache)
    pairs = [(old[0], new[0], old[1], new[1]), (old_values, values, old_scales, scales)]
    for old_codes, codes, old_scale, scale in pairs:
        assert (signed_steps(old_codes) - signed_steps(codes)).abs().max() <= 1
        torch.testing.assert_close(scale, old_scale, rtol=2.0**-7, atol=0)
        same = (old_codes.view(torch.uint8) == codes.view(torch.uint8)).all(-1) & (
            old_scale == scale)
        assert same.float().mean() >= 0.95


def test_prologue_equals_the_unfused_path_within_one_fp8_step():
    compare_with_unfused(16, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 128, 4096])
def test_prologue_gpu_equals_the_unfused_path_within_one_fp8_step(num_tokens):
    compare_with_unfused(num_tokens, "cuda")


@pytest.mark.parametrize("block", [1, 2, 4, 8])
def test_prologue_kernels_equal_the_cpu_face_at_any_tile(block):
    """Rows a program (small launches take fewer, down to one) change nothing, bit for bit."""
    device = "cuda" if HAS_CUDA else "cpu"
    q, k, weights, cache, slots, cos_sin, positions = random_prologue_inputs(
        5, device, num_heads=3, head_dim=16, rope_dim=8, num_blocks=4, block_size=4, max_len=16)
    rotation = (cos_sin, positions, True, False)
    q_fp8, head_weights = FACES[Q_OP].fake(q, weights, *rotation)
    q_prologue_triton(q, weights, *rotation, q_fp8, head_weights, block_r=block)
    want = FACES[Q_OP].cpu(q.cpu(), weights.cpu(), cos_sin.cpu(), positions.cpu(), True, False)
    assert torch.equal(q_fp8.view(torch.uint8).cpu(), want[0].view(torch.uint8))
    assert torch.equal(head_weights.cpu(), want[1])
    want_cache = cache.cpu()
    FACES[K_OP].cpu(k.cpu(), want_cache, slots.cpu(), cos_sin.cpu(), positions.cpu(), True,
                    False)
    k_prologue_triton(k, cache, slots, *rotation, block_t=block)
    assert torch.equal(cache.cpu(), want_cache)


def test_row_tile_spreads_small_launches():
    """16 rows of 128 a program at size; fewer (down to one, in one warp) below 128
    programs: V3.2's q at T = 1 is 64 programs of one (token, head), k one program."""
    assert [row_tile(n, 128) for n in (1, 64, 256, 1024, 2048, 4096, 10**6)] == [
        1, 1, 2, 8, 16, 16, 16]
    assert [tile_warps(r, 128) for r in (1, 2, 4, 8, 16)] == [1, 1, 1, 2, 4]
    assert row_tile(10**6, 8) == 256 and tile_warps(256, 8) == 4
    assert [row_tile(n, 128, max_rows=4) for n in (1, 256, 10**6)] == [1, 2, 4]


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 3, 2048])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_prologue_gpu_equals_cpu(ue8m0, num_tokens):
    """The Triton faces equal the torch faces bit for bit at V3.2's sizes (one-row programs
    in one warp at T = 1, 3; 16-row programs at T = 2048)."""
    q, k, weights, cache, slots, cos_sin, positions = random_prologue_inputs(num_tokens, "cuda")
    rotation = (cos_sin, positions, True, ue8m0)
    on_cpu = [t.cpu() for t in (q, k, weights, cache, slots, cos_sin, positions)]
    cpu_rotation = (on_cpu[5], on_cpu[6], True, ue8m0)
    gpu_q = FACES[Q_OP].cuda(q, weights, *rotation)
    cpu_q = FACES[Q_OP].cpu(on_cpu[0], on_cpu[2], *cpu_rotation)
    assert torch.equal(gpu_q[0].view(torch.uint8).cpu(), cpu_q[0].view(torch.uint8))
    assert torch.equal(gpu_q[1].cpu(), cpu_q[1])
    FACES[K_OP].cuda(k, cache, slots, *rotation)
    FACES[K_OP].cpu(on_cpu[1], on_cpu[3], on_cpu[4], *cpu_rotation)
    assert torch.equal(cache.cpu(), on_cpu[3])


def test_prologue_without_hadamard_takes_any_head_dim():
    gen = torch.Generator().manual_seed(1)
    q = random_rows(gen, (2, 3, 24), torch.bfloat16)
    cos_sin, positions = rotation_case(gen, 2, 24, 8)
    want = run_op("cpu", Q_OP, q, torch.ones(2, 3), cos_sin, positions, False)
    got = run_op("kernel", Q_OP, q, torch.ones(2, 3), cos_sin, positions, False)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])


def _opcheck_cases():
    gen = torch.Generator().manual_seed(2)
    q = random_rows(gen, (3, 4, 16), torch.bfloat16)
    cos_sin, positions = rotation_case(gen, 3, 16, 8)
    cache = random_cache(gen, 2, 4, 16)
    return [(Q_OP, (q, torch.randn(3, 4), cos_sin, positions, True, True)),
            (Q_OP, (q[:0], torch.randn(0, 4), cos_sin, positions[:0])),
            (K_OP, (q[:, 0], cache, torch.tensor([1, -1, 7]), cos_sin, positions.int(), True)),
            (K_OP, (torch.randn(16, 4).bfloat16().t(), cache, torch.tensor([0, 2, 3, 5]), cos_sin,
                    torch.arange(4), False))]


test_prologue_opcheck = opcheck_test(_opcheck_cases())

_Q, _W, _CS, _POS = torch.zeros(2, 4, 8), torch.zeros(2, 4), torch.zeros(16, 4), torch.zeros(
    2, dtype=torch.int64)
_CACHE, _SLOTS = torch.zeros(2, 4, 1, 12, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64)
test_prologue_validation = validation_test([
    (Q_OP, (_Q, _W, _CS.double(), _POS), TypeError, "`cos_sin` must be torch.float32"),
    (Q_OP, (_Q, _W, torch.zeros(16, 3), _POS), ValueError, r"rope_dim even and in \(0, "),
    (Q_OP, (_Q, _W, torch.zeros(16, 10), _POS), ValueError, "head_dim=8"),
    (Q_OP, (_Q, _W, torch.zeros(0, 4), _POS), ValueError, "max_len >= 1"),
    (Q_OP, (_Q, _W, _CS, _POS.float()), TypeError, "`positions` must be torch.int32"),
    (Q_OP, (_Q, _W, _CS, _POS[:1]), ValueError, r"`positions` must have size 2"),
    (Q_OP, (torch.zeros(2, 4, 12), _W, _CS, _POS), ValueError, "power-of-two head_dim, got 12"),
    (Q_OP, (_Q, _W[:1], _CS, _POS), ValueError, r"rope_hadamard_quantize_q: `weights` must"),
    (K_OP, (torch.zeros(2, 8), _CACHE, _SLOTS[:1], _CS, _POS), ValueError,
     r"rope_hadamard_quantize_and_cache_k: `slot_mapping` must have size 2"),
    (K_OP, (torch.zeros(2, 8), _CACHE, _SLOTS, _CS, _POS[:1]), ValueError,
     r"`positions` must have size 2"),
    (Q_OP, (_Q, _W, _CS, torch.zeros(4, dtype=torch.int64)[::2]), ValueError,
     "`positions` must be contiguous"),
    (K_OP, (torch.zeros(2, 8), _CACHE, torch.zeros(4, dtype=torch.int64)[::2], _CS, _POS),
     ValueError, "`slot_mapping` must be contiguous"),
    (K_OP, (torch.zeros(2, 8), _CACHE[:0], _SLOTS, _CS, _POS), ValueError,
     "`kv_cache` must have at least one block"),
])
