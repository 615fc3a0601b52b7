"""Real inputs, trusted no further than the contract: pytrees across replay/compile/export,
padding and out-of-range tokens never write, impossible batches raise with clear errors
(eagerly on the host; wrapped by dynamo under torch.compile), static batches reject
inputs that do not fit."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch._dynamo.exc import TorchDynamoException
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

import dsa
from dsa.graphs import DecodeGraphRunner, StaticBatch, live_outputs
from dsa.meta.batch import check_batch_values

CFG = {"max_num_reqs": 3, "max_num_batched_tokens": 8, "max_model_len": 64, "block_size": 16}


def config(**overrides) -> dsa.IndexerConfig:
    return dsa.IndexerConfig(**{**CFG, **overrides})


def decode_batch(**fields) -> dsa.Batch:
    """Two decode requests (2 and 1 tokens), one padding request, three padding tokens
    whose slots are stale (not -1)."""
    base = {
        "query_start_loc": torch.tensor([0, 2, 3, 3], dtype=torch.int32),
        "seq_lens": torch.tensor([20, 5, 0], dtype=torch.int32),
        "block_table": torch.tensor([[3, 1, 0, 2], [5, 4, 6, 7], [0, 0, 0, 0]],
                                    dtype=torch.int32),
        "slot_mapping": torch.tensor([18, 19, 84, 7, 8, 9]),
        "positions": torch.tensor([18, 19, 4, 0, 0, 0]),
    }
    return dsa.Batch(**{**base, **fields})


# --- 1. pytrees ----------------------------------------------------------------------------


def prefill_metadata() -> dsa.PrefillMetadata:
    cfg = config(max_logits_bytes=4 * 18)  # chunks [0], [1] (two query pieces), [2]
    batch = dsa.Batch(torch.tensor([0, 2, 5, 5], dtype=torch.int32),
                      torch.tensor([7, 9, 0], dtype=torch.int32),
                      torch.zeros(3, 4, dtype=torch.int32), torch.full((6,), -1),
                      torch.tensor([5, 6, 6, 7, 8, 0]))
    return dsa.build_prefill_metadata(cfg, batch)


@pytest.mark.parametrize("make", [
    lambda: dsa.IndexerOutput(torch.zeros(4, 2), torch.ones(4, 2)),
    decode_batch,
    lambda: dsa.build_decode_metadata(config(next_n=2), decode_batch()),
    lambda: dsa.build_decode_metadata(config(next_n=2, kpool=4), decode_batch()),
    prefill_metadata,
], ids=["IndexerOutput", "Batch", "DecodeMetadata", "DecodeMetadata_kpool", "PrefillMetadata"])
def test_dataclasses_are_pytree_nodes(make):
    obj = make()
    leaves, spec = tree_flatten(obj)
    assert leaves and all(isinstance(x, torch.Tensor) for x in leaves)
    again = tree_unflatten([x + 1 for x in leaves], spec)
    assert type(again) is type(obj)
    for name, value in vars(obj).items():
        got = getattr(again, name)
        if isinstance(value, torch.Tensor):
            assert torch.equal(got, value + 1), name
        elif not isinstance(value, tuple):  # static fields and None stay as they are
            assert got == value, name
    assert tree_flatten(tree_map(lambda t: t.clone(), obj))[1] == spec


def test_prefill_chunk_host_ints_are_static():
    meta = prefill_metadata()
    assert [c.skip_gather for c in meta.chunks] == [False, False, True]
    leaves, spec = tree_flatten(meta)
    chunks = tree_unflatten(leaves, spec).chunks
    assert [(c.token_start, c.token_end, c.skip_gather) for c in chunks] == [
        (c.token_start, c.token_end, c.skip_gather) for c in meta.chunks]
    assert len(leaves) == 4 + 7 * len(meta.chunks)  # 4 tensors, then 7 per chunk


def test_live_outputs_cuts_and_clones_indexer_output():
    graph_out = dsa.IndexerOutput(torch.arange(16).view(8, 2), torch.arange(16).view(8, 2))
    got = live_outputs(graph_out, capacity=8, live_tokens=6)
    assert isinstance(got, dsa.IndexerOutput)
    assert got.indices.shape == got.slots.shape == (6, 2)
    graph_out.indices.fill_(-7)  # the next replay overwrites the graph's outputs
    assert torch.equal(got.indices, torch.arange(12).view(6, 2))


def test_live_outputs_walks_nested_structures():
    meta = dsa.build_decode_metadata(config(next_n=2), decode_batch())
    graph_out = {"layers": [dsa.IndexerOutput(torch.zeros(6, 2), torch.zeros(6, 2))] * 2,
                 "meta": meta, "extra": (torch.zeros(3), 5, "tag", None)}
    got = live_outputs(graph_out, capacity=6, live_tokens=3)
    assert [o.indices.shape[0] for o in got["layers"]] == [3, 3]
    assert got["layers"][0].indices is not got["layers"][1].indices
    assert got["meta"].valid_tokens.tolist() == [True, True, True]
    assert got["meta"].slot_mapping.shape == (3,) and got["meta"].kpool_slot_mapping is None
    assert (got["meta"].layout, got["meta"].max_context_len) == (meta.layout,
                                                                  meta.max_context_len)
    assert got["meta"].request_block_table.shape == (3, 4)  # not token-major: kept whole
    assert got["extra"][1:] == (5, "tag", None)
    assert got["extra"][0].data_ptr() != graph_out["extra"][0].data_ptr()


def test_live_outputs_rejects_dataclasses_that_are_not_pytrees():
    @dataclass
    class Unregistered:
        x: torch.Tensor

    with pytest.raises(TypeError, match="Unregistered, a dataclass that is not a pytree node"):
        live_outputs([Unregistered(torch.zeros(2))], capacity=2, live_tokens=1)


def test_metadata_crosses_an_export_boundary():
    cfg = config(next_n=2)

    class Build(torch.nn.Module):
        def forward(self, batch: dsa.Batch) -> dsa.DecodeMetadata:
            return dsa.build_decode_metadata(cfg, batch)

    batch = decode_batch()
    exported = torch.export.export(Build(), (batch,))
    got, want = exported.module()(batch), dsa.build_decode_metadata(cfg, batch)
    assert isinstance(got, dsa.DecodeMetadata) and got.layout == want.layout
    for name in ("context_lens", "token_requests", "valid_tokens", "slot_mapping"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


# --- 2. padding tokens and out-of-range positions never write ------------------------------


def test_decode_padding_tokens_never_write():
    meta = dsa.build_decode_metadata(config(next_n=2, kpool=4), decode_batch())
    assert meta.valid_tokens.tolist() == [True, True, True, False, False, False]
    assert meta.slot_mapping.tolist() == [18, 19, 84, -1, -1, -1]
    assert meta.kpool_slot_mapping.tolist()[3:] == [-1, -1, -1]


def test_prefill_padding_tokens_never_write():
    meta = dsa.build_prefill_metadata(config(), decode_batch())
    assert meta.valid_tokens.tolist() == [True, True, True, False, False, False]
    assert meta.slot_mapping.tolist() == [18, 19, 84, -1, -1, -1]


@pytest.mark.parametrize("overrides", [{}, {"compress_ratio": 2}, {"kpool": 4}])
def test_out_of_range_positions_write_nothing_when_not_checked(overrides):
    """Traced (values unread), positions outside [0, max_model_len) are masked, not raised."""
    torch._dynamo.reset()
    cfg = config(next_n=2, **overrides)
    build = torch.compile(lambda b: dsa.build_decode_metadata(cfg, b), fullgraph=True,
                          backend="aot_eager")
    batch = decode_batch(positions=torch.tensor([18, 64, -1, 0, 0, 0]))
    meta = build(batch)
    assert meta.valid_tokens.tolist() == [True, False, False, False, False, False]
    assert meta.slot_mapping.tolist()[1:] == [-1] * 5
    if cfg.kpool is not None:
        assert meta.kpool_slot_mapping.tolist()[1:] == [-1] * 5


# --- 3. config -----------------------------------------------------------------------------


def test_config_num_blocks_debug_and_compress_ratio(monkeypatch):
    monkeypatch.delenv("DSA_DEBUG", raising=False)
    assert (config().num_blocks, config().debug) == (None, False)
    for on in ("1", "true", "Yes", "ON"):
        monkeypatch.setenv("DSA_DEBUG", on)
        assert config().debug and not config(debug=False).debug
    monkeypatch.setenv("DSA_DEBUG", "0")
    assert not config().debug
    with pytest.raises(ValueError, match="num_blocks must be a positive int, got 0"):
        config(num_blocks=0)
    with pytest.raises(ValueError, match=r"compress_ratio must be <= max_model_len=64 .*got 65"):
        config(compress_ratio=65)
    with pytest.raises(ValueError, match="debug must be a bool, got 'yes'"):
        config(debug="yes")


# --- 4. impossible batches raise -----------------------------------------------------------

I32 = {"dtype": torch.int32}
IMPOSSIBLE = {
    "qsl_start": ({"query_start_loc": torch.tensor([1, 2, 3, 3], **I32)},
                  "`query_start_loc` must start at 0, got 1"),
    "qsl_decreasing": ({"query_start_loc": torch.tensor([0, 2, 1, 3], **I32)},
                       r"`query_start_loc` must be non-decreasing, got 1 after 2 \(request 1\)"),
    "qsl_past_tokens": ({"query_start_loc": torch.tensor([0, 2, 3, 7], **I32)},
                        "`query_start_loc` must end at most at the 6 tokens of the batch .* got 7"),
    "negative_seq": ({"seq_lens": torch.tensor([20, 5, -1], **I32)},
                     "`seq_lens` must be >= 0, got -1 for request 2"),
    "seq_shorter_than_query": ({"seq_lens": torch.tensor([1, 5, 0], **I32)},
                               "`seq_lens` of request 0 must be >= its query length 2, got 1"),
    "decode_past_next_n": ({"query_start_loc": torch.tensor([0, 3, 4, 4], **I32),
                            "seq_lens": torch.tensor([20, 5, 0], **I32)},
                           "decode request 0 must have at most next_n=2 query tokens, got 3"),
    "position_past_model": ({"positions": torch.tensor([18, 64, 4, 0, 0, 0])},
                            r"`positions` of real token 1 must be in \[0, max_model_len=64\), "
                            "got 64"),
    "negative_position": ({"positions": torch.tensor([18, 19, -3, 0, 0, 0])},
                          "`positions` of real token 2 must be in .* got -3"),
    "seq_past_model": ({"seq_lens": torch.tensor([65, 5, 0], **I32)},
                       "`seq_lens` must be <= max_model_len=64, got 65 for request 0"),
}


@pytest.mark.parametrize("builder", ["build_decode_metadata", "build_prefill_metadata"])
@pytest.mark.parametrize("case", list(IMPOSSIBLE))
def test_impossible_batches_raise_on_the_host(case, builder):
    fields, match = IMPOSSIBLE[case]
    cfg, batch = config(next_n=2), decode_batch(**fields)
    kwargs = {}
    if case == "decode_past_next_n" and builder == "build_prefill_metadata":
        dsa.build_prefill_metadata(cfg, batch)  # prefill requests take any number of tokens
        kwargs, match = {"num_decodes": 1}, (r"decode request 0 \(of num_decodes=1\) must have "
                                             r"at most next_n=2 query tokens, got 3")
    with pytest.raises(ValueError, match=f"dsa.{builder}: {match}"):
        getattr(dsa, builder)(cfg, batch, **kwargs)


@pytest.mark.parametrize("builder", ["build_decode_metadata", "build_prefill_metadata"])
def test_slots_outside_the_cache_raise_on_the_host(builder):
    """A real token's slot beyond the cache (or negative, not -1) would silently write
    nothing; -1 (no write) is fine, and padding tokens' stale slots are not checked."""
    cfg = config(next_n=2, num_blocks=8)  # 8 blocks of 16: slots [0, 128)
    getattr(dsa, builder)(cfg, decode_batch(slot_mapping=torch.tensor([18, -1, 84, 999, 7, 8])))
    for slot in (128, -5):
        with pytest.raises(ValueError, match=rf"dsa.{builder}: `slot_mapping` of real token 1 "
                                             rf"must be -1 or in \[0, num_blocks \* block_size "
                                             rf"= 128\), got {slot}"):
            getattr(dsa, builder)(cfg, decode_batch(
                slot_mapping=torch.tensor([18, slot, 84, 7, 8, 9])))


