"""``dsa.Indexer``: the DeepSeek V3.2 lightning indexer layer, written with ``torch.ops.dsa``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange
from torch import Tensor, nn

from dsa._pytree import pytree_dataclass
from dsa.config import IndexerConfig
from dsa.meta.decode import DecodeMetadata
from dsa.meta.prefill import PrefillMetadata

ops = torch.ops.dsa


@pytree_dataclass()
@dataclass(frozen=True)
class IndexerOutput:
    """What sparse MLA consumes from the indexer.

    Attributes:
        indices: int32 ``[T, topk]`` selected key positions of each token, relative to its
            request's sequence (compressed states when R > 1); -1 in unused slots.
        slots: int32 ``[T, topk]`` the same keys as global K-cache slots; -1 where unused.
    """

    indices: Tensor
    slots: Tensor


class Indexer(nn.Module):
    """The lightning indexer: scores every cached key for each query token, keeps the top-k.

    ``wq_b`` on the q latent and ``wk`` + LayerNorm on the hidden state give q ``[T, H, D]``
    and k ``[T, D]``; NeoX RoPE rotates their first ``rope_dim`` dims, an optional Hadamard
    rotation mixes all D, then q is quantised per (token, head) and k is written to the fp8
    paged cache (a buffer of this module). ``weights_proj`` gives the head weights.

    Weights load from a DeepSeek state dict: ``wq_b.weight``, ``wk.weight``,
    ``k_norm.weight``, ``k_norm.bias``, ``weights_proj.weight``.
    """

    def __init__(
        self,
        cfg: IndexerConfig,
        *,
        hidden_size: int,
        q_lora_rank: int,
        num_blocks: int,
        rope_dim: int = 64,
        rope_theta: float = 10000.0,
        hadamard: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        if cfg.kpool is not None:
            raise ValueError("Indexer: the kpool tail is a storage-only cache; build its slot "
                             "mapping with build_decode_metadata and write it elsewhere")
        if not 0 < rope_dim <= cfg.head_dim or rope_dim % 2:
            raise ValueError(f"Indexer: rope_dim must be even and in (0, head_dim="
                             f"{cfg.head_dim}], got {rope_dim}")
        self.cfg = cfg
        heads, dim = cfg.num_heads, cfg.head_dim
        factory = {"device": device, "dtype": dtype}
        self.wq_b = nn.Linear(q_lora_rank, heads * dim, bias=False, **factory)
        self.wk = nn.Linear(hidden_size, dim, bias=False, **factory)
        self.k_norm = nn.LayerNorm(dim, eps=1e-6, **factory)
        self.weights_proj = nn.Linear(hidden_size, heads, bias=False, **factory)
        self.rope_dim = rope_dim
        self.register_buffer(
            "rope_cos_sin", _rope_table(cfg.max_model_len, rope_dim, rope_theta, device),
            persistent=False,
        )
        self.register_buffer(
            "hadamard", _hadamard(dim, device, dtype) if hadamard else None, persistent=False
        )
        self.register_buffer(
            "kv_cache",
            torch.zeros(num_blocks, cfg.block_size, 1, dim + 4, dtype=torch.uint8, device=device),
            persistent=False,
        )

    def forward(
        self,
        hidden: Tensor,
        q_latent: Tensor,
        positions: Tensor,
        meta: DecodeMetadata | PrefillMetadata,
    ) -> IndexerOutput:
        """Writes this step's K to the cache and selects the top-k keys of every token.

        Args:
            hidden: ``[T, hidden_size]`` hidden states of the step's tokens.
            q_latent: ``[T, q_lora_rank]`` the query latent (after q_a norm).
            positions: ``[T]`` positions of the tokens in their sequences.
            meta: the step's metadata, shared by every layer.
        """
        cfg = self.cfg
        q, k, weights = self._project(hidden, q_latent, positions)
        ops.quantize_and_cache_k(k, self.kv_cache, meta.slot_mapping, ue8m0=cfg.ue8m0_scales)
        q_fp8, head_weights = ops.quantize_q(q, weights, ue8m0=cfg.ue8m0_scales)
        if isinstance(meta, DecodeMetadata):
            indices = self._decode_topk(q_fp8, head_weights, meta)
        else:
            indices = self._prefill_topk(q_fp8, head_weights, meta)
        slots = ops.indices_to_slots(indices, meta.request_block_table, meta.token_requests,
                                     cfg.block_size)
        return IndexerOutput(indices=indices, slots=slots)

    def _project(self, hidden: Tensor, q_latent: Tensor, positions: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor]:
        q = rearrange(self.wq_b(q_latent), "t (h d) -> t h d", d=self.cfg.head_dim)
        k = self.k_norm(self.wk(hidden))
        cos_sin = self.rope_cos_sin[positions.long()]
        q = _neox_rope(q, cos_sin.unsqueeze(1), self.rope_dim)
        k = _neox_rope(k, cos_sin, self.rope_dim)
        if self.hadamard is not None:
            q, k = q @ self.hadamard, k @ self.hadamard
        return q, k, self.weights_proj(hidden)

    def _decode_topk(self, q_fp8: Tensor, head_weights: Tensor, meta: DecodeMetadata) -> Tensor:
        cfg = self.cfg
        rows = meta.context_lens.shape[0]
        if meta.packed:
            q_rows = ops.pack_decode_rows(q_fp8, meta.query_start_loc, meta.next_n)
            w_rows = ops.pack_decode_rows(head_weights, meta.query_start_loc, meta.next_n)
            w_rows = w_rows.flatten(0, 1)
        else:
            q_rows = q_fp8.view(rows, meta.next_n, cfg.num_heads, cfg.head_dim)
            w_rows = head_weights
        logits = ops.paged_mqa_logits(
            q_rows, self.kv_cache, w_rows, meta.context_lens, meta.block_table,
            meta.max_context_len, backend=cfg.logits_backend, schedule=meta.schedule,
        )
        indices = ops.topk_indices(logits, meta.context_lens, cfg.topk)
        if meta.packed:
            indices = ops.unpack_decode_rows(
                indices.view(rows, meta.next_n, cfg.topk), meta.query_start_loc,
                meta.num_tokens,
            )
        return indices

    def _prefill_topk(self, q_fp8: Tensor, head_weights: Tensor, meta: PrefillMetadata
                      ) -> Tensor:
        cfg = self.cfg
        indices = q_fp8.new_full((q_fp8.shape[0], cfg.topk), -1, dtype=torch.int32)
        k_fp8 = k_scale = None
        for chunk in meta.chunks:
            if chunk.num_local_rows == 0:
                continue
            if not chunk.skip_gather:
                k_fp8, k_scale = ops.gather_k(self.kv_cache, chunk.block_table,
                                              chunk.local_cu_seq_lens, chunk.num_local_rows)
            span = slice(chunk.token_start, chunk.token_end)
            logits = ops.mqa_logits(
                q_fp8[span], k_fp8, k_scale, head_weights[span], chunk.ks, chunk.ke,
                chunk.max_seqlen_k, backend=cfg.logits_backend,
            )
            indices[span] = ops.topk_indices(logits, chunk.ke - chunk.ks, cfg.topk)
        return indices


def _rope_table(max_len: int, rope_dim: int, theta: float, device) -> Tensor:
    """fp32 ``[max_len, rope_dim]``: cos of each frequency, then its sin."""
    inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64, device=device)
                         / rope_dim)
    angles = torch.arange(max_len, dtype=torch.float64, device=device)[:, None] * inv_freq
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def _neox_rope(x: Tensor, cos_sin: Tensor, rope_dim: int) -> Tensor:
    """NeoX-style rotation of the first ``rope_dim`` dims of ``x`` (halves, not pairs)."""
    half = rope_dim // 2
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    x1, x2 = x[..., :half].float(), x[..., half:rope_dim].float()
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rotated, x[..., rope_dim:]], dim=-1)


def _hadamard(dim: int, device, dtype: torch.dtype) -> Tensor:
    """The orthonormal Sylvester-Hadamard matrix of order ``dim`` (a power of two)."""
    if dim & (dim - 1):
        raise ValueError(f"Indexer: the Hadamard rotation needs a power-of-two head_dim, "
                         f"got {dim}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * dim**-0.5).to(device=device, dtype=dtype)
