"""The paged fp8 K cache: layout views, dsa::quantize_and_cache_k and dsa::gather_k against
the byte-level reference of design §2."""

from __future__ import annotations

import numpy as np
import pytest
import reference_compute as ref
import torch
from faces import FACE_NAMES, HAS_CUDA, KERNEL_MARK, run_op
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from dsa.ops.kcache import kcache_views


def write_cache(face, k, cache, slots, *args, op="quantize_and_cache_k"):
    """Cache write ``op(k, cache, slots, *args)`` on ``face``; the CPU ``cache`` holds the
    result either way."""
    if face == "kernel" and HAS_CUDA:
        on_gpu = cache.cuda()
        args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
        getattr(torch.ops.dsa, op)(k.cuda(), on_gpu, slots.cuda(), *args)
        cache.copy_(on_gpu.cpu())
    else:
        run_op(face, op, k, cache, slots, *args)


def random_cache(gen, num_blocks, block_size, head_dim):
    return torch.randint(0, 256, (num_blocks, block_size, 1, head_dim + 4), dtype=torch.uint8,
                         generator=gen)


def random_slots(gen, num_tokens, num_slots):
    """Distinct slots: valid ones mixed with -1, huge ones and others past the cache."""
    slots = torch.randperm(num_slots + num_tokens, generator=gen)[:num_tokens]
    kind = torch.randint(0, 5, (num_tokens,), generator=gen)
    slots = torch.where(kind == 0, -1, slots)
    return torch.where(kind == 1, 2**40, slots)


def random_k(gen, num_tokens, head_dim, dtype):
    magnitude = torch.logspace(-6, 3, max(num_tokens, 1))[:num_tokens, None]
    return (torch.randn(num_tokens, head_dim, generator=gen) * magnitude).to(dtype)


def test_views_follow_the_spec_layout():
    gen = torch.Generator().manual_seed(0)
    cache = random_cache(gen, 3, 4, 8)
    values, scales = kcache_views(cache)
    codes, want_scales = ref.read_cache(cache.numpy(), 4, 8)
    assert values.dtype == torch.float8_e4m3fn and values.shape == (3, 4, 8)
    assert scales.dtype == torch.float32 and scales.shape == (3, 4)
    np.testing.assert_array_equal(values.view(torch.uint8).numpy(), codes)
    np.testing.assert_array_equal(scales.numpy(), want_scales.astype(np.float32))
    # Views, not copies: token 2 of block 1 lives at these bytes.
    flat = cache.view(-1)
    values[1, 2].view(torch.uint8).fill_(0x11)
    scales[1, 2] = 1.5
    base = 1 * 4 * 12
    assert (flat[base + 2 * 8:base + 3 * 8] == 0x11).all()
    assert flat[base + 4 * 8 + 8:base + 4 * 8 + 12].view(torch.float32).item() == 1.5


@settings(max_examples=30)
@given(
    num_blocks=st.integers(1, 5),
    block_size=st.sampled_from([1, 4, 16, 64]),
    head_dim=st.sampled_from([4, 16, 32, 64]),
    num_tokens=st.integers(0, 12),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    ue8m0=st.booleans(),
    seed=st.integers(0, 2**31),
)
@pytest.mark.parametrize("face", FACE_NAMES)
def test_cache_write_matches_spec_bytes(face, num_blocks, block_size, head_dim, num_tokens,
                                        dtype, ue8m0, seed):
    gen = torch.Generator().manual_seed(seed)
    cache = random_cache(gen, num_blocks, block_size, head_dim)
    k = random_k(gen, num_tokens, head_dim, dtype)
    slots = random_slots(gen, num_tokens, num_blocks * block_size)
    want = ref.write_cache(cache.numpy(), k.double().numpy(), slots.numpy(), block_size, ue8m0)
    write_cache(face, k, cache, slots, ue8m0)
    np.testing.assert_array_equal(cache.view(-1).numpy(), want)


