"""Decode metadata ops (design §4) against the loop reference, on both faces; and
cap_context_lens, which keeps decode lengths inside the block table and the cache."""

import pytest
import reference_meta as ref
import torch
from faces import FACE_NAMES, face_tests, i32, opcheck_test, run_op, strided_rows, validation_test
from hypothesis import given
from hypothesis import strategies as st
from strategies import BatchSpec, batches, decode_batches

from dsa.ops.decode_meta import TABLE_SCAN_COLS

# --- design worked example ----------------------------------------------------------------


@pytest.mark.parametrize("face", FACE_NAMES)
def test_spec_per_token_lengths(face):
    qsl, seq_lens = i32([0, 3, 4, 8, 8]), i32([10, 7, 12, 0])
    expected = [8, 9, 10, 7, 9, 10, 11, 12]
    assert ref.decode_token_lens(qsl.tolist(), seq_lens.tolist(), 8) == expected
    assert run_op(face, "decode_token_lens", qsl, seq_lens, 10).tolist() == [*expected, 0, 0]


@pytest.mark.parametrize("face", FACE_NAMES)
def test_native_lens_of_padding_rows_are_zero_not_negative(face):
    out = run_op(face, "native_decode_lens", i32([0, 1, 5]), 3)
    assert out.tolist() == [[0, 0, 0], [0, 0, 1], [3, 4, 5]]


