"""build_decode_metadata / build_prefill_metadata against the loop reference; compiled
builds (fullgraph, no recompiles across batch compositions) equal to eager."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dsa
import dsa.meta.decode
from dsa.graphs import pad_batch
from dsa.meta.batch import Batch
from dsa.meta.decode import build_decode_metadata, max_context_len
from dsa.meta.prefill import build_prefill_metadata
from dsa.ops.logits import deepgemm, paged, ragged
from tests import reference_meta as ref
from tests.batches import random_decode_batch, table_width
from tests.faces import CPU_EXAMPLES
from tests.strategies import BatchSpec, batches, dcp_configs, decode_batches

METADATA_FIELDS = ("context_lens", "global_context_lens", "block_table", "request_block_table",
                   "token_requests", "slot_mapping")


def config_for(spec: BatchSpec, **kwargs) -> dsa.IndexerConfig:
    """A config whose max_model_len makes the spec's block table exactly wide enough."""
    return dsa.IndexerConfig(
        max_num_reqs=max(spec.num_reqs, 1),
        max_num_batched_tokens=max(spec.num_tokens, spec.num_reqs, 1),
        max_model_len=spec.width * spec.block_size,
        block_size=spec.block_size,
        next_n=spec.next_n,
        **kwargs,
    )


def as_lists(t: torch.Tensor) -> list:
    return t.tolist()


@CPU_EXAMPLES
@given(spec=decode_batches(max_reqs=5), layout=st.sampled_from(["native", "flat"]),
       ratio=st.sampled_from([1, 2, 4]), dcp=dcp_configs(), kpool=st.sampled_from([None, 4]))
