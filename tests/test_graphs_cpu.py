"""dsa.graphs pieces that need no GPU: capture sizes, buckets, static batches and padding,
and a compiled step over bucket prefixes of one set of buffers (what the runner captures)."""

import copy
import dataclasses
import random

import pytest
import torch

import dsa
from dsa.graphs import (
    DecodeGraphRunner,
    StaticBatch,
    bucket_for,
    capture_sizes,
    pad_batch,
    static_batch,
)
from dsa.graphs.runner import _fill_warmup_batch
from dsa.meta.batch import Batch, indexer_writes
from tests.batches import random_decode_batch, table_width


def live_batch() -> Batch:
    return Batch(
        query_start_loc=torch.tensor([0, 2, 3, 5], dtype=torch.int32),
        seq_lens=torch.tensor([10, 7, 12], dtype=torch.int32),
        block_table=torch.tensor([[4, 5], [6, 7], [8, 9]], dtype=torch.int32),
        slot_mapping=torch.tensor([264, 265, 390, 523, 524]),
        positions=torch.tensor([8, 9, 6, 10, 11]),
    )


def test_capture_sizes():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(6) == (1, 2, 4, 6)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(32, step=16) == (1, 2, 4, 16, 32)
    for bad in ((0,), (4.0,), ("8",), (8, 0)):
        with pytest.raises(ValueError, match="max_num_reqs and step must be ints >= 1"):
            capture_sizes(*bad[:1], **({"step": bad[1]} if len(bad) > 1 else {}))


def test_bucket_for():
    sizes = (1, 2, 4, 8)
    assert [bucket_for(n, sizes) for n in (0, 1, 3, 4, 5, 8)] == [1, 1, 4, 4, 8, 8]
    with pytest.raises(ValueError, match="9 requests exceed the largest capture size 8"):
        bucket_for(9, sizes)
    with pytest.raises(ValueError, match="num_reqs must be an int >= 0, got -1"):
        bucket_for(-1, sizes)
    with pytest.raises(ValueError, match="no capture sizes"):
        bucket_for(1, ())


def test_pad_batch_pads_requests_tokens_and_table():
    padded = pad_batch(live_batch(), num_reqs=5, num_tokens=8, table_width=3)
    assert padded.query_start_loc.tolist() == [0, 2, 3, 5, 5, 5]
    assert padded.seq_lens.tolist() == [10, 7, 12, 0, 0]
    assert padded.block_table.tolist() == [[4, 5, 0], [6, 7, 0], [8, 9, 0], [0, 0, 0],
                                           [0, 0, 0]]
    assert padded.slot_mapping.tolist() == [264, 265, 390, 523, 524, -1, -1, -1]
    assert padded.positions.tolist() == [8, 9, 6, 10, 11, 0, 0, 0]


