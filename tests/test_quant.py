"""dsa::quantize_q and the fp8 encoding shared by the quantising kernels, against the
float64 reference (byte-exact codes)."""

from __future__ import annotations

import numpy as np
import pytest
import reference_compute as ref
import torch
import triton
import triton.language as tl
from faces import FACE_NAMES, HAS_CUDA, KERNEL_MARK, run_op
from hypothesis import given, settings
from hypothesis import strategies as st

from dsa.ops.quant import fp8_e4m3_bits, quantize_rows, round_to


def encoding_probes() -> torch.Tensor:
    """Every finite e4m3 value, every midpoint and its neighbours, random values across the
    normal and subnormal ranges, signed zeros and out-of-range values."""
    values = torch.from_numpy(ref.E4M3_VALUES[:0x7F]).float()
    mids = (values[1:] + values[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    probes = [values, mids, mids.nextafter(torch.tensor(np.inf)),
              mids.nextafter(torch.tensor(-np.inf)), torch.randn(4000, generator=gen) * 100,
              torch.randn(1000, generator=gen) * 1e-3, torch.tensor([500.0, 1e30, 1e-45, 0.0])]
    probes = torch.cat(probes)
    return torch.cat([probes, -probes])


@triton.jit
def _encode_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, fp8_e4m3_bits(tl.load(x_ptr + i, mask=i < n)), mask=i < n)


@KERNEL_MARK
def test_triton_fp8_encoding_matches_reference():
    """The GPU's conversion instruction and the interpreter's integer arithmetic alike."""
    x = encoding_probes()
    device = "cuda" if HAS_CUDA else "cpu"
    out = torch.empty(x.numel(), dtype=torch.uint8, device=device)
    _encode_kernel[(triton.cdiv(x.numel(), 4096),)](x.to(device), out, x.numel(), BLOCK=4096)
    np.testing.assert_array_equal(out.cpu().numpy(), ref.fp8_encode(x.numpy()))


def bf16_rounding_probes() -> torch.Tensor:
    """fp32 values at, next to and halfway between bf16 values (both parities of the kept
    last bit), across the normal and subnormal ranges and at the top of the range, random
    values, signed zeros, infinities and NaN."""
    gen = torch.Generator().manual_seed(2)
    kept = torch.randint(0, 0x7F80, (3000,), generator=gen, dtype=torch.int32) << 16
    kept = torch.cat([kept, torch.tensor([0x7F7F << 16, 0x7F7E << 16, 1 << 16, 2 << 16])])
    bits = torch.cat([kept + offset for offset in (0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF)])
    special = torch.tensor([0.0, float("inf"), float("nan"), 3.4028234663852886e38])
    probes = torch.cat([bits.view(torch.float32), torch.randn(2000, generator=gen), special])
    return torch.cat([probes, -probes])


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(out_ptr + i, round_to(x, tl.bfloat16), mask=i < n)


@KERNEL_MARK
def test_triton_bf16_rounding_matches_torch():
    """round_to(x, bf16): torch's round to nearest even, overflow to ±inf, NaN stays NaN."""
    x = bf16_rounding_probes()
    device = "cuda" if HAS_CUDA else "cpu"
    out = torch.empty_like(x, device=device)
    _round_kernel[(triton.cdiv(x.numel(), 4096),)](x.to(device), out, x.numel(), BLOCK=4096)
    want = x.bfloat16().float()
    out = out.cpu()
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int32), want[~nan].view(torch.int32))


def test_torch_fp8_encoding_matches_reference():
    x = encoding_probes()
    scale = torch.ones(())
    values = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    np.testing.assert_array_equal(values.view(torch.uint8).numpy(), ref.fp8_encode(x.numpy()))


