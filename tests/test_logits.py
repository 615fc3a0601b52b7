"""dsa::paged_mqa_logits, dsa::mqa_logits and dsa::paged_mqa_schedule against the float64
reference of design §3: dsa's own kernel on both faces (plain torch on the CPU face; Triton on
the kernel face: on the GPU when there is one, else under the interpreter), on small shapes.
The DeepGEMM ops (``*_deepgemm``) and the Python choosers (``paged_logits``,
``ragged_logits``) on what the CPU can check: validation and refusal."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import reference_compute as ref
import torch
from faces import FACE_NAMES, HAS_CUDA, KERNEL_MARK, run_op, to_cpu
from torch._subclasses.fake_tensor import FakeTensorMode

from dsa.ops import FACES
from dsa.ops.kcache import kcache_views
from dsa.ops.logits import deepgemm, paged, paged_logits, ragged_logits
from dsa.ops.logits.paged import PagedLogitsConfig, paged_logits_triton
from dsa.ops.logits.ragged import MqaLogitsConfig, mqa_logits_triton
from dsa.ops.quant import quantize_rows

# The kernel face runs CUDA copies with a GPU, else the CPU tensors under the interpreter.
# opcheck's test_schema compares inputs with torch.allclose, which CPU fp8 tensors lack;
# fp8_inputs_unchanged checks the same (no input is mutated) byte for byte.
OPCHECK_UTILS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


def on_kernel_device(args: tuple) -> tuple:
    """``args`` where the Triton kernels run them: CUDA with a GPU, else CPU."""
    if not HAS_CUDA:
        return args
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


def _align(n: int, multiple: int = 256) -> int:
    return (n + multiple - 1) // multiple * multiple


# --- cases ----------------------------------------------------------------------------------


def paged_case(seed, batch, next_n, heads, head_dim, block_size, max_context_len, *,
               width=None, broken_table=False, full=False):
    """Random decode inputs quantised through dsa's own ops, with the unquantised and the
    dequantised float64 views the reference needs; ``full``: every row's length is
    ``max_context_len`` (past a narrow table's keys)."""
    gen = torch.Generator().manual_seed(seed)
    width = triton_cdiv(max_context_len, block_size) if width is None else width
    num_blocks = batch * width + 2
    cache = torch.randint(0, 256, (num_blocks, block_size, 1, head_dim + 4), dtype=torch.uint8,
                          generator=gen)
    k = torch.randn(num_blocks * block_size, head_dim, generator=gen)
    k *= torch.rand(num_blocks * block_size, 1, generator=gen) * 4
    torch.ops.dsa.quantize_and_cache_k(k, cache, torch.arange(num_blocks * block_size))
    table = torch.randperm(num_blocks, generator=gen)[:batch * width].view(batch, width)
    table = table.to(torch.int32)
    if broken_table and table.numel():
        table.view(-1)[torch.randint(0, table.numel(), (3,), generator=gen)] = -1
        table.view(-1)[torch.randint(0, table.numel(), (1,), generator=gen)] = num_blocks + 5
    choices = torch.tensor([0, 1, block_size - 1, block_size, block_size + 1, max_context_len])
    choices = choices[choices <= max_context_len]
    context_lens = choices[torch.randint(0, len(choices), (batch, next_n), generator=gen)]
    if full:
        context_lens.fill_(max_context_len)
    context_lens = context_lens.to(torch.int32)
    q = torch.randn(batch * next_n, heads, head_dim, generator=gen)
    weights = torch.randn(batch * next_n, heads, generator=gen)
    q_fp8, head_weights = torch.ops.dsa.quantize_q(q, weights)
    inputs = (q_fp8.view(batch, next_n, heads, head_dim), cache, head_weights, context_lens, table)
    codes, scales = ref.read_cache(cache.numpy(), block_size, head_dim)
    dequantised = ref.paged_logits(
        ref.fp8_decode(q_fp8.view(torch.uint8).numpy()).reshape(batch, next_n, heads, head_dim),
        head_weights.double().numpy(), context_lens.numpy(), table.numpy(), max_context_len,
        ref.fp8_decode(codes), scales)
    exact = ref.paged_logits(
        q.double().numpy().reshape(batch, next_n, heads, head_dim),
        weights.double().numpy() * heads**-0.5 * head_dim**-0.5, context_lens.numpy(),
        table.numpy(), max_context_len, k.double().numpy().reshape(num_blocks, block_size, -1),
        np.ones((num_blocks, block_size)))
    return inputs, max_context_len, dequantised, exact


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_logits(out: torch.Tensor, dequantised: np.ndarray, exact: np.ndarray,
                 exact_pairs: list | None = None) -> None:
    """Every element is -inf exactly where the reference is invalid and matches the
    dequantised reference elsewhere. The fp8 noise against the unquantised reference
    (about 7e-4 in this metric for random data) only settles over many elements: with
    ``exact_pairs`` the valid entries are collected for :func:`check_fp8_noise`, else they
    are checked here."""
    assert out.dtype == torch.float32 and out.shape == dequantised.shape
    if out.numel():
        assert out.stride() == (_align(out.shape[1]), 1)
    got = out.double().numpy()
    valid = np.isfinite(dequantised)
    np.testing.assert_array_equal(np.isneginf(got), ~valid)
    assert np.isfinite(got[valid]).all()
    assert ref.relative_error(got[valid], dequantised[valid]) < 1e-5
    if exact_pairs is None:
        check_fp8_noise([(got[valid], exact[valid])])
    else:
        exact_pairs.append((got[valid], exact[valid]))


def check_fp8_noise(pairs: list) -> None:
    got = np.concatenate([g for g, _ in pairs])
    exact = np.concatenate([e for _, e in pairs])
    assert ref.relative_error(got, exact) < 1e-3


PAGED_SHAPES = [
    # batch, next_n, heads, head_dim, block_size, max_context_len
    (2, 1, 16, 32, 16, 100),
    (2, 2, 16, 64, 64, 130),
    (1, 1, 16, 32, 128, 200),
    (2, 3, 8, 32, 16, 77),
    (2, 3, 16, 32, 64, 150),   # next_n 3 and 4 (MTP), one cache block per 64-token tile
    (2, 4, 16, 32, 64, 130),
    (1, 4, 8, 32, 128, 300),   # tiles inside a larger block
    (1, 1, 64, 64, 64, 65),
    (2, 1, 4, 32, 16, 50),
    (2, 2, 16, 32, 16, 0),
    (0, 1, 16, 32, 16, 40),
]


@pytest.mark.parametrize("face", FACE_NAMES)
@pytest.mark.parametrize("shape", PAGED_SHAPES)
def test_paged_logits_match_reference(face, shape):
    pairs = []
    for seed in range(3):
        inputs, max_len, dequantised, exact = paged_case(seed, *shape)
        with ref.poisoned_empty():
            out = run_op(face, "paged_mqa_logits", *inputs, max_len)
        check_logits(out, dequantised, exact, pairs)
    check_fp8_noise(pairs)


@pytest.mark.parametrize("face", FACE_NAMES)
@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize(("next_n", "block_size", "max_len", "width"),
                         [(2, 16, 120, 2), (2, 16, 120, 9), (4, 64, 300, 3), (3, 64, 300, 6),
                          (1, 16, 120, 2), (3, 64, 300, 2)])
def test_paged_logits_invalid_blocks_are_masked(face, full, next_n, block_size, max_len, width):
    """A table narrower than the contexts (``full``: every length reaches past it, where the
    next row's entries must not be read), holding -1 and out-of-cache entries."""
    inputs, max_len, dequantised, exact = paged_case(3, 2, next_n, 16, 32, block_size,
                                                     max_len, width=width, broken_table=True,
                                                     full=full)
    with ref.poisoned_empty():
        out = run_op(face, "paged_mqa_logits", *inputs, max_len)
    check_logits(out, dequantised, exact)


@KERNEL_MARK
@pytest.mark.parametrize(
    "config",
    [PagedLogitsConfig(tile=16, tiles_per_program=3, num_warps=2, num_stages=1),
     PagedLogitsConfig(tile=32, tiles_per_program=1, scales_ahead=True),
     PagedLogitsConfig(tile=128, tiles_per_program=2, num_warps=8, num_stages=4),
     PagedLogitsConfig(tile=16, tiles_per_program=2, num_warps=2, num_stages=1,
                       split_rows=True, scales_ahead=True),
     PagedLogitsConfig(tile=32, tiles_per_program=3, num_stages=2, tma=True),
     PagedLogitsConfig(tile=16, tiles_per_program=5, num_warps=2, num_stages=1,
                       split_rows=True, scales_ahead=True, tma=True, direct_store=True),
     PagedLogitsConfig(tile=32, tiles_per_program=4, num_stages=3, split_rows=True,
                       scales_ahead=True, tma=True, direct_store=True, keep_in_l2=True),
     PagedLogitsConfig(tile=16, tiles_per_program=5, num_warps=2, num_stages=1,
                       blocks_preloaded=True),
     PagedLogitsConfig(tile=32, tiles_per_program=3, num_stages=2, scales_ahead=True,
                       tma=True, blocks_preloaded=True, keep_in_l2=True, early_tiles=2)],
)
@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
def test_paged_logits_triton_configs(config, next_n):
    inputs, max_len, dequantised, exact = paged_case(4, 2, next_n, 16, 32, 64, 190)
    with ref.poisoned_empty():
        out = paged_logits_triton(*on_kernel_device(inputs), max_len, config=config)
    check_logits(to_cpu(out), dequantised, exact)


def test_tma_unsupported_reason():
    """Where the kernel's K copies by TMA run (elsewhere it copies per thread)."""
    cache = torch.zeros(8, 64, 1, 132, dtype=torch.uint8)
    assert paged.tma_unsupported_reason(cache, 64) is None
    assert paged.tma_unsupported_reason(cache, 32) is None
    assert "do not split" in paged.tma_unsupported_reason(cache, 128)
    assert "contiguous" in paged.tma_unsupported_reason(cache[1::2], 64)
    shifted = torch.zeros(cache.numel() + 4, dtype=torch.uint8)[4:].view(cache.shape)
    assert "aligned" in paged.tma_unsupported_reason(shifted, 64)
    assert "power of two" in paged.tma_unsupported_reason(
        torch.zeros(8, 64, 1, 100, dtype=torch.uint8), 64)
    assert paged.tma_unsupported_reason(torch.zeros(8, 16, 1, 36, dtype=torch.uint8), 16) is None


def test_paged_logits_strided_inputs():
    inputs, max_len, dequantised, exact = paged_case(5, 2, 1, 16, 32, 16, 70)
    q, cache, weights, lens, table = inputs
    wide_weights = torch.zeros(weights.shape[0], 24)
    wide_weights[:, :16] = weights
    wide_table = torch.full((table.shape[0], table.shape[1] + 3), -1, dtype=torch.int32)
    wide_table[:, :table.shape[1]] = table
    for face in ("cpu", "kernel"):
        out = run_op(face, "paged_mqa_logits", q, cache, wide_weights[:, :16], lens,
                     wide_table[:, :table.shape[1]], max_len)
        check_logits(out, dequantised, exact)


def test_paged_logits_output_layout():
    inputs, _, _, _ = paged_case(6, 1, 2, 16, 32, 16, 40)
    for max_len in (1, 255, 256, 257):
        for face in ("cpu", "kernel", "fake"):
            out = run_op(face, "paged_mqa_logits", *inputs, max_len)
            assert out.shape == (2, max_len) and out.stride() == (_align(max_len), 1)


def fp8_inputs_unchanged(op, args, kwargs) -> None:
    before = [a.view(torch.uint8).clone() if a.dtype == torch.float8_e4m3fn else a.clone()
              for a in args if isinstance(a, torch.Tensor)]
    op(*args, **kwargs)
    after = [a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a
             for a in args if isinstance(a, torch.Tensor)]
    assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))