def test_static_batch_load_keeps_addresses_and_clears_stale_requests():
    """Padding requests and tokens are cleared; the token inputs' rows past the live tokens
    keep what they held (padding tokens' outputs never depend on them)."""
    static = StaticBatch(4, 6, 2, token_inputs={"hidden": ((3,), torch.float32)})
    addresses = [t.data_ptr() for t in (static.batch.seq_lens, static.inputs["hidden"])]
    static.load(live_batch(), hidden=torch.ones(5, 3))
    smaller = Batch(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([3], dtype=torch.int32),
        block_table=torch.tensor([[1, 2]], dtype=torch.int32),
        slot_mapping=torch.tensor([66]),
        positions=torch.tensor([2]),
    )
    static.load(smaller, hidden=torch.full((1, 3), 2.0))
    assert static.batch.query_start_loc.tolist() == [0, 1, 1, 1, 1]
    assert static.batch.seq_lens.tolist() == [3, 0, 0, 0]
    assert static.batch.block_table.tolist() == [[1, 2], [0, 0], [0, 0], [0, 0]]
    assert static.batch.slot_mapping.tolist() == [66, -1, -1, -1, -1, -1]
    assert static.inputs["hidden"][:, 0].tolist() == [2.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert [t.data_ptr() for t in (static.batch.seq_lens, static.inputs["hidden"])] == addresses


def one_token_requests(n: int) -> Batch:
    return Batch(query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                 seq_lens=torch.full((n,), 5, dtype=torch.int32),
                 block_table=torch.zeros(n, 2, dtype=torch.int32),
                 slot_mapping=torch.arange(n), positions=torch.full((n,), 4))


def test_static_batch_load_copies_every_token_input():
    """All token inputs at once, whatever their dtypes and order: a full bucket, a partial
    one and no live tokens; rows past the live tokens stay."""
    static = StaticBatch(4, 4, 2, token_inputs={"hidden": ((3,), torch.bfloat16),
                                                "q_latent": ((2,), torch.float32)})
    for tokens in (4, 2, 0):
        q, h = torch.randn(tokens, 2), torch.randn(tokens, 3).bfloat16()
        before = {name: value.clone() for name, value in static.inputs.items()}
        static.load(one_token_requests(tokens), q_latent=q, hidden=h)
        assert torch.equal(static.inputs["hidden"][:tokens], h)
        assert torch.equal(static.inputs["q_latent"][:tokens], q)
        for name, value in static.inputs.items():
            assert torch.equal(value[tokens:], before[name][tokens:]), name


def test_static_batch_load_checks_each_signature_once(monkeypatch):
    """``load`` checks its arguments the first time their shapes, strides, dtypes and
    devices come; a repeat is not checked again, and any new signature is, with the same
    clear errors (a bad call is never remembered)."""
    faces = static_batch.FACES["pad_batch_out"]
    checks = []

    def counted(*tensors):
        checks.append(tensors[3].shape[0])
        return faces.fake(*tensors)

    monkeypatch.setattr(static_batch, "_PAD_FACES", dataclasses.replace(faces, fake=counted))
    static = StaticBatch(4, 6, 2, token_inputs={"hidden": ((3,), torch.float32)})
    for _ in range(3):
        static.load(live_batch(), hidden=torch.ones(5, 3))
    assert checks == [5]
    assert static.batch.seq_lens.tolist() == [10, 7, 12, 0]
    bad = dataclasses.replace(live_batch(), positions=torch.tensor([1, 2]))
    for _ in range(2):
        with pytest.raises(ValueError, match=r"dsa.pad_batch_out: `positions` must have size 5 "
                                             r"\(num_tokens = len\(slot_mapping\)\)"):
            static.load(bad, hidden=torch.ones(5, 3))
    with pytest.raises(ValueError, match=r"token input `hidden` must have shape \(5, 3\)"):
        static.load(live_batch(), hidden=torch.ones(4, 3))
    with pytest.raises(ValueError, match="does not fit capacity 4 requests, 6 tokens"):
        static.load(dataclasses.replace(live_batch(), slot_mapping=torch.arange(7),
                                        positions=torch.arange(7)), hidden=torch.ones(7, 3))
    strided = torch.ones(5, 6)[:, ::2]  # another signature: checked, then copied
    static.load(live_batch(), hidden=strided)
    assert checks == [5, 5, 5, 5, 7, 5]
    assert static.inputs["hidden"][:5].tolist() == [[1.0] * 3] * 5


def test_static_batch_rejects_oversized_batches_and_wrong_inputs():
    static = StaticBatch(2, 4, 2, token_inputs={"hidden": ((3,), torch.float32)})
    with pytest.raises(ValueError, match="3 requests, 5 tokens and block-table width 2 does "
                                         "not fit capacity 2 requests, 4 tokens"):
        static.load(live_batch(), hidden=torch.ones(5, 3))
    small = pad_batch(live_batch(), 3, 5)
    with pytest.raises(ValueError, match=r"expected token inputs \['hidden'\], got \[\]"):
        StaticBatch(3, 5, 2, token_inputs={"hidden": ((3,), torch.float32)}).load(small)


def test_static_batch_prefix_shares_the_buffers():
    static = StaticBatch(4, 8, 3, token_inputs={"hidden": ((2,), torch.float32)})
    view = static.prefix(2, 4)
    assert (view.num_reqs, view.num_tokens) == (2, 4)
    assert view.batch.query_start_loc.shape == (3,) and view.batch.block_table.shape == (2, 3)
    assert view.inputs["hidden"].shape == (4, 2)
    for whole, part in zip((*static.batch.__dict__.values(), static.inputs["hidden"]),
                           (*view.batch.__dict__.values(), view.inputs["hidden"])):
        assert part.data_ptr() == whole.data_ptr()
    view.batch.seq_lens[1] = 9
    assert static.batch.seq_lens.tolist() == [0, 9, 0, 0]
    with pytest.raises(ValueError, match="5 requests and 4 tokens exceed capacity 4 requests"):
        static.prefix(5, 4)


@pytest.mark.parametrize("trailing", [0, 2])
def test_static_batch_pad_in_place_equals_load(trailing):
    """An engine writes its live rows in place (``trailing`` padding tokens after the last
    request's, as a batch may carry) and pads; the batch equals ``load``'s."""
    live = live_batch()
    live = dataclasses.replace(
        live, slot_mapping=torch.cat([live.slot_mapping, torch.full((trailing,), 99)]),
        positions=torch.cat([live.positions, torch.full((trailing,), 3)]))
    loaded = StaticBatch(5, 8, 3)
    loaded.load(live)
    in_place = StaticBatch(5, 8, 3)
    in_place.batch.slot_mapping.fill_(77)  # stale rows of an earlier step
    in_place.batch.block_table.fill_(77)
    view = in_place.prefix(live.num_reqs, live.num_tokens).batch
    for name in ("query_start_loc", "seq_lens", "slot_mapping", "positions"):
        getattr(view, name).copy_(getattr(live, name))
    view.block_table[:, :2].copy_(live.block_table)
    view.block_table[:, 2:].zero_()
    in_place.pad(live.num_reqs, live.num_tokens)
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "positions"):
        assert torch.equal(getattr(in_place.batch, name), getattr(loaded.batch, name)), name


