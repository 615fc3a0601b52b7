"""pad_batch_out (design §9): a live batch padded into static buffers, on every face, against
the loop reference."""

import pytest
import reference_meta as ref
import torch
from faces import (
    FACE_NAMES,
    HAS_CUDA,
    KERNEL_MARK,
    face_tests,
    i32,
    opcheck_test,
    run_op,
    strided_rows,
    validation_test,
)
from hypothesis import strategies as st
from strategies import BatchSpec, batches

from dsa.ops import _launch
from dsa.ops._launch import FixedLaunch
from dsa.ops.pad import launch_pad_batch, pad_batch_launch

GARBAGE = 12345


def buffers(num_reqs: int, num_tokens: int, width: int) -> tuple[torch.Tensor, ...]:
    """Static buffers full of garbage, so an entry the op leaves unwritten shows."""
    full = lambda shape, dtype: torch.full(shape, GARBAGE, dtype=dtype)
    return (full((num_reqs + 1,), torch.int32), full((num_reqs,), torch.int32),
            full((num_reqs, width), torch.int32), full((num_tokens,), torch.int64),
            full((num_tokens,), torch.int64))


def pad_into(face: str, live: tuple, out: tuple) -> list:
    """Runs the op on ``face``; returns the buffers' contents as lists."""
    if face == "kernel" and HAS_CUDA:
        on_gpu = [t.cuda() for t in out]
        torch.ops.dsa.pad_batch_out(*(t.cuda() for t in live), *on_gpu)
        out = tuple(t.cpu() for t in on_gpu)
    else:
        run_op(face, "pad_batch_out", *live, *out)
    return [t.tolist() for t in out]


def live_tensors(b: BatchSpec) -> tuple[torch.Tensor, ...]:
    t = b.tensors()
    return t.query_start_loc, t.seq_lens, t.block_table, t.slot_mapping, t.positions


def check_pad(face: str, b: BatchSpec, extra_reqs: int, extra_tokens: int, extra_width: int,
              swap_dtypes: bool) -> None:
    live = live_tensors(b)
    if swap_dtypes:  # int64 offsets, lengths and table (a packed host copy), int32 positions
        live = (*(t.long() for t in live[:3]), live[3], live[4].int())
    cap = (b.num_reqs + extra_reqs, b.num_tokens + extra_tokens, b.width + extra_width)
    got = pad_into(face, live, buffers(*cap))
    want = ref.pad_batch(b.query_start_loc, b.seq_lens, [list(r) for r in b.block_table],
                         b.slot_mapping, b.positions, *cap)
    assert got == list(want)


extras = {"extra_reqs": st.integers(0, 3), "extra_tokens": st.integers(0, 3),
          "extra_width": st.integers(0, 3), "swap_dtypes": st.booleans()}
test_pad_batch_cpu, test_pad_batch_kernel = face_tests(
    check_pad, {"b": batches(), **extras}, {"b": batches(max_decodes=2, max_prefills=1), **extras})


