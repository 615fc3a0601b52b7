"""GPU checks of the indexer logits on realistic shapes (H 64, D 128, bs 64): dsa's Triton
ops (``paged_mqa_logits``, ``mqa_logits``) and the DeepGEMM ops (``*_deepgemm``) against
each other and against the float64 reference on sampled rows; the choosers
(``paged_logits``, ``ragged_logits``); torch.compile and CUDA-graph replay."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import reference_compute as ref
import torch
from cuda_graphs import capture

from dsa.ops._launch import CHAIN_KEYS
from dsa.ops.logits import deepgemm, paged_backend, paged_logits, ragged_logits
from dsa.ops.logits.paged import PagedLogitsConfig, paged_logits_config, paged_logits_triton
from dsa.ops.logits.ragged import mqa_logits_triton
from dsa.ops.quant import quantize_rows

pytestmark = pytest.mark.gpu

HEADS, HEAD_DIM, BLOCK_SIZE = 64, 128, 64


def deepgemm_ready() -> bool:
    return torch.cuda.is_available() and deepgemm.deepgemm_paged_supported(
        torch.device("cuda"), HEADS, HEAD_DIM, BLOCK_SIZE, 1)


requires_deepgemm = pytest.mark.skipif(not deepgemm_ready(),
                                       reason="needs DeepGEMM on an sm_90 GPU")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Decode:
    """A decode batch: every request has its own blocks; row j of request b sees
    ``ctx[b, j] = base[b] + j`` tokens (bases include 0, 1, 64 and the maximum)."""

    def __init__(self, seed, batch, next_n, max_len, heads=HEADS, head_dim=HEAD_DIM):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        dev = "cuda"
        self.width = _cdiv(max_len, BLOCK_SIZE)
        num_blocks = batch * self.width + 1
        self.k = torch.randn(num_blocks * BLOCK_SIZE, head_dim, device=dev, generator=gen,
                             dtype=torch.bfloat16)
        self.cache = torch.empty(num_blocks, BLOCK_SIZE, 1, head_dim + 4, dtype=torch.uint8,
                                 device=dev)
        torch.ops.dsa.quantize_and_cache_k(self.k, self.cache,
                                           torch.arange(self.k.shape[0], device=dev))
        table = torch.randperm(num_blocks, device=dev, generator=gen)[:batch * self.width]
        self.table = table.view(batch, self.width).to(torch.int32)
        base = torch.randint(0, max_len - next_n + 2, (batch,), device=dev, generator=gen)
        fixed = torch.tensor([max_len - next_n + 1, 0, 1, BLOCK_SIZE], device=dev)[:batch]
        base[:len(fixed)] = fixed
        self.context_lens = (base[:, None] + torch.arange(next_n, device=dev)).to(torch.int32)
        self.q = torch.randn(batch * next_n, heads, head_dim, device=dev, generator=gen,
                             dtype=torch.bfloat16)
        self.weights = torch.randn(batch * next_n, heads, device=dev, generator=gen)
        q_fp8, self.head_weights = torch.ops.dsa.quantize_q(self.q, self.weights)
        self.q_fp8 = q_fp8.view(batch, next_n, heads, head_dim)
        self.max_len = max_len

    @property
    def inputs(self):
        return (self.q_fp8, self.cache, self.head_weights, self.context_lens, self.table)

    def valid(self) -> torch.Tensor:
        pos = torch.arange(self.max_len, device="cuda")
        return pos < self.context_lens.view(-1, 1)

    def references(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(dequantised, unquantised) float64 logits of request b's rows."""
        next_n, heads, head_dim = self.q_fp8.shape[1:]
        blocks = self.table[b].long()
        mini_cache = self.cache[blocks].cpu().numpy()
        mini_table = np.arange(self.width)[None, :]
        lens = self.context_lens[b:b + 1].cpu().numpy()
        codes, scales = ref.read_cache(mini_cache, BLOCK_SIZE, head_dim)
        rows = slice(b * next_n, (b + 1) * next_n)
        dequantised = ref.paged_logits(
            ref.fp8_decode(self.q_fp8[b:b + 1].view(torch.uint8).cpu().numpy()),
            self.head_weights[rows].double().cpu().numpy(), lens, mini_table, self.max_len,
            ref.fp8_decode(codes), scales)
        tokens = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device="cuda"))
        k = self.k[tokens.view(-1)].double().cpu().numpy().reshape(self.width, BLOCK_SIZE, -1)
        exact = ref.paged_logits(
            self.q[rows].double().cpu().numpy().reshape(1, next_n, heads, head_dim),
            self.weights[rows].double().cpu().numpy() * heads**-0.5 * head_dim**-0.5, lens,
            mini_table, self.max_len, k, np.ones((self.width, BLOCK_SIZE)))
        return dequantised, exact