def test_static_batch_pad_checks_its_sizes():
    """pad's num_tokens must cover the live requests' tokens (a smaller one left real tokens
    with slot -1 and position 0, still valid); sizes are ints."""
    static = StaticBatch(5, 8, 3)
    static.load(live_batch())
    live = live_batch()
    with pytest.raises(ValueError, match=rf"num_tokens must be at least query_start_loc\["
                                         rf"num_reqs={live.num_reqs}\] = {live.num_tokens}, "
                                         rf".* got 1"):
        static.pad(live.num_reqs, 1)
    with pytest.raises(TypeError, match="`num_reqs` must be an int, got float"):
        static.pad(2.5, live.num_tokens)
    static.pad(live.num_reqs, live.num_tokens)


@pytest.mark.parametrize("ratio, next_n", [(1, 2), (2, 2), (4, 4), (4, 1)])
def test_warmup_batch_writes_no_k(ratio, next_n):
    """The runner's warm-up batch gives every token slot -1, block-derived slots too
    (compressed states, the kpool tail), so capture never overwrites an engine's K."""
    cfg = dsa.IndexerConfig(max_num_reqs=4, max_num_batched_tokens=16, max_model_len=1024,
                            next_n=next_n, topk=64, num_blocks=64, compress_ratio=ratio,
                            kpool=8)
    static = StaticBatch(4, 4 * next_n, table_width(cfg))
    _fill_warmup_batch(static, next_n)
    batch = static.batch
    _, slots = indexer_writes(cfg, batch)
    kpool = torch.ops.dsa.kpool_tail_slot_mapping(batch.query_start_loc, batch.block_table,
                                                  batch.positions, cfg.kpool)
    assert (slots == -1).all() and (kpool == -1).all()


def test_decode_graph_runner_needs_cuda_and_a_table_width():
    cfg = dsa.IndexerConfig(max_num_reqs=4, max_num_batched_tokens=8, max_model_len=256)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        DecodeGraphRunner(lambda b: b.seq_lens, cfg, table_width=4, device="cpu")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"sizes": (2, 8)}, "bucket 8 takes more requests than IndexerConfig.max_num_reqs=4"),
    ({"table_width": 3}, r"at least IndexerConfig.block_table_width = 4, got 3"),
    ({"buffers": StaticBatch(4, 8, 2)}, r"at least IndexerConfig.block_table_width = 4, got 2"),
])
def test_decode_graph_runner_checks_its_settings_before_capture(kwargs, match):
    """Settings no capture could take fail at construction (checked before the device)."""
    cfg = dsa.IndexerConfig(max_num_reqs=4, max_num_batched_tokens=8, max_model_len=256)
    with pytest.raises(ValueError, match=match):
        DecodeGraphRunner(lambda b: b.seq_lens, cfg, **{"table_width": 4, **kwargs},
                          device="cuda")


def test_compiled_step_over_bucket_prefixes_matches_eager():
    """What ``DecodeGraphRunner`` captures: each bucket's step reads a prefix of one set of
    buffers, which ``load`` fills; no recompile within a bucket, equal to eager."""
    torch._dynamo.reset()
    cfg = dsa.IndexerConfig(max_num_reqs=4, max_num_batched_tokens=8, max_model_len=256,
                            next_n=2, topk=16, num_blocks=4 * 4)
    width = table_width(cfg)
    layer = dsa.Indexer(cfg, hidden_size=32, q_lora_rank=16, dtype=torch.float32)
    eager_layer = copy.deepcopy(layer)

    def step(batch, hidden, q_latent):
        return layer(hidden, q_latent, batch.positions, dsa.build_decode_metadata(cfg, batch))

    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend="aot_eager")
    buffers = StaticBatch(4, 8, width, token_inputs={"hidden": ((32,), torch.float32),
                                                     "q_latent": ((16,), torch.float32)})
    rng = random.Random(0)
    for bucket, num_reqs in [(4, 4), (2, 1), (4, 3), (2, 2), (4, 1)]:
        static = buffers.prefix(bucket, bucket * cfg.next_n)
        live = random_decode_batch(rng, cfg, num_reqs)
        x = {"hidden": torch.randn(live.num_tokens, 32), "q_latent": torch.randn(live.num_tokens,
                                                                                16)}
        static.load(live, **x)
        stance = "fail_on_recompile" if num_reqs in (3, 2, 1) and bucket == 4 else "default"
        with torch.compiler.set_stance(stance):
            got = compiled(static.batch, **static.inputs)
        padded = pad_batch(live, bucket, bucket * cfg.next_n, width)
        padded_x = {k: torch.cat([v, v.new_zeros(padded.num_tokens - len(v), v.shape[1])])
                    for k, v in x.items()}
        meta = dsa.build_decode_metadata(cfg, padded)
        want = eager_layer(padded_x["hidden"], padded_x["q_latent"], padded.positions, meta)
        assert torch.equal(got.indices, want.indices) and torch.equal(got.slots, want.slots)
