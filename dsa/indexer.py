"""``dsa.Indexer``: the DeepSeek V3.2 lightning indexer layer, written with ``torch.ops.dsa``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from dsa import distributed
from dsa._pytree import pytree_dataclass
from dsa.config import IndexerConfig, hf_config_dict, hf_switch
from dsa.meta.decode import DecodeMetadata
from dsa.meta.prefill import PrefillMetadata
from dsa.ops import block_fp8
from dsa.ops._checks import (
    POSITION_DTYPES,
    check_size,
    check_tensor,
    is_finite_number,
    is_int,
)
from dsa.ops.dcp import owned_indices
from dsa.ops.project import KERNEL_TOKENS, project_torch
from dsa.ops.quant import FLOAT_DTYPES
from dsa.ops.topk.scored import check_merge_size
from dsa.rope import YarnScaling, rope_scaling_from_hf, rope_table

ops = torch.ops.dsa


class BlockFP8Linear(nn.Module):
    """The weight of a bias-free linear layer as DeepSeek ships it: fp8 e4m3 ``weight``
    ``[out_features, in_features]`` and its fp32 ``weight_scale_inv``, one per 128x128 block
    (``dsa.ops.block_fp8``). Holds the weight for the indexer's ops; no forward."""

    def __init__(self, in_features: int, out_features: int,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, device=device,
                                               dtype=torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.ones(block_fp8.scale_shape(out_features, in_features), device=device),
            requires_grad=False)


@pytree_dataclass()
@dataclass(frozen=True)
class IndexerOutput:
    """What sparse MLA consumes from the indexer.

    Attributes:
        indices: int32 ``[T, topk]`` selected key positions of each token, relative to its
            request's sequence (compressed states when R > 1); -1 in unused slots.
        slots: int32 ``[T, topk]`` the same keys as global K-cache slots; -1 where unused.
        global_indices: with a DCP group (decode), int32 ``[T, topk]`` the exact top-k of
            the whole sequence as global positions (ties at the k-th score to the lower
            positions; order inside a row free), the same on every rank; ``indices`` and
            ``slots`` then hold only the keys this rank owns (-1 for the others). ``None``
            otherwise.
    """

    indices: Tensor
    slots: Tensor
    global_indices: Tensor | None = None