def check_sampled_rows(case: Decode, out: torch.Tensor, masked: bool) -> None:
    """Sampled requests against the reference; ``masked``: -inf exactly past the context.

    The fp8 noise against the unquantised reference is checked over the sampled rows
    pooled, once there are several: one row's q is quantised once, so its error is one
    draw (about 7e-4 on average in this metric), not an average."""
    batch, next_n = case.q_fp8.shape[:2]
    pairs = []
    for b in sorted({0, 1 % batch, batch - 1, batch // 2}):
        dequantised, exact = case.references(b)
        got = out[b * next_n:(b + 1) * next_n].double().cpu().numpy()
        valid = np.isfinite(dequantised)
        if masked:
            np.testing.assert_array_equal(np.isneginf(got), ~valid)
        assert np.isfinite(got[valid]).all()
        if valid.any():
            assert ref.relative_error(got[valid], dequantised[valid]) < 1e-5
            pairs.append((got[valid], exact[valid]))
    if len(pairs) * next_n >= 4:
        got, exact = (np.concatenate(x) for x in zip(*pairs))
        assert ref.relative_error(got, exact) < 1e-3


def gpu_relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    return 0.0 if denominator == 0 else float(1 - 2 * (x * y).sum() / denominator)


def triton_logits(case, op, width: int) -> torch.Tensor:
    """``op``, a Triton logits op, on ``case`` (a ``Decode`` or ``Prefill``) with its fresh
    outputs poisoned: -inf exactly past each row's keys. Returns the logits."""
    with ref.poisoned_empty():
        out = op(*case.inputs, width)
    assert torch.equal(torch.isneginf(out), ~case.valid())
    return out


def deepgemm_logits(case, op, triton_op, width: int) -> torch.Tensor:
    """``op``, a DeepGEMM logits op, on ``case``: rows padded to 256 columns, valid entries
    as the Triton op ``triton_op`` computes them. Returns the logits."""
    out = op(*case.inputs, width)
    assert out.stride() == (_cdiv(width, 256) * 256, 1)
    valid = case.valid()
    assert gpu_relative_error(out[valid], triton_op(*case.inputs, width)[valid]) < 1e-5
    return out


DECODE_SHAPES = [
    # batch, next_n, max_context_len
    (1, 1, 4096),
    (2, 2, 131072),
    (64, 1, 32768),
    (128, 2, 8192),
    (256, 1, 8192),
    (5, 1, 100),
]


# Multi-token prediction: next_n 3 and 4 run on dsa's kernel only.
MTP_SHAPES = [
    # batch, next_n, max_context_len
    (8, 3, 16384),
    (4, 4, 32768),
    (33, 4, 2000),
    (1, 3, 262144),
]


@pytest.mark.parametrize("shape", DECODE_SHAPES + MTP_SHAPES)
def test_triton_paged_logits(shape):
    case = Decode(0, *shape)
    out = triton_logits(case, torch.ops.dsa.paged_mqa_logits, case.max_len)
    assert torch.isfinite(out[case.valid()]).all()
    check_sampled_rows(case, out, masked=True)


@pytest.mark.deepgemm
@requires_deepgemm
@pytest.mark.parametrize("shape", DECODE_SHAPES)
def test_deepgemm_paged_logits(shape):
    case = Decode(1, *shape)
    out = deepgemm_logits(case, torch.ops.dsa.paged_mqa_logits_deepgemm,
                          torch.ops.dsa.paged_mqa_logits, case.max_len)
    check_sampled_rows(case, out, masked=False)
    valid = case.valid()
    # "auto" runs the op paged_backend picks for the call's size; an explicit schedule
    # gives the same result.
    batch, next_n = shape[:2]
    auto = paged_logits(*case.inputs, case.max_len)
    if paged_backend("auto", out.device, HEADS, HEAD_DIM, BLOCK_SIZE, next_n, batch,
                     case.max_len) == "deepgemm":
        assert torch.equal(auto[valid], out[valid])
    else:
        want = torch.ops.dsa.paged_mqa_logits(*case.inputs, case.max_len)
        assert torch.equal(auto[valid], want[valid])
    schedule = torch.ops.dsa.paged_mqa_schedule(case.context_lens, BLOCK_SIZE)
    scheduled = torch.ops.dsa.paged_mqa_logits_deepgemm(*case.inputs, case.max_len, schedule)
    assert torch.equal(scheduled[valid], out[valid])
    chosen = paged_logits(*case.inputs, case.max_len, backend="deepgemm", schedule=schedule)
    assert torch.equal(chosen[valid], out[valid])
    # lengths clamped by the caller (as DecodeMetadata.schedule_lens) go through as they are
    q_fp8, cache, weights, lens, table = case.inputs
    clamped = torch.ops.dsa.paged_mqa_logits_deepgemm(
        q_fp8, cache, weights, lens.clamp(1, max(case.max_len, 1)), table, case.max_len,
        schedule, True)
    assert torch.equal(clamped[valid], out[valid])


@pytest.mark.deepgemm
@requires_deepgemm
def test_deepgemm_paged_schedule_validation():
    case = Decode(8, 2, 1, 1000)
    rows = deepgemm.num_sms(torch.device("cuda")) + 1
    for shape, match in (((3, 2), rf"`schedule` must have size {rows} \(num_sms \+ 1"),
                         ((rows, 3), r"`schedule` must have size 2 \(")):
        bad = torch.zeros(shape, dtype=torch.int32, device="cuda")
        with pytest.raises(ValueError, match=f"dsa.paged_mqa_logits_deepgemm: {match}"):
            torch.ops.dsa.paged_mqa_logits_deepgemm(*case.inputs, case.max_len, bad)


@pytest.mark.deepgemm
@requires_deepgemm
def test_deepgemm_paged_logits_repeatable():
    case = Decode(2, 64, 2, 16384)
    valid = case.valid()
    first = torch.ops.dsa.paged_mqa_logits_deepgemm(*case.inputs, case.max_len)
    for _ in range(20):
        again = torch.ops.dsa.paged_mqa_logits_deepgemm(*case.inputs, case.max_len)
        assert torch.equal(again[valid], first[valid])


def test_triton_paged_logits_repeatable():
    case = Decode(3, 32, 1, 16384)
    first = torch.ops.dsa.paged_mqa_logits(*case.inputs, case.max_len)
    for _ in range(5):
        assert torch.equal(first, torch.ops.dsa.paged_mqa_logits(*case.inputs, case.max_len))


@pytest.mark.parametrize(
    ("batch", "next_n", "heads", "head_dim"),
    [(4, 3, 64, 128), (4, 4, 64, 128), (2, 1, 128, 128), (2, 1, 64, 256), (3, 1, 16, 64)],
)
def test_auto_falls_back_to_triton(batch, next_n, heads, head_dim):
    case = Decode(4, batch, next_n, 3000, heads=heads, head_dim=head_dim)
    assert paged_backend("auto", case.q_fp8.device, heads, head_dim, BLOCK_SIZE,
                         next_n) == "triton"
    auto = paged_logits(*case.inputs, case.max_len)
    triton_out = torch.ops.dsa.paged_mqa_logits(*case.inputs, case.max_len)
    assert torch.equal(auto, triton_out)
    check_sampled_rows(case, auto, masked=True)
    with pytest.raises(ValueError, match="backend='deepgemm' cannot run this call"):
        paged_logits(*case.inputs, case.max_len, backend="deepgemm")
    with pytest.raises(ValueError, match=r"dsa\.paged_mqa_logits_deepgemm: DeepGEMM cannot run"):
        torch.ops.dsa.paged_mqa_logits_deepgemm(*case.inputs, case.max_len)


@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
def test_triton_paged_logits_configs_agree(next_n):
    """The default launch and others (tiles across blocks, several tiles per program, other
    warps and stages, key scales read a tile ahead or not) give the same logits and the same
    -inf mask."""
    case = Decode(10, 6, next_n, 5000)
    want = torch.ops.dsa.paged_mqa_logits(*case.inputs, case.max_len)
    valid = case.valid()
    for config in (PagedLogitsConfig(tile=128, tiles_per_program=3, num_warps=8, num_stages=3),
                   PagedLogitsConfig(tile=32, tiles_per_program=5, num_warps=4, num_stages=2,
                                     scales_ahead=True),
                   PagedLogitsConfig(tile=32, tiles_per_program=6, num_warps=4, num_stages=3,
                                     split_rows=True, tma=True, direct_store=True),
                   PagedLogitsConfig(tile=64, tiles_per_program=9, num_warps=8, num_stages=2,
                                     tma=True),
                   PagedLogitsConfig(tile=64, tiles_per_program=64, num_warps=8, num_stages=4),
                   PagedLogitsConfig(tile=64, tiles_per_program=7, num_warps=4, num_stages=4,
                                     split_rows=True, scales_ahead=True),
                   PagedLogitsConfig(tile=128, tiles_per_program=2, num_warps=8, num_stages=3,
                                     split_rows=True)):
        got = paged_logits_triton(*case.inputs, case.max_len, config=config)
        assert torch.equal(torch.isneginf(got), ~valid), config
        assert gpu_relative_error(got[valid], want[valid]) < 1e-6, config


@pytest.mark.parametrize("next_n", [1, 2])
def test_triton_paged_logits_early_start_bitwise(next_n):
    """Started early (programmatic dependent launch, a program's first tiles prefetched into
    L2 before its wait): the same bits as without, on calls of more than ``CHAIN_KEYS`` keys
    (the only ones that start early), ragged lengths and blocks outside the cache included.
    Inside a step, after the kernel writing q and the keys: test_graph_capture_gpu."""
    case = Decode(7, 8, next_n, 40000)
    assert 8 * next_n * case.max_len > CHAIN_KEYS
    case.table[0, [0, 20]] = -1  # a program's first tile, and a later one
    case.table[4, 32] = case.cache.shape[0] + 5
    base = paged_logits_config(8, next_n, case.max_len)
    want = paged_logits_triton(*case.inputs, case.max_len,
                               config=dataclasses.replace(base, early_tiles=0))
    for early in (1, 2, 4):
        got = paged_logits_triton(*case.inputs, case.max_len,
                                  config=dataclasses.replace(base, early_tiles=early))
        assert torch.equal(got, want), early


@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
def test_triton_paged_logits_tma_and_direct_stores_bitwise(next_n):
    """K tiles copied by TMA or per thread, logits stored from the MMA's layout or through
    shared memory: the same bits, the default launch and another tile."""
    case = Decode(11, 6, next_n, 5000)
    for base in (paged_logits_config(6, next_n, case.max_len),
                 PagedLogitsConfig(tile=32, tiles_per_program=4, split_rows=next_n > 1)):
        want = paged_logits_triton(*case.inputs, case.max_len, config=dataclasses.replace(
            base, tma=False, direct_store=False))
        for tma, direct_store in ((True, False), (False, True), (True, True)):
            config = dataclasses.replace(base, tma=tma, direct_store=direct_store)
            got = paged_logits_triton(*case.inputs, case.max_len, config=config)
            assert torch.equal(got, want), config


def test_cpu_face_matches_triton():
    """dsa's op on CPU copies (plain torch) equals its Triton face on the GPU."""
    case = Decode(5, 4, 4, 5000)
    cpu_out = torch.ops.dsa.paged_mqa_logits(*(t.cpu() for t in case.inputs), case.max_len)
    triton_out = torch.ops.dsa.paged_mqa_logits(*case.inputs, case.max_len).cpu()
    valid = case.valid().cpu()
    assert torch.equal(torch.isneginf(cpu_out), torch.isneginf(triton_out))
    assert gpu_relative_error(cpu_out[valid], triton_out[valid]) < 1e-6


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_paged_logits_compiled_and_graphed(backend):
    """A decode step (schedule + the logits op ``backend`` resolves to, chosen once as
    ``build_decode_metadata`` does) under torch.compile(fullgraph=True), then captured in
    a CUDA graph and replayed on new lengths and a rewritten cache."""
    case = Decode(6, 16, 2, 8192)
    chosen = paged_backend(backend, case.q_fp8.device, HEADS, HEAD_DIM, BLOCK_SIZE, 2)

    def step(q, cache, weights, lens, table):
        args = (q, cache, weights, lens, table, 8192)
        if chosen == "deepgemm":
            schedule = torch.ops.dsa.paged_mqa_schedule(lens, BLOCK_SIZE)
            return torch.ops.dsa.paged_mqa_logits_deepgemm(*args, schedule)
        return torch.ops.dsa.paged_mqa_logits(*args)

    compiled = torch.compile(step, fullgraph=True)
    eager = step(*case.inputs)
    valid = case.valid()
    assert torch.equal(compiled(*case.inputs)[valid], eager[valid])

    static = [t.clone() for t in case.inputs]
    replay, graphed = capture(compiled, *static)
    new = Decode(7, 16, 2, 8192)
    for dst, src in zip(static, new.inputs, strict=True):
        dst.copy_(src)
    replay()
    want = step(*new.inputs)
    valid = new.valid()
    assert torch.equal(graphed[valid], want[valid])


# --- mqa_logits (ragged prefill) --------------------------------------------------------------


class Prefill:
    """A prefill chunk: requests of (seq_len, query_len), design §5 bounds with R = 1."""

    def __init__(self, seed, seq_lens, query_lens):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        dev = "cuda"
        cu = np.concatenate([[0], np.cumsum(seq_lens)])
        ks = np.concatenate([np.full(q, cu[r]) for r, q in enumerate(query_lens)])
        ke = np.concatenate([cu[r] + s - q + 1 + np.arange(q)
                             for r, (s, q) in enumerate(zip(seq_lens, query_lens, strict=True))])
        self.ks = torch.tensor(ks, dtype=torch.int32, device=dev)
        self.ke = torch.tensor(ke, dtype=torch.int32, device=dev)
        self.max_seqlen_k = int((ke - ks).max())
        num_q, num_keys = len(ks), int(cu[-1])
        k = torch.randn(num_keys, HEAD_DIM, device=dev, generator=gen, dtype=torch.bfloat16)
        self.k_fp8, self.k_scale = quantize_rows(k, ue8m0=False)
        self.q = torch.randn(num_q, HEADS, HEAD_DIM, device=dev, generator=gen,
                             dtype=torch.bfloat16)
        weights = torch.randn(num_q, HEADS, device=dev, generator=gen)
        self.q_fp8, self.head_weights = torch.ops.dsa.quantize_q(self.q, weights)

    @property
    def inputs(self):
        return (self.q_fp8, self.k_fp8, self.k_scale, self.head_weights, self.ks, self.ke)

    def valid(self) -> torch.Tensor:
        j = torch.arange(self.max_seqlen_k, device="cuda")
        return j < (self.ke - self.ks)[:, None]

    def check_sampled_rows(self, out: torch.Tensor, masked: bool) -> None:
        rows = sorted({0, out.shape[0] // 2, out.shape[0] - 1})
        want = ref.mqa_logits(
            ref.fp8_decode(self.q_fp8.view(torch.uint8).cpu().numpy()),
            ref.fp8_decode(self.k_fp8.view(torch.uint8).cpu().numpy()),
            self.k_scale.double().cpu().numpy(), self.head_weights.double().cpu().numpy(),
            self.ks.cpu().numpy(), self.ke.cpu().numpy(), self.max_seqlen_k, rows=rows)
        got = out.double().cpu().numpy()
        for i in rows:
            valid = np.isfinite(want[i])
            if masked:
                np.testing.assert_array_equal(np.isneginf(got[i]), ~valid)
            assert ref.relative_error(got[i][valid], want[i][valid]) < 1e-5


PREFILL_SHAPES = [
    ([4096], [4096]),
    ([8000, 3000, 17], [1000, 700, 17]),
    ([20000], [64]),
]


@pytest.mark.parametrize("shape", PREFILL_SHAPES)
def test_triton_mqa_logits(shape):
    case = Prefill(0, *shape)
    out = triton_logits(case, torch.ops.dsa.mqa_logits, case.max_seqlen_k)
    case.check_sampled_rows(out, masked=True)


@pytest.mark.deepgemm
@requires_deepgemm
@pytest.mark.parametrize("shape", PREFILL_SHAPES)
def test_deepgemm_mqa_logits(shape):
    case = Prefill(1, *shape)
    out = deepgemm_logits(case, torch.ops.dsa.mqa_logits_deepgemm, mqa_logits_triton,
                          case.max_seqlen_k)
    case.check_sampled_rows(out, masked=False)
    valid = case.valid()
    auto = ragged_logits(*case.inputs, case.max_seqlen_k)
    assert torch.equal(auto[valid], out[valid])


def test_ragged_auto_falls_back_to_triton():
    """128 heads: DeepGEMM cannot take them; "auto" runs dsa's Triton op."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    num_q, num_keys, heads = 40, 300, 128
    q_fp8, head_weights = torch.ops.dsa.quantize_q(
        torch.randn(num_q, heads, HEAD_DIM, device="cuda", generator=gen),
        torch.randn(num_q, heads, device="cuda", generator=gen))
    k_fp8, k_scale = quantize_rows(torch.randn(num_keys, HEAD_DIM, device="cuda",
                                               generator=gen), ue8m0=False)
    ks = torch.zeros(num_q, dtype=torch.int32, device="cuda")
    ke = torch.arange(num_keys - num_q + 1, num_keys + 1, dtype=torch.int32, device="cuda")
    inputs = (q_fp8, k_fp8, k_scale, head_weights, ks, ke, num_keys)
    assert torch.equal(ragged_logits(*inputs), torch.ops.dsa.mqa_logits(*inputs))
    with pytest.raises(ValueError, match="backend='deepgemm' cannot run this call"):
        ragged_logits(*inputs, backend="deepgemm")
    with pytest.raises(ValueError, match=r"dsa\.mqa_logits_deepgemm: DeepGEMM cannot run"):
        torch.ops.dsa.mqa_logits_deepgemm(*inputs)


def test_a_nan_fp8_code_scores_zero_as_on_the_cpu_face():
    """The kernels' relu (``max``) takes a NaN dot product to 0, as the CPU face does: the
    key's logit is 0 on both, the other keys agree within the fp8 MMA's rounding."""
    from test_logits import nan_code_case

    paged, ragged = nan_code_case()
    for op, args in ((torch.ops.dsa.paged_mqa_logits, paged), (torch.ops.dsa.mqa_logits, ragged)):
        cpu = op(*args)
        gpu = op(*(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)).cpu()
        assert gpu[0, 3].item() == 0.0 and cpu[0, 3].item() == 0.0
        torch.testing.assert_close(gpu, cpu, rtol=1e-3, atol=1e-3)
