"""dsa::project_quantize_and_cache_k (design §2, "Projections"): the CPU face is the layer's
torch projections followed by the two prologue ops' CPU faces, bit for bit; the kernel face
(two launches up to KERNEL_TOKENS tokens: products one token at a time up to SMALL_TOKENS,
matrix products of token tiles above) differs from it only by its fp32 sums' order:
dequantised values within an fp8 step plus 2**-6 of their row, scales within 2**-6. fp8
block-scaled ``wq_b`` / ``wk`` give every face's outputs for the weights dequantised, bit for
bit."""

from __future__ import annotations

import pytest
import torch
from faces import FACE_NAMES, HAS_CUDA, face_tests, opcheck_test, validation_test
from hypothesis import strategies as st
from test_kcache import random_cache, random_slots
from torch._subclasses.fake_tensor import FakeTensorMode

from dsa.ops import FACES, block_fp8, project
from dsa.ops.kcache import kcache_views
from dsa.ops.project import KERNEL_TOKENS, SMALL_TOKENS, project_torch, project_triton
from dsa.rope import rope_table

OP = "project_quantize_and_cache_k"
Q_OP, K_OP = "rope_hadamard_quantize_q", "rope_hadamard_quantize_and_cache_k"


def project_case(seed: int, tokens: int, width: int, q_width: int, heads: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, rope_dim: int | None = None,
                 hadamard: bool = True, ue8m0: bool = False, block_size: int = 4) -> tuple:
    """The op's arguments: weights scaled like a trained layer's, a random cache of three
    blocks, slots that are valid, -1, huge or past the cache, positions partly outside
    the RoPE table."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, width, generator=gen).to(dtype)
    q_latent = torch.randn(tokens, q_width, generator=gen).to(dtype)
    wq_b = (torch.randn(heads * head_dim, q_width, generator=gen) * q_width**-0.5).to(dtype)
    wk = (torch.randn(head_dim, width, generator=gen) * width**-0.5).to(dtype)
    norm_weight = torch.rand(head_dim, generator=gen) + 0.5
    norm_bias = torch.randn(head_dim, generator=gen) * 0.1
    weights_proj = torch.randn(heads, width, generator=gen) * width**-0.5
    cache = random_cache(gen, 3, block_size, head_dim)
    slots = random_slots(gen, tokens, 3 * block_size)
    cos_sin = rope_table(16, rope_dim or head_dim // 2, 10000.0)
    positions = torch.randint(-3, 19, (tokens,), generator=gen)
    return (hidden, q_latent, wq_b, wk, norm_weight, norm_bias, 1e-6, weights_proj, cache,
            slots, cos_sin, positions, hadamard, ue8m0)


def run_project(face: str, args: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_fp8, head_weights, the cache after the write) of ``face`` on CPU-side ``args``
    (the cache argument itself untouched)."""
    args = (*args[:8], args[8].clone(), *args[9:])
    if face == "kernel" and HAS_CUDA:
        args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
        q_fp8, head_weights = torch.ops.dsa.project_quantize_and_cache_k(*args)
    elif face == "kernel":
        q_fp8, head_weights = FACES[OP].cuda(*args)
    else:
        q_fp8, head_weights = torch.ops.dsa.project_quantize_and_cache_k(*args)
    return q_fp8.cpu(), head_weights.cpu(), args[8].cpu()


