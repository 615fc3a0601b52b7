"""Fixed-address input buffers of one captured bucket, and padding a live batch into them."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from dsa.meta.batch import Batch

TokenInputs = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
INTEGER_DTYPES = (torch.int32, torch.int64)


class StaticBatch:
    """A ``Batch`` (and token-major model inputs) at a bucket's capacity.

    ``load`` copies a live batch in with device-side copies only (no host sync) and pads the
    rest: padding requests get query_len 0 and seq_len 0 (their ``query_start_loc`` entries
    repeat the live total), padding tokens get slot -1 and position 0, padding inputs 0.
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

    @property
    def num_reqs(self) -> int:
        return self.batch.num_reqs

    @property
    def num_tokens(self) -> int:
        return self.batch.num_tokens

    def load(self, live: Batch, **inputs: Tensor) -> None:
        """Copies ``live`` (and its token inputs) in, padding to capacity.

        ``live`` must be consistent (integer tensors, ``len(seq_lens) + 1`` offsets, one
        block-table row per request, one position per slot) and fit; each token input has one
        row per live token and the trailing shape, dtype and device it was declared with.
        """
        _check_live(live)
        reqs, tokens = live.num_reqs, live.num_tokens
        width = live.block_table.shape[1]
        static = self.batch
        if reqs > self.num_reqs or tokens > self.num_tokens or (
            width > static.block_table.shape[1]
        ):
            raise ValueError(
                f"StaticBatch.load: a batch of {reqs} requests, {tokens} tokens and block-table "
                f"width {width} does not fit capacity {self.num_reqs} requests, "
                f"{self.num_tokens} tokens, width {static.block_table.shape[1]}"
            )
        if inputs.keys() != self.inputs.keys():
            raise ValueError(f"StaticBatch.load: expected token inputs {sorted(self.inputs)}, "
                             f"got {sorted(inputs)}")
        for name, value in inputs.items():
            _check_token_input(name, value, self.inputs[name], tokens)
        qsl = static.query_start_loc
        qsl[: reqs + 1].copy_(live.query_start_loc)
        qsl[reqs + 1 :].copy_(live.query_start_loc[reqs:].expand(self.num_reqs - reqs))
        _copy_padded(static.seq_lens, live.seq_lens, 0)
        static.block_table.zero_()
        static.block_table[:reqs, :width].copy_(live.block_table)
        _copy_padded(static.slot_mapping, live.slot_mapping, -1)
        _copy_padded(static.positions, live.positions, 0)
        for name, value in inputs.items():
            _copy_padded(self.inputs[name], value, 0)


def pad_batch(live: Batch, num_reqs: int, num_tokens: int, table_width: int | None = None
              ) -> Batch:
    """A new batch holding ``live`` padded to ``num_reqs`` requests and ``num_tokens`` tokens."""
    static = StaticBatch(num_reqs, num_tokens, table_width or live.block_table.shape[1],
                         device=live.seq_lens.device)
    static.load(live)
    return static.batch


def _check_live(live: Batch) -> None:
    dims = {"query_start_loc": 1, "seq_lens": 1, "block_table": 2, "slot_mapping": 1,
            "positions": 1}
    for name, ndim in dims.items():
        t = getattr(live, name)
        if not isinstance(t, Tensor) or t.dtype not in INTEGER_DTYPES:
            got = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(f"StaticBatch.load: `{name}` must be an int32 or int64 tensor, "
                            f"got {got}")
        if t.dim() != ndim:
            raise ValueError(f"StaticBatch.load: `{name}` must have {ndim} dimension(s), got "
                             f"shape {tuple(t.shape)}")
    rows = {"query_start_loc": (live.num_reqs + 1, "len(seq_lens) + 1"),
            "block_table": (live.num_reqs, "len(seq_lens)"),
            "positions": (live.num_tokens, "len(slot_mapping)")}
    for name, (want, what) in rows.items():
        got = getattr(live, name).shape[0]
        if got != want:
            raise ValueError(f"StaticBatch.load: `{name}` must have {want} rows ({what}), "
                             f"got {got}")


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


def _copy_padded(dst: Tensor, src: Tensor, fill: int) -> None:
    n = src.shape[0]
    dst[:n].copy_(src)
    dst[n:].fill_(fill)