def test_padding_positions_are_not_checked():
    batch = decode_batch(positions=torch.tensor([18, 19, 4, -5, 99, 0]))
    meta = dsa.build_decode_metadata(config(next_n=2), batch)
    assert meta.valid_tokens.tolist() == [True] * 3 + [False] * 3


def test_block_ids_outside_the_cache_raise_after_coarsening():
    """block_size 64 over kernel blocks of 16: the indexer table is table[:, ::4] // 4."""
    cfg = config(max_model_len=256, block_size=64, kernel_block_size=16, num_blocks=4)
    table = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 99, 99, 99, 99, 99, 99, 99, 99]], **I32)
    batch = dsa.Batch(torch.tensor([0, 1], **I32), torch.tensor([100], **I32), table,
                      torch.tensor([-1]), torch.tensor([99]))
    dsa.build_decode_metadata(cfg, batch)  # 100 tokens: indexer blocks 0, 1 (columns 0, 4)
    table[0, 4] = 16  # indexer block 4: outside 4 blocks
    with pytest.raises(ValueError, match=r"`block_table` row 0 \(request 0\) must map its first "
                                         r"2 indexer blocks into \[0, num_blocks=4\), got "
                                         "indexer block 4 at column 4"):
        dsa.build_decode_metadata(cfg, batch)
    table[0, 4] = -1
    with pytest.raises(ValueError, match="got indexer block -1 at column 4"):
        dsa.build_prefill_metadata(cfg, batch)


