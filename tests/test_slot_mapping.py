"""compressed_slot_mapping and kpool_tail_slot_mapping (design §7) against the reference."""

import pytest
import reference_meta as ref
import torch
from faces import FACE_NAMES, face_tests, i32, opcheck_test, run_op, strided_rows, validation_test
from hypothesis import given
from hypothesis import strategies as st
from strategies import BatchSpec, batches, dcp_configs


@st.composite
def tables(draw: st.DrawFn, b: BatchSpec) -> tuple[list[list[int]], int]:
    """(table, width): the batch's block table, maybe narrowed (so some blocks fall past
    the width) and with some entries -1 (unallocated)."""
    width = draw(st.integers(0, b.width)) if draw(st.booleans()) else b.width
    holes = draw(st.sets(st.integers(0, max(b.num_reqs * width - 1, 0)), max_size=3))
    table = [[-1 if r * width + c in holes else b.block_table[r][c] for c in range(width)]
             for r in range(b.num_reqs)]
    return table, width


def table_tensor(table: list[list[int]], width: int, strided: bool) -> torch.Tensor:
    t = i32(table).reshape(len(table), width)
    return strided_rows(t) if strided else t


# --- compressed_slot_mapping ---------------------------------------------------------------


@st.composite
def compressed_cases(draw: st.DrawFn, max_decodes: int = 4, max_prefills: int = 2):
    b = draw(batches(max_decodes=max_decodes, max_prefills=max_prefills))
    return (b, draw(tables(b)), draw(st.sampled_from([1, 2, 4])), draw(dcp_configs()),
            draw(st.booleans()))


def check_compressed(face: str, case) -> None:
    b, (table, width), ratio, (world, rank), strided = case
    t = b.tensors()
    out = run_op(face, "compressed_slot_mapping", t.query_start_loc, t.seq_lens,
                 table_tensor(table, width, strided), b.num_tokens, b.block_size, ratio,
                 world, rank, 1)
    assert out.dtype == torch.int64 and out.shape == (b.num_tokens,)
    assert out.tolist() == ref.compressed_slot_mapping(
        b.query_start_loc, b.seq_lens, table, b.num_tokens, b.block_size, ratio, world, rank)


test_compressed_slot_mapping_cpu, test_compressed_slot_mapping_kernel = face_tests(
    check_compressed, {"case": compressed_cases()},
    {"case": compressed_cases(max_decodes=2, max_prefills=1)})


@pytest.mark.parametrize("face", FACE_NAMES)
def test_compressed_no_dcp_worked(face):
    """bs = 2, R = 2: request 0 (seq 7, 3 queries) sits at positions 4..6 and writes
    states 2 (pos 5) at block_table[0][1] * 2 + 0; request 1 (seq 4, 4 queries) writes
    states 0, 1 (pos 1, 3) into block 9; the padding token writes nothing."""
    out = run_op(face, "compressed_slot_mapping", i32([0, 3, 7]), i32([7, 4]),
                 i32([[5, 6], [9, 8]]), 8, 2, 2, 1, 0, 1)
    assert out.tolist() == [-1, 12, -1, -1, 18, -1, 19, -1]


@pytest.mark.parametrize("face", FACE_NAMES)
def test_compressed_every_token_writes_with_ratio_one(face):
    out = run_op(face, "compressed_slot_mapping", i32([0, 4]), i32([4]), i32([[3, 7]]), 4,
                 2, 1, 1, 0, 1)
    assert out.tolist() == [6, 7, 14, 15]


@pytest.mark.parametrize("face", FACE_NAMES)
def test_compressed_blocks_past_a_narrow_table_write_nothing(face):
    """bs = 2, R = 1, a table of one column (rows strided, block 1 past the width): states
    2 and 3 fall in column 1, past the table, and write nothing."""
    out = run_op(face, "compressed_slot_mapping", i32([0, 4]), i32([4]),
                 strided_rows(i32([[3]])), 4, 2, 1, 1, 0, 1)
    assert out.tolist() == [6, 7, -1, -1]


@pytest.mark.parametrize("face", FACE_NAMES)
def test_compressed_negative_positions_write_nothing(face):
    """seq_len < query_len (malformed): the first tokens have negative positions."""
    out = run_op(face, "compressed_slot_mapping", i32([0, 4]), i32([2]), i32([[3]]), 4, 4, 1,
                 1, 0, 1)
    assert out.tolist() == [-1, -1, 12, 13]


@given(num_states=st.integers(0, 40), block_size=st.integers(1, 4),
       dcp=dcp_configs((1, 2, 3, 4)), interleave=st.integers(1, 3))