@pytest.mark.parametrize("face", FACE_NAMES)
@pytest.mark.parametrize("ue8m0", [False, True])
def test_cache_write_round_trip(face, ue8m0):
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, head_dim = 4, 16, 64
    cache = random_cache(gen, num_blocks, block_size, head_dim)
    k = random_k(gen, 40, head_dim, torch.float32)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:40]
    write_cache(face, k, cache, slots, ue8m0)
    values, scales = kcache_views(cache)
    blk, off = slots // block_size, slots % block_size
    scale = scales[blk, off]
    back = values[blk, off].float() * scale[:, None]
    # e4m3: 3 mantissa bits (half-ulp 2**-4 relative), subnormal step 2**-9 * scale.
    bound = torch.maximum(k.abs() * 2.0**-4, scale[:, None] * 2.0**-10) * (1 + 1e-6)
    assert ((back - k).abs() <= bound).all()
    amax = k.abs().amax(dim=1).clamp(min=1e-4)
    if ue8m0:
        assert (torch.frexp(scale).mantissa == 0.5).all()
        assert ((scale >= amax / 448) & (scale < amax / 224)).all()
    else:
        torch.testing.assert_close(scale, amax / 448, rtol=0, atol=0)


@pytest.mark.parametrize("face", FACE_NAMES)
def test_cache_write_skips_invalid_slots(face):
    """Nothing is written, not even past the cache's end (the cache is the first 3 of 5
    blocks of one allocation, so a write past it lands in memory the test can see)."""
    gen = torch.Generator().manual_seed(2)
    storage = random_cache(gen, 5, 8, 16)
    before = storage.clone()
    for slots in (torch.tensor([-1, 24, 25, 39]), torch.tensor([10**12, -(2**62)])):
        write_cache(face, torch.randn(len(slots), 16), storage[:3], slots)
        assert torch.equal(storage, before)


@KERNEL_MARK
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cache_write_nonfinite_faces_agree(dtype, ue8m0):
    """Rows with NaN, +inf, -inf and mixes: both faces write the reference's bytes, bit for
    bit (values and scales); scales stay finite and inf keeps its sign."""
    gen = torch.Generator().manual_seed(7)
    k = ref.nonfinite_rows(16, seed=8).to(dtype)
    slots = torch.randperm(4 * 4, generator=gen)[:k.shape[0]]
    cache = random_cache(gen, 4, 4, 16)
    want = ref.write_cache(cache.numpy(), k.double().numpy(), slots.numpy(), 4, ue8m0)
    caches = {face: cache.clone() for face in ("cpu", "kernel")}
    for face, c in caches.items():
        write_cache(face, k, c, slots, ue8m0)
        np.testing.assert_array_equal(c.view(-1).numpy(), want)
    assert torch.equal(caches["cpu"], caches["kernel"])
    values, scales = kcache_views(caches["cpu"])
    blk, off = slots // 4, slots % 4
    ref.check_nonfinite_codes(k, values[blk, off].view(torch.uint8).numpy(),
                              scales[blk, off].numpy(), ue8m0)


def test_cache_write_opcheck():
    gen = torch.Generator().manual_seed(3)
    cache = random_cache(gen, 3, 4, 16)
    k = random_k(gen, 6, 16, torch.bfloat16)
    slots = torch.tensor([0, 5, -1, 11, 12, 3])
    torch.library.opcheck(torch.ops.dsa.quantize_and_cache_k.default, (k, cache, slots),
                          {"ue8m0": True})


def test_cache_write_as_compiled_module_buffer():
    class Writer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("kv_cache", torch.zeros(4, 8, 1, 36, dtype=torch.uint8))

        def forward(self, k, slots):
            torch.ops.dsa.quantize_and_cache_k(k, self.kv_cache, slots)
            return self.kv_cache.sum(dtype=torch.int64)

    eager, compiled = Writer(), Writer()
    step = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(4)
    for _ in range(2):
        k, slots = torch.randn(5, 32, generator=gen), torch.randperm(32, generator=gen)[:5]
        assert step(k, slots) == eager(k, slots)
        assert torch.equal(compiled.kv_cache, eager.kv_cache)