def the_chain(args: tuple, projections: tuple | None = None, interleaved: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the op stands for on the CPU: the torch projections (``projections``: their
    ``project_torch`` outputs, already computed), then the two prologue ops."""
    cache = args[8].clone()
    q, k, weights = project_torch(*args[:8]) if projections is None else projections
    rotation = (*args[10:14], interleaved)
    torch.ops.dsa.rope_hadamard_quantize_and_cache_k(k, cache, args[9], *rotation)
    return (*torch.ops.dsa.rope_hadamard_quantize_q(q, weights, *rotation), cache)


def assert_codes_close(codes: torch.Tensor, scale: torch.Tensor, want: torch.Tensor,
                       want_scale: torch.Tensor) -> None:
    """fp8 rows ``codes * scale`` (a scale per row) within one fp8 step (2**-3 relative) of
    ``want``'s plus 2**-6 of the row's largest magnitude: where the two faces' projections
    round an element to either side of a τ boundary, the rotation spreads the difference
    (about 2**-9 of the row) over every element of the row, and a small element's fp8 code
    moves by more than a step."""
    got = codes.float() * torch.nan_to_num(scale).unsqueeze(-1)
    ref = want.float() * torch.nan_to_num(want_scale).unsqueeze(-1)
    amax = ref.abs().amax(-1, keepdim=True) if ref.numel() else ref
    assert bool(((got - ref).abs() <= ref.abs() * 2.0**-3 + amax * 2.0**-6).all())


def weight_floor(args: tuple, projections: tuple) -> torch.Tensor:
    """``[T, H]``: how far two faces' head weights may part where their sums cancel: two fp32
    sums of the same ``width`` products in different orders (each add may truncate, as a
    tensor core's does) differ by at most ``width * 2**-22`` of the products' magnitudes
    summed, scaled as the head weights are (the q op's head weights for unit weights;
    ``projections``: ``project_torch`` of ``args``)."""
    hidden, weights_proj = args[0].double(), args[7].double()
    magnitude = hidden.abs() @ weights_proj.abs().T
    q, _, weights = projections
    unit = torch.ops.dsa.rope_hadamard_quantize_q(q, torch.ones_like(weights), *args[10:14])[1]
    return magnitude * unit.double() * hidden.shape[1] * 2.0**-22


def assert_faces_close(got: tuple, args: tuple, projections: tuple | None = None,
                       interleaved: bool = False) -> None:
    """The kernel face's outputs ``got`` against the CPU chain on ``args`` (fp8 weights
    dequantised; ``projections``: its ``project_torch`` outputs, already computed): q codes
    (by the chain's scales) and K cache rows as :func:`assert_codes_close`; q scales (in the
    head weights) and k scales within 2**-6 relative (a rounding of τ moves an amax by 2**-8
    or less), a head weight also within its sum's rounding (:func:`weight_floor`); the cache
    slots whose bytes differ (those the faces wrote) compared so, the others equal."""
    if projections is None:
        projections = project_torch(*args[:8])
    q_fp8, head_weights, cache = got
    q_want, w_want, cache_want = the_chain(args, projections, interleaved)
    floor = weight_floor(args, projections).float()
    assert bool(((head_weights - w_want).abs() <= w_want.abs() * 2.0**-6 + floor).all())
    assert_codes_close(q_fp8, w_want, q_want, w_want)  # a cancelled weight: any sign
    (values, scales), (values_want, scales_want) = kcache_views(cache), kcache_views(cache_want)
    written = ((values.view(torch.uint8) != values_want.view(torch.uint8)).any(-1)
               | (scales.view(torch.int32) != scales_want.view(torch.int32)))  # slots
    assert_codes_close(values[written], scales[written], values_want[written],
                       scales_want[written])
    torch.testing.assert_close(scales[written], scales_want[written], rtol=2.0**-6, atol=0)


def assert_same_outputs(got: tuple, want: tuple) -> None:
    """Outputs equal bit for bit (fp8 ones compared as bytes)."""
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


def check_project(face, tokens, width, q_width, heads, head_dim, rope_div, dtype, hadamard,
                  ue8m0, weights, seed):
    """``weights``: ``wq_b`` / ``wk`` in the layer's dtype, or fp8 blocks with general or
    power-of-two scales (against the chain of their dequantised values)."""
    args = project_case(seed, tokens, width, q_width, heads, head_dim, dtype,
                        head_dim // rope_div, hadamard, ue8m0)
    if weights != "dtype":
        args, dequantised = fp8_weights(args, ue8m0=weights == "fp8 pow2")
    got = run_project(face, args)
    reference = args if weights == "dtype" else dequantised
    if face == "cpu":
        assert_same_outputs(got, the_chain(reference))
    else:
        assert_faces_close(got, reference)


_SIZES = {"width": st.integers(1, 700), "q_width": st.integers(1, 600),
          "heads": st.sampled_from([1, 3, 8]), "head_dim": st.sampled_from([16, 32, 64]),
          "rope_div": st.sampled_from([1, 2, 4]),
          "dtype": st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
          "hadamard": st.booleans(), "ue8m0": st.booleans(),
          "weights": st.sampled_from(["dtype", "fp8", "fp8 pow2"]), "seed": st.integers(0, 2**31)}
test_project_cpu, test_project_kernel = face_tests(
    check_project, {"tokens": st.integers(0, 9), **_SIZES},
    {"tokens": st.integers(0, SMALL_TOKENS + 5), **_SIZES})


@pytest.mark.interpret
@pytest.mark.parametrize("tokens", [37, 130])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weights", ["dtype", "fp8 pow2"])
def test_project_token_tiles(tokens, dtype, weights):
    """Matrix products over tiles of tokens (130: two tiles, the second of 2 tokens), the
    q_lora dim in two slices; 16-bit or fp8 weights."""
    if HAS_CUDA:
        pytest.skip("the kernel face on CUDA tensors: test_project_gpu")
    assert project.partials_plan(tokens).dot
    check_project("kernel", tokens, 700, 1000, 3, 32, 2, dtype, True, False, weights, tokens)


@pytest.mark.interpret
@pytest.mark.parametrize("weights_proj_16_bit", [False, True])
def test_project_hidden_tiles_by_tma(weights_proj_16_bit, monkeypatch):
    """Hidden states and ``wk`` (and a 16-bit ``weights_proj``) whose rows TMA can copy: the
    hidden product's tiles by TMA, bit for bit the sums of the pointer path."""
    if HAS_CUDA:
        pytest.skip("the kernel face on CUDA tensors: test_project_gpu")
    args = project_case(3, 37, 704, 1024, 3, 32)
    if weights_proj_16_bit:
        args = (*args[:7], args[7].to(torch.bfloat16), *args[8:])
    assert project._tma_tiles(args[0]) and project._tma_tiles(args[3])
    assert_faces_close(tma_tiles_equal_pointers(args, monkeypatch), args)


def tma_tiles_equal_pointers(args: tuple, monkeypatch) -> tuple:
    """The kernel face's outputs with tiles by TMA where they can go, after checking them bit
    for bit against the same launch with every tile by pointers."""
    got = run_project("kernel", args)
    monkeypatch.setattr(project, "_tma_tiles", lambda t: False)
    by_pointers = run_project("kernel", args)
    monkeypatch.undo()
    assert_same_outputs(got, by_pointers)
    return got


@pytest.mark.parametrize("face", ["cpu", pytest.param("kernel", marks=pytest.mark.interpret)])
def test_project_strided_inputs(face):
    """Row-strided hidden states, latents and weights (views into wider buffers)."""
    if face == "kernel" and HAS_CUDA:
        pytest.skip("the kernel face on CUDA tensors: test_project_gpu")
    args = project_case(3, 3, 300, 200, 4, 32)

    def strided(x: torch.Tensor, left: int) -> torch.Tensor:
        wide = torch.zeros(x.shape[0], x.shape[1] + left + 7, dtype=x.dtype)
        wide[:, left:left + x.shape[1]] = x
        return wide[:, left:left + x.shape[1]]

    strided_args = (strided(args[0], 20), strided(args[1], 3), strided(args[2], 0),
                    strided(args[3], 5), *args[4:])
    got = run_project(face, strided_args)
    if face == "cpu":
        assert_same_outputs(got, the_chain(args))
    else:
        assert_faces_close(got, args)


@pytest.mark.parametrize("face", FACE_NAMES)
@pytest.mark.parametrize("tokens", [1, 3, KERNEL_TOKENS + 1])
def test_project_interleaved_rope(face, tokens):
    """RoPE on interleaved pairs (GLM-5's indexer) in the op's kernels and, past
    KERNEL_TOKENS, in the prologue ops' kernels: the chain of the prologue ops so rotating
    (and not the NeoX chain: the two rotations part)."""
    args = (*project_case(7, tokens, 96, 80, 4, 32, torch.float32, 16), None, None, True)
    got = run_project(face, args)
    projections = project_torch(*args[:8])
    want = the_chain(args, projections, interleaved=True)
    if face == "cpu":
        assert_same_outputs(got, want)
    else:
        assert_faces_close(got, args, projections, interleaved=True)
    neox = the_chain(args, projections)
    assert not torch.equal(neox[0].view(torch.uint8), want[0].view(torch.uint8))


@pytest.mark.parametrize("face", FACE_NAMES)
def test_project_head_dim_not_a_power_of_two(face):
    """Without the Hadamard rotation head_dim need not be a power of two: k's LayerNorm
    statistics run over its D columns only, not the padding of the kernel's power-of-two
    tile (wk's rows share a component, so k's mean is large against its spread)."""
    args = project_case(5, 3, 96, 64, 2, 24, rope_dim=12, hadamard=False)
    wk = args[3].float()
    shared = torch.randn(1, wk.shape[1], generator=torch.Generator().manual_seed(6))
    args = (*args[:3], (wk + shared * 4 * wk.shape[1] ** -0.5).to(args[3].dtype), *args[4:])
    got = run_project(face, args)
    if face == "cpu":
        assert_same_outputs(got, the_chain(args))
    else:
        assert_faces_close(got, args)

@pytest.mark.parametrize("face", FACE_NAMES)
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_project_cancelled_head_weight(face, tokens, dtype):
    """One head whose ``weights_proj`` row is orthogonal to the first token's hidden state:
    that token's head weight cancels to about 1e-10 of its products, where the two faces'
    sums part by more than any fraction of it: the floor is the sums' rounding, not the
    token's largest weight (the likely cause of a hypothesis failure on the H200 whose
    example was lost)."""
    args = project_case(5, tokens, 700, 64, 1, 32, dtype)
    hidden, weights_proj = args[0].double(), args[7].double()
    first = hidden[0]
    weights_proj -= (weights_proj @ first)[:, None] * first[None, :] / (first @ first)
    args = (*args[:7], weights_proj.float(), *args[8:])
    got = run_project(face, args)
    projections = project_torch(*args[:8])
    want = the_chain(args, projections)
    if face == "cpu":
        assert_same_outputs(got, want)
    else:
        assert_faces_close(got, args, projections)
    assert float(want[1][0, 0].abs()) < 1e-3 * float(weight_floor(args, projections)[0, 0])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 2, 3, SMALL_TOKENS, SMALL_TOKENS + 1, 16, 64, 100,
                                    KERNEL_TOKENS, KERNEL_TOKENS + 1])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_project_gpu(tokens, ue8m0):
    """V3.2's sizes: up to KERNEL_TOKENS the kernels, close to the CPU face; above, the torch
    projections and the prologue kernels, the same chain on CUDA bit for bit."""
    args = project_case(tokens, tokens, 7168, 1536, 64, 128, rope_dim=64, ue8m0=ue8m0,
                        block_size=64)
    got = run_project("kernel", args)
    if tokens <= KERNEL_TOKENS:
        assert_faces_close(got, args)
    else:
        cuda_args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
        cache = cuda_args[8].clone()
        q, k, weights = project_torch(*cuda_args[:8])
        FACES[K_OP].cuda(k, cache, cuda_args[9], *cuda_args[10:])
        q_fp8, head_weights = FACES[Q_OP].cuda(q, weights, *cuda_args[10:])
        assert torch.equal(got[0].view(torch.uint8), q_fp8.view(torch.uint8).cpu())
        assert torch.equal(got[1], head_weights.cpu()) and torch.equal(got[2], cache.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize(("tokens", "heads", "head_dim"),
                         [(1, 64, 128), (3, 64, 128), (64, 64, 128), (100, 64, 128),
                          (1, 1, 16), (5, 3, 32)])
def test_project_gpu_discarded_q_partials(tokens, heads, head_dim, monkeypatch):
    """The prologue's q partials dropped from L2 once read (``DISCARD_Q_PARTIALS_FROM``): q, the
    head weights and the cache bit for bit as without, read back right after the launch
    (a line of theirs dropped unwritten would read stale); programs of one short row (less
    than a line of partials) too."""
    args = project_case(tokens, tokens, 7168, 1536, heads, head_dim, rope_dim=head_dim // 2,
                        block_size=64)
    monkeypatch.setattr(project, "DISCARD_Q_PARTIALS_FROM", tokens + 1)
    want = run_project("kernel", args)
    monkeypatch.setattr(project, "DISCARD_Q_PARTIALS_FROM", tokens)
    got = run_project("kernel", args)
    assert_same_outputs(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [2, 16])
def test_project_gpu_16_bit_weights_proj(tokens):
    """weights_proj in the activations' dtype (one product per step, not three)."""
    args = project_case(tokens, tokens, 7168, 1536, 64, 128, rope_dim=64, block_size=64)
    args = (*args[:7], args[7].to(torch.bfloat16), *args[8:])
    assert_faces_close(run_project("kernel", args), args)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [16, 64, 128, 256])
