"""dsa::project_k_and_weights (design §2, "Projections"): both faces against a float64
reference of the documented rounding (k rounded to the input's dtype before and after its
LayerNorm), and the CUDA face's two paths (its kernels up to SMALL_TOKENS, the torch ops
above)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from faces import HAS_CUDA, face_tests, opcheck_test, run_op, validation_test
from hypothesis import strategies as st

from dsa.ops.project import SMALL_TOKENS, project_triton

OP = "project_k_and_weights"
# Mantissa bits of each dtype, capped at what fp32 sums over the hidden dim keep.
PRECISION_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 18}


def project_case(seed: int, tokens: int, width: int, head_dim: int, heads: int,
                 dtype: torch.dtype) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, width, generator=gen).to(dtype)
    wk = (torch.randn(head_dim, width, generator=gen) * width**-0.5).to(dtype)
    norm_weight = torch.rand(head_dim, generator=gen) + 0.5
    norm_bias = torch.randn(head_dim, generator=gen) * 0.1
    weights_proj = torch.randn(heads, width, generator=gen) * width**-0.5
    return hidden, wk, norm_weight, norm_bias, 1e-6, weights_proj


def reference(hidden, wk, norm_weight, norm_bias, eps, weights_proj):
    """float64 k (the product rounded to the input's dtype, then LayerNorm), weights, and
    which rows of k hold a product so close to a rounding boundary of the dtype that an
    fp32 sum may round it the other way."""
    exact = hidden.double() @ wk.double().T
    z = exact.to(hidden.dtype).double()
    bound = 2.0 ** -PRECISION_BITS[torch.float32]
    near = (exact * (1 + bound)).to(hidden.dtype) != (exact * (1 - bound)).to(hidden.dtype)
    k = F.layer_norm(z, (z.shape[1],), norm_weight.double(), norm_bias.double(), eps)
    return k, hidden.double() @ weights_proj.double().T, near.any(dim=1, keepdim=True)


def check_projection(k: torch.Tensor, weights: torch.Tensor, args: tuple) -> None:
    hidden, _, norm_weight, _, _, weights_proj = args
    k_ref, weights_ref, near = reference(*args)
    assert k.dtype == hidden.dtype and weights.dtype == torch.float32
    assert k.shape == k_ref.shape and weights.shape == weights_ref.shape
    # k: the final rounding and fp32 LayerNorm arithmetic; on a row whose product may round
    # the other way before the LayerNorm, one step of that moves an output by about
    # w * ulp(z) / std, |z| / std staying under ~8 on these rows.
    step = 2.0 ** -PRECISION_BITS[hidden.dtype]
    w_max = norm_weight.abs().max()
    k_tol = step * k_ref.abs() + torch.where(near, 16 * step, 2.0**-16) * w_max
    assert bool(((k.double() - k_ref).abs() <= k_tol).all()), (k.double() - k_ref).abs().max()
    scale = hidden.double().abs() @ weights_proj.double().abs().T
    w_tol = hidden.shape[1] * 2.0**-24 * scale + 1e-30
    assert bool(((weights.double() - weights_ref).abs() <= w_tol).all())


def check_project_k_and_weights(face, tokens, width, head_dim, heads, dtype, seed):
    args = project_case(seed, tokens, width, head_dim, heads, dtype)
    k, weights = run_op(face, OP, *args)
    check_projection(k, weights, args)


_SIZES = {"width": st.integers(1, 700), "head_dim": st.sampled_from([16, 32, 128]),
          "heads": st.sampled_from([8, 32, 64]),
          "dtype": st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
          "seed": st.integers(0, 2**31)}
test_project_k_and_weights_cpu, test_project_k_and_weights_kernel = face_tests(
    check_project_k_and_weights, {"tokens": st.integers(0, 40), **_SIZES},
    {"tokens": st.integers(0, SMALL_TOKENS), **_SIZES})


@pytest.mark.parametrize("face", ["cpu", pytest.param("kernel", marks=pytest.mark.interpret)])
def test_project_strided_inputs(face):
    """Row-strided hidden states and weights (views into wider buffers)."""
    if face == "kernel" and HAS_CUDA:
        pytest.skip("the kernel face on CUDA tensors: tests/test_project.py's GPU tests")
    hidden, wk, norm_weight, norm_bias, eps, weights_proj = project_case(3, 3, 300, 32, 16,
                                                                         torch.bfloat16)
    wide = torch.zeros(3, 340, dtype=hidden.dtype)
    wide[:, 20:320] = hidden
    wide_wk = torch.zeros(32, 310, dtype=wk.dtype)
    wide_wk[:, :300] = wk
    args = (wide[:, 20:320], wide_wk[:, :300], norm_weight, norm_bias, eps, weights_proj)
    k, weights = run_op(face, OP, *args)
    check_projection(k, weights, args)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 2, SMALL_TOKENS, SMALL_TOKENS + 1, 64])
def test_project_cuda_paths(tokens):
    """Up to SMALL_TOKENS the kernels (against the reference); above, the torch ops on CUDA,
    bit for bit."""
    args = project_case(7, tokens, 7168, 128, 64, torch.bfloat16)
    cuda_args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    k, weights = torch.ops.dsa.project_k_and_weights(*cuda_args)
    check_projection(k.cpu(), weights.cpu(), args)
    if tokens > SMALL_TOKENS:
        hidden, wk, norm_weight, norm_bias, eps, weights_proj = cuda_args
        k_torch = F.layer_norm(F.linear(hidden, wk).float(), (128,), norm_weight, norm_bias,
                               eps).to(hidden.dtype)
        assert torch.equal(k, k_torch)
        assert torch.equal(weights, F.linear(hidden.float(), weights_proj))


test_project_opcheck = opcheck_test(
    [project_case(0, tokens, 200, 32, 16, torch.bfloat16) for tokens in (0, 1, 3)], op=OP)

_GOOD = project_case(1, 2, 64, 16, 8, torch.bfloat16)


def _bad(index: int, value) -> tuple:
    return tuple(value if i == index else a for i, a in enumerate(_GOOD))


test_project_rejects_bad_inputs = validation_test([
    (_bad(0, _GOOD[0].to(torch.int32)), TypeError, r"project_k_and_weights: `hidden`"),
    (_bad(1, _GOOD[1].float()), TypeError, r"`wk`"),
    (_bad(1, _GOOD[1][:, :60]), ValueError, r"`wk`.*hidden_size"),
    (_bad(1, _GOOD[1][:0]), ValueError, r"`wk` must be \[head_dim >= 1"),
    ((_GOOD[0][:, :0], _GOOD[1][:, :0], *_GOOD[2:5], _GOOD[5][:, :0]), ValueError,
     r"`wk` must be \[head_dim >= 1, hidden_size >= 1\]"),
    (_bad(2, _GOOD[2][:8]), ValueError, r"`norm_weight`.*head_dim"),
    (_bad(3, _GOOD[3].double()), TypeError, r"`norm_bias`"),
    (_bad(4, 0.0), ValueError, r"`eps` must be a positive float"),
    (_bad(5, _GOOD[5][:, :10]), ValueError, r"`weights_proj`.*hidden_size"),
], op=OP)


@pytest.mark.interpret
def test_project_kernels_take_at_most_small_tokens():
    args = project_case(0, SMALL_TOKENS + 1, 64, 16, 8, torch.float32)
    k, weights = torch.ops.dsa.project_k_and_weights(*args)
    with pytest.raises(ValueError, match=f"at most {SMALL_TOKENS} tokens"):
        project_triton(*args, k, weights)
