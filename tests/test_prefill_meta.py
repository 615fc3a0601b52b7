"""prefill_chunk_bounds (design §5) against the loop reference, on both faces."""

import pytest
import reference_meta as ref
import torch
from faces import FACE_NAMES, face_tests, i32, opcheck_test, run_op, validation_test
from hypothesis import given
from hypothesis import strategies as st
from strategies import batches, dcp_configs

OUTPUTS = ("cu_seq_lens", "local_cu_seq_lens", "token_to_seq", "ks", "ke", "global_lens")

SPEC_QSL, SPEC_SEQ = i32([0, 2, 4, 7]), i32([5, 9, 4])


@pytest.mark.parametrize("face", FACE_NAMES)
def test_spec_example(face):
    cu, local_cu, token_to_seq, ks, ke, glen = run_op(
        face, "prefill_chunk_bounds", SPEC_QSL, SPEC_SEQ, 0, 3, 0, 7, 18)
    assert ks.tolist() == [0, 0, 5, 5, 14, 14, 14]
    assert ke.tolist() == [4, 5, 13, 14, 16, 17, 18]
    assert cu.tolist() == local_cu.tolist() == [0, 5, 14, 18]
    assert token_to_seq.tolist() == [0] * 5 + [1] * 9 + [2] * 4
    assert glen.tolist() == [4, 5, 8, 9, 2, 3, 4]


@pytest.mark.parametrize("face", FACE_NAMES)
def test_spec_example_later_query_slice(face):
    """A later query slice [2, 5) of the same chunk: same workspace, its rows only; spare
    workspace rows get -1."""
    _, _, token_to_seq, ks, ke, _ = run_op(
        face, "prefill_chunk_bounds", SPEC_QSL, SPEC_SEQ, 0, 3, 2, 5, 20)
    assert ks.tolist() == [5, 5, 14]
    assert ke.tolist() == [13, 14, 16]
    assert token_to_seq.tolist()[18:] == [-1, -1]


@pytest.mark.parametrize("face", FACE_NAMES)
def test_dcp_compressed_example(face):
    """Requests 1..2 (seq 9 and 4), R = 2, world 2, rank 1: compressed lengths [4, 2] whose
    rank-1 shares are [2, 1]; query 1 of request 1 sees 9 // 2 = 4 states globally, 2 here."""
    cu, local_cu, _, ks, ke, glen = run_op(
        face, "prefill_chunk_bounds", SPEC_QSL, SPEC_SEQ, 1, 3, 1, 5, 6, 2, 2, 1, 1)
    assert (cu.tolist(), local_cu.tolist()) == ([0, 4, 6], [0, 2, 3])
    assert glen.tolist() == [4, 1, 1, 2]
    assert ks.tolist() == [0, 2, 2, 2]
    assert ke.tolist() == [2, 2, 2, 3]