class Indexer(nn.Module):
    """The lightning indexer: scores every cached key for each query token, keeps the top-k.

    ``wq_b`` on the q latent and ``wk`` + LayerNorm on the hidden state give q ``[T, H, D]``
    and k ``[T, D]``; RoPE rotates their first ``rope_dim`` dims (NeoX halves, DeepSeek's; or
    with ``rope_interleaved`` pairs ``2i, 2i + 1``, GLM-5's), an optional Hadamard rotation
    mixes all D, then q is quantised per (token, head) and k is written to the fp8 paged
    cache (a buffer of this module): up to ``KERNEL_TOKENS`` (512) tokens one op from the
    hidden state (``project_quantize_and_cache_k``), more the projections as torch ops and
    one fused op each for q and k (design §2). As in DeepSeek's reference, ``k_norm`` and
    ``weights_proj`` (which gives the head weights) keep fp32 parameters and compute in fp32,
    also through a cast of the layer (a whole model's ``to(dtype)``), which sets only its
    ``dtype`` and 16-bit ``wq_b`` / ``wk``. ``rope_scaling``: YaRN for the RoPE table,
    ``None`` for plain RoPE.

    DCP (``cfg.dcp_world > 1``): the cache holds this rank's shard. With ``dcp_group`` (the
    process group of the ``dcp_world`` ranks, this process being ``cfg.dcp_rank``), decode
    selects the exact top-k of the whole sequence across the ranks (``dsa.distributed``,
    design §11); without it, and in prefill, each rank selects among its own keys only.

    The K cache has ``cfg.num_blocks`` blocks (required): metadata built from a config with
    the same ``num_blocks`` keeps every length, and so every selection, inside the cache.
    ``forward`` refuses metadata built from a config that differs in any field the metadata
    depends on (``IndexerConfig.metadata_key``: the cache, layout, parallelism, model
    length).

    Weights load from a DeepSeek state dict: ``wq_b.weight``, ``wk.weight``,
    ``k_norm.weight``, ``k_norm.bias``, ``weights_proj.weight`` (``load_state_dict``), or
    from a checkpoint as shipped, fp8 block-scaled weights included (``load_checkpoint``).
    ``fp8_weights``: ``wq_b`` and ``wk`` stay as DeepSeek ships them, fp8 e4m3 with an fp32
    ``weight_scale_inv`` per 128x128 block (half the bytes a decode step reads for them);
    the layer computes what it computes on them dequantised to ``dtype`` (bit for bit on
    the CPU; on the GPU its kernels sum in another order, within their rounding). On an
    H200 this pays for one-token steps (a layer step at (1, 4K): 29.5-29.9 against 32.1-32.4 µs) and
    costs 1.6-4.3 µs at 64-128 tokens a step (the matrix products dequantise each element).
    """

    def __init__(
        self,
        cfg: IndexerConfig,
        *,
        hidden_size: int,
        q_lora_rank: int,
        rope_dim: int = 64,
        rope_theta: float = 10000.0,
        rope_scaling: YarnScaling | None = None,
        rope_interleaved: bool = False,
        hadamard: bool = True,
        dcp_group: torch.distributed.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        fp8_weights: bool = False,
    ) -> None:
        super().__init__()
        _check_layer_args(cfg, hidden_size, q_lora_rank, rope_theta, rope_scaling, dtype)
        if dcp_group is not None:
            distributed.check_dcp_group("Indexer", dcp_group, cfg.dcp_world, cfg.dcp_rank,
                                        cfg.dcp_interleave)
            check_merge_size("Indexer", cfg.dcp_world, cfg.topk, sorted=False)
        self.dcp_group = dcp_group
        if cfg.num_blocks is None:
            raise ValueError("Indexer: IndexerConfig.num_blocks (the K cache's blocks) must be "
                             "set, so the metadata keeps every selection inside the cache")
        if cfg.kpool is not None:
            raise ValueError("Indexer: the kpool tail is a storage-only cache; build its slot "
                             "mapping with build_decode_metadata and write it elsewhere")
        if not 0 < rope_dim <= cfg.head_dim or rope_dim % 2:
            raise ValueError(f"Indexer: rope_dim must be even and in (0, head_dim="
                             f"{cfg.head_dim}], got {rope_dim}")
        self.cfg = cfg
        heads, dim = cfg.num_heads, cfg.head_dim
        self.dtype = dtype
        linear = BlockFP8Linear if fp8_weights else partial(nn.Linear, bias=False, dtype=dtype)
        self.wq_b = linear(q_lora_rank, heads * dim, device=device)
        self.wk = linear(hidden_size, dim, device=device)
        self.k_norm = nn.LayerNorm(dim, eps=1e-6, device=device, dtype=torch.float32)
        self.weights_proj = nn.Linear(hidden_size, heads, bias=False, device=device,
                                      dtype=torch.float32)
        self.rope_dim = rope_dim
        self.rope_interleaved = rope_interleaved
        self.register_buffer(
            "rope_cos_sin",
            rope_table(cfg.max_model_len, rope_dim, rope_theta, rope_scaling, device),
            persistent=False,
        )
        if hadamard and dim & (dim - 1):
            raise ValueError(f"Indexer: the Hadamard rotation needs a power-of-two head_dim, "
                             f"got {dim}")
        self.hadamard = hadamard
        self.register_buffer(
            "kv_cache",
            torch.zeros(cfg.num_blocks, cfg.block_size, 1, dim + 4, dtype=torch.uint8,
                        device=device),
            persistent=False,
        )

    @classmethod
    def from_hf_config(
        cls,
        config: Mapping[str, Any],
        *,
        max_num_reqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_blocks: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        fp8_weights: bool = False,
        **cfg_overrides: Any,
    ) -> Indexer:
        """A layer sized by a DeepSeek V3.2 ``config.json`` dict and the scheduler's limits.

        Reads ``hidden_size``, ``q_lora_rank``, ``index_n_heads``, ``index_head_dim``,
        ``index_topk``, ``qk_rope_head_dim``, ``rope_theta`` and ``rope_scaling`` (absent or
        null: plain RoPE; or both from ``rope_parameters``, as transformers 5 writes them),
        ``indexer_rope_interleave`` (true: RoPE on interleaved pairs, GLM-5's indexer;
        absent: NeoX halves, DeepSeek's) and ``quantization_config.scale_fmt`` (``"ue8m0"``,
        DeepSeek's fp8 checkpoints, sets ``ue8m0_scales``: the indexer's q and k scales
        rounded up to powers of two, as DeepSeek's reference quantises them; absent or null,
        plain fp32 scales). ``cfg_overrides``: other ``IndexerConfig`` fields (block_size,
        next_n, ...), and ``ue8m0_scales`` over the config's. ``fp8_weights``: see the class.
        Weights are uninitialised: see ``load_checkpoint``.
        """
        config = hf_config_dict(config, "Indexer.from_hf_config")

        def read(key: str) -> Any:
            if config.get(key) is None:
                raise ValueError(f"Indexer.from_hf_config: the config has no {key!r} (a "
                                 "DeepSeek V3.2 config.json is expected)")
            return config[key]

        # theta at the top or inside rope_parameters / rope_scaling (transformers 5 writes
        # it into both): wherever it is given, one value.
        rope_parameters = dict(config.get("rope_parameters") or {})
        rope_scaling = config.get("rope_scaling")
        rope_scaling = None if rope_scaling is None else dict(rope_scaling)
        given = {name: value for name, value in (
            ("rope_theta", config.get("rope_theta")),
            ("rope_parameters.rope_theta", rope_parameters.pop("rope_theta", None)),
            ("rope_scaling.rope_theta", (rope_scaling or {}).pop("rope_theta", None)))
            if value is not None}
        if len(set(given.values())) > 1:
            raise ValueError(f"Indexer.from_hf_config: the config's RoPE thetas disagree: "
                             f"{given}")
        if not given:
            raise ValueError("Indexer.from_hf_config: the config has no 'rope_theta' (nor "
                             "rope_parameters.rope_theta; a DeepSeek V3.2 config.json is "
                             "expected)")
        theta = next(iter(given.values()))
        if rope_scaling is None and rope_parameters:
            rope_scaling = rope_parameters
        scale_fmt = (config.get("quantization_config") or {}).get("scale_fmt")
        if scale_fmt not in (None, "ue8m0"):
            raise ValueError(f"Indexer.from_hf_config: quantization_config.scale_fmt must be "
                             f"'ue8m0' or absent, got {scale_fmt!r}")
        cfg_overrides.setdefault("ue8m0_scales", scale_fmt == "ue8m0")
        cfg = IndexerConfig(max_num_reqs=max_num_reqs,
                            max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=max_model_len, num_heads=read("index_n_heads"),
                            head_dim=read("index_head_dim"), topk=read("index_topk"),
                            num_blocks=num_blocks, **cfg_overrides)
        interleaved = hf_switch(config, "indexer_rope_interleave", "Indexer.from_hf_config")
        return cls(cfg, hidden_size=read("hidden_size"), q_lora_rank=read("q_lora_rank"),
                   rope_dim=read("qk_rope_head_dim"),
                   rope_theta=theta, rope_scaling=rope_scaling_from_hf(rope_scaling),
                   rope_interleaved=interleaved, device=device, dtype=dtype,
                   fp8_weights=fp8_weights)

    def load_checkpoint(self, state_dict: Mapping[str, Tensor], prefix: str = "") -> None:
        """Loads this layer's weights from a checkpoint state dict as DeepSeek V3.2 ships it.

        Reads the keys under ``prefix`` (e.g. ``"model.layers.3.self_attn.indexer."``) and
        ignores the others. ``wq_b.weight`` and ``wk.weight`` may be fp8 e4m3 with fp32
        ``.weight_scale_inv`` scales, one per 128x128 block; they are dequantised to the
        layer's dtype, or kept with ``fp8_weights`` (which takes fp8 ones only: see
        ``block_fp8.quantize`` for 16-bit ones). A missing, unexpected or wrong-shaped key
        raises ``ValueError``.
        """
        if prefix and not prefix.endswith("."):
            prefix += "."
        own = {key[len(prefix):]: value for key, value in state_dict.items()
               if key.startswith(prefix)}
        params = dict(self.named_parameters())
        values = {name: _checkpoint_weight(own, prefix, name, param)
                  for name, param in params.items()}
        scales = {f"{name}_scale_inv" for name, param in params.items() if param.ndim == 2
                  and own[name].dtype == torch.float8_e4m3fn}
        unexpected = sorted(set(own) - set(params) - scales)
        if unexpected:
            raise ValueError(f"Indexer.load_checkpoint: unexpected keys "
                             f"{[prefix + key for key in unexpected]}")
        with torch.no_grad():
            for name, value in values.items():
                params[name].copy_(value)

    def _apply(self, fn: Any, recurse: bool = True) -> Indexer:
        """``nn.Module``'s moves and casts (``to``, ``cuda``, ``half``, a whole model's
        ``to(dtype)``): a cast of floating dtypes sets the layer's ``dtype`` and its 16-bit /
        fp32 ``wq_b`` and ``wk``; ``k_norm``, ``weights_proj`` and the RoPE table stay fp32,
        fp8 weights and their scales as shipped."""
        dtype = fn(torch.empty(0, dtype=self.dtype, device=self.kv_cache.device)).dtype
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"Indexer: the layer's dtype must be one of {list(FLOAT_DTYPES)}, "
                             f"a cast asks for {dtype}")
        follow = {f"{name}.weight" for name in ("wq_b", "wk")
                  if isinstance(getattr(self, name), nn.Linear)}
        # .data: the original storage, which a parameter's in-place conversion leaves behind
        kept = {name: t.data for name, t in (*self.named_parameters(), *self.named_buffers())
                if name not in follow and t.is_floating_point()}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            owner, _, leaf = name.rpartition(".")
            module = self.get_submodule(owner)
            new = getattr(module, leaf)
            if new.dtype != old.dtype:  # cast back from the original: nothing lost
                if isinstance(new, nn.Parameter):
                    new.data = old.to(new.device)
                else:
                    setattr(module, leaf, old.to(new.device))
        self.dtype = dtype
        return self

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
            positions: ``[T]`` positions of the tokens in their sequences, for RoPE: the
                batch's ``positions`` the metadata was built from (its ``valid_tokens``
                come from those).
            meta: the step's metadata, shared by every layer.
        """
        cfg = self.cfg
        self._check_inputs(hidden, q_latent, positions, meta)
        # Projections, RoPE, Hadamard, quantisation and the K write. The ops clamp a position
        # outside [0, max_model_len) into the RoPE table; such a token writes no K and selects
        # nothing (meta.valid_tokens).
        rotation = (self.rope_cos_sin, positions, self.hadamard, cfg.ue8m0_scales)
        if hidden.shape[0] <= KERNEL_TOKENS:  # two launches instead of about ten
            q_fp8, head_weights = ops.project_quantize_and_cache_k(
                hidden, q_latent, self.wq_b.weight, self.wk.weight, self.k_norm.weight,
                self.k_norm.bias, self.k_norm.eps, self.weights_proj.weight, self.kv_cache,
                meta.slot_mapping, *rotation, *self._weight_scales(), self.rope_interleaved)
        else:  # the GEMMs as torch ops: torch.compile fuses the norm and casts around them
            q, k, weights = self._project(hidden, q_latent)
            ops.rope_hadamard_quantize_and_cache_k(k, self.kv_cache, meta.slot_mapping,
                                                   *rotation, self.rope_interleaved)
            q_fp8, head_weights = ops.rope_hadamard_quantize_q(q, weights, *rotation,
                                                               self.rope_interleaved)
        global_indices = None
        if isinstance(meta, DecodeMetadata):
            indices, slots, global_indices = self._decode_topk(q_fp8, head_weights, meta)
        else:
            indices, slots = self._prefill_topk(q_fp8, head_weights, meta)
        return IndexerOutput(indices=indices, slots=slots, global_indices=global_indices)

    def _select(self, logits: Tensor, lens: Tensor, meta: DecodeMetadata | PrefillMetadata,
                tokens: slice, consume: bool = False) -> tuple[Tensor, Tensor]:
        """Top-k indices and cache slots of logits rows that are the tokens ``tokens``, whose
        lengths ``lens`` are 0 outside ``meta.valid_tokens`` (such a token selects nothing).
        consume: the logits are dead after (their lines leave L2 unwritten)."""
        select = ops.topk_indices_and_slots_consume if consume else ops.topk_indices_and_slots
        return select(logits, lens.view(-1, 1), self.cfg.topk, meta.request_block_table,
                      meta.token_requests[tokens], self.cfg.block_size, self.kv_cache.shape[0])

    def _check_inputs(self, hidden: Tensor, q_latent: Tensor, positions: Tensor,
                      meta: DecodeMetadata | PrefillMetadata) -> None:
        """Names the argument a bad call gets wrong (shapes, dtypes and devices only)."""
        op = "Indexer.forward"
        cache = self.kv_cache
        for name, x, layer in (("hidden", hidden, self.wk), ("q_latent", q_latent, self.wq_b)):
            check_tensor(op, name, x, dtype=self.dtype, ndim=2, like=cache)
            check_size(op, name, x, 1, layer.in_features, f"the layer's {name} width")
        check_tensor(op, "positions", positions, dtype=POSITION_DTYPES, ndim=1, like=cache)
        if not isinstance(meta, DecodeMetadata | PrefillMetadata):
            raise TypeError(f"dsa.{op}: `meta` must be DecodeMetadata or PrefillMetadata, got "
                            f"{type(meta).__name__}")
        ours = self.cfg.metadata_key()
        if meta.built_for != ours:
            theirs = dict(meta.built_for)
            differ = [(name, value) for name, value in ours if theirs.get(name) != value]
            raise ValueError(
                f"dsa.{op}: `meta` must be built from a config like this layer's (its K cache, "
                f"layout and parallelism): built for "
                + ", ".join(f"{n}={theirs.get(n)}" for n, _ in differ) + ", the layer has "
                + ", ".join(f"{n}={v}" for n, v in differ))
        tokens = meta.slot_mapping.shape[0]
        for name, x in (("hidden", hidden), ("q_latent", q_latent), ("positions", positions)):
            check_size(op, name, x, 0, tokens, "the metadata's tokens")

    def _project(self, hidden: Tensor, q_latent: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q ``[T, H, D]``, k ``[T, D]`` (normed) and the head weights, before RoPE."""
        return project_torch(hidden, q_latent, self.wq_b.weight, self.wk.weight,
                             self.k_norm.weight, self.k_norm.bias, self.k_norm.eps,
                             self.weights_proj.weight, *self._weight_scales())

    def _weight_scales(self) -> tuple[Tensor | None, Tensor | None]:
        """The block scales of ``wq_b`` and ``wk`` (``None`` unless ``fp8_weights``)."""
        return tuple(getattr(linear, "weight_scale_inv", None)
                     for linear in (self.wq_b, self.wk))

    def _decode_topk(self, q_fp8: Tensor, head_weights: Tensor, meta: DecodeMetadata
                     ) -> tuple[Tensor, Tensor, Tensor | None]:
        cfg = self.cfg
        rows = meta.context_lens.shape[0]
        if meta.packed:
            q_rows = ops.pack_decode_rows(q_fp8, meta.query_start_loc, meta.next_n)
            w_rows = ops.pack_decode_rows(head_weights, meta.query_start_loc, meta.next_n)
            w_rows = w_rows.flatten(0, 1)
        else:
            q_rows = q_fp8.view(rows, meta.next_n, cfg.num_heads, cfg.head_dim)
            w_rows = head_weights
        if meta.logits_backend == "deepgemm":  # lengths >= 1, as the schedule's
            logits = ops.paged_mqa_logits_deepgemm(q_rows, self.kv_cache, w_rows,
                                                   meta.schedule_lens, meta.block_table,
                                                   meta.max_context_len, meta.schedule, True)
        else:
            logits = ops.paged_mqa_logits(q_rows, self.kv_cache, w_rows, meta.context_lens,
                                          meta.block_table, meta.max_context_len)
        if self.dcp_group is None and not meta.packed:  # logits rows are the tokens
            return *self._select(logits, meta.select_lens, meta, slice(None), True), None
        if self.dcp_group is None:
            indices = ops.topk_indices(logits, meta.context_lens, cfg.topk)
        else:  # global positions
            indices, _ = distributed.dcp_topk(logits, meta.context_lens, cfg.topk,
                                              self.dcp_group, world=cfg.dcp_world,
                                              rank=cfg.dcp_rank)
        if meta.packed:
            indices = ops.unpack_decode_rows(
                indices.view(rows, meta.next_n, cfg.topk), meta.query_start_loc,
                meta.num_tokens,
            )
        indices = torch.where(meta.valid_tokens[:, None], indices, -1)
        global_indices = None
        if self.dcp_group is not None:
            global_indices = indices
            indices = owned_indices(global_indices, cfg.dcp_world, cfg.dcp_rank)
        slots = ops.indices_to_slots(indices, meta.request_block_table, meta.token_requests,
                                     cfg.block_size, self.kv_cache.shape[0])
        return indices, slots, global_indices

    def _prefill_topk(self, q_fp8: Tensor, head_weights: Tensor, meta: PrefillMetadata
                      ) -> tuple[Tensor, Tensor]:
        cfg = self.cfg
        indices = q_fp8.new_full((q_fp8.shape[0], cfg.topk), -1, dtype=torch.int32)
        slots = torch.full_like(indices, -1)
        k_fp8 = k_scale = None
        logits_op = ops.mqa_logits_deepgemm if meta.logits_backend == "deepgemm" else ops.mqa_logits
        for chunk in meta.chunks:
            if chunk.num_local_rows == 0:
                continue
            if not chunk.skip_gather:
                k_fp8, k_scale = ops.gather_k(self.kv_cache, chunk.block_table,
                                              chunk.local_cu_seq_lens, chunk.num_local_rows)
            span = slice(chunk.token_start, chunk.token_end)
            logits = logits_op(q_fp8[span], k_fp8, k_scale, head_weights[span], chunk.ks,
                               chunk.ke, chunk.max_seqlen_k)
            lens = (chunk.ke - chunk.ks).clamp(0, chunk.max_seqlen_k)
            lens = torch.where(meta.valid_tokens[span], lens, 0)
            indices[span], slots[span] = self._select(logits, lens, meta, span)
        return indices, slots