@pytest.mark.parametrize("weights_proj_16_bit", [False, True])
def test_project_gpu_tiles_by_tma_equal_pointers(tokens, weights_proj_16_bit, monkeypatch):
    """V3.2's sizes: the matrix products' tiles by TMA give the pointer path's q_fp8, head
    weights and cache bit for bit."""
    args = project_case(tokens, tokens, 7168, 1536, 64, 128, rope_dim=64, block_size=64)
    if weights_proj_16_bit:
        args = (*args[:7], args[7].to(torch.bfloat16), *args[8:])
    tma_tiles_equal_pointers(args, monkeypatch)


def fp8_weights(args: tuple, ue8m0: bool) -> tuple[tuple, tuple]:
    """``args`` with ``wq_b`` and ``wk`` quantised to fp8 blocks (their scales last), and
    with the same weights dequantised."""
    (wq_b, wq_b_scale), (wk, wk_scale) = (block_fp8.quantize(w, ue8m0) for w in args[2:4])
    dtype = args[0].dtype
    dequantised = (block_fp8.dequantize(wq_b, wq_b_scale, dtype),
                   block_fp8.dequantize(wk, wk_scale, dtype))
    return ((*args[:2], wq_b, wk, *args[4:], wq_b_scale, wk_scale),
            (*args[:2], *dequantised, *args[4:]))