@pytest.mark.parametrize("ue8m0", [False, True])
def test_quantize_rows_matches_reference(ue8m0):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(50, 64, generator=gen) * torch.logspace(-6, 3, 50)[:, None]
    x[3] = 0.0
    values, scale = quantize_rows(x.bfloat16(), ue8m0)
    for row in range(x.shape[0]):
        codes, want = ref.quantize_row(x[row].bfloat16().double().numpy(), ue8m0)
        np.testing.assert_array_equal(values[row].view(torch.uint8).numpy(), codes)
        assert scale[row].item() == want


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_rows_nonfinite_matches_reference(ue8m0, dtype):
    """NaN counts as 0 and ±inf as ±fp32 max before the scale."""
    x = ref.nonfinite_rows(32).to(dtype)
    values, scale = quantize_rows(x, ue8m0)
    codes = values.view(torch.uint8).numpy()
    for row in range(x.shape[0]):
        want_codes, want = ref.quantize_row(x[row].double().numpy(), ue8m0)
        np.testing.assert_array_equal(codes[row], want_codes)
        assert scale[row].item() == want
    ref.check_nonfinite_codes(x, codes, scale.numpy(), ue8m0)


def _random_q(gen, num_tokens, num_heads, head_dim, dtype):
    magnitude = torch.logspace(-5, 2, num_tokens * num_heads)[torch.randperm(
        num_tokens * num_heads, generator=gen)].view(num_tokens, num_heads, 1)
    q = (torch.randn(num_tokens, num_heads, head_dim, generator=gen) * magnitude).to(dtype)
    weights = torch.randn(num_tokens, num_heads, generator=gen)
    return q, weights


