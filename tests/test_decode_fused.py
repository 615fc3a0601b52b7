"""``dsa::decode_metadata`` (the fused decode-metadata op) equals the composition of the small
ops it fuses, bit for bit, on every face; ``build_decode_metadata`` traces to it alone."""

from __future__ import annotations

import operator

import pytest
import reference_meta as ref
import torch
from decode_composition import composed_decode_metadata
from faces import (
    CPU_EXAMPLES,
    FACE_NAMES,
    HAS_CUDA,
    KERNEL_EXAMPLES,
    KERNEL_MARK,
    i32,
    opcheck_test,
    run_op,
    strided_rows,
    validation_test,
)
from hypothesis import given
from hypothesis import strategies as st
from strategies import dcp_configs, decode_batches

import dsa
import dsa.meta.decode
import dsa.ops._tokens
from dsa.meta.batch import Batch
from dsa.ops.logits import deepgemm

OUTPUTS = ("global_lens", "context_lens", "block_table", "token_requests", "valid_tokens",
           "slot_mapping", "select_lens", "schedule_lens", "schedule")


@st.composite
def fused_cases(draw: st.DrawFn, max_reqs: int = 5):
    """Arguments of ``decode_metadata``: decode batches with hostile values mixed in (block ids
    outside the cache, positions outside the model, lengths past the table and the width)."""
    spec = draw(decode_batches(max_reqs=max_reqs, max_context=12))
    qsl, seq_lens, table, slots, positions = spec.tensors()
    if table.numel() and draw(st.booleans()):
        flat = table.view(-1)
        for i in draw(st.lists(st.integers(0, flat.numel() - 1), max_size=3)):
            flat[i] = draw(st.sampled_from([-1, 2**31 - 1, 2 * table.numel() + 5]))
    if positions.numel() and draw(st.booleans()):
        positions[draw(st.integers(0, positions.numel() - 1))] = draw(st.sampled_from([-3, 10**6]))
    if draw(st.booleans()):
        positions = positions.int()
    if draw(st.booleans()):
        table = strided_rows(table)
    world, rank = draw(dcp_configs())
    span = (spec.width + 1) * spec.block_size
    num_blocks = draw(st.sampled_from([0, 3, 2 * max(table.numel(), 1), 2**31 - 1]))
    return (qsl, seq_lens, table, positions, slots, draw(st.booleans()), spec.next_n,
            draw(st.sampled_from([1, 2, 4])), world, rank, 1, num_blocks, spec.block_size,
            draw(st.integers(0, span)), draw(st.sampled_from([0, 5, 10**6])), draw(st.booleans()))


def check_fused(face: str, args: tuple) -> None:
    """The face against the small ops on the same device (the schedule's size is the
    device's)."""
    got = run_op(face, "decode_metadata", *args)
    device = "cuda" if face == "kernel" and HAS_CUDA else "cpu"
    want = composed_decode_metadata(*(a.to(device) if isinstance(a, torch.Tensor) else a
                                      for a in args))
    for name, g, w in zip(OUTPUTS, got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w.cpu()), name


@CPU_EXAMPLES
@given(args=fused_cases())
def test_decode_metadata_cpu(args):
    check_fused("cpu", args)


@KERNEL_MARK
@KERNEL_EXAMPLES
@given(args=fused_cases(max_reqs=2))
def test_decode_metadata_kernel(args):
    check_fused("kernel", args)


@CPU_EXAMPLES
@given(args=fused_cases())
def test_decode_metadata_fake_shapes(args):
    fake = run_op("fake", "decode_metadata", *args)
    real = run_op("cpu", "decode_metadata", *args)
    assert [(f.shape, f.dtype) for f in fake] == [(r.shape, r.dtype) for r in real]


@pytest.mark.parametrize("face", FACE_NAMES)
def test_decode_metadata_worked(face):
    """Flat rows of qsl [0, 2, 3] (tokens 0, 1 of request 0, token 2 of request 1, then a
    padding token), seq_lens [20, 5], block 8: lengths [19, 20, 5, 0]. Request 0's table
    [3, -1, 4] cuts its lengths at 8 keys; request 1's first block 9 is outside the cache of
    6 blocks: no key, and DeepGEMM's first column is clamped to 5. The padding token and
    position 70 (>= max_model_len 64) write nothing."""
    table = i32([[3, -1, 4], [9, 1, 2]])
    args = (i32([0, 2, 3]), i32([20, 5]), table, torch.tensor([18, 70, 4, 0]),
            torch.tensor([100, 101, 102, 103]), False, 2, 1, 1, 0, 1, 6, 8, 24, 64, True)
    glob, lens, rows, requests, valid, slots, select_lens, schedule_lens, schedule = run_op(
        face, "decode_metadata", *args)
    assert glob.view(-1).tolist() == [19, 20, 5, 0]
    assert lens.view(-1).tolist() == [8, 8, 0, 0]
    assert rows.tolist() == [[3, -1, 4], [3, -1, 4], [5, 1, 2], [0, 0, 0]]
    assert requests.tolist() == [0, 0, 1, 2]
    assert valid.tolist() == [True, False, True, False]
    assert slots.tolist() == [100, -1, 102, -1]
    assert select_lens.view(-1).tolist() == [8, 0, 0, 0]
    assert schedule_lens.view(-1).tolist() == [8, 8, 1, 1]
    assert schedule.shape[1] == 2 and not schedule.any()  # zeros where DeepGEMM cannot run
    assert lens.view(-1).tolist() == [
        row[0] for row in ref.cap_context_lens([[19], [20], [5], [0]], table[[0, 0, 1, 0]].tolist(),
                                               6, 8, 24)
    ]