def test_paged_logits_opcheck():
    inputs, max_len, _, _ = paged_case(7, 2, 2, 16, 32, 16, 40)
    op = torch.ops.dsa.paged_mqa_logits.default
    for args in ((*inputs, max_len), on_kernel_device((*inputs, max_len))):
        torch.library.opcheck(op, args, test_utils=OPCHECK_UTILS)
        fp8_inputs_unchanged(op, args, {})


def test_paged_chooser_runs_dsa_kernel_off_deepgemm():
    """On the CPU "auto" and "triton" run dsa's own op (a schedule is ignored there)."""
    inputs, max_len, _, _ = paged_case(8, 2, 2, 16, 32, 16, 40)
    want = torch.ops.dsa.paged_mqa_logits(*inputs, max_len)
    schedule = torch.ops.dsa.paged_mqa_schedule(inputs[3], 16)
    for kwargs in ({}, {"backend": "auto", "schedule": schedule}, {"backend": "triton"}):
        got = paged_logits(*inputs, max_len, **kwargs)
        assert torch.equal(got, want) and got.stride() == want.stride()


def test_paged_chooser_auto_rule(monkeypatch):
    """Where DeepGEMM could run, "auto" takes it unless the call reads at most
    ``AUTO_TRITON_MAX_KEYS[next_n]`` keys (rows x max_context_len), where dsa's kernel was
    measured faster; without the sizes, DeepGEMM."""
    monkeypatch.setattr(deepgemm, "paged_unsupported_reason",
                        lambda *shape: None if shape[-1] in deepgemm.PAGED_NEXT_N else "next_n")
    monkeypatch.setattr(paged, "_gpu_name", lambda _: "NVIDIA H200")
    cuda = torch.device("cuda")
    choose = functools.partial(paged.paged_backend, "auto", cuda, 64, 128, 64)
    assert [choose(n) for n in (1, 2, 3, 4)] == ["deepgemm"] * 2 + ["triton"] * 2
    # the H200 shapes: next_n 1 to dsa's kernel at every size (4K to 8M keys); next_n 2
    # up to 256K keys
    assert [choose(1, b, n) for b, n in ((1, 4096), (8, 32768), (64, 16384), (1, 2**20),
                                         (8, 2**17 + 64), (64, 65536), (128, 65536))] == (
        ["triton"] * 7)
    assert [choose(2, b, n) for b, n in ((1, 4096), (1, 65536), (8, 32768), (8, 65536),
                                         (1, 2**20))] == ["triton"] * 3 + ["deepgemm"] * 2
    assert [choose(1, b, n) for b, n in ((1, None), (None, 4096))] == ["deepgemm"] * 2
    monkeypatch.setattr(paged, "AUTO_TRITON_MAX_KEYS", {1: 4 * 100})
    assert [choose(1, b, 100) for b in (1, 4, 5)] == ["triton"] * 2 + ["deepgemm"]
    assert choose(2, 1, 100) == "deepgemm"
    assert paged.paged_backend("deepgemm", cuda, 64, 128, 64, 1, 1, 4096) == "deepgemm"
    assert paged.paged_backend("triton", cuda, 64, 128, 64, 1, 64, 2**20) == "triton"
    # the H100's rule: next_n 2 to dsa's kernel at every size too
    monkeypatch.setattr(paged, "_gpu_name", lambda _: "NVIDIA H100 80GB HBM3")
    assert [choose(n, b, L) for n in (1, 2) for b, L in ((1, 4096), (1, 2**20), (64, 65536))
            ] == ["triton"] * 6
    assert [choose(n) for n in (1, 2)] == ["deepgemm"] * 2  # without the sizes
    assert paged.paged_backend("deepgemm", cuda, 64, 128, 64, 2, 1, 4096) == "deepgemm"