def _check_layer_args(cfg: object, hidden_size: object, q_lora_rank: object,
                      rope_theta: object, rope_scaling: object, dtype: object) -> None:
    """The Indexer's constructor arguments that its parts would otherwise fail on deep
    inside (or, for ``rope_theta``, silently: a NaN RoPE table)."""
    if not isinstance(cfg, IndexerConfig):
        raise TypeError(f"Indexer: `cfg` must be a dsa.IndexerConfig, got {type(cfg).__name__}")
    for name, value in (("hidden_size", hidden_size), ("q_lora_rank", q_lora_rank)):
        if not is_int(value) or value < 1:
            raise ValueError(f"Indexer: `{name}` must be a positive int, got {value!r}")
    if not is_finite_number(rope_theta) or rope_theta <= 0:
        raise ValueError(f"Indexer: `rope_theta` must be a positive finite number, got "
                         f"{rope_theta!r}")
    if rope_scaling is not None and not isinstance(rope_scaling, YarnScaling):
        raise TypeError(f"Indexer: `rope_scaling` must be a dsa.YarnScaling or None (from a HF "
                        f"config: dsa.rope.rope_scaling_from_hf), got "
                        f"{type(rope_scaling).__name__}")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"Indexer: `dtype` must be one of {list(FLOAT_DTYPES)}, got {dtype!r}")