@given(b=batches())
def test_batch_strategy_contract(b):
    """The shared strategy: decodes, prefills, padding in that order; every request's
    blocks in its table row; distinct block ids; capacity covers the real tokens."""
    kinds = [0 if q == 0 else 1 if q <= b.next_n else 2 for q in b.query_lens]
    assert kinds == [1] * b.num_decodes + [2] * b.num_prefills + [0] * kinds.count(0)
    assert all(s == 0 for q, s in zip(b.query_lens, b.seq_lens) if q == 0)
    assert all(s >= q and -(-s // b.block_size) <= b.width
               for q, s in zip(b.query_lens, b.seq_lens))
    ids = [i for row in b.block_table for i in row]
    assert len(set(ids)) == len(ids) == b.num_reqs * b.width
    assert b.num_tokens >= b.num_real_tokens
    t = b.tensors()
    assert t.block_table.shape == (b.num_reqs, b.width)
    assert t.slot_mapping.shape == t.positions.shape == (b.num_tokens,)


# --- properties against the reference ------------------------------------------------------


def check_decode_token_lens(face: str, b: BatchSpec) -> None:
    t = b.tensors()
    out = run_op(face, "decode_token_lens", t.query_start_loc, t.seq_lens, b.num_tokens)
    assert out.dtype == torch.int32
    assert out.tolist() == ref.decode_token_lens(b.query_start_loc, b.seq_lens, b.num_tokens)


def check_native_decode_lens(face: str, b: BatchSpec) -> None:
    out = run_op(face, "native_decode_lens", b.tensors().seq_lens, b.next_n)
    assert out.dtype == torch.int32
    assert out.tolist() == ref.native_decode_lens(b.seq_lens, b.next_n)
    # Right-aligned: slot next_n - d + i of request r has token i's true length.
    flat = ref.decode_token_lens(b.query_start_loc, b.seq_lens, b.num_real_tokens)
    packed = ref.pack_decode_rows(flat, b.query_start_loc, b.next_n, None)
    for row, lens in zip(packed, out.tolist()):
        assert all(p is None or p == n for p, n in zip(row, lens))


def check_expand_block_table(face: str, b: BatchSpec, strided: bool) -> None:
    t = b.tensors()
    table = strided_rows(t.block_table) if strided else t.block_table
    out = run_op(face, "expand_block_table", t.query_start_loc, table, b.num_tokens)
    assert out.dtype == torch.int32 and out.shape == (b.num_tokens, b.width)
    assert out.tolist() == ref.expand_block_table(b.query_start_loc, b.block_table,
                                                  b.num_tokens, b.width)


def check_decode_row_requests(face: str, b: BatchSpec) -> None:
    out = run_op(face, "decode_row_requests", b.tensors().query_start_loc, b.num_tokens)
    assert out.dtype == torch.int32
    assert out.tolist() == ref.decode_row_requests(b.query_start_loc, b.num_tokens)


SMALL = {"b": decode_batches(max_reqs=3)}
test_decode_token_lens_cpu, test_decode_token_lens_kernel = face_tests(
    check_decode_token_lens, {"b": decode_batches(max_reqs=6)}, SMALL)
test_native_decode_lens_cpu, test_native_decode_lens_kernel = face_tests(
    check_native_decode_lens, {"b": decode_batches(max_reqs=6)}, SMALL)
test_expand_block_table_cpu, test_expand_block_table_kernel = face_tests(
    check_expand_block_table, {"b": decode_batches(max_reqs=6), "strided": st.booleans()},
    {"b": decode_batches(max_reqs=3, max_context=8), "strided": st.booleans()})
test_decode_row_requests_cpu, test_decode_row_requests_kernel = face_tests(
    check_decode_row_requests, {"b": decode_batches(max_reqs=6)}, SMALL)


@pytest.mark.parametrize("face", FACE_NAMES)
def test_empty_batch(face):
    qsl, empty = i32([0]), i32([])
    assert run_op(face, "decode_token_lens", qsl, empty, 3).tolist() == [0, 0, 0]
    assert run_op(face, "native_decode_lens", empty, 2).shape == (0, 2)
    table = torch.zeros((0, 4), dtype=torch.int32)
    assert run_op(face, "expand_block_table", qsl, table, 2).tolist() == [[0] * 4] * 2
    assert run_op(face, "decode_row_requests", qsl, 3).tolist() == [0, 1, 2]
    out = run_op(face, "cap_context_lens", torch.zeros((0, 2), dtype=torch.int32), table, 4,
                 16, 64)
    assert out.shape == (0, 2)


# --- cap_context_lens ----------------------------------------------------------------------

# block entries whose slots would overflow int32
HUGE = (2**30, 2**31 - 1)


@st.composite
def cap_cases(draw: st.DrawFn, max_rows: int = 5, max_width: int = 6):
    """(context_lens [R][N], table [R][W], num_blocks, block_size, max_context_len,
    strided): entries inside the cache, -1, at or past ``num_blocks`` and huge; lengths
    negative, within and past the table and ``max_context_len``."""
    rows, next_n = draw(st.integers(0, max_rows)), draw(st.integers(1, 4))
    width, block_size = draw(st.integers(0, max_width)), draw(st.sampled_from([1, 4, 16]))
    num_blocks = draw(st.integers(0, 20))
    entry = st.one_of(st.integers(0, max(num_blocks - 1, 0)), st.integers(-2, num_blocks + 3),
                      st.sampled_from(HUGE))
    table = draw(st.lists(st.lists(entry, min_size=width, max_size=width), min_size=rows,
                          max_size=rows))
    span = (width + 2) * block_size
    lens = draw(st.lists(st.lists(st.integers(-3, span), min_size=next_n, max_size=next_n),
                         min_size=rows, max_size=rows))
    max_context_len = draw(st.integers(0, span))
    return lens, table, num_blocks, block_size, max_context_len, draw(st.booleans())


def check_cap_context_lens(face: str, case) -> None:
    lens, table, num_blocks, block_size, max_context_len, strided = case
    context_lens = i32(lens).reshape(len(lens), -1 if lens else 1)
    t = i32(table).reshape(len(table), -1 if table else 1)
    out = run_op(face, "cap_context_lens", context_lens, strided_rows(t) if strided else t,
                 num_blocks, block_size, max_context_len)
    assert out.dtype == torch.int32 and out.shape == context_lens.shape
    assert out.tolist() == ref.cap_context_lens(lens, table, num_blocks, block_size,
                                                max_context_len)


test_cap_context_lens_cpu, test_cap_context_lens_kernel = face_tests(
    check_cap_context_lens, {"case": cap_cases()}, {"case": cap_cases(max_rows=3)})


@pytest.mark.parametrize("face", FACE_NAMES)
def test_cap_context_lens_worked(face):
    """Block size 16, 8 blocks, logits width 100. Row 0: column 1 points past the cache, so
    at most 16 keys. Row 1: -1 at column 2 (32 keys); its lengths of 0 and -5 stay 0.
    Row 2: the huge entry at column 3 is past what its longest length (40) needs: only the
    width 100 cuts. Row 3: a table of 4 columns holds 64 keys at most."""
    lens = i32([[10, 90], [0, -5], [40, 33], [70, 99]])
    table = i32([[0, 8, 1, 2], [3, 4, -1, 5], [6, 7, 0, 2**30], [1, 2, 3, 4]])
    out = run_op(face, "cap_context_lens", lens, table, 8, 16, 100)
    assert out.tolist() == [[10, 16], [0, 0], [40, 33], [64, 64]]
    # an empty cache holds nothing; a width of 0 keeps no key
    assert (run_op(face, "cap_context_lens", lens, table, 0, 16, 100) == 0).all()
    assert (run_op(face, "cap_context_lens", lens, table, 8, 16, 0) == 0).all()


@pytest.mark.parametrize("face", FACE_NAMES)
def test_cap_context_lens_wide_table(face):
    """Tables wider than one step of the kernel's scan (TABLE_SCAN_COLS entries): an
    invalid entry in a later step still cuts the length, one past the longest length's
    blocks does not."""
    width = TABLE_SCAN_COLS + 300
    table = torch.arange(width, dtype=torch.int32).repeat(3, 1)
    table[0, TABLE_SCAN_COLS + 100] = -1
    table[1, TABLE_SCAN_COLS + 250] = width
    table[2, TABLE_SCAN_COLS + 200] = -1
    lens = i32([[width], [width - 1], [TABLE_SCAN_COLS + 150]])
    out = run_op(face, "cap_context_lens", lens, table, width, 1, width)
    assert out.view(-1).tolist() == [TABLE_SCAN_COLS + 100, TABLE_SCAN_COLS + 250,
                                     TABLE_SCAN_COLS + 150]


@pytest.mark.parametrize("face", FACE_NAMES)
@pytest.mark.parametrize("rows", [0, 2])
def test_cap_context_lens_table_without_columns(face, rows):
    """No column: every length needing a key is cut to 0."""
    lens = i32([[0, 3]] * rows).reshape(rows, 2)
    out = run_op(face, "cap_context_lens", lens, torch.zeros(rows, 0, dtype=torch.int32), 4,
                 16, 64)
    assert out.tolist() == [[0, 0]] * rows


# --- opcheck and validation ----------------------------------------------------------------

QSL, SEQ, TABLE = i32([0, 2, 3, 3]), i32([5, 1, 0]), i32([[4, 5], [6, 7], [8, 9]])

test_opcheck = opcheck_test([
    ("decode_token_lens", (QSL, SEQ, 5)),
    ("decode_token_lens", (i32([0]), i32([]), 2)),
    ("native_decode_lens", (SEQ, 2)),
    ("native_decode_lens", (i32([7]), 1)),
    ("expand_block_table", (QSL, TABLE, 5)),
    ("expand_block_table", (QSL, strided_rows(TABLE), 3)),
    ("decode_row_requests", (QSL, 6)),
    ("decode_row_requests", (i32([0]), 0)),
    ("cap_context_lens", (i32([[5, 40], [0, -2], [33, 31]]), TABLE, 8, 16, 36)),
    ("cap_context_lens", (i32([[5, 40], [0, -2], [33, 31]]), strided_rows(TABLE), 5, 4, 10)),
])

test_validation_errors = validation_test([
    ("decode_token_lens", (QSL.long(), SEQ, 4), TypeError, "`query_start_loc` must be torch.int32"),
    ("decode_token_lens", (QSL.view(1, 4), SEQ, 4), ValueError,
     "`query_start_loc` must have 1 dimension"),
    ("decode_token_lens", (QSL, SEQ[:2], 4), ValueError, "`seq_lens` must have size 3"),
    ("decode_token_lens", (QSL, SEQ, -1), ValueError, "`num_tokens` must be >= 0"),
    ("native_decode_lens", (SEQ.float(), 2), TypeError, "`seq_lens` must be torch.int32"),
    ("native_decode_lens", (SEQ.view(3, 1), 2), ValueError, "`seq_lens` must have 1 dim"),
    ("native_decode_lens", (SEQ, 0), ValueError, "`next_n` must be >= 1"),
    ("expand_block_table", (QSL, TABLE.long(), 4), TypeError, "`block_table` must be torch.int32"),
    ("expand_block_table", (QSL, TABLE[0], 4), ValueError, "`block_table` must have 2 dim"),
    ("expand_block_table", (QSL, TABLE[:2], 4), ValueError, "`block_table` must have size 3"),
    ("expand_block_table", (QSL, TABLE.t(), 4), ValueError, "must have size 3"),
    ("expand_block_table", (QSL, i32([[1, 2, 3, 4]] * 3)[:, ::2], 4), ValueError,
     r"stride\(1\) == 1"),
    ("expand_block_table", (QSL, TABLE, -2), ValueError, "`num_tokens` must be >= 0"),
    ("decode_row_requests", (i32([]), 4), ValueError, "num_reqs \\+ 1 >= 1 entries"),
    ("decode_row_requests", (QSL, -1), ValueError, "`num_tokens` must be >= 0"),
    ("cap_context_lens", (SEQ.view(3, 1).long(), TABLE, 8, 16, 64), TypeError,
     "`context_lens` must be torch.int32"),
    ("cap_context_lens", (SEQ, TABLE, 8, 16, 64), ValueError, "`context_lens` must have 2 dim"),
    ("cap_context_lens", (i32([[1, 2, 3], [4, 5, 6]]).t(), TABLE, 8, 16, 64), ValueError,
     "`context_lens` must be contiguous"),
    ("cap_context_lens", (SEQ.view(3, 1), TABLE[:2], 8, 16, 64), ValueError,
     "one row per row of `context_lens`"),
    ("cap_context_lens", (SEQ.view(3, 1), TABLE.long(), 8, 16, 64), TypeError,
     "`block_table` must be torch.int32"),
    ("cap_context_lens", (SEQ.view(3, 1), i32([[1, 2, 3, 4]] * 3)[:, ::2], 8, 16, 64),
     ValueError, r"stride\(1\) == 1"),
    ("cap_context_lens", (SEQ.view(3, 1), TABLE, -1, 16, 64), ValueError,
     "`num_blocks` must be >= 0"),
    ("cap_context_lens", (SEQ.view(3, 1), TABLE, 8, 0, 64), ValueError,
     "`block_size` must be >= 1"),
    ("cap_context_lens", (SEQ.view(3, 1), TABLE, 8, 16, -1), ValueError,
     "`max_context_len` must be >= 0"),
])
