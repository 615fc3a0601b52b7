"""compress_block_table, pack_decode_rows, unpack_decode_rows against the reference."""

import math

import pytest
import reference_meta as ref
import torch
from faces import FACE_NAMES, face_tests, i32, opcheck_test, run_op, strided_rows, validation_test
from hypothesis import strategies as st
from strategies import decode_batches

DTYPES = [torch.float8_e4m3fn, torch.float32, torch.bfloat16, torch.int32]
FEATURES = [(), (3,), (2, 2)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_bits(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert torch.equal(bits(out), bits(expected))


def values(rows: list, dtype: torch.dtype, feature: tuple[int, ...]) -> torch.Tensor:
    """Small integers (exact in every dtype, fp8 included) as a ``[len(rows), *feature]``."""
    return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), *feature).to(dtype)


# --- compress_block_table ------------------------------------------------------------------


@st.composite
def block_tables(draw: st.DrawFn, max_rows: int = 4, max_width: int = 9):
    rows, width = draw(st.integers(0, max_rows)), draw(st.integers(0, max_width))
    entries = st.lists(st.integers(-3, 60), min_size=width, max_size=width)
    table = draw(st.lists(entries, min_size=rows, max_size=rows))
    return table, width, draw(st.integers(1, 4)), draw(st.booleans())


