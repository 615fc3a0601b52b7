"""dsa::indices_to_slots against the loop reference of SPEC §3's slot transform."""

from __future__ import annotations

import numpy as np
import pytest
import reference_compute as ref
import torch
from faces import KERNEL_MARK, run_op
from hypothesis import given, settings
from hypothesis import strategies as st

FACE_NAMES = ("cpu", pytest.param("kernel", marks=KERNEL_MARK))


def slots_case(gen, rows, k, num_reqs, width, block_size):
    """Indices with -1, other negatives and ones past the table; block tables with -1
    entries; row requests outside [0, num_reqs)."""
    indices = torch.randint(-3, block_size * (width + 1) + 1, (rows, k), generator=gen,
                            dtype=torch.int32)
    indices[torch.rand(rows, k, generator=gen) < 0.2] = -1
    table = torch.randint(-1, 50, (num_reqs, width), generator=gen, dtype=torch.int32)
    row_requests = torch.randint(-1, num_reqs + 2, (rows,), generator=gen, dtype=torch.int32)
    return indices, table, row_requests


@settings(max_examples=40)
@given(
    rows=st.integers(0, 6),
    k=st.integers(1, 40),
    num_reqs=st.integers(0, 4),
    width=st.integers(0, 5),
    block_size=st.sampled_from([1, 16, 64]),
    seed=st.integers(0, 2**31),
)
@pytest.mark.parametrize("face", FACE_NAMES)
def test_indices_to_slots_matches_reference(face, rows, k, num_reqs, width, block_size, seed):
    gen = torch.Generator().manual_seed(seed)
    indices, table, row_requests = slots_case(gen, rows, k, num_reqs, width, block_size)
    with ref.poisoned_empty():
        out = run_op(face, "indices_to_slots", indices, table, row_requests, block_size)
    assert out.dtype == torch.int32 and out.shape == indices.shape
    want = ref.indices_to_slots(indices.numpy(), table.numpy(), row_requests.numpy(), block_size)
    np.testing.assert_array_equal(out.numpy(), want)


def test_indices_to_slots_example():
    table = torch.tensor([[3, 7], [5, -1]], dtype=torch.int32)
    indices = torch.tensor([[0, 65, -1, 130], [1, 64, 63, 2]], dtype=torch.int32)
    requests = torch.tensor([0, 1], dtype=torch.int32)
    want = torch.tensor([[192, 449, -1, -1], [321, -1, 383, 322]], dtype=torch.int32)
    for face in ("cpu", "kernel"):
        assert torch.equal(run_op(face, "indices_to_slots", indices, table, requests, 64), want)


def test_indices_to_slots_strided_block_table():
    gen = torch.Generator().manual_seed(1)
    indices, table, row_requests = slots_case(gen, 4, 9, 3, 8, 4)
    narrow = table[:, :5]
    want = run_op("cpu", "indices_to_slots", indices, narrow.contiguous(), row_requests, 4)
    for face in ("cpu", "kernel"):
        assert torch.equal(run_op(face, "indices_to_slots", indices, narrow, row_requests, 4),
                           want)


def test_indices_to_slots_opcheck():
    gen = torch.Generator().manual_seed(2)
    indices, table, row_requests = slots_case(gen, 3, 7, 2, 3, 16)
    torch.library.opcheck(torch.ops.dsa.indices_to_slots.default,
                          (indices, table, row_requests, 16))


@pytest.mark.parametrize(
    ("indices", "table", "requests", "block_size", "error", "match"),
    [
        (torch.zeros(2, 3, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.int32),
         torch.zeros(2, dtype=torch.int32), 64, TypeError, "`indices` must be torch.int32"),
        (torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
         torch.zeros(2, dtype=torch.int32), 64, ValueError, "`block_table` must have 2"),
        (torch.zeros(2, 3, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32),
         torch.zeros(3, dtype=torch.int32), 64, ValueError, r"`row_requests` must have size 2"),
        (torch.zeros(2, 3, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32),
         torch.zeros(2, dtype=torch.int32), 0, ValueError, "`block_size` must be >= 1"),
        (torch.zeros(3, 2, dtype=torch.int32).T, torch.zeros(1, 2, dtype=torch.int32),
         torch.zeros(2, dtype=torch.int32), 64, ValueError, "`indices` must be contiguous"),
    ],
)
def test_indices_to_slots_validation(indices, table, requests, block_size, error, match):
    with pytest.raises(error, match=match):
        torch.ops.dsa.indices_to_slots(indices, table, requests, block_size)
