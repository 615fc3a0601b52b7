"""split_prefill_chunks (design §5 chunking) against the loop reference and its invariants."""

import pytest
import reference_meta as ref
from hypothesis import given, settings
from hypothesis import strategies as st

from dsa.meta import split_prefill_chunks

BIG = 10**9  # a workspace that never binds


def test_spec_example_packs_two_then_one():
    chunks = split_prefill_chunks([10, 10, 10], [5, 5, 5], BIG, 1000)
    assert chunks == [(slice(0, 2), slice(0, 10)), (slice(2, 3), slice(0, 5))]


def test_spec_example_request_over_budget_is_split_into_single_queries():
    chunks = split_prefill_chunks([1000, 50], [100, 5], BIG, 1000)
    assert chunks == [(slice(0, 1), slice(q, q + 1)) for q in range(100)] + [
        (slice(1, 2), slice(0, 5))]


def test_workspace_bounds_the_chunk():
    assert split_prefill_chunks([6, 6, 6], [1, 1, 1], 12, BIG) == [
        (slice(0, 2), slice(0, 2)), (slice(2, 3), slice(0, 1))]


def test_request_over_the_workspace_is_its_own_chunk():
    assert split_prefill_chunks([3, 20, 3], [1, 1, 1], 10, BIG) == [
        (slice(0, 1), slice(0, 1)), (slice(1, 2), slice(0, 1)), (slice(2, 3), slice(0, 1))]


def test_chunk_within_budget_is_one_piece():
    """Pieces hold (budget // 4) // sum(seq) queries, and a chunk within budget has at most
    that many: 4 queries * 20 rows * 4 bytes = 320 <= 400, pieces of 100 // 20 = 5."""
    assert split_prefill_chunks([10, 10], [2, 2], BIG, 400) == [(slice(0, 2), slice(0, 4))]


def test_lone_request_within_logits_budget_but_over_workspace_is_one_piece():
    assert split_prefill_chunks([50], [3], 10, 1000) == [(slice(0, 1), slice(0, 3))]


def test_zero_length_sequences_make_one_piece():
    """Sequences shorter than the ratio have no K rows: one piece of all their queries."""
    assert split_prefill_chunks([3, 4], [3, 4], BIG, 4, compress_ratio=8) == [
        (slice(0, 2), slice(0, 7))]


def test_chunk_without_queries_yields_no_piece():
    assert split_prefill_chunks([5], [0], BIG, 1000) == []
    assert split_prefill_chunks([], [], BIG, 1000) == []


@st.composite
def chunking_cases(draw: st.DrawFn):
    n = draw(st.integers(0, 8))
    seq = draw(st.lists(st.integers(0, 60), min_size=n, max_size=n))
    query = [draw(st.integers(0, min(s, 20))) for s in seq]
    return seq, query, draw(st.integers(1, 120)), draw(st.integers(1, 4000))


@settings(max_examples=300)
@given(case=chunking_cases())
def test_matches_reference(case):
    assert split_prefill_chunks(*case) == ref.split_prefill_chunks(*case)


@settings(max_examples=300)
@given(case=chunking_cases())
def test_invariants(case):
    """Requests appear in order, each once; a chunk's pieces tile its queries; a chunk of
    several requests fits both budgets; every piece fits the logits budget unless it is a
    single query."""
    seq, query, workspace, budget = case
    chunks = split_prefill_chunks(seq, query, workspace, budget)
    groups: dict[tuple[int, int], list[slice]] = {}
    for reqs, queries in chunks:
        groups.setdefault((reqs.start, reqs.stop), []).append(queries)
    ends = [0]
    for (start, stop), pieces in groups.items():
        assert start >= ends[-1] and stop > start
        assert all(query[r] == 0 for r in range(ends[-1], start))  # skipped: no queries
        ends.append(stop)
        total_q, total_s = sum(query[start:stop]), sum(seq[start:stop])
        assert [p.start for p in pieces] == [0, *[p.stop for p in pieces[:-1]]]
        assert pieces[-1].stop == total_q
        if stop - start > 1:
            assert total_s <= workspace and total_q * total_s * 4 <= budget
        for p in pieces:
            assert p.stop - p.start == 1 or (p.stop - p.start) * total_s * 4 <= budget
    assert all(query[r] == 0 for r in range(ends[-1], len(seq)))


@pytest.mark.parametrize(("args", "error", "match"), [
    (([1, -2], [1, 1], 10, 10), ValueError, "`seq_lens` must be >= 0"),
    (([1, 2], [1, -1], 10, 10), ValueError, "`query_lens` must be >= 0"),
    (([1, 2], [1], 10, 10), ValueError, "same length, got 2 and 1"),
    (([1], [1], 0, 10), ValueError, "`workspace_rows` must be >= 1"),
    (([1], [1], 10, -5), ValueError, "`max_logits_bytes` must be >= 1"),
    (([1.5], [1], 10, 10), TypeError, "`seq_lens` must be a sequence of ints"),
    (([1], [1], 10.0, 10), TypeError, "`workspace_rows` must be an int"),
    (([4, 2], [4, 3], 10, 10), ValueError, "`seq_lens` of request 1 must be >= its query "
                                           "length 3, got 2"),
])
def test_validation_errors(args, error, match):
    with pytest.raises(error, match=match):
        split_prefill_chunks(*args)