def test_block_ids_under_dcp_count_local_blocks():
    """DCP world 2: 40 states span ceil(40 / (16 * 2)) = 2 local blocks."""
    cfg = config(max_model_len=128, dcp_world=2, num_blocks=8)
    table = torch.tensor([[1, 2, 8, 8]], **I32)
    batch = dsa.Batch(torch.tensor([0, 1], **I32), torch.tensor([40], **I32), table,
                      torch.tensor([-1]), torch.tensor([39]))
    dsa.build_decode_metadata(cfg, batch)
    table[0, 1] = 8
    with pytest.raises(ValueError, match="got indexer block 8 at column 1"):
        dsa.build_decode_metadata(cfg, batch)


def test_values_are_not_read_from_fake_or_traced_tensors():
    cfg = config(next_n=2, debug=True)
    bad = decode_batch(seq_lens=torch.tensor([1, 5, -1], **I32))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = tree_map(mode.from_tensor, bad)
        meta = dsa.build_decode_metadata(cfg, fake)
    assert meta.slot_mapping.shape == (6,)
    torch._dynamo.reset()
    compiled = torch.compile(lambda b: dsa.build_decode_metadata(cfg, b), fullgraph=True,
                             backend="eager")
    assert compiled(bad).valid_tokens.shape == (6,)  # skipped while tracing
    with pytest.raises(ValueError, match="`seq_lens` must be >= 0"):
        check_batch_values("op", cfg, bad, decode=True)