def test_paged_chooser_gpu_name_off_cuda():
    """Off CUDA the chooser's GPU name is empty: the default rule."""
    assert paged._gpu_name(torch.device("cpu")) == ""
    assert paged.auto_triton_max_keys(torch.device("cpu")) is paged.AUTO_TRITON_MAX_KEYS


@pytest.mark.parametrize("next_n", [1, 2, 3, 4, 5])
def test_paged_default_config_by_next_n(next_n):
    config = paged.paged_logits_config(64, next_n, 65536)
    launch = paged.PAGED_LAUNCH[min(next_n, 4)]
    fields = paged.PagedLaunch._fields[1:]
    assert tuple(getattr(config, f) for f in fields) == launch[1:]
    # 65536 tiles of 64 keys: most_tiles a program (512 programs would take 128 each)
    assert (config.tile, config.tiles_per_program) == (64, launch.most_tiles)
    assert paged.paged_logits_config(64, next_n, 16384).tiles_per_program == min(
        launch.most_tiles, 32)
    assert paged.paged_logits_config(1, next_n, 4096).tiles_per_program == 1


def test_paged_split_rows_takes_at_most_four_rows():
    inputs, max_len, _, _ = paged_case(1, 2, 5, 16, 32, 64, 100)
    with pytest.raises(ValueError, match="split_rows takes next_n <= 4"):
        paged_logits_triton(*inputs, max_len, config=PagedLogitsConfig(split_rows=True))


