"""dsa::indices_to_slots against the loop reference of design §3's slot transform: no slot
ever points outside the cache (block entries outside ``[0, num_blocks)`` give -1)."""

from __future__ import annotations

import numpy as np
import pytest
import reference_compute as ref
import torch
from faces import FACE_NAMES, i32, run_op, strided_rows, validation_test
from hypothesis import given, settings
from hypothesis import strategies as st

# block entries whose slot would overflow int32 (2**30 * 64 = 2**36)
HUGE = (2**30, 2**31 - 1)


def slots_case(gen, rows, k, num_reqs, width, block_size, num_blocks=50):
    """Indices with -1, other negatives and ones past the table; block tables with -1
    entries, entries at and past ``num_blocks`` and huge ones; row requests outside
    [0, num_reqs)."""
    indices = torch.randint(-3, block_size * (width + 1) + 1, (rows, k), generator=gen,
                            dtype=torch.int32)
    indices[torch.rand(rows, k, generator=gen) < 0.2] = -1
    table = torch.randint(-1, num_blocks + 3, (num_reqs, width), generator=gen,
                          dtype=torch.int32)
    huge = torch.tensor(HUGE, dtype=torch.int32)[torch.randint(0, len(HUGE), table.shape,
                                                               generator=gen)]
    table = torch.where(torch.rand(table.shape, generator=gen) < 0.1, huge, table)
    row_requests = torch.randint(-3, num_reqs + 2, (rows,), generator=gen, dtype=torch.int32)
    return indices, table, row_requests


@settings(max_examples=40)
@given(
    rows=st.integers(0, 6),
    k=st.integers(1, 40),
    num_reqs=st.integers(0, 4),
    width=st.integers(0, 5),
    block_size=st.sampled_from([1, 16, 64]),
    num_blocks=st.integers(0, 60),
    seed=st.integers(0, 2**31),
)
@pytest.mark.parametrize("face", FACE_NAMES)
def test_indices_to_slots_matches_reference(face, rows, k, num_reqs, width, block_size,
                                            num_blocks, seed):
    gen = torch.Generator().manual_seed(seed)
    indices, table, row_requests = slots_case(gen, rows, k, num_reqs, width, block_size,
                                              num_blocks)
    with ref.poisoned_empty():
        out = run_op(face, "indices_to_slots", indices, table, row_requests, block_size,
                     num_blocks)
    assert out.dtype == torch.int32 and out.shape == indices.shape
    want = ref.indices_to_slots(indices.numpy(), table.numpy(), row_requests.numpy(),
                                block_size, num_blocks)
    np.testing.assert_array_equal(out.numpy(), want)


@pytest.mark.parametrize("face", FACE_NAMES)
def test_indices_to_slots_example(face):
    table = i32([[3, 7], [5, -1]])
    indices = i32([[0, 65, -1, 130], [1, 64, 63, 2]])
    requests = i32([0, 1])
    want = i32([[192, 449, -1, -1], [321, -1, 383, 322]])
    assert torch.equal(run_op(face, "indices_to_slots", indices, table, requests, 64, 8), want)
    # block 7 is outside a cache of 7 blocks; block 5 is inside
    want_7 = i32([[192, -1, -1, -1], [321, -1, 383, 322]])
    assert torch.equal(run_op(face, "indices_to_slots", indices, table, requests, 64, 7),
                       want_7)
    # no block is inside an empty cache
    assert (run_op(face, "indices_to_slots", indices, table, requests, 64, 0) == -1).all()


@pytest.mark.parametrize("face", FACE_NAMES)
def test_indices_past_a_narrow_table_give_minus_one(face):
    """Positions past the table's width have no block (rows strided, block 1 past the
    width, inside the cache): -1, whatever lies beyond the row."""
    table = strided_rows(i32([[3, 7], [5, 2]]))
    indices = i32([[0, 127, 128, 200], [64, 191, 192, 255]])
    want = i32([[192, 511, -1, -1], [128, -1, -1, -1]])
    assert torch.equal(run_op(face, "indices_to_slots", indices, table, i32([0, 1]), 64, 8),
                       want)


@pytest.mark.parametrize("face", FACE_NAMES)
def test_indices_to_slots_huge_block_entries_give_minus_one(face):
    """Entries whose slot would overflow int32 are outside the cache: -1, never a wrapped
    slot."""
    table = i32([[2**30, 3], [2**31 - 1, 8], [1, 2**30 + 1]])
    indices = i32([[0, 63, 64, 127], [5, 64, 70, -1], [0, 63, 64, 65]])
    requests = i32([0, 1, 2])
    out = run_op(face, "indices_to_slots", indices, table, requests, 64, 8)
    assert out.tolist() == [[-1, -1, 192, 255], [-1, -1, -1, -1], [64, 127, -1, -1]]
    # the largest cache whose slots fit int32: 2**31 slots
    out = run_op(face, "indices_to_slots", indices, table, requests, 64, 2**25)
    assert out.tolist() == [[-1, -1, 192, 255], [-1, 512, 518, -1], [64, 127, -1, -1]]


@pytest.mark.parametrize("face", FACE_NAMES)
def test_indices_to_slots_strided_block_table(face):
    gen = torch.Generator().manual_seed(1)
    indices, table, row_requests = slots_case(gen, 4, 9, 3, 8, 4)
    narrow = table[:, :5]
    want = run_op("cpu", "indices_to_slots", indices, narrow.contiguous(), row_requests, 4, 50)
    assert torch.equal(run_op(face, "indices_to_slots", indices, narrow, row_requests, 4, 50),
                       want)


def test_indices_to_slots_opcheck():
    gen = torch.Generator().manual_seed(2)
    indices, table, row_requests = slots_case(gen, 3, 7, 2, 3, 16)
    for num_blocks in (0, 20, 50):
        torch.library.opcheck(torch.ops.dsa.indices_to_slots.default,
                              (indices, table, row_requests, 16, num_blocks))


IDX, TABLE, REQS = torch.zeros(2, 3, dtype=torch.int32), i32([[0, 1]]), i32([0, 0])


test_indices_to_slots_validation = validation_test([
    ((IDX.long(), TABLE, REQS, 64, 4), TypeError, "`indices` must be torch.int32"),
    ((IDX, TABLE[0], REQS, 64, 4), ValueError, "`block_table` must have 2"),
    ((IDX, TABLE, i32([0, 0, 0]), 64, 4), ValueError, r"`row_requests` must have size 2"),
    ((IDX, TABLE, REQS, 0, 4), ValueError, "`block_size` must be >= 1"),
    ((IDX.view(3, 2).T, TABLE, REQS, 64, 4), ValueError, "`indices` must be contiguous"),
    ((IDX, TABLE, REQS, 64, -1), ValueError, "`num_blocks` must be >= 0"),
    ((IDX, TABLE, REQS, 64, 2**25 + 1), ValueError, "slots must fit int32"),
], op="indices_to_slots")


@pytest.mark.parametrize("face", FACE_NAMES)
def test_indices_to_slots_requests_below_minus_one_give_minus_one(face):
    """A row whose request is negative (not only -1) reads no block-table row."""
    table = i32([[3, 7], [5, 2]])
    indices = i32([[0, 65], [1, 64], [2, 127]])
    out = run_op(face, "indices_to_slots", indices, table, i32([-2, -3, 1]), 64, 8)
    assert out.tolist() == [[-1, -1], [-1, -1], [322, 191]]