def test_q_tiles_by_tma_where_they_can_be():
    """The q product's tiles go by TMA for 16-bit rows of unit stride at 16-byte aligned
    addresses and pitches (on the CPU too, where the interpreter runs the kernel, so the
    token-tile tests above take that path), else by pointers."""
    x = torch.zeros(5, 1000, dtype=torch.bfloat16)
    assert project._tma_tiles(x) and project._tma_tiles(x.half())
    assert not project._tma_tiles(x.float())  # fp32 rows: the pointer path
    assert not project._tma_tiles(torch.zeros(5, 1001, dtype=torch.bfloat16)[:, :1000])  # pitch
    assert not project._tma_tiles(x[:, 3:])  # address
    assert not project._tma_tiles(x.t())  # column stride
    with FakeTensorMode():  # traced: sizes only, the same answers
        fake = torch.zeros(5, 1000, dtype=torch.bfloat16)
        assert project._tma_tiles(fake) and not project._tma_tiles(fake[:, 3:])


def test_partial_sums_stay_inside_weight_blocks():
    """A program's columns and a step's elements share one fp8 block's scale."""
    for tokens in (1, 2, 64, 65, KERNEL_TOKENS):
        for fp8_q, fp8_k in ((True, True), (True, False), (False, True)):
            plan = project.partials_plan(tokens, fp8_q, fp8_k)
            for size in (project.COLS, plan.q_cols, plan.step):
                assert block_fp8.BLOCK % size == 0