@pytest.mark.parametrize("face", FACE_NAMES)
@pytest.mark.parametrize(("ratio", "world", "rank"), [(1, 1, 0), (2, 2, 1), (4, 2, 0)])
def test_malformed_lengths_count_as_empty(face, ratio, world, rank):
    """Device values the op cannot check: a negative length adds no rows, and a sequence
    shorter than its query (request 2: 1 key, 3 queries) gives its early queries no keys."""
    qsl, seq = [0, 2, 4, 7], [5, -9, 1]
    outs = run_op(face, "prefill_chunk_bounds", i32(qsl), i32(seq), 0, 3, 0, 7, 8, ratio,
                  world, rank, 1)
    want = ref.prefill_chunk_bounds(qsl, seq, 0, 3, 0, 7, 8, ratio, world, rank, 1)
    assert [out.tolist() for out in outs] == list(want)
    assert want[0][1:3] == [5 // ratio] * 2 and want[5][4:6] == [0, 0]


@st.composite
def chunk_cases(draw: st.DrawFn, max_reqs: int = 4):
    """A batch, one chunk of its requests, a query slice of the chunk (maybe running past
    its tokens), a workspace capacity (maybe short of or past the gathered rows), R, DCP."""
    b = draw(batches(max_decodes=max_reqs // 2, max_prefills=max_reqs - max_reqs // 2))
    req_start = draw(st.integers(0, b.num_reqs))
    req_end = draw(st.integers(req_start, b.num_reqs))
    qsl = b.query_start_loc
    chunk_tokens = qsl[req_end] - qsl[req_start]
    query_begin = draw(st.integers(0, chunk_tokens))
    query_end = draw(st.integers(query_begin, chunk_tokens + 2))
    ratio = draw(st.sampled_from([1, 2, 4]))
    rows = sum(s // ratio for s in b.seq_lens[req_start:req_end])
    num_rows = draw(st.integers(max(rows - 2, 0), rows + 3))
    return (b, (req_start, req_end, query_begin, query_end, num_rows, ratio),
            draw(dcp_configs()))


def check_chunk_bounds(face: str, case) -> None:
    b, chunk, (world, rank) = case
    t = b.tensors()
    outs = run_op(face, "prefill_chunk_bounds", t.query_start_loc, t.seq_lens, *chunk, world,
                  rank, 1)
    expected = ref.prefill_chunk_bounds(b.query_start_loc, b.seq_lens, *chunk, world, rank, 1)
    for name, out, want in zip(OUTPUTS, outs, expected, strict=True):
        assert out.dtype == torch.int32, name
        assert out.tolist() == want, name


test_prefill_chunk_bounds_cpu, test_prefill_chunk_bounds_kernel = face_tests(
    check_chunk_bounds, {"case": chunk_cases()}, {"case": chunk_cases(max_reqs=3)})


@given(case=chunk_cases())
def test_reference_invariants(case):
    """Each query row spans its own request's local rows; without DCP local == global."""
    b, chunk, (world, rank) = case
    cu, local_cu, _, ks, ke, glen = ref.prefill_chunk_bounds(
        b.query_start_loc, b.seq_lens, *chunk, world, rank, 1)
    if world == 1:
        assert local_cu == cu
        assert [e - s for s, e in zip(ks, ke)] == glen
    assert all(0 <= s <= e <= local_cu[-1] for s, e in zip(ks, ke))


test_opcheck = opcheck_test([
    (SPEC_QSL, SPEC_SEQ, 0, 3, 0, 7, 18),
    (SPEC_QSL, SPEC_SEQ, 1, 3, 1, 5, 6, 2, 2, 1, 1),
    (SPEC_QSL, SPEC_SEQ, 2, 2, 0, 0, 0),
], op="prefill_chunk_bounds")


def test_defaults_are_no_compression_no_dcp():
    assert all(torch.equal(a, b) for a, b in zip(
        torch.ops.dsa.prefill_chunk_bounds(SPEC_QSL, SPEC_SEQ, 0, 3, 0, 7, 18),
        torch.ops.dsa.prefill_chunk_bounds(SPEC_QSL, SPEC_SEQ, 0, 3, 0, 7, 18, 1, 1, 0, 1),
        strict=True))


test_validation_errors = validation_test([
    ((SPEC_QSL.long(), SPEC_SEQ, 0, 3, 0, 7, 18), TypeError, "`query_start_loc` must be"),
    ((SPEC_QSL, SPEC_SEQ.view(3, 1), 0, 3, 0, 7, 18), ValueError, "`seq_lens` must have 1"),
    ((SPEC_QSL, SPEC_SEQ[:2], 0, 3, 0, 7, 18), ValueError, "`seq_lens` must have size 3"),
    ((SPEC_QSL, SPEC_SEQ, -1, 3, 0, 7, 18), ValueError, "`req_start` must be >= 0"),
    ((SPEC_QSL, SPEC_SEQ, 2, 1, 0, 7, 18), ValueError, "`req_end` must be >= 2"),
    ((SPEC_QSL, SPEC_SEQ, 0, 4, 0, 7, 18), ValueError, "`req_end` must be <= num_reqs=3"),
    ((SPEC_QSL, SPEC_SEQ, 0, 3, -1, 7, 18), ValueError, "`query_begin` must be >= 0"),
    ((SPEC_QSL, SPEC_SEQ, 0, 3, 5, 4, 18), ValueError, "`query_end` must be >= 5"),
    ((SPEC_QSL, SPEC_SEQ, 0, 3, 0, 7, -1), ValueError, "`num_rows` must be >= 0"),
    ((SPEC_QSL, SPEC_SEQ, 0, 3, 0, 7, 18, 0), ValueError, "`compress_ratio` must be >= 1"),
    ((SPEC_QSL, SPEC_SEQ, 0, 3, 0, 7, 18, 1, 2, 2), ValueError, "`dcp_rank` must be <"),
    ((SPEC_QSL, SPEC_SEQ, 0, 3, 0, 7, 18, 1, 2, 0, 2), NotImplementedError, "interleave"),
], op="prefill_chunk_bounds")