@settings(max_examples=30)
@given(
    num_tokens=st.integers(0, 5),
    num_heads=st.sampled_from([1, 3, 16]),
    head_dim=st.sampled_from([4, 32, 48, 64]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    weights_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    ue8m0=st.booleans(),
    seed=st.integers(0, 2**31),
)
@pytest.mark.parametrize("face", FACE_NAMES)
def test_quantize_q_matches_reference(face, num_tokens, num_heads, head_dim, dtype,
                                      weights_dtype, ue8m0, seed):
    gen = torch.Generator().manual_seed(seed)
    q, weights = _random_q(gen, num_tokens, num_heads, head_dim, dtype)
    weights = weights.to(weights_dtype)
    with ref.poisoned_empty():
        q_fp8, head_weights = run_op(face, "quantize_q", q, weights, ue8m0)
    assert q_fp8.dtype == torch.float8_e4m3fn and q_fp8.shape == q.shape
    assert head_weights.dtype == torch.float32 and head_weights.shape == weights.shape
    codes, want = ref.quantize_q(q.double().numpy(), weights.double().numpy(), ue8m0)
    np.testing.assert_array_equal(q_fp8.view(torch.uint8).numpy(), codes)
    np.testing.assert_allclose(head_weights.numpy(), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("face", FACE_NAMES)
def test_quantize_q_ue8m0_scales_are_powers_of_two(face):
    gen = torch.Generator().manual_seed(2)
    q, _ = _random_q(gen, 4, 8, 32, torch.bfloat16)
    weights = torch.full((4, 8), 8.0**0.5 * 32**0.5)  # head_weights == q scale
    _, scales = run_op(face, "quantize_q", q, weights, True)
    mantissa, _ = torch.frexp(scales)
    assert (mantissa == 0.5).all()


@pytest.mark.parametrize("face", FACE_NAMES)
def test_quantize_q_ue8m0_keeps_exact_powers_of_two(face):
    """A ue8m0 scale is amax / 448 rounded up to a power of two only where it is not one
    already: amax 448 keeps scale 1 and amax -28 scale 2**-4 (their largest magnitudes code
    ±448: 0x7E, 0xFE); amax 300 rounds up to 1."""
    q = torch.tensor([[[448.0, -3.0, 1.0, 0.0], [-28.0, 2.0, 0.5, 1.0],
                       [300.0, 7.0, -1.0, 0.25]]])
    weights = torch.ones(1, 3)
    q_fp8, head_weights = run_op(face, "quantize_q", q, weights, True)
    codes, want = ref.quantize_q(q.double().numpy(), weights.double().numpy(), True)
    np.testing.assert_array_equal(q_fp8.view(torch.uint8).numpy(), codes)
    np.testing.assert_allclose(head_weights.numpy(), want, rtol=1e-6, atol=0)
    assert q_fp8.view(torch.uint8)[0, :2, 0].tolist() == [0x7E, 0xFE]
    torch.testing.assert_close(head_weights * 12**0.5, torch.tensor([[1.0, 2.0**-4, 1.0]]))

def test_quantize_q_faces_agree_on_ties():
    # bf16 inputs over power-of-two scales land exactly on fp8 midpoints often.
    gen = torch.Generator().manual_seed(3)
    q, weights = _random_q(gen, 6, 16, 64, torch.bfloat16)
    cpu = run_op("cpu", "quantize_q", q, weights, True)
    kernel = run_op("kernel", "quantize_q", q, weights, True)
    assert torch.equal(cpu[0].view(torch.uint8), kernel[0].view(torch.uint8))
    assert torch.equal(cpu[1], kernel[1])


@KERNEL_MARK
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_q_nonfinite_faces_agree(ue8m0, dtype):
    """Rows with NaN, +inf, -inf and mixes: both faces equal the reference bit for bit,
    values and head weights (which carry the scales); inf keeps its sign."""
    q = ref.nonfinite_rows(32, seed=5).to(dtype).view(4, 2, 32)
    weights = torch.randn(4, 2, generator=torch.Generator().manual_seed(6))
    cpu = run_op("cpu", "quantize_q", q, weights, ue8m0)
    kernel = run_op("kernel", "quantize_q", q, weights, ue8m0)
    assert torch.equal(cpu[0].view(torch.uint8), kernel[0].view(torch.uint8))
    assert torch.equal(cpu[1], kernel[1])
    codes, want = ref.quantize_q(q.double().numpy(), weights.double().numpy(), ue8m0)
    np.testing.assert_array_equal(cpu[0].view(torch.uint8).numpy(), codes)
    np.testing.assert_allclose(cpu[1].numpy(), want, rtol=1e-6, atol=0)
    ref.check_nonfinite_codes(q, codes, cpu[1].numpy(), ue8m0)


def test_quantize_q_opcheck():
    gen = torch.Generator().manual_seed(4)
    q, weights = _random_q(gen, 3, 4, 32, torch.bfloat16)
    torch.library.opcheck(torch.ops.dsa.quantize_q.default, (q, weights), {"ue8m0": True})
    torch.library.opcheck(torch.ops.dsa.quantize_q.default, (q.float(), weights.bfloat16()))


@pytest.mark.parametrize(
    ("q", "weights", "error", "match"),
    [
        (torch.zeros(2, 4, 8, dtype=torch.int32), torch.zeros(2, 4), TypeError, "`q` must be"),
        (torch.zeros(2, 32), torch.zeros(2, 4), ValueError, "`q` must have 3 dimension"),
        (torch.zeros(2, 4, 8), torch.zeros(3, 4), ValueError, r"`weights` must have size 2"),
        (torch.zeros(2, 4, 8), torch.zeros(2, 5), ValueError, r"`weights` must have size 4"),
        (torch.zeros(2, 4, 8), torch.zeros(2, 4, dtype=torch.int64), TypeError, "`weights`"),
        (torch.zeros(2, 8, 4).transpose(1, 2), torch.zeros(2, 4), ValueError, "contiguous"),
        (torch.zeros(2, 4, 0), torch.zeros(2, 4), ValueError, "head_dim >= 1"),
        (torch.zeros(2, 0, 8), torch.zeros(2, 0), ValueError, "`q` must have num_heads >= 1"),
    ],
)
def test_quantize_q_validation(q, weights, error, match):
    with pytest.raises(error, match=match):
        torch.ops.dsa.quantize_q(q, weights)