def live_example(table: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    return (i32([0, 2, 3, 5]), i32([10, 7, 12]),
            i32([[4, 5], [6, 7], [8, 9]]) if table is None else table,
            torch.tensor([264, 265, 390, 523, 524]), i32([8, 9, 6, 10, 11]))


@pytest.mark.parametrize("face", FACE_NAMES)
def test_pad_batch_design_example(face):
    """design §9's example, its table rows strided (the padding is the same)."""
    got = pad_into(face, live_example(strided_rows(i32([[4, 5], [6, 7], [8, 9]]))),
                   buffers(5, 8, 3))
    assert got == [[0, 2, 3, 5, 5, 5], [10, 7, 12, 0, 0],
                   [[4, 5, 0], [6, 7, 0], [8, 9, 0], [0, 0, 0], [0, 0, 0]],
                   [264, 265, 390, 523, 524, -1, -1, -1], [8, 9, 6, 10, 11, 0, 0, 0]]


@pytest.mark.parametrize("face", FACE_NAMES)
def test_pad_batch_of_no_requests_and_into_no_room(face):
    empty = (i32([0]), i32([]), i32([]).view(0, 2), torch.tensor([], dtype=torch.int64),
             torch.tensor([], dtype=torch.int64))
    assert pad_into(face, empty, buffers(2, 3, 2)) == [
        [0, 0, 0], [0, 0], [[0, 0], [0, 0]], [-1, -1, -1], [0, 0, 0]]
    assert pad_into(face, empty, buffers(0, 0, 2)) == [[0], [], [], [], []]


@pytest.mark.parametrize("face", FACE_NAMES)
def test_pad_batch_in_place(face):
    """Live tensors that are prefix views of the buffers (``StaticBatch.pad``)."""
    out = buffers(5, 8, 2)
    for buffer, value in zip(out, live_example()):
        buffer[: value.shape[0]] = value
    if face == "kernel" and HAS_CUDA:
        out = tuple(t.cuda() for t in out)
    live = (out[0][:4], out[1][:3], out[2][:3], out[3][:5], out[4][:5])
    if face == "cpu" or HAS_CUDA:
        torch.ops.dsa.pad_batch_out(*live, *out)
    else:
        run_op(face, "pad_batch_out", *live, *out)
    assert [t.tolist() for t in out] == [
        [0, 2, 3, 5, 5, 5], [10, 7, 12, 0, 0], [[4, 5], [6, 7], [8, 9], [0, 0], [0, 0]],
        [264, 265, 390, 523, 524, -1, -1, -1], [8, 9, 6, 10, 11, 0, 0, 0]]


@pytest.mark.parametrize("face", FACE_NAMES)
def test_int64_values_outside_int32_never_wrap_into_valid_ones(face):
    """int64 live values into int32 buffers: lengths saturate, block ids and positions past
    int32 become -1 (outside every cache and model length), never a small valid value."""
    big = 2**32
    live = (torch.tensor([0, 1]), torch.tensor([big + 5]), torch.tensor([[big + 1, 3 - big]]),
            torch.tensor([7]), torch.tensor([big + 4]))
    out = (*buffers(2, 2, 3)[:4], torch.full((2,), GARBAGE, dtype=torch.int32))
    assert pad_into(face, live, out) == [[0, 1, 1], [2**31 - 1, 0], [[-1, -1, 0], [0, 0, 0]],
                                         [7, -1], [-1, 0]]


@KERNEL_MARK
def test_launch_pad_batch_in_place_keeps_trailing_padding_tokens_as_the_cpu_face():
    """Live tokens past the last request's (padding by ``query_start_loc``) in place: the
    launch ``StaticBatch.pad`` uses on CUDA and the CPU face agree."""
    out = buffers(5, 8, 2)
    for buffer, value in zip(out, live_example()):
        buffer[: value.shape[0]] = value
    out[3][5:7], out[4][5:7] = torch.tensor([99, 98]), torch.tensor([3, 4])
    expected = tuple(t.clone() for t in out)
    torch.ops.dsa.pad_batch_out(expected[0][:4], expected[1][:3], expected[2][:3],
                                expected[3][:7], expected[4][:7], *expected)
    device = "cuda" if HAS_CUDA else "cpu"
    out = tuple(t.to(device) for t in out)
    launch_pad_batch(out * 2, 3, 7, 2)
    assert [t.tolist() for t in out] == [t.tolist() for t in expected]


@KERNEL_MARK
def test_launch_pad_batch_in_place_takes_the_live_sizes():
    """The raw launch ``StaticBatch.pad`` uses on CUDA: the buffers are both halves."""
    out = buffers(5, 8, 2)
    for buffer, value in zip(out, live_example()):
        buffer[: value.shape[0]] = value
    device = "cuda" if HAS_CUDA else "cpu"
    out = tuple(t.to(device) for t in out)
    launch_pad_batch(out * 2, 3, 5, 2)
    assert [t.tolist() for t in out] == [
        [0, 2, 3, 5, 5, 5], [10, 7, 12, 0, 0], [[4, 5], [6, 7], [8, 9], [0, 0], [0, 0]],
        [264, 265, 390, 523, 524, -1, -1, -1], [8, 9, 6, 10, 11, 0, 0, 0]]


def test_pad_batch_fake_face_returns_nothing():
    assert run_op("fake", "pad_batch_out", *live_example(), *buffers(5, 8, 3)) is None


test_pad_batch_opcheck = opcheck_test(
    [(*live_example(), *buffers(5, 8, 3)),
     (*live_example(strided_rows(i32([[4, 5], [6, 7], [8, 9]]))), *buffers(3, 5, 2))],
    op="pad_batch_out",
)

test_pad_batch_validation = validation_test(
    [
        ((*live_example(), *buffers(2, 8, 3)), ValueError,
         "pad_batch_out: a batch of 3 requests, 5 tokens and block-table width 2 does not fit "
         "capacity 2 requests, 8 tokens, width 3"),
        ((*live_example(), *buffers(5, 4, 3)), ValueError, "does not fit capacity"),
        ((*live_example(), *buffers(5, 8, 1)), ValueError, "does not fit capacity"),
        ((*live_example()[:4], i32([1, 2]), *buffers(5, 8, 3)), ValueError,
         r"pad_batch_out: `positions` must have size 5 \(num_tokens = len\(slot_mapping\)\)"),
        ((live_example()[0].float(), *live_example()[1:], *buffers(5, 8, 3)), TypeError,
         "pad_batch_out: `query_start_loc` must be torch.int32 or torch.int64, got "
         "torch.float32"),
        ((*live_example(), *buffers(5, 8, 3)[:3], torch.zeros(8, dtype=torch.int32),
          buffers(5, 8, 3)[4]), TypeError,
         "pad_batch_out: `out_slot_mapping` must be torch.int64, got torch.int32"),
        ((*live_example(), torch.zeros(5, dtype=torch.int32), *buffers(5, 8, 3)[1:]),
         ValueError, r"`out_query_start_loc` must have size 6 \(capacity = len\(out_seq_lens\) "
         r"\+ 1\)"),
    ],
    op="pad_batch_out",
)


@KERNEL_MARK
def test_pad_batch_launch_relaunches_for_new_live_data():
    """A ready launch serves every live batch of its sizes (any data, any address)."""
    device = "cuda" if HAS_CUDA else "cpu"
    out = tuple(t.to(device) for t in buffers(5, 8, 3))
    ready = pad_batch_launch(out, 3, 5, 2, 2)
    for shift in (0, 100):
        live = tuple(t.to(device) + shift for t in live_example())
        ready(*live, *out)
        want = ref.pad_batch(*(t.tolist() for t in live), 5, 8, 3)
        assert [t.tolist() for t in out] == list(want)


@KERNEL_MARK
@pytest.mark.parametrize("inputs", [1, 2])
def test_pad_batch_launch_copies_token_rows(inputs):
    """The ready launch also copies the live rows of up to two token inputs (any row
    stride, any dtype) into their buffers, leaving the rows past the live tokens alone."""
    device = "cuda" if HAS_CUDA else "cpu"
    out = tuple(t.to(device) for t in buffers(5, 8, 3))
    live = tuple(t.to(device) for t in live_example())
    tokens = live[3].shape[0]
    wide = torch.randn(tokens, 2, 40, device=device).to(torch.bfloat16)
    strided = torch.randn(tokens, 24, device=device)[:, :5]
    values = (wide, strided)[:inputs]
    held = (torch.full((8, 2, 40), 7.0, device=device, dtype=torch.bfloat16),
            torch.full((8, 5), 7.0, device=device))[:inputs]
    ready = pad_batch_launch(out, 3, tokens, 2, 2, [(b, v.stride(0)) for b, v in
                                                   zip(held, values)])
    ready(*live, *out, *(t for pair in zip(values, held) for t in pair))
    assert [t.tolist() for t in out] == list(ref.pad_batch(*(t.tolist() for t in live), 5, 8, 3))
    for value, buffer in zip(values, held):
        assert torch.equal(buffer[:tokens], value)
        assert (buffer[tokens:] == 7).all()


class FakeCompiled:
    """Stands in for Triton's ``CompiledKernel``: ``[grid]`` gives a launcher."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *args, stream=None: self.calls.append(("compiled", grid, args))


class FakeKernel:
    """Stands in for a ``JITFunction``: ``[grid](...)`` launches, returns the compiled one."""

    arg_names = ("x_ptr", "y_ptr", "n", "BLOCK")

    def __init__(self) -> None:
        self.calls = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append(("jit", grid, args, kwargs))
            return FakeCompiled(self.calls)

        return run


def test_fixed_launch_relaunches_the_compiled_kernel(monkeypatch):
    """After the first launch through the JIT, the compiled kernel gets every argument in
    declaration order (constexprs too) on a three-dim grid; another current device goes
    through the JIT again."""
    monkeypatch.setattr(_launch, "CompiledKernel", FakeCompiled)
    device = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device[0])
    monkeypatch.setattr(_launch, "current_raw_stream", lambda device: 0)
    kernel = FakeKernel()
    ready = FixedLaunch(kernel, (6,), BLOCK=8, n=3)
    ready("a", "b")
    ready("c", "d")
    device[0] = 1
    ready("e", "f")
    assert kernel.calls == [("jit", (6,), ("a", "b"), {"BLOCK": 8, "n": 3}),
                            ("compiled", (6, 1, 1), ("c", "d", 3, 8)),
                            ("jit", (6,), ("e", "f"), {"BLOCK": 8, "n": 3})]


def test_fixed_launch_without_a_compiled_kernel_launches_every_time():
    """The interpreter's launch returns no ``CompiledKernel``: every call goes through it."""
    kernel = FakeKernel()
    ready = FixedLaunch(kernel, (2,), BLOCK=4, n=1)
    ready("a", "b")
    ready("c", "d")
    assert [call[0] for call in kernel.calls] == ["jit", "jit"]