@pytest.mark.parametrize("face", ["cpu", pytest.param("kernel", marks=pytest.mark.interpret)])
@pytest.mark.parametrize(("tokens", "dtype", "ue8m0"), [
    (1, torch.bfloat16, False), (2, torch.bfloat16, True), (3, torch.float16, False),
    (1, torch.float32, True), (2, torch.float32, False)])
def test_project_fp8_weights(face, tokens, dtype, ue8m0):
    """fp8 ``wq_b`` and ``wk`` with block scales (widths, q columns and k columns past a
    whole block; ue8m0: power-of-two scales) give the outputs of their dequantised weights
    exactly: one token at a time and by matrix products."""
    if face == "kernel" and HAS_CUDA:
        pytest.skip("the kernel face on CUDA tensors: test_project_gpu_fp8_weights")
    args = project_case(tokens, tokens, 300, 200, 5, 32, dtype, 16)
    fp8, dequantised = fp8_weights(args, ue8m0)
    assert_same_outputs(run_project(face, fp8), run_project(face, dequantised))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 2, 16, 64, 100, KERNEL_TOKENS + 1])
def test_project_gpu_fp8_weights(tokens):
    """V3.2's sizes and checkpoint format (fp8 ``wq_b`` / ``wk``, power-of-two block
    scales): up to KERNEL_TOKENS the kernels, close to the CPU face of the dequantised
    weights (fp8 tiles take other layouts than 16-bit ones: their fp32 sums run in another
    order); above, the torch projections, the outputs of the dequantised weights bit for
    bit."""
    args = project_case(tokens, tokens, 7168, 1536, 64, 128, rope_dim=64, block_size=64)
    fp8, dequantised = fp8_weights(args, ue8m0=True)
    if tokens <= KERNEL_TOKENS:
        assert_faces_close(run_project("kernel", fp8), dequantised)
    else:
        assert_same_outputs(run_project("kernel", fp8), run_project("kernel", dequantised))