def test_paged_schedule_on_cpu_is_zeros():
    lens = torch.tensor([[3, 4], [0, 1]], dtype=torch.int32)
    schedule = torch.ops.dsa.paged_mqa_schedule(lens, 64)
    assert torch.equal(schedule, torch.zeros(2, 2, dtype=torch.int32))
    torch.library.opcheck(torch.ops.dsa.paged_mqa_schedule.default, (lens, 64))


# --- validation -----------------------------------------------------------------------------


def _paged_args(**changes):
    q = torch.zeros(2, 1, 16, 32, dtype=torch.float8_e4m3fn)
    args = {
        "q_fp8": q,
        "kv_cache": torch.zeros(4, 16, 1, 36, dtype=torch.uint8),
        "weights": torch.zeros(2, 16),
        "context_lens": torch.zeros(2, 1, dtype=torch.int32),
        "block_table": torch.zeros(2, 3, dtype=torch.int32),
        "max_context_len": 48,
    }
    args.update(changes)
    return args


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"q_fp8": torch.zeros(2, 1, 16, 32, dtype=torch.bfloat16)}, TypeError, "`q_fp8` must be"),
        ({"q_fp8": torch.zeros(2, 16, 32, dtype=torch.float8_e4m3fn)}, ValueError,
         "`q_fp8` must have 4 dimension"),
        ({"q_fp8": torch.zeros(2, 1, 0, 32, dtype=torch.float8_e4m3fn),
          "weights": torch.zeros(2, 0)}, ValueError, "`q_fp8` must have num_heads >= 1"),
        ({"kv_cache": torch.zeros(4, 16, 1, 68, dtype=torch.uint8)}, ValueError,
         r"`kv_cache` must have size 36"),
        ({"kv_cache": torch.zeros(0, 16, 1, 36, dtype=torch.uint8)}, ValueError,
         "at least one block"),
        ({"kv_cache": torch.zeros(8, 16, 1, 36, dtype=torch.uint8)[::2]}, ValueError,
         "`kv_cache` must be contiguous"),
        ({"kv_cache": torch.zeros(4, 16, 1, 36)}, TypeError, "`kv_cache` must be torch.uint8"),
        ({"weights": torch.zeros(2, 16, dtype=torch.bfloat16)}, TypeError, "`weights` must be"),
        ({"weights": torch.zeros(1, 16)}, ValueError, r"`weights` must have size 2"),
        ({"context_lens": torch.zeros(2, 1, dtype=torch.int64)}, TypeError, "`context_lens`"),
        ({"context_lens": torch.zeros(2, 2, dtype=torch.int32)}, ValueError,
         r"`context_lens` must have size 1"),
        ({"context_lens": torch.full((2, 1), -1, dtype=torch.int32)}, ValueError, ">= 0"),
        ({"block_table": torch.zeros(3, 3, dtype=torch.int32)}, ValueError,
         r"`block_table` must have size 2"),
        ({"block_table": torch.zeros(2, 6, dtype=torch.int32)[:, ::2]}, ValueError,
         r"rows must be contiguous \(stride\(1\) == 1\)"),
        ({"max_context_len": -1}, ValueError, "`max_context_len` must be >= 0"),
    ],
)
@pytest.mark.parametrize("op", ["paged_mqa_logits", "paged_mqa_logits_deepgemm"])
def test_paged_logits_validation(op, changes, error, match):
    """Both ops check their arguments alike (before DeepGEMM's own refusal), naming
    themselves; eagerly and under fake tensors."""
    reads_values = match == ">= 0"  # value checks read host tensors; fake ones have none
    match = f"dsa.{op}: .*{match}"
    with pytest.raises(error, match=match):
        getattr(torch.ops.dsa, op)(**_paged_args(**changes))
    if not reads_values:
        with pytest.raises(error, match=match), FakeTensorMode(allow_non_fake_inputs=True):
            getattr(torch.ops.dsa, op)(**_paged_args(**changes))


