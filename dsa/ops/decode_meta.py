"""Decode metadata: per-token context lengths, expanded block tables, row -> request ids.

SPEC §4. For the j-th query token of decode request r (decode_len tokens this step)::

    len(r, j) = max(seq_lens[r] - decode_len[r] + j + 1, 0)

All outputs have the static capacity given as an int; rows past the real tokens are
defined (length 0, block-table row 0, request id ``num_reqs + k``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dsa.ops._checks import INDEX_DTYPES, check_int, check_size, check_tensor
from dsa.ops._registry import register
from dsa.ops._tokens import block_for, request_of, search_steps, token_requests


def _check_qsl(op: str, query_start_loc: Tensor) -> int:
    check_tensor(op, "query_start_loc", query_start_loc, dtype=INDEX_DTYPES, ndim=1,
                 contiguous=True)
    if query_start_loc.numel() < 1:
        raise ValueError(f"dsa.{op}: `query_start_loc` must have num_reqs + 1 >= 1 entries, "
                         "got 0")
    return query_start_loc.numel() - 1


def _check_seq_lens(op: str, seq_lens: Tensor, query_start_loc: Tensor, num_reqs: int) -> None:
    check_tensor(op, "seq_lens", seq_lens, dtype=INDEX_DTYPES, ndim=1, contiguous=True,
                 like=query_start_loc)
    check_size(op, "seq_lens", seq_lens, 0, num_reqs, "num_reqs = len(query_start_loc) - 1")


# --- decode_token_lens -------------------------------------------------------------------


def _decode_token_lens_out(query_start_loc: Tensor, seq_lens: Tensor, num_tokens: int) -> Tensor:
    op = "decode_token_lens"
    num_reqs = _check_qsl(op, query_start_loc)
    _check_seq_lens(op, seq_lens, query_start_loc, num_reqs)
    check_int(op, "num_tokens", num_tokens, low=0)
    return query_start_loc.new_empty(num_tokens, dtype=torch.int32)


def _decode_token_lens_cpu(query_start_loc: Tensor, seq_lens: Tensor, num_tokens: int) -> Tensor:
    out = _decode_token_lens_out(query_start_loc, seq_lens, num_tokens)
    num_reqs = seq_lens.numel()
    req = token_requests(query_start_loc, num_tokens)
    qsl = query_start_loc.long()
    seq = torch.cat([seq_lens.long(), seq_lens.new_zeros(1, dtype=torch.long)])
    start = qsl[req]
    decode_len = qsl[(req + 1).clamp_(max=num_reqs)] - start
    j = torch.arange(num_tokens, device=out.device) - start
    lens = (seq[req] - decode_len + j + 1).clamp_(min=0)
    return out.copy_(torch.where(req < num_reqs, lens, 0))


@triton.jit
def _decode_token_lens_kernel(qsl_ptr, seq_lens_ptr, out_ptr, num_tokens, num_reqs,
                              SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = t < num_tokens
    req = request_of(qsl_ptr, t, num_reqs, SEARCH_STEPS)
    real = in_range & (req < num_reqs)
    start = tl.load(qsl_ptr + req, mask=real, other=0)
    end = tl.load(qsl_ptr + req + 1, mask=real, other=0)
    seq = tl.load(seq_lens_ptr + req, mask=real, other=0)
    lens = tl.maximum(seq - (end - start) + (t - start) + 1, 0)
    tl.store(out_ptr + t, tl.where(real, lens, 0), mask=in_range)


def _decode_token_lens_cuda(query_start_loc: Tensor, seq_lens: Tensor, num_tokens: int) -> Tensor:
    out = _decode_token_lens_out(query_start_loc, seq_lens, num_tokens)
    if num_tokens:
        num_reqs = seq_lens.numel()
        block = block_for(num_tokens)
        _decode_token_lens_kernel[(triton.cdiv(num_tokens, block),)](
            query_start_loc, seq_lens, out, num_tokens, num_reqs,
            SEARCH_STEPS=search_steps(num_reqs), BLOCK=block,
        )
    return out


decode_token_lens = register(
    "decode_token_lens",
    cpu=_decode_token_lens_cpu,
    cuda=_decode_token_lens_cuda,
    fake=_decode_token_lens_out,
)
