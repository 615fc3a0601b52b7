"""dsa.graphs pieces that need no GPU: capture sizes, buckets, static batches and padding."""

import pytest
import torch

from dsa.graphs import StaticBatch, bucket_for, capture_sizes, pad_batch
from dsa.meta.batch import Batch


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
    with pytest.raises(ValueError, match="max_num_reqs and step must be >= 1"):
        capture_sizes(0)


def test_bucket_for():
    sizes = (1, 2, 4, 8)
    assert [bucket_for(n, sizes) for n in (0, 1, 3, 4, 5, 8)] == [1, 1, 4, 4, 8, 8]
    with pytest.raises(ValueError, match="9 requests exceed the largest capture size 8"):
        bucket_for(9, sizes)


def test_pad_batch_pads_requests_tokens_and_table():
    padded = pad_batch(live_batch(), num_reqs=5, num_tokens=8, table_width=3)
    assert padded.query_start_loc.tolist() == [0, 2, 3, 5, 5, 5]
    assert padded.seq_lens.tolist() == [10, 7, 12, 0, 0]
    assert padded.block_table.tolist() == [[4, 5, 0], [6, 7, 0], [8, 9, 0], [0, 0, 0],
                                           [0, 0, 0]]
    assert padded.slot_mapping.tolist() == [264, 265, 390, 523, 524, -1, -1, -1]
    assert padded.positions.tolist() == [8, 9, 6, 10, 11, 0, 0, 0]


def test_static_batch_load_keeps_addresses_and_clears_stale_rows():
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
    assert static.inputs["hidden"][:, 0].tolist() == [2.0, 0, 0, 0, 0, 0]
    assert [t.data_ptr() for t in (static.batch.seq_lens, static.inputs["hidden"])] == addresses


def test_static_batch_rejects_oversized_batches_and_wrong_inputs():
    static = StaticBatch(2, 4, 2, token_inputs={"hidden": ((3,), torch.float32)})
    with pytest.raises(ValueError, match="3 requests, 5 tokens and block-table width 2 does "
                                         "not fit capacity 2 requests, 4 tokens"):
        static.load(live_batch(), hidden=torch.ones(5, 3))
    small = pad_batch(live_batch(), 3, 5)
    with pytest.raises(ValueError, match=r"expected token inputs \['hidden'\], got \[\]"):
        StaticBatch(3, 5, 2, token_inputs={"hidden": ((3,), torch.float32)}).load(small)