DEEPGEMM_ON_CPU = "DeepGEMM cannot run this call: it needs CUDA tensors, got cpu tensors"


def on_cpu_tensors(face: str, name: str, *args):
    """Op ``name`` on CPU tensors through one face: the CPU or CUDA face called directly,
    or the dispatcher under fake tensors."""
    if face == "fake":
        return run_op("fake", name, *args)
    return getattr(FACES[name], face)(*args)


@pytest.mark.parametrize("face", ["cpu", "cuda", "fake"])
def test_paged_deepgemm_refuses_cpu_tensors(face):
    """The DeepGEMM op on CPU tensors raises on every face, at trace time too."""
    args = _paged_args().values()
    with pytest.raises(ValueError, match=f"dsa.paged_mqa_logits_deepgemm: {DEEPGEMM_ON_CPU}"):
        on_cpu_tensors(face, "paged_mqa_logits_deepgemm", *args)
    with pytest.raises(ValueError, match=DEEPGEMM_ON_CPU):
        on_cpu_tensors(face, "paged_mqa_logits_deepgemm", *args,
                       torch.zeros(2, 2, dtype=torch.int32))


def test_deepgemm_shape_reasons():
    cuda = torch.device("cuda")
    cpu = torch.device("cpu")
    assert "CUDA tensors" in deepgemm.paged_unsupported_reason(cpu, 64, 128, 64, 1)
    assert "CUDA tensors" in deepgemm.mqa_unsupported_reason(cpu, 64, 128)
    assert not deepgemm.deepgemm_paged_supported(cpu, 64, 128, 64, 1)
    assert not deepgemm.deepgemm_mqa_supported(cpu, 64, 128)
    assert not deepgemm.schedule_supported(cpu, 64)
    assert deepgemm.num_sms(cpu) == 1
    if (torch.cuda.is_available() and deepgemm.arch_major(cuda) == 9
            and deepgemm.deep_gemm() is not None and deepgemm.api_mismatch() is None):
        assert deepgemm.deepgemm_paged_supported(cuda, 64, 128, 64, 2)
        assert "next_n" in deepgemm.paged_unsupported_reason(cuda, 64, 128, 64, 3)
        assert "num_heads" in deepgemm.paged_unsupported_reason(cuda, 128, 128, 64, 1)
        assert "head_dim" in deepgemm.paged_unsupported_reason(cuda, 64, 256, 64, 1)
        assert "block_size" in deepgemm.paged_unsupported_reason(cuda, 64, 128, 32, 1)