def check_compress(face: str, case) -> None:
    table, width, factor, strided = case
    t = i32(table).reshape(len(table), width)
    out = run_op(face, "compress_block_table", strided_rows(t) if strided else t, factor)
    assert out.dtype == torch.int32 and out.shape == (len(table), -(-width // factor))
    assert out.tolist() == ref.compress_block_table(table, factor)


test_compress_block_table_cpu, test_compress_block_table_kernel = face_tests(
    check_compress, {"case": block_tables()})


@pytest.mark.parametrize("face", FACE_NAMES)
def test_compress_block_table_worked(face):
    table = i32([[8, 9, 10, 11, 12], [-1, -1, 4, 5, 7]])
    assert run_op(face, "compress_block_table", table, 2).tolist() == [[4, 5, 6], [-1, 2, 3]]
    out = run_op(face, "compress_block_table", table, 1)
    assert torch.equal(out, table) and out.data_ptr() != table.data_ptr()


# --- pack / unpack -------------------------------------------------------------------------


@st.composite
def pack_cases(draw: st.DrawFn, max_reqs: int = 5):
    """A decode batch, a packing width (maybe narrower than some decode lengths, so their
    first tokens drop), token rows (maybe fewer than query_start_loc claims), dtype."""
    b = draw(decode_batches(max_reqs=max_reqs))
    next_n = draw(st.integers(1, b.next_n))
    num_rows = draw(st.integers(max(b.num_real_tokens - 2, 0), b.num_tokens))
    feature = draw(st.sampled_from(FEATURES))
    rows = [[draw(st.integers(-8, 8)) for _ in range(math.prod(feature))]
            for _ in range(num_rows)]
    return b, next_n, rows, feature, draw(st.sampled_from(DTYPES))


def check_pack(face: str, case) -> None:
    b, next_n, rows, feature, dtype = case
    x = values(rows, dtype, feature)
    out = run_op(face, "pack_decode_rows", x, b.tensors().query_start_loc, next_n)
    packed = ref.pack_decode_rows(rows, b.query_start_loc, next_n, [0] * math.prod(feature))
    flat = [row for slots in packed for row in slots]
    expected = values(flat, dtype, feature).reshape(b.num_reqs, next_n, *feature)
    assert_same_bits(out, expected)


@st.composite
def unpack_cases(draw: st.DrawFn, max_reqs: int = 5):
    """A decode batch, packed rows ``[B, next_n, *feature]`` (next_n maybe narrower than
    some decode lengths), fill value, dtype."""
    b = draw(decode_batches(max_reqs=max_reqs))
    next_n = draw(st.integers(1, b.next_n))
    feature = draw(st.sampled_from(FEATURES))
    flat = [[draw(st.integers(-8, 8)) for _ in range(math.prod(feature))]
            for _ in range(b.num_reqs * next_n)]
    fill = draw(st.sampled_from([-1, 0, 5]))
    return b, next_n, flat, feature, fill, draw(st.sampled_from(DTYPES))


def check_unpack(face: str, case) -> None:
    b, next_n, flat, feature, fill, dtype = case
    y = values(flat, dtype, feature).reshape(b.num_reqs, next_n, *feature)
    out = run_op(face, "unpack_decode_rows", y, b.tensors().query_start_loc, b.num_tokens,
                 fill)
    packed = [flat[r * next_n:(r + 1) * next_n] for r in range(b.num_reqs)]
    rows = ref.unpack_decode_rows(packed, b.query_start_loc, b.num_tokens,
                                  [fill] * math.prod(feature))
    assert_same_bits(out, values(rows, dtype, feature))


test_pack_decode_rows_cpu, test_pack_decode_rows_kernel = face_tests(
    check_pack, {"case": pack_cases()}, {"case": pack_cases(max_reqs=3)})
test_unpack_decode_rows_cpu, test_unpack_decode_rows_kernel = face_tests(
    check_unpack, {"case": unpack_cases()}, {"case": unpack_cases(max_reqs=3)})


@pytest.mark.parametrize("face", FACE_NAMES)
def test_pack_then_unpack_gives_back_the_tokens(face):
    """Decode lengths [2, 1, 3] in next_n = 2 (the 3-token request loses its first token)
    plus one padding row; top-k style int32 rows with fill -1."""
    qsl = i32([0, 2, 3, 6])
    x = torch.arange(7 * 4, dtype=torch.int32).reshape(7, 4)
    packed = run_op(face, "pack_decode_rows", x, qsl, 2)
    assert packed[:, :, 0].tolist() == [[0, 4], [0, 8], [16, 20]]
    out = run_op(face, "unpack_decode_rows", packed, qsl, 7, -1)
    expected = x.clone()
    expected[[3, 6]] = -1
    assert torch.equal(out, expected)


@pytest.mark.parametrize("face", FACE_NAMES)
def test_pack_reads_no_row_past_the_tokens(face):
    """query_start_loc claims 4 tokens, x holds 3 (the first 3 rows of a larger
    allocation): the missing token's slot packs 0, not the row after x."""
    storage = torch.arange(1, 5 * 2 + 1, dtype=torch.int32).reshape(5, 2)
    packed = run_op(face, "pack_decode_rows", storage[:3], i32([0, 2, 4]), 2)
    assert packed.tolist() == [[[1, 2], [3, 4]], [[5, 6], [0, 0]]]


@pytest.mark.parametrize("face", FACE_NAMES)
def test_unpack_fp8_fill_is_cast(face):
    y = torch.full((1, 2, 3), 2.0).to(torch.float8_e4m3fn)
    out = run_op(face, "unpack_decode_rows", y, i32([0, 1]), 2, -1)
    assert out.float().tolist() == [[2.0] * 3, [-1.0] * 3]


# --- opcheck and validation ----------------------------------------------------------------

QSL = i32([0, 2, 3, 3])
X = torch.randn(5, 2, 4).to(torch.bfloat16)


test_opcheck = opcheck_test([
    ("compress_block_table", (i32([[3, 4, -1], [5, 6, 7]]), 2)),
    ("compress_block_table", (strided_rows(i32([[3, 4, -1], [5, 6, 7]])), 1)),
    ("pack_decode_rows", (X, QSL, 2)),
    ("pack_decode_rows", (torch.arange(4, dtype=torch.int32), QSL, 1)),
    ("unpack_decode_rows", (torch.randn(3, 2, 4), QSL, 5, -1)),
    ("unpack_decode_rows", (torch.zeros(3, 2, dtype=torch.int32), QSL, 4)),
])

test_validation_errors = validation_test([
    ("compress_block_table", (X, 2), TypeError, "`block_table` must be torch.int32"),
    ("compress_block_table", (i32([1, 2]), 2), ValueError, "`block_table` must have 2 dim"),
    ("compress_block_table", (i32([[1, 2, 3, 4]])[:, ::2], 1), ValueError, r"stride\(1\)"),
    ("compress_block_table", (i32([[1, 2]]), 0), ValueError, "`factor` must be >= 1"),
    ("pack_decode_rows", (X.transpose(0, 1), QSL, 2), ValueError, "`x` must be contiguous"),
    ("pack_decode_rows", (torch.tensor(1.0), QSL, 2), ValueError, "token dimension"),
    ("pack_decode_rows", (X.to(torch.complex128), QSL, 2), TypeError, "1, 2, 4 or 8-byte"),
    ("pack_decode_rows", (X, QSL.long(), 2), TypeError, "`query_start_loc` must be torch.int32"),
    ("pack_decode_rows", (X, QSL, 0), ValueError, "`next_n` must be >= 1"),
    ("unpack_decode_rows", (X, QSL, 4), ValueError, "`y` must have size 3"),
    ("unpack_decode_rows", (X[0, 0], QSL, 4), ValueError, r"`y` must be \[num_reqs, next_n"),
    ("unpack_decode_rows", (X[:3], QSL, -1), ValueError, "`num_tokens` must be >= 0"),
    ("unpack_decode_rows", (X[:3].transpose(1, 2), QSL, 4), ValueError, "must be contiguous"),
    # the CPU face raised torch's overflow error, the kernel face saturated to 448
    ("unpack_decode_rows", (torch.zeros(3, 2, 2).to(torch.float8_e4m3fn), QSL, 4, 1000),
     ValueError, r"`fill` must be representable in y's torch.float8_e4m3fn, in \[-448.0, "
     r"448.0\], got 1000"),
    ("unpack_decode_rows", (torch.zeros(3, 2, dtype=torch.int8), QSL, 4, 200), ValueError,
     r"in \[-128, 127\], got 200"),
])