def test_reference_dcp_placement_is_the_brute_force_one(num_states, block_size, dcp,
                                                        interleave):
    """The design's slot formula puts each state where dealing the states out does, and every
    state lands on exactly one rank."""
    world, rank = dcp
    row = [10 + i for i in range(-(-num_states // block_size) + 1)]
    slots = ref.dcp_state_slots(num_states, row, block_size, world, rank, interleave)
    for c in range(num_states):
        got = ref.compressed_slot(c, row, block_size, 1, world, rank, interleave)
        assert got == slots.get(c, -1)
    owners = [sum(ref.compressed_slot(c, row, block_size, 1, world, k, interleave) >= 0
                  for k in range(world)) for c in range(num_states)]
    assert all(n == 1 for n in owners)


# --- kpool_tail_slot_mapping ---------------------------------------------------------------


@st.composite
def kpool_cases(draw: st.DrawFn, max_decodes: int = 4, max_prefills: int = 2):
    b = draw(batches(max_decodes=max_decodes, max_prefills=max_prefills))
    if draw(st.booleans()):
        positions = b.positions
    else:  # any positions, negative ones included
        positions = draw(st.lists(st.integers(-40, 100), min_size=b.num_tokens,
                                  max_size=b.num_tokens))
    table = [list(row) for row in b.block_table]
    if table:
        for r in draw(st.sets(st.integers(0, b.num_reqs - 1), max_size=2)):
            table[r][0] = -1
    return (b, table, positions, draw(st.sampled_from([torch.int32, torch.int64])),
            draw(st.integers(1, 8)), draw(st.booleans()))


def check_kpool(face: str, case) -> None:
    b, table, positions, dtype, kpool, strided = case
    out = run_op(face, "kpool_tail_slot_mapping", b.tensors().query_start_loc,
                 table_tensor(table, b.width, strided),
                 torch.tensor(positions, dtype=dtype), kpool)
    assert out.dtype == torch.int64 and out.shape == (b.num_tokens,)
    assert out.tolist() == ref.kpool_tail_slot_mapping(b.query_start_loc, table, positions,
                                                       kpool)


test_kpool_tail_slot_mapping_cpu, test_kpool_tail_slot_mapping_kernel = face_tests(
    check_kpool, {"case": kpool_cases()}, {"case": kpool_cases(max_decodes=2, max_prefills=1)})


@pytest.mark.parametrize("face", FACE_NAMES)
def test_kpool_worked(face):
    out = run_op(face, "kpool_tail_slot_mapping", i32([0, 2, 3]), i32([[4, 9], [-1, 2]]),
                 torch.tensor([6, 7, 7, 3]), 4)
    assert out.tolist() == [4 * 4 + 2, 4 * 4 + 3, -1, -1]
    # a negative position writes nothing (it used to wrap into a live slot of the block)
    out = run_op(face, "kpool_tail_slot_mapping", i32([0, 3]), i32([[2]]),
                 torch.tensor([-1, -5, 5], dtype=torch.int32), 4)
    assert out.tolist() == [-1, -1, 2 * 4 + 1]


# --- opcheck and validation ----------------------------------------------------------------

QSL, SEQ, TABLE = i32([0, 2, 5, 5]), i32([6, 5, 0]), i32([[4, 5, 0], [6, 7, 1], [8, 9, 2]])
POS = torch.arange(7)


test_opcheck = opcheck_test([
    ("compressed_slot_mapping", (QSL, SEQ, TABLE, 7, 2, 2, 1, 0, 1)),
    ("compressed_slot_mapping", (QSL, SEQ, strided_rows(TABLE), 6, 1, 1, 2, 1, 1)),
    ("kpool_tail_slot_mapping", (QSL, TABLE, POS, 3)),
    ("kpool_tail_slot_mapping", (QSL, strided_rows(TABLE), POS.int() - 3, 5)),
])


def test_compressed_interleave_defaults_to_one():
    args = (QSL, SEQ, TABLE, 7, 2, 2, 2, 1)
    assert torch.equal(torch.ops.dsa.compressed_slot_mapping(*args),
                       torch.ops.dsa.compressed_slot_mapping(*args, 1))


CSM = "compressed_slot_mapping"
test_validation_errors = validation_test([
    (CSM, (QSL, SEQ.long(), TABLE, 7, 2, 2, 1, 0, 1), TypeError, "`seq_lens` must be torch.int32"),
    (CSM, (QSL, SEQ, TABLE[:2], 7, 2, 2, 1, 0, 1), ValueError, "`block_table` must have size 3"),
    (CSM, (QSL, SEQ[:1], TABLE, 7, 2, 2, 1, 0, 1), ValueError, "`seq_lens` must have size 3"),
    (CSM, (QSL, SEQ, TABLE[:, ::2], 7, 2, 2, 1, 0, 1), ValueError, r"stride\(1\) == 1"),
    (CSM, (QSL, SEQ, TABLE, -1, 2, 2, 1, 0, 1), ValueError, "`num_tokens` must be >= 0"),
    (CSM, (QSL, SEQ, TABLE, 7, 0, 2, 1, 0, 1), ValueError, "`block_size` must be >= 1"),
    (CSM, (QSL, SEQ, TABLE, 7, 2, 0, 1, 0, 1), ValueError, "`compress_ratio` must be >= 1"),
    (CSM, (QSL, SEQ, TABLE, 7, 2, 2, 2, 2, 1), ValueError, "`dcp_rank` must be < dcp_world=2"),
    (CSM, (QSL, SEQ, TABLE, 7, 2, 2, 2, 0, 2), NotImplementedError, "interleave > 1"),
    ("kpool_tail_slot_mapping", (QSL, TABLE, POS.float(), 4), TypeError,
     "`positions` must be torch.int32 or torch.int64"),
    ("kpool_tail_slot_mapping", (QSL, TABLE, POS.view(1, 7), 4), ValueError,
     "`positions` must have 1 dim"),
    ("kpool_tail_slot_mapping", (QSL, TABLE[:, :0], POS, 4), ValueError, "at least 1 column"),
    ("kpool_tail_slot_mapping", (QSL, TABLE, POS, 0), ValueError, "`kpool` must be >= 1"),
    ("kpool_tail_slot_mapping", (QSL.view(2, 2), TABLE, POS, 4), ValueError,
     "`query_start_loc` must have 1 dim"),
])