# --- mqa_logits (ragged prefill) --------------------------------------------------------------


def mqa_case(seed, seq_lens, query_lens, heads, head_dim, *, extra_rows=()):
    """A prefill chunk (design §5 bounds with R = 1) plus optional odd (ks, ke) rows."""
    gen = torch.Generator().manual_seed(seed)
    cu = np.concatenate([[0], np.cumsum(seq_lens)])
    ks, ke = [], []
    for r, (seq, queries) in enumerate(zip(seq_lens, query_lens, strict=True)):
        for j in range(queries):
            ks.append(cu[r])
            ke.append(cu[r] + seq - queries + 1 + j)
    for start, end in extra_rows:
        ks.append(start)
        ke.append(end)
    ks, ke = torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32)
    num_keys, num_q = int(cu[-1]), len(ks)
    k = torch.randn(num_keys, head_dim, generator=gen) * 3
    k_fp8, k_scale = quantize_rows(k, False)
    q = torch.randn(num_q, heads, head_dim, generator=gen)
    weights = torch.randn(num_q, heads, generator=gen)
    q_fp8, head_weights = torch.ops.dsa.quantize_q(q, weights)
    inputs = (q_fp8, k_fp8, k_scale, head_weights, ks, ke)
    return inputs, k, q, weights


def mqa_references(case, max_seqlen_k):
    (q_fp8, k_fp8, k_scale, head_weights, ks, ke), k, q, weights = case
    heads, head_dim = q.shape[1:]
    dequantised = ref.mqa_logits(
        ref.fp8_decode(q_fp8.view(torch.uint8).numpy()), ref.fp8_decode(
            k_fp8.view(torch.uint8).numpy()), k_scale.double().numpy(),
        head_weights.double().numpy(), ks.numpy(), ke.numpy(), max_seqlen_k)
    exact = ref.mqa_logits(q.double().numpy(), k.double().numpy(), np.ones(k.shape[0]),
                           weights.double().numpy() * heads**-0.5 * head_dim**-0.5, ks.numpy(),
                           ke.numpy(), max_seqlen_k)
    return dequantised, exact


MQA_CASES = [
    # seq_lens, query_lens, heads, head_dim, extra (ks, ke) rows
    ([5, 9, 4], [2, 2, 3], 16, 32, ()),
    ([40, 130, 1], [7, 5, 1], 16, 64, ((0, 0), (10, 5), (160, 200), (3, 171))),
    ([33], [33], 8, 32, ()),
    ([20, 20], [3, 4], 4, 32, ((0, 40),)),
    ([], [], 16, 32, ((0, 3),)),
]