def test_decode_metadata_matches_reference(spec, layout, ratio, dcp, kpool):
    world, rank = dcp
    cfg = config_for(spec, decode_layout=layout, compress_ratio=ratio, dcp_world=world,
                     dcp_rank=rank, kpool=kpool)
    batch = Batch(*spec.tensors())
    meta = build_decode_metadata(cfg, batch)

    qsl, seq, table = spec.query_start_loc, list(spec.seq_lens), [list(r) for r in
                                                                   spec.block_table]
    local = lambda n: ref.dcp_local(n, world, rank, 1)
    if layout == "native":
        global_lens = [[n // ratio for n in row]
                       for row in ref.native_decode_lens(seq, spec.next_n)]
        row_table = table
    else:
        global_lens = [[n // ratio] for n in ref.decode_token_lens(qsl, seq, spec.num_tokens)]
        row_table = ref.expand_block_table(qsl, table, spec.num_tokens, spec.width)
    assert meta.layout == layout
    assert as_lists(meta.global_context_lens) == global_lens
    local_lens = [[local(n) for n in row] for row in global_lens]
    assert as_lists(meta.context_lens) == ref.cap_context_lens(
        local_lens, row_table, 2**31 - 1, spec.block_size, max_context_len(cfg))
    assert as_lists(meta.block_table) == row_table
    assert as_lists(meta.request_block_table) == table
    assert as_lists(meta.token_requests) == ref.decode_row_requests(qsl, spec.num_tokens)
    if ratio > 1:
        want_slots = ref.compressed_slot_mapping(qsl, seq, table, spec.num_tokens,
                                                 spec.block_size, ratio, world, rank)
    else:
        want_slots = spec.slot_mapping
    assert as_lists(meta.slot_mapping) == want_slots
    if kpool is None:
        assert meta.kpool_slot_mapping is None
    else:
        assert as_lists(meta.kpool_slot_mapping) == ref.kpool_tail_slot_mapping(
            qsl, table, spec.positions, kpool)
    assert meta.schedule is None and meta.logits_backend == "triton"  # DeepGEMM needs CUDA
    assert meta.max_context_len == -(-(cfg.max_model_len // ratio) // world)


def test_decode_metadata_spec_example():
    """design §4: seq_lens [10, 7, 12, 0], decode_len [3, 1, 4, 0] -> [8,9,10,7,9,10,11,12]."""
    cfg = dsa.IndexerConfig(max_num_reqs=4, max_num_batched_tokens=10, max_model_len=64,
                            block_size=16, next_n=4, decode_layout="flat")
    batch = Batch(
        query_start_loc=torch.tensor([0, 3, 4, 8, 8], dtype=torch.int32),
        seq_lens=torch.tensor([10, 7, 12, 0], dtype=torch.int32),
        block_table=torch.arange(16, dtype=torch.int32).view(4, 4),
        slot_mapping=torch.full((10,), -1),
        positions=torch.zeros(10, dtype=torch.int64),
    )
    meta = build_decode_metadata(cfg, batch)
    assert meta.context_lens.view(-1).tolist() == [8, 9, 10, 7, 9, 10, 11, 12, 0, 0]
    assert meta.token_requests.tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 4, 5]
    assert meta.block_table[8:].tolist() == [[0, 0, 0, 0]] * 2


def test_decode_metadata_dcp_localises_after_expansion():
    """design §6: world 2, rank 1, global per-token [8, 9, 10] -> [4, 4, 5]."""
    cfg = dsa.IndexerConfig(max_num_reqs=1, max_num_batched_tokens=3, max_model_len=64,
                            block_size=16, next_n=3, dcp_world=2, dcp_rank=1,
                            decode_layout="flat")
    batch = Batch(torch.tensor([0, 3], dtype=torch.int32), torch.tensor([10], dtype=torch.int32),
                  torch.zeros(1, 2, dtype=torch.int32), torch.full((3,), -1),
                  torch.tensor([7, 8, 9]))
    meta = build_decode_metadata(cfg, batch)
    assert meta.global_context_lens.view(-1).tolist() == [8, 9, 10]
    assert meta.context_lens.view(-1).tolist() == [4, 4, 5]


def test_decode_metadata_compresses_before_localising():
    """design §6: n = 10, R = 2, W = 2: rank 0 owns states {0, 2, 4} -> 3, not 5 // 2."""
    cfg = dsa.IndexerConfig(max_num_reqs=1, max_num_batched_tokens=1, max_model_len=64,
                            block_size=16, compress_ratio=2, dcp_world=2, dcp_rank=0)
    batch = Batch(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([10], dtype=torch.int32),
                  torch.zeros(1, 1, dtype=torch.int32), torch.full((1,), -1),
                  torch.tensor([9]))
    assert build_decode_metadata(cfg, batch).context_lens.tolist() == [[3]]


@pytest.mark.parametrize("layout", ["native", "flat"])
def test_decode_metadata_caps_lengths_at_unallocated_blocks(layout):
    """A -1 block-table entry inside a request's context: its lengths stop at that block
    (cap_context_lens), so no kernel reads and no top-k selects a key there; lengths past
    the logits width stop at the width."""
    cfg = dsa.IndexerConfig(max_num_reqs=3, max_num_batched_tokens=6, max_model_len=64,
                            block_size=16, next_n=2, decode_layout=layout)
    batch = Batch(torch.tensor([0, 2, 4, 6], dtype=torch.int32),
                  torch.tensor([40, 64, 20], dtype=torch.int32),
                  torch.tensor([[3, -1, 5, 6], [0, 1, 2, 4], [-1, 7, 8, 9]], dtype=torch.int32),
                  torch.full((6,), -1), torch.tensor([38, 39, 62, 63, 18, 19]))
    meta = build_decode_metadata(cfg, batch)
    assert meta.global_context_lens.view(-1).tolist() == [39, 40, 63, 64, 19, 20]
    assert meta.context_lens.view(-1).tolist() == [16, 16, 63, 64, 0, 0]
    assert meta.logits_backend == "triton"


def test_decode_metadata_coarsens_kernel_block_table():
    cfg = dsa.IndexerConfig(max_num_reqs=2, max_num_batched_tokens=2, max_model_len=256,
                            block_size=64, kernel_block_size=16, compress_ratio=4)
    kernel_table = torch.tensor([[8, 9, 10, 11], [-1, -1, -1, -1]], dtype=torch.int32)
    batch = Batch(torch.tensor([0, 1, 1], dtype=torch.int32),
                  torch.tensor([8, 0], dtype=torch.int32), kernel_table,
                  torch.full((2,), -1), torch.tensor([7, 0]))
    meta = build_decode_metadata(cfg, batch)
    assert meta.request_block_table.tolist() == [[2], [-1]]
    assert meta.slot_mapping.tolist() == [2 * 64 + 1, -1]  # pos 7 -> state 1 of block 2


def test_decode_metadata_takes_a_one_column_table_of_any_stride():
    """A table one block wide has no column stride to honour: a column sliced out of a wider
    table builds what the contiguous one does (as every op taking a table accepts it)."""
    cfg = dsa.IndexerConfig(max_num_reqs=2, max_num_batched_tokens=2, max_model_len=64,
                            block_size=64)
    wide = torch.tensor([[3, 9], [5, 9]], dtype=torch.int32)
    metas = [build_decode_metadata(cfg, Batch(
        torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([10, 20], dtype=torch.int32),
        table, torch.tensor([3 * 64 + 9, 5 * 64 + 19]), torch.tensor([9, 19])))
        for table in (wide[:, ::2], wide[:, :1].contiguous())]
    for field in ("slot_mapping", "context_lens", "block_table", "request_block_table"):
        assert torch.equal(getattr(metas[0], field), getattr(metas[1], field)), field


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seq_lens": torch.zeros(2, dtype=torch.int64)}, "`seq_lens` must be torch.int32"),
        ({"block_table": torch.zeros(2, 3, dtype=torch.int32)},
         r"`block_table` must have at least IndexerConfig\.block_table_width = 4 columns to cover "
         r"max_model_len=256"),
        ({"block_table": torch.zeros(8, 2, dtype=torch.int32).t()},
         r"`block_table` rows must be contiguous"),
        ({"slot_mapping": torch.zeros(9, dtype=torch.int64)},
         "at most max_num_batched_tokens=8 entries, got 9"),
        ({"positions": torch.zeros(3, dtype=torch.int64)}, "`positions` must have size 4"),
        ({"query_start_loc": torch.zeros(10, dtype=torch.int32)},
         "must have 1 to max_num_reqs \\+ 1 = 3 entries, got 10"),
    ],
)
def test_build_decode_metadata_validation(kwargs, match):
    cfg = dsa.IndexerConfig(max_num_reqs=2, max_num_batched_tokens=8, max_model_len=256)
    fields = {"query_start_loc": torch.tensor([0, 2, 4], dtype=torch.int32),
              "seq_lens": torch.tensor([5, 6], dtype=torch.int32),
              "block_table": torch.zeros(2, 4, dtype=torch.int32),
              "slot_mapping": torch.zeros(4, dtype=torch.int64),
              "positions": torch.zeros(4, dtype=torch.int64)}
    with pytest.raises((TypeError, ValueError), match=match):
        build_decode_metadata(cfg, Batch(**{**fields, **kwargs}))


COMPILE_CONFIGS = {
    "next_n1": {"next_n": 1},
    "next_n2_native": {"next_n": 2},
    "next_n3_flat": {"next_n": 3, "decode_layout": "flat"},
    "next_n4_native": {"next_n": 4},
    "compress4_dcp2_rank1_kpool": {"next_n": 2, "compress_ratio": 4, "dcp_world": 2,
                                   "dcp_rank": 1, "kpool": 8},
}


@pytest.mark.parametrize("name", list(COMPILE_CONFIGS))
def test_compiled_decode_metadata_has_no_recompiles(name):
    """One capacity, six batch compositions: one compile, then no recompile; equal to eager."""
    torch._dynamo.reset()
    cfg = dsa.IndexerConfig(max_num_reqs=6, max_num_batched_tokens=24, max_model_len=1024,
                            **COMPILE_CONFIGS[name])
    build = torch.compile(lambda batch: build_decode_metadata(cfg, batch), fullgraph=True,
                          dynamic=False)
    rng = random.Random(len(name))
    capacity = (cfg.max_num_reqs, cfg.max_num_reqs * cfg.next_n, table_width(cfg))
    for i, num_reqs in enumerate([6, 0, 3, 1, 5, 2]):
        live = random_decode_batch(rng, cfg, num_reqs, uneven=i % 2 == 0)
        batch = pad_batch(live, *capacity)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            got = build(batch)
        want = build_decode_metadata(cfg, batch)
        for field in METADATA_FIELDS:
            assert torch.equal(getattr(got, field), getattr(want, field)), field
        assert (got.kpool_slot_mapping is None) == (cfg.kpool is None)
        if cfg.kpool is not None:
            assert torch.equal(got.kpool_slot_mapping, want.kpool_slot_mapping)


@CPU_EXAMPLES
@given(spec=batches(max_decodes=2, max_prefills=4, max_context=40),
       ratio=st.sampled_from([1, 2, 4]), dcp=dcp_configs(),
       budget=st.sampled_from([40, 400, 4000, 1 << 20]), rows=st.sampled_from([16, 64, 4096]))
def test_prefill_metadata_matches_reference(spec, ratio, dcp, budget, rows):
    world, rank = dcp
    cfg = config_for(spec, compress_ratio=ratio, dcp_world=world, dcp_rank=rank,
                     max_logits_bytes=budget, workspace_rows=rows)
    qsl, seq = spec.query_start_loc, list(spec.seq_lens)
    batch = Batch(*spec.tensors())
    meta = build_prefill_metadata(cfg, batch, num_decodes=spec.num_decodes,
                                  seq_lens_cpu=seq, query_start_loc_cpu=qsl)

    first = spec.num_decodes
    states = [s // ratio for s in seq]
    query_lens = list(spec.query_lens)
    pieces = ref.split_prefill_chunks(states[first:], query_lens[first:], rows, budget)
    assert len(meta.chunks) == len(pieces)
    covered = []
    for chunk, (req_slice, query_slice) in zip(meta.chunks, pieces):
        start, end = req_slice.start + first, req_slice.stop + first
        assert (chunk.req_start, chunk.req_end) == (start, end)
        assert chunk.skip_gather == (query_slice.start > 0)
        assert chunk.num_rows == sum(states[start:end])
        want = ref.prefill_chunk_bounds(qsl, seq, start, end, query_slice.start,
                                        query_slice.stop, chunk.num_rows, ratio, world, rank)
        got = (chunk.cu_seq_lens, chunk.local_cu_seq_lens, chunk.token_to_seq, chunk.ks,
               chunk.ke, chunk.global_lens)
        assert [as_lists(t) for t in got] == [list(w) for w in want]
        assert chunk.num_local_rows == want[1][-1]
        assert chunk.max_seqlen_k >= max([1, *(e - s for s, e in zip(want[3], want[4]))])
        covered += range(chunk.token_start, chunk.token_end)
    assert covered == list(range(qsl[first], qsl[first + spec.num_prefills]))
    assert as_lists(meta.token_requests) == ref.decode_row_requests(qsl, spec.num_tokens)


@pytest.mark.parametrize("build", ["decode", "prefill"])
def test_metadata_resolves_the_logits_backend(build):
    """"auto" and "triton" resolve to dsa's kernel on the CPU; "deepgemm" cannot run there
    and the build says why."""
    batch = Batch(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
                  torch.zeros(1, 1, dtype=torch.int32), torch.full((1,), -1),
                  torch.tensor([4]))
    builder = {"decode": build_decode_metadata, "prefill": build_prefill_metadata}[build]
    for backend in ("auto", "triton"):
        cfg = dsa.IndexerConfig(max_num_reqs=1, max_num_batched_tokens=1, max_model_len=64,
                                logits_backend=backend)
        assert builder(cfg, batch).logits_backend == "triton"
    cfg = dsa.IndexerConfig(max_num_reqs=1, max_num_batched_tokens=1, max_model_len=64,
                            logits_backend="deepgemm")
    with pytest.raises(ValueError, match=rf"dsa.build_{build}_metadata: IndexerConfig."
                                         rf"logits_backend='deepgemm' cannot run this call: it "
                                         rf"needs CUDA tensors"):
        builder(cfg, batch)


def test_prefill_metadata_spec_example():
    """design §5: query_start_loc [0, 2, 4, 7], seq_lens [5, 9, 4], R = 1."""
    cfg = dsa.IndexerConfig(max_num_reqs=3, max_num_batched_tokens=7, max_model_len=64,
                            next_n=1)
    batch = Batch(torch.tensor([0, 2, 4, 7], dtype=torch.int32),
                  torch.tensor([5, 9, 4], dtype=torch.int32), torch.zeros(3, 1, dtype=torch.int32),
                  torch.full((7,), -1), torch.zeros(7, dtype=torch.int64))
    (chunk,) = build_prefill_metadata(cfg, batch).chunks
    assert chunk.ks.tolist() == [0, 0, 5, 5, 14, 14, 14]
    assert chunk.ke.tolist() == [4, 5, 13, 14, 16, 17, 18]
    assert (chunk.num_rows, chunk.max_seqlen_k, chunk.token_start, chunk.token_end) == (
        18, 9, 0, 7)


def test_prefill_metadata_rejects_bad_host_lengths():
    cfg = dsa.IndexerConfig(max_num_reqs=2, max_num_batched_tokens=4, max_model_len=64)
    batch = Batch(torch.tensor([0, 2, 4], dtype=torch.int32),
                  torch.tensor([2, 2], dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32),
                  torch.full((4,), -1), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="host lengths must match the batch"):
        build_prefill_metadata(cfg, batch, seq_lens_cpu=[2])
    with pytest.raises(ValueError, match="host lengths must be ints >= 0, got \\[2, -1\\]"):
        build_prefill_metadata(cfg, batch, seq_lens_cpu=[2, -1])
    with pytest.raises(ValueError, match=r"`num_decodes` must be in \[0, 2\], got 3"):
        build_prefill_metadata(cfg, batch, num_decodes=3)


def test_max_context_len():
    cfg = dsa.IndexerConfig(max_num_reqs=1, max_num_batched_tokens=1, max_model_len=1000,
                            compress_ratio=4, dcp_world=4, dcp_rank=3)
    assert max_context_len(cfg) == 63  # 250 states over 4 ranks


def test_decode_metadata_auto_backend_by_bucket(monkeypatch):
    """``build_decode_metadata`` decides once, from the bucket's logits rows and the row
    width (``max_model_len`` over compression and DCP), not the live lengths."""
    monkeypatch.setattr(deepgemm, "paged_unsupported_reason", lambda *_: None)
    monkeypatch.setattr(deepgemm, "num_sms", lambda _: 4)
    monkeypatch.setattr(paged, "AUTO_TRITON_MAX_KEYS", {1: 1 << 20})  # a rule with a bound
    monkeypatch.setattr(paged, "AUTO_TRITON_MAX_KEYS_BY_GPU", {})  # on any GPU
    seen = []
    real = paged.paged_backend

    def spy(*args, **kwargs):
        seen.append(args[5:])
        return real(*args, **kwargs)

    monkeypatch.setattr(dsa.meta.decode, "paged_backend", spy)
    for reqs, max_model_len, dcp in ((8, 32768, 1), (64, 32768, 1), (64, 32768, 4)):
        cfg = dsa.IndexerConfig(max_num_reqs=reqs, max_num_batched_tokens=reqs,
                                max_model_len=max_model_len, num_blocks=4, dcp_world=dcp)
        batch = Batch(torch.arange(reqs + 1, dtype=torch.int32),
                          torch.ones(reqs, dtype=torch.int32),
                          torch.zeros(reqs, table_width(cfg), dtype=torch.int32),
                          torch.zeros(reqs, dtype=torch.long), torch.zeros(reqs, dtype=torch.long))
        build_decode_metadata(cfg, batch)
    assert seen == [(1, 8, 32768), (1, 64, 32768), (1, 64, 8192)]
    assert [real("auto", torch.device("cuda"), 64, 128, 64, *args) for args in seen] == [
        "triton", "deepgemm", "triton"]


def _deep_gemm_missing():
    """``deepgemm.deep_gemm`` where the package is not installed (an import that fails)."""
    try:
        import dsa_no_such_module  # noqa: F401
    except ImportError:
        return None


@pytest.mark.parametrize("next_n", [0, 2, 3, 4])
def test_auto_backend_compiles_without_deep_gemm(monkeypatch, next_n):
    """On a Hopper GPU without DeepGEMM, ``auto`` resolves under torch.compile(fullgraph=True)
    to Triton, for paged logits (next_n 2-4) and ragged ones (prefill, next_n 0 here): the
    package's import is a trace-time constant, not traced (an import failure inside the
    trace would fail the whole graph)."""
    monkeypatch.setattr(deepgemm, "deep_gemm", _deep_gemm_missing)
    monkeypatch.setattr(deepgemm, "arch_major", lambda _: 9)
    cuda = torch.device("cuda")

    def step(x: torch.Tensor) -> torch.Tensor:
        if next_n:
            backend = paged.paged_backend("auto", cuda, 64, 128, 64, next_n, 64, 65536)
        else:
            backend = ragged.ragged_backend("auto", cuda, 64, 128)
        return x + (1 if backend == "triton" else 2)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(step, fullgraph=True)(torch.zeros(2)), torch.ones(2))


def test_dynamic_shapes_raise_a_clear_error():
    """A dynamic-shape trace (dynamic=True, or torch.compile's recompile after a new capacity)
    fails at the first op given a symbolic size, saying what to do."""
    torch._dynamo.reset()
    cfg = dsa.IndexerConfig(max_num_reqs=4, max_num_batched_tokens=8, max_model_len=256)
    build = torch.compile(lambda batch: build_decode_metadata(cfg, batch), fullgraph=True,
                          dynamic=True)
    batch = Batch(torch.tensor([0, 1, 2], dtype=torch.int32),
                  torch.tensor([5, 6], dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32),
                  torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(Exception, match=r"must be a static int, got a SymInt.*dynamic=False"):
        build(batch)
    torch._dynamo.reset()


def test_int_arguments_reject_symbolic_sizes():
    op = torch.compile(lambda qsl, n: torch.ops.dsa.decode_row_requests(qsl, n.shape[0]),
                       fullgraph=True, dynamic=True)
    with pytest.raises(Exception, match=r"`num_tokens` must be a static int.*dynamic=False"):
        op(torch.tensor([0, 1, 2], dtype=torch.int32), torch.zeros(3))
    torch._dynamo.reset()
