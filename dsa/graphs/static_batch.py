"""Fixed-address input buffers of captured buckets, and padding a live batch into them."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar

import torch
from torch import Tensor

from dsa.meta.batch import Batch
from dsa.ops import FACES
from dsa.ops._checks import is_int
from dsa.ops.pad import LIVE_DTYPES, MAX_ROW_INPUTS, pad_batch_launch

TokenInputs = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
# The op's faces, called directly: outside a graph, the dispatcher's custom-op overhead
# would be host time every padded replay pays.
_PAD_FACES = FACES["pad_batch_out"]
# Ready loads and pads a StaticBatch keeps (one per signature); past this many, it forgets
# them all and starts over.
_MAX_READY = 256
_Ready = TypeVar("_Ready")


class StaticBatch:
    """A ``Batch`` (and token-major model inputs) at a bucket's capacity, at fixed addresses.

    ``load`` pads a live batch in (``dsa::pad_batch_out``, one launch, no host sync):
    padding requests get query_len 0 and seq_len 0 (their ``query_start_loc`` entries
    repeat the live total), block-table entries past the live ones 0, padding tokens slot
    -1 and position 0; rows of the inputs past the live tokens keep what they held (no real
    token's output depends on them). An engine may instead write ``batch`` and ``inputs`` in
    place itself, then ``pad`` the rest. ``prefix`` views the first requests and tokens:
    each bucket of a ``DecodeGraphRunner`` is such a view.
    """

    def __init__(self, num_reqs: int, num_tokens: int, table_width: int, *,
                 token_inputs: TokenInputs | None = None,
                 device: torch.device | str | None = None) -> None:
        i32 = {"dtype": torch.int32, "device": device}
        self.batch = Batch(
            query_start_loc=torch.zeros(num_reqs + 1, **i32),
            seq_lens=torch.zeros(num_reqs, **i32),
            block_table=torch.zeros(num_reqs, table_width, **i32),
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
            positions=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        )
        self.inputs = {
            name: torch.zeros(num_tokens, *tail, dtype=dtype, device=device)
            for name, (tail, dtype) in (token_inputs or {}).items()
        }
        self._ready: dict[Hashable, Any] = {}

    @property
    def num_reqs(self) -> int:
        return self.batch.num_reqs

    @property
    def num_tokens(self) -> int:
        return self.batch.num_tokens

    def prefix(self, num_reqs: int, num_tokens: int) -> StaticBatch:
        """The first ``num_reqs`` requests and ``num_tokens`` tokens, as views sharing these
        buffers (every bucket of a ``DecodeGraphRunner`` is a prefix of one set)."""
        self._check_room("prefix", num_reqs, num_tokens)
        b = self.batch
        view = object.__new__(StaticBatch)
        view.batch = Batch(b.query_start_loc[: num_reqs + 1], b.seq_lens[:num_reqs],
                           b.block_table[:num_reqs], b.slot_mapping[:num_tokens],
                           b.positions[:num_tokens])
        view.inputs = {name: value[:num_tokens] for name, value in self.inputs.items()}
        view._ready = {}
        return view

    def pad(self, num_reqs: int, num_tokens: int) -> None:
        """Pads in place, after an engine wrote the first ``num_reqs`` requests (offsets
        ``query_start_loc[: num_reqs + 1]``) and ``num_tokens`` tokens of ``batch`` (at least
        ``query_start_loc[num_reqs]``; those past it are padding): the rest becomes padding as
        ``load`` makes it, in one launch. Rows of ``inputs`` past ``num_tokens`` stay as they
        are: padding tokens' outputs never depend on them."""
        self._check_room("pad", num_reqs, num_tokens)
        b = self.batch
        if b.seq_lens.is_cuda:  # no views to build: the launch takes the live sizes
            buffers = _fields(b)
            launch = self._get_ready(("pad", num_reqs, num_tokens), lambda: pad_batch_launch(
                buffers, num_reqs, num_tokens, b.block_table.shape[1], b.block_table.stride(0)))
            launch(*buffers, *buffers)
        else:  # host buffers: the live total is readable for free
            total = int(b.query_start_loc[num_reqs])
            if num_tokens < total:
                raise ValueError(f"StaticBatch.pad: num_tokens must be at least query_start_loc["
                                 f"num_reqs={num_reqs}] = {total}, the live requests' tokens, "
                                 f"got {num_tokens}")
            _PAD_FACES.cpu(*_fields(self.prefix(num_reqs, num_tokens).batch), *_fields(b))

    def _check_room(self, method: str, num_reqs: int, num_tokens: int) -> None:
        for name, value in (("num_reqs", num_reqs), ("num_tokens", num_tokens)):
            if not is_int(value):
                raise TypeError(f"StaticBatch.{method}: `{name}` must be an int, got "
                                f"{type(value).__name__}")
        if not (0 <= num_reqs <= self.num_reqs and 0 <= num_tokens <= self.num_tokens):
            raise ValueError(f"StaticBatch.{method}: {num_reqs} requests and {num_tokens} "
                             f"tokens exceed capacity {self.num_reqs} requests, "
                             f"{self.num_tokens} tokens")

    def load_batch(self, live: Batch) -> None:
        """Copies ``live`` in, padding to capacity (one launch; see ``load``); ``inputs`` are
        left to the caller, who writes them in place."""
        fields = _fields(live)
        key = (None, tuple(map(_signature, fields)))
        self._get_ready(key, lambda: _Load(self, fields, None))(fields, ())

    def load(self, live: Batch, **inputs: Tensor) -> None:
        """Copies ``live`` (and its token inputs) in, padding to capacity.

        ``live`` must be consistent (int32 or int64 tensors, ``len(seq_lens) + 1``
        offsets, one block-table row per request, one position per slot) and fit; its
        tensors on the host travel in one pinned, non-blocking copy. Each token input has one
        row per live token and the trailing shape, dtype and device it was declared with;
        rows past the live tokens keep what they held. On CUDA, one launch pads the batch and
        copies up to two token inputs (those whose rows are contiguous); any others take one
        ``torch._foreach_copy_``. The arguments are checked the first
        time their shapes, strides, dtypes and devices come, not again while they repeat.
        """
        fields = _fields(live)
        values = tuple(inputs.values())
        key = (tuple(inputs), tuple(map(_signature, fields)), tuple(map(_signature, values)))
        self._get_ready(key, lambda: _Load(self, fields, inputs))(fields, values)

    def _get_ready(self, key: Hashable, make: Callable[[], _Ready]) -> _Ready:
        """The ready load or pad of ``key``, made (and checked) the first time it comes."""
        ready = self._ready.get(key)
        if ready is None:
            ready = make()
            if len(self._ready) >= _MAX_READY:
                self._ready.clear()
            self._ready[key] = ready
        return ready


class _Load:
    """``StaticBatch.load`` (``load_batch`` without ``inputs``) for one signature of its
    arguments, checked when made: on CUDA one ready launch of the ``pad_batch_out`` kernel
    pads the live batch in and copies up to ``MAX_ROW_INPUTS`` token inputs into their
    buffers' live rows; the other inputs (all of them on the CPU) take one
    ``torch._foreach_copy_``."""

    def __init__(self, static: StaticBatch, fields: tuple[Tensor, ...],
                 inputs: dict[str, Tensor] | None) -> None:
        if inputs is not None and inputs.keys() != static.inputs.keys():
            raise ValueError(f"StaticBatch.load: expected token inputs {sorted(static.inputs)}, "
                             f"got {sorted(inputs)}")
        self._out = _fields(static.batch)
        self._device = self._out[1].device
        self._host = _host_fields(fields, self._device)
        checked = list(fields)
        for i in self._host:  # moved as int64; their own layouts checked as the op checks them
            checked[i] = torch.empty_strided(fields[i].shape, fields[i].stride(),
                                             dtype=torch.int64, device=self._device)
        _PAD_FACES.fake(*checked, *self._out)  # the op's checks, as its fake face runs them
        (reqs, width), tokens = fields[2].shape, fields[3].shape[0]
        # ``_moved`` packs a host table's rows contiguously: its row stride is then its width
        table_stride = width if 2 in self._host else fields[2].stride(0)
        in_launch: list[tuple[Tensor, int]] = []  # (buffer, live row stride)
        self._launched: list[tuple[int, Tensor]] = []  # inputs the pad launch copies
        self._copied: list[int] = []  # and those it leaves to _foreach_copy_
        self._rows: list[Tensor] = []
        for i, (name, value) in enumerate((inputs or {}).items()):
            buffer = static.inputs[name]
            _check_token_input(name, value, buffer, tokens)
            if (self._device.type == "cuda" and len(in_launch) < MAX_ROW_INPUTS
                    and value.stride()[1:] == buffer.stride()[1:]):
                in_launch.append((buffer, value.stride(0)))
                self._launched.append((i, buffer))
            else:
                self._copied.append(i)
                self._rows.append(buffer[:tokens])
        if self._device.type == "cuda":
            self._pad = pad_batch_launch(self._out, reqs, tokens, width, table_stride,
                                         in_launch)
        else:
            self._pad = _PAD_FACES.cpu

    def __call__(self, fields: tuple[Tensor, ...], values: tuple[Tensor, ...]) -> None:
        if self._host:
            fields = _moved(fields, self._host, self._device)
        self._pad(*fields, *self._out,
                  *(t for i, buffer in self._launched for t in (values[i], buffer)))
        if self._rows:
            torch._foreach_copy_(self._rows, [values[i] for i in self._copied])


def pad_batch(live: Batch, num_reqs: int, num_tokens: int, table_width: int | None = None
              ) -> Batch:
    """A new batch holding ``live`` padded to ``num_reqs`` requests and ``num_tokens`` tokens."""
    static = StaticBatch(num_reqs, num_tokens, table_width or live.block_table.shape[1],
                         device=live.seq_lens.device)
    static.load(live)
    return static.batch


def _check_token_input(name: str, value: object, buffer: Tensor, tokens: int) -> None:
    if not isinstance(value, Tensor):
        raise TypeError(f"StaticBatch.load: token input `{name}` must be a torch.Tensor, got "
                        f"{type(value).__name__}")
    want = (tokens, *buffer.shape[1:])
    if tuple(value.shape) != want:
        raise ValueError(f"StaticBatch.load: token input `{name}` must have shape {want} (one "
                         f"row per live token), got {tuple(value.shape)}")
    if value.dtype != buffer.dtype:
        raise TypeError(f"StaticBatch.load: token input `{name}` must be {buffer.dtype}, got "
                        f"{value.dtype}")
    if value.device != buffer.device:
        raise ValueError(f"StaticBatch.load: token input `{name}` must be on {buffer.device}, "
                         f"got {value.device}")


def _fields(batch: Batch) -> tuple[Tensor, ...]:
    return (batch.query_start_loc, batch.seq_lens, batch.block_table, batch.slot_mapping,
            batch.positions)


def _signature(t: object) -> Hashable:
    """What the checks of a ``load`` argument read: a repeat needs no new check."""
    if isinstance(t, Tensor):
        return t.shape, t.stride(), t.dtype, t.device
    return type(t)


def _host_fields(fields: tuple[Tensor, ...], device: torch.device) -> list[int]:
    """Which ``fields`` are integer tensors elsewhere than ``device`` (``_moved`` moves
    them); none when any such tensor is not an integer one (the check names it)."""
    elsewhere = [i for i, t in enumerate(fields) if isinstance(t, Tensor) and t.device != device]
    return elsewhere if all(fields[i].dtype in LIVE_DTYPES for i in elsewhere) else []


def _moved(fields: tuple[Tensor, ...], which: list[int], device: torch.device
           ) -> tuple[Tensor, ...]:
    """``fields`` with those in ``which`` (on the host) moved to ``device`` in one copy:
    packed as int64 into one pinned buffer, copied without blocking, split into views."""
    packed = torch.cat([fields[i].reshape(-1).long() for i in which])
    if device.type == "cuda":
        packed = packed.pin_memory()
    parts = packed.to(device, non_blocking=True).split([fields[i].numel() for i in which])
    moved = list(fields)
    for i, part in zip(which, parts):
        moved[i] = part.view(fields[i].shape)
    return tuple(moved)