# --- what build_decode_metadata traces to -------------------------------------------------


def traced_calls(fn, *args) -> list[str]:
    """Names of the functions the FX graph(s) of ``torch.compile(fn, fullgraph=True)`` call,
    tuple indexing left out: ``dsa.<op>`` for a dsa op, anything else a kernel Inductor adds."""
    graphs = []

    def capture(gm: torch.fx.GraphModule, _example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    ops = (torch._ops.OpOverloadPacket, torch._ops.OpOverload)
    return [str(n.target) if isinstance(n.target, ops) else n.target.__name__
            for gm in graphs for n in gm.graph.nodes
            if n.op == "call_function" and n.target is not operator.getitem]


def small_batch(cfg: dsa.IndexerConfig) -> Batch:
    tokens = cfg.max_num_batched_tokens
    return Batch(torch.tensor([0, 1, 2], dtype=torch.int32),
                 torch.tensor([9, 3], dtype=torch.int32),
                 torch.arange(2 * cfg.table_factor * 4, dtype=torch.int32).view(2, -1),
                 torch.arange(tokens), torch.arange(tokens) + 3)


@pytest.mark.parametrize("backend", ["triton", "deepgemm"])
@pytest.mark.parametrize(("kwargs", "extra"), [
    ({}, []),
    ({"next_n": 2}, []),
    ({"next_n": 2, "decode_layout": "flat"}, []),
    ({"dcp_world": 2, "dcp_rank": 1}, []),
    ({"compress_ratio": 4, "kernel_block_size": 16},
     ["dsa.compress_block_table", "dsa.compressed_slot_mapping"]),
    ({"kpool": 4}, ["dsa.kpool_tail_slot_mapping", "where"]),
])
def test_build_decode_metadata_is_one_op(monkeypatch, backend, kwargs, extra):
    """The decode metadata is one dsa op (one Triton launch, plus DeepGEMM's schedule kernel
    with that backend) and no Inductor kernel around it; compressed caches add their slot
    ops, kpool its tail slots. DeepGEMM cannot run here: its choice is patched in."""
    if backend == "deepgemm":
        monkeypatch.setattr(dsa.meta.decode, "paged_backend", lambda *_, **__: "deepgemm")
    cfg = dsa.IndexerConfig(max_num_reqs=2, max_num_batched_tokens=4, max_model_len=256,
                            num_blocks=64, **kwargs)
    calls = traced_calls(lambda b: dsa.build_decode_metadata(cfg, b), small_batch(cfg))
    assert sorted(calls) == sorted(["dsa.decode_metadata", *extra]), calls


# --- opcheck and validation ---------------------------------------------------------------

QSL, SEQ, TABLE = i32([0, 2, 3, 3]), i32([5, 1, 0]), i32([[4, 5], [6, 7], [8, 9]])
POS, SLOTS = torch.tensor([3, 4, 0, 0]), torch.tensor([1, 2, 3, -1])


def fused_args(**changes) -> tuple:
    """Valid ``decode_metadata`` arguments with ``changes`` applied by name."""
    args = {"query_start_loc": QSL, "seq_lens": SEQ, "block_table": TABLE, "positions": POS,
            "slot_mapping": SLOTS, "native": True, "next_n": 2, "compress_ratio": 1,
            "dcp_world": 1, "dcp_rank": 0, "dcp_interleave": 1, "num_blocks": 8,
            "block_size": 2, "max_context_len": 4, "max_model_len": 16, "deepgemm": False}
    return tuple({**args, **changes}.values())


test_opcheck = opcheck_test([
    fused_args(),
    fused_args(native=False, deepgemm=True, block_table=strided_rows(TABLE)),
    fused_args(compress_ratio=2, dcp_world=2, dcp_rank=1, positions=POS.int()),
    fused_args(query_start_loc=i32([0]), seq_lens=i32([]), block_table=TABLE[:0],
               positions=POS[:2], slot_mapping=SLOTS[:2]),
], op="decode_metadata")

test_validation_errors = validation_test([
    (fused_args(seq_lens=SEQ[:2]), ValueError, "`seq_lens` must have size 3"),
    (fused_args(block_table=TABLE.long()), TypeError, "`block_table` must be torch.int32"),
    (fused_args(positions=POS[:3]), ValueError, "`positions` must have size 4"),
    (fused_args(positions=POS.float()), TypeError, "`positions` must be torch.int32 or"),
    (fused_args(slot_mapping=SLOTS.int()), TypeError, "`slot_mapping` must be torch.int64"),
    (fused_args(next_n=0), ValueError, "`next_n` must be >= 1"),
    (fused_args(compress_ratio=0), ValueError, "`compress_ratio` must be >= 1"),
    (fused_args(dcp_rank=1), ValueError, "`dcp_rank` must be < dcp_world=1"),
    (fused_args(num_blocks=-1), ValueError, "`num_blocks` must be >= 0"),
    (fused_args(max_model_len=-1), ValueError, "`max_model_len` must be >= 0"),
], op="decode_metadata")


@pytest.mark.parametrize("face", FACE_NAMES)
def test_decode_metadata_wide_table(face):
    """A table wider than one column block (1024) is copied block by block."""
    rng = torch.Generator().manual_seed(0)
    table = torch.randint(-1, 3000, (2, 1030), dtype=torch.int32, generator=rng)
    args = fused_args(query_start_loc=i32([0, 1, 2]), seq_lens=i32([2000, 40]),
                      block_table=table, positions=POS[:2], slot_mapping=SLOTS[:2],
                      native=False, block_size=2, num_blocks=2500, max_context_len=2060,
                      deepgemm=True)
    check_fused(face, args)


@KERNEL_MARK
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("pairs", [0, 8192])
def test_decode_metadata_kernel_request_lookups(monkeypatch, native, pairs):
    """The tokens' requests by binary search (no pairs to compare) and by one read of
    ``query_start_loc`` (an empty request, a padding token, a request of three tokens)."""
    monkeypatch.setattr(dsa.ops._tokens, "LOOKUP_PAIRS", pairs)
    rng = torch.Generator().manual_seed(3)
    table = torch.randperm(40, generator=rng)[:20].view(5, 4).to(torch.int32)
    args = fused_args(query_start_loc=i32([0, 2, 2, 5, 6, 7]), seq_lens=i32([9, 0, 14, 3, 8]),
                      block_table=table, positions=torch.tensor([7, 8, 11, 12, 13, 2, 7, 0]),
                      slot_mapping=torch.arange(8), native=native, next_n=3, num_blocks=40,
                      block_size=4, max_context_len=16, max_model_len=64, deepgemm=True)
    check_fused("kernel", args)


@pytest.mark.gpu
@pytest.mark.parametrize("native", [True, False])
def test_decode_metadata_deepgemm_schedule_gpu(native):
    """With DeepGEMM, the schedule built from the fused op's clamped lengths is the one
    ``paged_mqa_schedule`` builds from the capped lengths (zero lengths included)."""
    device = torch.device("cuda")
    if not deepgemm.schedule_supported(device, 64):
        pytest.skip("DeepGEMM cannot build a paged-logits schedule here")
    rng = torch.Generator().manual_seed(1)
    batch, next_n, width = 16, 2, 32
    seq_lens = torch.randint(0, width * 64, (batch,), dtype=torch.int32, generator=rng)
    seq_lens[::5] = 0
    query_lens = torch.minimum(seq_lens, torch.tensor(next_n, dtype=torch.int32))
    qsl = torch.cat([i32([0]), query_lens.cumsum(0, dtype=torch.int32)])
    tokens = batch * next_n
    table = torch.randperm(batch * width, dtype=torch.int32, generator=rng).view(batch, width)
    table[3, 5] = -1
    args = fused_args(query_start_loc=qsl, seq_lens=seq_lens, block_table=table,
                      positions=torch.arange(tokens), slot_mapping=torch.arange(tokens),
                      native=native, next_n=next_n, num_blocks=batch * width, block_size=64,
                      max_context_len=width * 64, max_model_len=width * 64, deepgemm=True)
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    got = torch.ops.dsa.decode_metadata(*args)
    want = composed_decode_metadata(*args)
    for name, g, w in zip(OUTPUTS, got, want, strict=True):
        assert torch.equal(g, w), name
    assert got[-1].shape == (deepgemm.num_sms(device) + 1, 2) and got[-1].any()
