"""Token -> request lookup on the device, shared by the metadata ops.

Tokens are flattened token-major (requests concatenated, ``query_start_loc`` delimits them).
Token ``t`` belongs to the largest ``r`` with ``query_start_loc[r] <= t``; ``r == num_reqs``
marks a token past the real ones (graph padding); a *valid* token is a real one at a
position in ``[0, max_model_len)`` (design §9). No host sync, no data-dependent sizes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


def token_requests(query_start_loc: Tensor, num_tokens: int) -> Tensor:
    """int64 ``[num_tokens]``: request of each token, ``num_reqs`` for padding tokens."""
    num_reqs = query_start_loc.numel() - 1
    tokens = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    req = torch.searchsorted(query_start_loc, tokens, right=True) - 1
    return req.clamp_(0, num_reqs)


def token_offsets(query_start_loc: Tensor, num_tokens: int) -> tuple[Tensor, Tensor]:
    """(int64 request of each token, ``num_reqs`` for padding tokens; int64 ``t - end`` of
    the token's request, so -1 for a request's last token and 0 for padding tokens)."""
    num_reqs = query_start_loc.numel() - 1
    req = token_requests(query_start_loc, num_tokens).long()
    end = query_start_loc.long()[(req + 1).clamp(max=num_reqs)]
    t = torch.arange(num_tokens, device=query_start_loc.device)
    return req, torch.where(req < num_reqs, t - end, 0)


def search_steps(num_reqs: int) -> int:
    """Binary-search steps that resolve any token among ``num_reqs + 1`` candidates."""
    return max(num_reqs, 0).bit_length()


# (token, request) pairs a program may compare at once to look its tokens up in one read of
# ``query_start_loc`` instead of a binary search (a load per step, one after another).
LOOKUP_PAIRS = 8192


def lookup_requests(num_reqs: int, lookups: int) -> int:
    """``REQS`` of :func:`request_of` for a program looking up ``lookups`` tokens at a time:
    the requests' power-of-two cover when the pairs fit ``LOOKUP_PAIRS``, else 0 (search)."""
    reqs = triton.next_power_of_2(max(num_reqs, 1))
    return reqs if reqs * triton.next_power_of_2(max(lookups, 1)) <= LOOKUP_PAIRS else 0


@triton.jit
def request_of(qsl_ptr, t, num_reqs, SEARCH_STEPS: tl.constexpr, REQS: tl.constexpr = 0):
    """For each token in ``t`` (a 1-d block), the largest ``r <= num_reqs`` with
    ``qsl[r] <= t``: a vectorised binary search (SEARCH_STEPS loads, one after another), or
    with REQS (a power of two >= num_reqs) a count of the ends ``qsl[1 .. num_reqs]`` <= t
    from one load (the same request for non-decreasing ``qsl``). Every load stays inside
    ``qsl[0 .. num_reqs]``."""
    if REQS:
        r = 1 + tl.arange(0, REQS)
        ends = tl.load(qsl_ptr + r, mask=r <= num_reqs, other=0)
        before = (ends[None, :] <= t[:, None]) & (r <= num_reqs)[None, :]
        lo = tl.sum(before.to(t.dtype), axis=1)
    else:
        lo = tl.zeros_like(t)
        hi = lo + num_reqs
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi + 1) // 2
            ok = tl.load(qsl_ptr + mid) <= t
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def token_offset(qsl_ptr, t, in_range, num_reqs, SEARCH_STEPS: tl.constexpr,
                 REQS: tl.constexpr = 0):
    """For tokens ``t``: (request, whether the token is real, ``t - end`` of its request)."""
    req = request_of(qsl_ptr, t, num_reqs, SEARCH_STEPS, REQS)
    real = in_range & (req < num_reqs)
    end = tl.load(qsl_ptr + req + 1, mask=real, other=0)
    return req, real, t - end


def valid_tokens(requests: Tensor, positions: Tensor, num_reqs: int,
                 max_model_len: int) -> Tensor:
    """Torch: bool, a real token (request < ``num_reqs``) at a position in
    ``[0, max_model_len)``."""
    return (requests < num_reqs) & (positions >= 0) & (positions < max_model_len)


@triton.jit
def valid_tokens_tl(requests, positions, num_reqs, max_model_len):
    """Triton: same as ``valid_tokens``."""
    return (requests < num_reqs) & (positions >= 0) & (positions < max_model_len)