def test_prefill_rejects_host_lengths_that_disagree_with_the_batch():
    cfg = config(max_model_len=512)
    batch = dsa.Batch(torch.tensor([0, 2, 4], **I32), torch.tensor([400, 300], **I32),
                      torch.zeros(2, 32, **I32), torch.full((4,), -1),
                      torch.tensor([398, 399, 298, 299]))
    with pytest.raises(ValueError, match=r"`seq_lens_cpu` and `query_start_loc_cpu` must equal "
                                         r"the batch's .* got \[40, 30\] and \[0, 2, 4\] for "
                                         r"\[400, 300\] and \[0, 2, 4\]"):
        dsa.build_prefill_metadata(cfg, batch, seq_lens_cpu=[40, 30],
                                   query_start_loc_cpu=[0, 2, 4])
    with pytest.raises(ValueError, match=r"got \[400, 300\] and \[0, 1, 4\]"):
        dsa.build_prefill_metadata(cfg, batch, query_start_loc_cpu=[0, 1, 4])
    meta = dsa.build_prefill_metadata(cfg, batch, seq_lens_cpu=torch.tensor([400, 300]),
                                      query_start_loc_cpu=[0, 2, 4])
    assert meta.valid_tokens.all()
    for bad in ([400.7, 300], ["400", "300"], torch.tensor([400.0, 300.0])):
        with pytest.raises(ValueError, match="host lengths must be"):
            dsa.build_prefill_metadata(cfg, batch, seq_lens_cpu=bad, query_start_loc_cpu=[0, 2, 4])
    with pytest.raises(ValueError, match=r"`num_decodes` must be in \[0, 2\], got 1.5"):
        dsa.build_prefill_metadata(cfg, batch, num_decodes=1.5)