def _checkpoint_weight(own: Mapping[str, Tensor], prefix: str, name: str, param: Tensor
                       ) -> Tensor:
    """Checkpoint tensor ``name`` checked against ``param``, dequantised when it is fp8."""
    value = _checkpoint_tensor(own, prefix, name, tuple(param.shape))
    if name.endswith("_scale_inv"):  # fp8_weights: the block scales, kept as fp32
        return _block_scales(value, prefix + name)
    if param.dtype == torch.float8_e4m3fn:  # fp8_weights: kept as shipped
        if value.dtype != torch.float8_e4m3fn:
            raise ValueError(f"Indexer.load_checkpoint: {prefix + name!r} has dtype "
                             f"{value.dtype}, expected fp8 e4m3 for a layer built with "
                             "fp8_weights=True (build it without, or quantise the weight with "
                             "dsa.ops.block_fp8.quantize)")
        return value
    if param.ndim == 2 and value.dtype == torch.float8_e4m3fn:
        blocks = block_fp8.scale_shape(*param.shape)
        key = f"{name}_scale_inv"
        scale = _block_scales(_checkpoint_tensor(own, prefix, key, blocks), prefix + key)
        value = block_fp8.dequantize(value, scale.to(value.device), torch.float32)
    elif not value.is_floating_point() or value.dtype.itemsize < 2:
        raise ValueError(f"Indexer.load_checkpoint: {prefix + name!r} has dtype {value.dtype}, "
                         "expected bf16/fp16/fp32 (or fp8 e4m3 with block scales for a linear "
                         "weight)")
    return value.to(param.dtype)


def _block_scales(value: Tensor, key: str) -> Tensor:
    """A checkpoint's block scales as fp32 (exact from any 16- or 32-bit float)."""
    if not value.is_floating_point() or value.dtype.itemsize < 2:
        raise ValueError(f"Indexer.load_checkpoint: {key!r} has dtype {value.dtype}, expected "
                         "the fp32 block scales (weight_scale_inv) of an fp8 weight")
    return value.float()


def _checkpoint_tensor(own: Mapping[str, Tensor], prefix: str, name: str,
                       shape: tuple[int, ...]) -> Tensor:
    if name not in own:
        raise ValueError(f"Indexer.load_checkpoint: missing key {prefix + name!r} "
                         f"(expected shape {list(shape)})")
    value = own[name]
    if tuple(value.shape) != shape:
        raise ValueError(f"Indexer.load_checkpoint: {prefix + name!r} has shape "
                         f"{list(value.shape)}, expected {list(shape)}")
    return value