def fp8_tiles_by_tma_equal_pointers(args: tuple, monkeypatch) -> None:
    """With fp8 weights (``args`` with their scales), the kernel face with their tiles by TMA
    (``FP8_WEIGHTS_BY_TMA``) gives its outputs by pointers bit for bit."""
    monkeypatch.setattr(project, "FP8_WEIGHTS_BY_TMA", True)
    assert project._tma_operands(args[1], args[2], args[-2])
    got = run_project("kernel", args)
    monkeypatch.setattr(project, "FP8_WEIGHTS_BY_TMA", False)
    want = run_project("kernel", args)
    assert_same_outputs(got, want)


@pytest.mark.interpret
@pytest.mark.parametrize("ue8m0", [False, True])
def test_project_fp8_tiles_by_tma(ue8m0, monkeypatch):
    """fp8 ``wq_b`` and ``wk`` tiles by TMA, scaled in registers: the pointer path's outputs
    bit for bit (37 tokens: a tile's rows past the tokens, q and k columns past a block)."""
    if HAS_CUDA:
        pytest.skip("the kernel face on CUDA tensors: test_project_gpu_fp8_tiles_by_tma")
    args = project_case(5, 37, 704, 1024, 3, 32)
    fp8_tiles_by_tma_equal_pointers(fp8_weights(args, ue8m0)[0], monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [2, 16, 64, 128, 256])
def test_project_gpu_fp8_tiles_by_tma(tokens, monkeypatch):
    """V3.2's sizes with its checkpoint's fp8 ``wq_b`` / ``wk``: their tiles by TMA give the
    pointer path's q_fp8, head weights and cache bit for bit."""
    args = project_case(tokens, tokens, 7168, 1536, 64, 128, rope_dim=64, block_size=64)
    fp8_tiles_by_tma_equal_pointers(fp8_weights(args, ue8m0=True)[0], monkeypatch)


test_project_opcheck = opcheck_test(
    [project_case(0, tokens, 200, 100, 4, 32) for tokens in (0, 1, 3)], op=OP)