def test_split_prefill_chunks_rejects_a_query_longer_than_its_sequence():
    with pytest.raises(ValueError, match=r"dsa\.split_prefill_chunks: `seq_lens` of request 1 "
                                         "must be >= its query length 5, got 4"):
        dsa.split_prefill_chunks([8, 4], [8, 5], 100, 1000)
    assert dsa.split_prefill_chunks([8, 4], [8, 4], 100, 1000, compress_ratio=4) == [
        (slice(0, 2), slice(0, 12))]


# --- 5. StaticBatch.load -------------------------------------------------------------------

LIVE_HIDDEN = torch.ones(3, 4)


@pytest.mark.parametrize(("fields", "inputs", "error", "match"), [
    ({"positions": torch.tensor([18.0, 19.0, 4.0])}, {}, TypeError,
     "dsa.pad_batch_out: `positions` must be torch.int32 or torch.int64, got torch.float32"),
    ({"query_start_loc": torch.tensor([0, 2, 3], **I32)}, {}, ValueError,
     r"dsa.pad_batch_out: `seq_lens` must have size 2 \(num_reqs = len\(query_start_loc\) - 1\)"
     r" in dimension 0, got shape \(3,\)"),
    ({"block_table": torch.zeros(2, 4, **I32)}, {}, ValueError,
     r"dsa.pad_batch_out: `block_table` must have size 3 .* got shape \(2, 4\)"),
    ({"block_table": torch.zeros(3, **I32)}, {}, ValueError,
     r"dsa.pad_batch_out: `block_table` must have 2 dimension\(s\), got shape \(3,\)"),
    ({"positions": torch.tensor([18, 19])}, {}, ValueError,
     r"dsa.pad_batch_out: `positions` must have size 3 \(num_tokens = len\(slot_mapping\)\)"),
    ({}, {"hidden": torch.ones(7, 4)}, ValueError,
     r"StaticBatch.load: token input `hidden` must have shape \(3, 4\) \(one row per live "
     r"token\), got \(7, 4\)"),
    ({}, {"hidden": torch.ones(2, 4)}, ValueError,
     r"StaticBatch.load: token input `hidden` must have shape \(3, 4\) .* got \(2, 4\)"),
    ({}, {"hidden": torch.ones(3, 5)}, ValueError,
     r"StaticBatch.load: token input `hidden` .* got \(3, 5\)"),
    ({}, {"hidden": torch.ones(3, 4, dtype=torch.float64)}, TypeError,
     "StaticBatch.load: token input `hidden` must be torch.float32, got torch.float64"),
    ({}, {"hidden": torch.ones(3, 4, device="meta")}, ValueError,
     "StaticBatch.load: token input `hidden` must be on cpu, got meta"),
    ({}, {"hidden": [[1.0] * 4] * 3}, TypeError,
     "StaticBatch.load: token input `hidden` must be a torch.Tensor, got list"),
])
def test_static_batch_load_rejects_inconsistent_inputs(fields, inputs, error, match):
    live = {"query_start_loc": torch.tensor([0, 2, 3, 3], **I32),
            "seq_lens": torch.tensor([20, 5, 0], **I32),
            "block_table": torch.zeros(3, 4, **I32),
            "slot_mapping": torch.tensor([34, 35, 84]),
            "positions": torch.tensor([18, 19, 4])}
    static = StaticBatch(4, 8, 4, token_inputs={"hidden": ((4,), torch.float32)})
    with pytest.raises(error, match=match):
        static.load(dsa.Batch(**{**live, **fields}), **{"hidden": LIVE_HIDDEN, **inputs})