@pytest.mark.parametrize("face", FACE_NAMES)
@pytest.mark.parametrize("case_args", MQA_CASES)
@pytest.mark.parametrize("width", ["exact", "short", "long"])
def test_mqa_logits_match_reference(face, case_args, width):
    case = mqa_case(0, *case_args[:4], extra_rows=case_args[4])
    ks, ke = case[0][4], case[0][5]
    longest = int((ke - ks).max()) if len(ks) else 0
    max_seqlen_k = {"exact": longest, "short": max(longest // 2, 1), "long": longest + 70}[width]
    dequantised, exact = mqa_references(case, max_seqlen_k)
    with ref.poisoned_empty():
        out = run_op(face, "mqa_logits", *case[0], max_seqlen_k)
    check_logits(out, dequantised, exact)


@KERNEL_MARK
@pytest.mark.parametrize(
    "config",
    [MqaLogitsConfig(block_q=1, tile=16, tiles_per_program=3, num_warps=2),
     MqaLogitsConfig(block_q=4, tile=64, tiles_per_program=1),
     MqaLogitsConfig(block_q=4, tile=16, tiles_per_program=2, num_warps=4)],
)
def test_mqa_logits_triton_configs(config):
    # rows past either end of the workspace too (the kernel masks their keys)
    case = mqa_case(1, [40, 60, 7], [9, 5, 3], 16, 32, extra_rows=((-20, 30), (90, 200)))
    dequantised, exact = mqa_references(case, 70)
    with ref.poisoned_empty():
        out = mqa_logits_triton(*on_kernel_device(case[0]), 70, config=config)
    check_logits(to_cpu(out), dequantised, exact)


def test_mqa_logits_opcheck():
    case = mqa_case(2, [10, 7], [3, 2], 16, 32)
    op = torch.ops.dsa.mqa_logits.default
    for args in ((*case[0], 11), on_kernel_device((*case[0], 11))):
        torch.library.opcheck(op, args, test_utils=OPCHECK_UTILS)
        fp8_inputs_unchanged(op, args, {})


def test_ragged_chooser_runs_dsa_kernel_off_deepgemm():
    case = mqa_case(3, [10, 7], [3, 2], 16, 32)
    want = torch.ops.dsa.mqa_logits(*case[0], 11)
    for kwargs in ({}, {"backend": "auto"}, {"backend": "triton"}):
        got = ragged_logits(*case[0], 11, **kwargs)
        assert torch.equal(got, want) and got.stride() == want.stride()


def _mqa_args(**changes):
    args = {
        "q_fp8": torch.zeros(3, 16, 32, dtype=torch.float8_e4m3fn),
        "k_fp8": torch.zeros(5, 32, dtype=torch.float8_e4m3fn),
        "k_scale": torch.zeros(5),
        "weights": torch.zeros(3, 16),
        "ks": torch.zeros(3, dtype=torch.int32),
        "ke": torch.zeros(3, dtype=torch.int32),
        "max_seqlen_k": 5,
    }
    args.update(changes)
    return args


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"q_fp8": torch.zeros(3, 16, 32)}, TypeError, "`q_fp8` must be"),
        ({"q_fp8": torch.zeros(3, 0, 32, dtype=torch.float8_e4m3fn), "weights": torch.zeros(3, 0)},
         ValueError, "`q_fp8` must have num_heads >= 1"),
        ({"k_fp8": torch.zeros(5, 64, dtype=torch.float8_e4m3fn)}, ValueError,
         r"`k_fp8` must have size 32"),
        ({"k_scale": torch.zeros(4)}, ValueError, r"`k_scale` must have size 5"),
        ({"weights": torch.zeros(3, 8)}, ValueError, r"`weights` must have size 16"),
        ({"ks": torch.zeros(2, dtype=torch.int32)}, ValueError, r"`ks` must have size 3"),
        ({"ke": torch.zeros(3, dtype=torch.int64)}, TypeError, "`ke` must be torch.int32"),
        ({"max_seqlen_k": -2}, ValueError, "`max_seqlen_k` must be >= 0"),
    ],
)
@pytest.mark.parametrize("op", ["mqa_logits", "mqa_logits_deepgemm"])
def test_mqa_logits_validation(op, changes, error, match):
    match = f"dsa.{op}: .*{match}"
    with pytest.raises(error, match=match):
        getattr(torch.ops.dsa, op)(**_mqa_args(**changes))
    with pytest.raises(error, match=match), FakeTensorMode(allow_non_fake_inputs=True):
        getattr(torch.ops.dsa, op)(**_mqa_args(**changes))