_GOOD = project_case(1, 2, 64, 48, 4, 16)
_FP8 = fp8_weights(_GOOD, ue8m0=False)[0]


def _bad(index: int, value) -> tuple:
    return tuple(value if i == index else a for i, a in enumerate(_GOOD))


test_project_rejects_bad_inputs = validation_test([
    (_bad(0, _GOOD[0].to(torch.int32)), TypeError, r"project_quantize_and_cache_k: `hidden`"),
    (_bad(1, _GOOD[1][:1]), ValueError, r"`q_latent`.*num_tokens"),
    (_bad(1, _GOOD[1].float()), TypeError, r"`q_latent`"),
    (_bad(2, _GOOD[2][:60]), ValueError, r"`wq_b`.*num_heads \* head_dim"),
    (_bad(2, _GOOD[2][:, :40]), ValueError, r"`wq_b`.*q_lora_rank"),
    (_bad(3, _GOOD[3].float()), TypeError, r"`wk`"),
    (_bad(3, _GOOD[3][:, :60]), ValueError, r"`wk`.*hidden_size"),
    (_bad(3, _GOOD[3][:0]), ValueError, r"`wk` must be \[head_dim >= 1"),
    (_bad(4, _GOOD[4][:8]), ValueError, r"`norm_weight`.*head_dim"),
    (_bad(5, _GOOD[5].double()), TypeError, r"`norm_bias`"),
    (_bad(6, 0.0), ValueError, r"`eps` must be a positive float"),
    (_bad(7, _GOOD[7][:, :10]), ValueError, r"`weights_proj`.*hidden_size"),
    (_bad(7, _GOOD[7][:0]), ValueError, r"`weights_proj` must have num_heads >= 1"),
    (_bad(8, torch.zeros(3, 4, 1, 36, dtype=torch.uint8)), ValueError,
     r"`kv_cache` must hold head_dim = wk.shape\[0\] = 16"),
    (_bad(9, _GOOD[9].int()), TypeError, r"`slot_mapping`"),
    (_bad(9, _GOOD[9][:1]), ValueError, r"`slot_mapping`.*num_tokens"),
    (_bad(10, _GOOD[10][:, :5].contiguous()), ValueError,
     r"`cos_sin` must be \[max_len >= 1, rope_dim\]"),
    (_bad(11, _GOOD[11][:1]), ValueError, r"`positions`.*num_tokens"),
    (_bad(4, _GOOD[4].repeat(2)[::2]), ValueError, r"`norm_weight` must be contiguous"),
    (_bad(9, _GOOD[9].repeat(2)[::2]), ValueError, r"`slot_mapping` must be contiguous"),
    (_bad(8, _GOOD[8][:0]), ValueError, r"`kv_cache` must have at least one block"),
    ((*_FP8[:14], None, _FP8[15]), ValueError,
     r"an fp8 e4m3 `wq_b` needs `wq_b_scale`, its fp32 scales per 128x128 block, got None"),
    ((*_GOOD, None, _FP8[15]), ValueError,
     r"`wk_scale` goes with an fp8 e4m3 `wk` only, got a scale for a torch.bfloat16 `wk`"),
    ((*_FP8[:14], _FP8[14].double(), _FP8[15]), TypeError, r"`wq_b_scale` must be"),
    ((*_FP8[:15], _FP8[15][:, :0]), ValueError,
     r"`wk_scale` must have size 1 \(ceil\(wk.shape\[1\] / 128\)\) in dimension 1"),
    ((*_FP8[:3], _FP8[3].to(torch.float8_e5m2), *_FP8[4:]), TypeError,
     r"`wk` must be torch.bfloat16 or torch.float8_e4m3fn"),
], op=OP)


@pytest.mark.interpret
def test_project_kernels_take_at_most_kernel_tokens():
    args = project_case(0, KERNEL_TOKENS + 1, 64, 32, 2, 16)
    outputs = FACES[OP].fake(*args)
    with pytest.raises(ValueError, match=f"at most {KERNEL_TOKENS} tokens"):
        project_triton(*args, *outputs)
