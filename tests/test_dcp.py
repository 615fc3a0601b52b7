"""dcp_local_lens (design §6) against the loop reference, on both faces."""

import pytest
import reference_meta as ref
import torch
from faces import FACE_NAMES, face_tests, i32, opcheck_test, run_op, validation_test
from hypothesis import given
from hypothesis import strategies as st
from strategies import dcp_configs


@pytest.mark.parametrize("face", FACE_NAMES)
def test_spec_localise_after_expanding(face):
    """World 2, rank 1: global per-token [8, 9, 10] -> [4, 4, 5] (not [3, 4, 5])."""
    assert run_op(face, "dcp_local_lens", i32([8, 9, 10]), 2, 1, 1).tolist() == [4, 4, 5]


@pytest.mark.parametrize("face", FACE_NAMES)
def test_spec_localise_the_compressed_length(face):
    """n = 10, R = 2, W = 2: rank 0 owns states {0, 2, 4} of 5 -> 3 (not local(10) // 2)."""
    assert ref.dcp_local(10 // 2, 2, 0, 1) == 3 == ref.dcp_owned(10 // 2, 2, 0, 1)
    assert run_op(face, "dcp_local_lens", i32([10 // 2]), 2, 0, 1).tolist() == [3]


@given(n=st.integers(-3, 200), world=st.integers(1, 5), interleave=st.integers(1, 4),
       data=st.data())
def test_reference_formula_counts_owned_entries(n, world, interleave, data):
    """The design's formula (any interleave) equals a brute-force count of owned entries, and
    the shares of all ranks add up to n."""
    rank = data.draw(st.integers(0, world - 1))
    assert ref.dcp_local(n, world, rank, interleave) == ref.dcp_owned(n, world, rank, interleave)
    assert sum(ref.dcp_local(n, world, k, interleave) for k in range(world)) == max(n, 0)


def check_dcp_local_lens(face: str, case: tuple[list[int], tuple[int, ...]],
                         dcp: tuple[int, int]) -> None:
    (lens, shape), (world, rank) = case, dcp
    x = i32(lens).reshape(shape)
    out = run_op(face, "dcp_local_lens", x, world, rank, 1)
    assert out.dtype == torch.int32 and out.shape == x.shape
    assert out.flatten().tolist() == [ref.dcp_local(n, world, rank, 1) for n in lens]


@st.composite
def shaped_lens(draw: st.DrawFn) -> tuple[list[int], tuple[int, ...]]:
    """Lengths (negatives included) as a 1-D or 2-D array."""
    lens = draw(st.lists(st.integers(-5, 1000), max_size=12))
    shape = (len(lens),) if len(lens) % 2 else (2, len(lens) // 2)
    return lens, shape


test_dcp_local_lens_cpu, test_dcp_local_lens_kernel = face_tests(
    check_dcp_local_lens, {"case": shaped_lens(), "dcp": dcp_configs()})


@pytest.mark.parametrize("face", FACE_NAMES)
def test_world_one_is_a_copy(face):
    x = i32([[0, 7], [3, 9]])
    out = run_op(face, "dcp_local_lens", x, 1, 0, 1)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
    # world 1 accepts any interleave: every entry is local
    assert torch.equal(run_op(face, "dcp_local_lens", x, 1, 0, 4), x)


@pytest.mark.parametrize("face", FACE_NAMES)
def test_non_contiguous_input(face):
    x = i32([[5, 6, 7], [8, 9, 10]]).t()
    assert run_op(face, "dcp_local_lens", x, 2, 0, 1).tolist() == [[3, 4], [3, 5], [4, 5]]


test_opcheck = opcheck_test([(i32([3, -1, 10]), 2, 1, 1), (i32([[4], [0]]), 4, 3, 1),
                             (i32([]), 1, 0, 1)], op="dcp_local_lens")

test_validation_errors = validation_test([
    ((i32([1]).long(), 2, 0, 1), TypeError, "`lens` must be torch.int32"),
    ((i32([1]).float(), 2, 0, 1), TypeError, "`lens` must be torch.int32"),
    ((i32([1]), 0, 0, 1), ValueError, "`world` must be >= 1"),
    ((i32([1]), 2, -1, 1), ValueError, "`rank` must be >= 0"),
    ((i32([1]), 2, 2, 1), ValueError, "`rank` must be < world=2"),
    ((i32([1]), 2, 0, 0), ValueError, "`interleave` must be >= 1"),
    ((i32([1]), 2, 0, 2), NotImplementedError, "interleave > 1 is not supported"),
], op="dcp_local_lens")
