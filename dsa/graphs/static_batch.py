"""Fixed-address input buffers of one captured bucket, and padding a live batch into them."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from dsa.meta.batch import Batch

TokenInputs = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


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
        """Copies ``live`` (and its token inputs) in, padding to capacity."""
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


def _copy_padded(dst: Tensor, src: Tensor, fill: int) -> None:
    n = src.shape[0]
    dst[:n].copy_(src)
    dst[n:].fill_(fill)