@pytest.mark.parametrize(
    ("k", "cache", "slots", "error", "match"),
    [
        (torch.zeros(2, 8, dtype=torch.int32), torch.zeros(1, 4, 1, 12, dtype=torch.uint8),
         torch.zeros(2, dtype=torch.int64), TypeError, "`k` must be"),
        (torch.zeros(2, 8), torch.zeros(1, 4, 1, 12), torch.zeros(2, dtype=torch.int64),
         TypeError, "`kv_cache` must be torch.uint8"),
        (torch.zeros(2, 8), torch.zeros(1, 4, 12, dtype=torch.uint8),
         torch.zeros(2, dtype=torch.int64), ValueError, "`kv_cache` must have 4 dimension"),
        (torch.zeros(2, 8), torch.zeros(1, 4, 2, 12, dtype=torch.uint8),
         torch.zeros(2, dtype=torch.int64), ValueError, "head_dim a positive multiple of 4"),
        (torch.zeros(2, 6), torch.zeros(1, 4, 1, 10, dtype=torch.uint8),
         torch.zeros(2, dtype=torch.int64), ValueError, "head_dim a positive multiple of 4"),
        (torch.zeros(2, 16), torch.zeros(1, 4, 1, 12, dtype=torch.uint8),
         torch.zeros(2, dtype=torch.int64), ValueError, r"`k` must have size 8"),
        (torch.zeros(2, 8), torch.zeros(4, 4, 1, 12, dtype=torch.uint8)[::2],
         torch.zeros(2, dtype=torch.int64), ValueError, "`kv_cache` must be contiguous"),
        (torch.zeros(2, 8), torch.zeros(1, 4, 1, 12, dtype=torch.uint8),
         torch.zeros(2, dtype=torch.int32), TypeError, "`slot_mapping` must be torch.int64"),
        (torch.zeros(2, 8), torch.zeros(1, 4, 1, 12, dtype=torch.uint8),
         torch.zeros(3, dtype=torch.int64), ValueError, r"`slot_mapping` must have size 2"),
        # a strided view: the kernel reads slots as contiguous (it wrote at the wrong slot)
        (torch.zeros(2, 8), torch.zeros(1, 4, 1, 12, dtype=torch.uint8),
         torch.zeros(4, dtype=torch.int64)[::2], ValueError, "`slot_mapping` must be contiguous"),
        (torch.zeros(2, 8), torch.zeros(0, 4, 1, 12, dtype=torch.uint8),
         torch.zeros(2, dtype=torch.int64), ValueError, "`kv_cache` must have at least one block"),
        # sliced out of a shared byte buffer: its scales could not be read as fp32
        (torch.zeros(2, 8), torch.zeros(49, dtype=torch.uint8)[1:].view(1, 4, 1, 12),
         torch.zeros(2, dtype=torch.int64), ValueError, "byte offset that is a multiple of 4"),
    ],
)
def test_cache_write_validation(k, cache, slots, error, match):
    with pytest.raises(error, match=match):
        torch.ops.dsa.quantize_and_cache_k(k, cache, slots)
    with FakeTensorMode() as mode, pytest.raises(error, match=match):  # the fake face alike
        torch.ops.dsa.quantize_and_cache_k(*(mode.from_tensor(t) for t in (k, cache, slots)))


# --- gather_k -------------------------------------------------------------------------------