@pytest.mark.parametrize("face", ["cpu", "cuda", "fake"])
def test_mqa_deepgemm_refuses_cpu_tensors(face):
    with pytest.raises(ValueError, match=f"dsa.mqa_logits_deepgemm: {DEEPGEMM_ON_CPU}"):
        on_cpu_tensors(face, "mqa_logits_deepgemm", *_mqa_args().values())


@pytest.mark.parametrize(
    ("backend", "match"),
    [("cutlass", "`backend` must be one of"), ("torch", "`backend` must be one of"),
     ("deepgemm", "backend='deepgemm' cannot run this call: it needs CUDA tensors")],
)
@pytest.mark.parametrize("chooser", ["paged", "ragged"])
def test_chooser_validation(chooser, backend, match):
    """An unknown backend (the old "torch" included: dsa's CPU face is plain torch) or
    DeepGEMM where it cannot run: the choosers say so."""
    choose, args = {"paged": (paged_logits, _paged_args),
                    "ragged": (ragged_logits, _mqa_args)}[chooser]
    with pytest.raises(ValueError, match=match):
        choose(*args().values(), backend=backend)


@pytest.mark.parametrize("face", FACE_NAMES)
def test_mqa_logits_rows_starting_before_the_workspace(face):
    """A row whose span starts before key 0 (ks < 0) scores only the keys inside the
    workspace: its columns before key 0 are -inf on every face."""
    case = mqa_case(2, [40, 60, 7], [9, 5, 3], 16, 32, extra_rows=((-20, 30), (-5, 2)))
    dequantised, exact = mqa_references(case, 70)
    with ref.poisoned_empty():
        out = run_op(face, "mqa_logits", *case[0], 70)
    check_logits(out, dequantised, exact)
    assert torch.isneginf(out[-2, :20]).all() and torch.isfinite(out[-2, 20:50]).all()

    # A span past int32 (ke - ks wraps there): the row is still max_seqlen_k keys from ks.
    _, ragged = nan_code_case()
    q, keys, key_scales, weights = ragged[:4]
    out = run_op(face, "mqa_logits", q, keys, key_scales, weights,
                 torch.tensor([-5], dtype=torch.int32),
                 torch.tensor([2**31 - 1], dtype=torch.int32), 8)
    assert torch.isneginf(out[0, :5]).all() and torch.isfinite(out[0, 5:]).all()


def nan_code_case(seed: int = 0) -> tuple[tuple, tuple]:
    """Paged and ragged logits arguments (one request, 8 valid keys of 4 heads x 32 dims)
    whose key 3 holds one NaN fp8 code (0x7F), as a cache slot never written may."""
    torch.manual_seed(seed)
    q = torch.randn(1, 1, 4, 32).to(torch.float8_e4m3fn)
    cache = torch.zeros(1, 64, 1, 36, dtype=torch.uint8)
    values, scales = kcache_views(cache)
    values.view(torch.uint8).copy_(torch.randn(1, 64, 32).to(torch.float8_e4m3fn)
                                   .view(torch.uint8))
    scales.fill_(1.0)
    values.view(torch.uint8)[0, 3, 5] = 0x7F
    weights, lens = torch.ones(1, 4), torch.tensor([[8]], dtype=torch.int32)
    paged = (q, cache, weights, lens, torch.zeros(1, 1, dtype=torch.int32), 8)
    ragged = (q[0], values[0, :8].contiguous(), scales[0, :8].contiguous(), weights,
              torch.zeros(1, dtype=torch.int32), torch.full((1,), 8, dtype=torch.int32), 8)
    return paged, ragged


def test_a_nan_fp8_code_scores_zero_on_the_cpu_face():
    """A NaN dot product counts as 0 after the relu (the kernels' ``max``): the key's
    logit is 0, the others are what they are without it."""
    paged, ragged = nan_code_case()
    for out in (torch.ops.dsa.paged_mqa_logits(*paged), torch.ops.dsa.mqa_logits(*ragged)):
        assert out[0, 3].item() == 0.0 and torch.isfinite(out).all()