# --- 6. DecodeGraphRunner needs CUDA -------------------------------------------------------


def test_graph_runner_on_cpu_raises_a_clear_error():
    with pytest.raises(ValueError, match="DecodeGraphRunner: CUDA graphs need a CUDA device, "
                                         "got cpu; on the CPU, call the compiled step directly"):
        DecodeGraphRunner(lambda batch: batch, config(), token_inputs={}, table_width=4,
                          device="cpu")
    with pytest.raises(ValueError, match=r"bucket 3 takes 3 \* next_n = 9 tokens, more than "
                                         r"IndexerConfig.max_num_batched_tokens=8"):
        DecodeGraphRunner(lambda batch: batch, config(next_n=3), token_inputs={}, table_width=4)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device, and torch "
                                               "finds none"):
            DecodeGraphRunner(lambda batch: batch, config(), token_inputs={}, table_width=4)


# --- 7. errors under torch.compile ---------------------------------------------------------


def test_errors_under_compile_arrive_wrapped_by_dynamo():
    """A dsa error raised while tracing comes out as a dynamo RuntimeError whose message
    holds the dsa error; ``set_stance("force_eager")`` raises the original."""
    cfg = config()
    bad_batch = decode_batch(seq_lens=torch.zeros(3, dtype=torch.int64))
    qsl = torch.tensor([0, 1], **I32)
    cases = [
        (lambda: dsa.build_decode_metadata(cfg, bad_batch), TypeError,
         "dsa.build_decode_metadata: `seq_lens` must be torch.int32, got torch.int64"),
        (lambda: torch.ops.dsa.decode_row_requests(qsl, -1), ValueError,
         "dsa.decode_row_requests: `num_tokens` must be >= 0, got -1"),
    ]
    for fn, original, message in cases:
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="eager")
        with pytest.raises(TorchDynamoException) as info:
            compiled()
        assert isinstance(info.value, RuntimeError)
        assert message in str(info.value)
        with torch.compiler.set_stance("force_eager"), pytest.raises(original, match=message):
            compiled()


def test_block_table_must_cover_the_kernel_blocks():
    """Kernel blocks 4 times smaller than the indexer's: the engine's table needs 4 entries
    per indexer block; a table only as wide as the indexer's blocks is refused."""
    cfg = config(max_model_len=256, block_size=64, kernel_block_size=16)  # 4 indexer blocks
    batch = dsa.Batch(torch.tensor([0, 1], **I32), torch.tensor([100], **I32),
                      torch.zeros(1, 4, **I32), torch.tensor([-1]), torch.tensor([99]))
    for builder in (dsa.build_decode_metadata, dsa.build_prefill_metadata):
        with pytest.raises(ValueError, match=r"`block_table` must have at least "
                                             r"IndexerConfig\.block_table_width = 16 columns"):
            builder(cfg, batch)


def test_live_outputs_keeps_tensors_that_are_not_token_major():
    """Only tensors whose leading dim is the bucket's token capacity are cut; others, even
    at least as long as the live tokens, stay whole."""
    got = live_outputs({"tokens": torch.arange(8), "requests": torch.arange(4),
                        "schedule": torch.zeros(9, 2)}, capacity=8, live_tokens=2)
    assert got["tokens"].tolist() == [0, 1]
    assert got["requests"].tolist() == [0, 1, 2, 3] and got["schedule"].shape == (9, 2)