def gather_case(gen, num_reqs, block_size, num_blocks, width, max_len, spare_rows):
    """Random requests: block tables with -1 and out-of-range entries, lengths past the
    table; rows past the last request."""
    lens = torch.randint(0, max_len + 1, (num_reqs,), generator=gen)
    cu = torch.zeros(num_reqs + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    table = torch.randint(-1, num_blocks + 2, (num_reqs, width), generator=gen,
                          dtype=torch.int32)
    return table, cu, int(cu[-1]) + spare_rows


@settings(max_examples=30)
@given(
    num_reqs=st.integers(0, 4),
    block_size=st.sampled_from([1, 4, 16]),
    head_dim=st.sampled_from([16, 32]),
    width=st.integers(0, 4),
    spare_rows=st.integers(0, 5),
    seed=st.integers(0, 2**31),
)
@pytest.mark.parametrize("face", FACE_NAMES)
def test_gather_k_matches_reference(face, num_reqs, block_size, head_dim, width, spare_rows,
                                    seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 6
    cache = random_cache(gen, num_blocks, block_size, head_dim)
    table, cu, num_rows = gather_case(gen, num_reqs, block_size, num_blocks, width,
                                      block_size * (width + 1), spare_rows)
    with ref.poisoned_empty():
        k_fp8, k_scale = run_op(face, "gather_k", cache, table, cu, num_rows)
    assert k_fp8.dtype == torch.float8_e4m3fn and k_fp8.shape == (num_rows, head_dim)
    assert k_scale.dtype == torch.float32 and k_scale.shape == (num_rows,)
    codes, scales = ref.gather(cache.numpy(), block_size, head_dim, table.numpy(), cu.numpy(),
                               num_rows)
    np.testing.assert_array_equal(k_fp8.view(torch.uint8).numpy(), codes)
    np.testing.assert_array_equal(k_scale.numpy(), scales.astype(np.float32))


def test_gather_k_strided_block_table():
    gen = torch.Generator().manual_seed(5)
    cache = random_cache(gen, 8, 4, 16)
    wide = torch.randint(0, 8, (3, 10), generator=gen, dtype=torch.int32)
    cu = torch.tensor([0, 5, 9, 20], dtype=torch.int32)
    for width in (6, 2):  # 2: request 2's rows 8-10 lie past the table (blocks beyond it)
        table = wide[:, :width]
        want = run_op("cpu", "gather_k", cache, table.contiguous(), cu, 22)
        for face in ("cpu", "kernel"):
            got = run_op(face, "gather_k", cache, table, cu, 22)
            assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
            assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32))


def test_gather_k_opcheck():
    gen = torch.Generator().manual_seed(6)
    cache = random_cache(gen, 4, 4, 16)
    table, cu, num_rows = gather_case(gen, 3, 4, 4, 3, 12, 2)
    torch.library.opcheck(torch.ops.dsa.gather_k.default, (cache, table, cu, num_rows))


@pytest.mark.parametrize(
    ("cache", "table", "cu", "num_rows", "error", "match"),
    [
        (torch.zeros(0, 4, 1, 20, dtype=torch.uint8), torch.zeros(1, 2, dtype=torch.int32),
         torch.zeros(2, dtype=torch.int32), 4, ValueError, "at least one block"),
        (torch.zeros(2, 4, 1, 20, dtype=torch.uint8), torch.zeros(1, 2, dtype=torch.int64),
         torch.zeros(2, dtype=torch.int32), 4, TypeError, "`block_table` must be torch.int32"),
        (torch.zeros(2, 4, 1, 20, dtype=torch.uint8), torch.zeros(1, 4, dtype=torch.int32)[:, ::2],
         torch.zeros(2, dtype=torch.int32), 4, ValueError, r"rows must be contiguous"),
        (torch.zeros(2, 4, 1, 20, dtype=torch.uint8), torch.zeros(1, 2, dtype=torch.int32),
         torch.zeros(3, dtype=torch.int32), 4, ValueError, r"`cu_seq_lens` must have size 2"),
        (torch.zeros(2, 4, 1, 20, dtype=torch.uint8), torch.zeros(1, 2, dtype=torch.int32),
         torch.zeros(2, dtype=torch.int32), -1, ValueError, "`num_rows` must be >= 0"),
    ],
)
def test_gather_k_validation(cache, table, cu, num_rows, error, match):
    with pytest.raises(error, match=match):
        torch.ops.dsa.gather_k(cache, table, cu, num_rows)
