"""IndexerConfig: derived sizes and every validation error."""

import pytest
import torch

from dsa.config import IndexerConfig

LIMITS = {"max_num_reqs": 8, "max_num_batched_tokens": 64, "max_model_len": 4096}


def test_defaults_are_deepseek_v32():
    cfg = IndexerConfig(**LIMITS)
    assert (cfg.num_heads, cfg.head_dim, cfg.topk, cfg.block_size) == (64, 128, 2048, 64)
    assert cfg.layout == "native"
    assert cfg.max_blocks_per_req == 64
    assert cfg.prefill_workspace_rows == 40 * 4096
    assert cfg.table_factor == 1
    assert cfg.block_table_width == 64


@pytest.mark.parametrize(("next_n", "layout"), [(1, "native"), (2, "native"), (3, "native"),
                                                (4, "native"), (5, "flat")])
def test_auto_layout_follows_next_n(next_n, layout):
    assert IndexerConfig(**LIMITS, next_n=next_n).layout == layout
    assert IndexerConfig(**LIMITS, next_n=next_n, logits_backend="triton").layout == layout


@pytest.mark.parametrize(("next_n", "layout"), [(2, "native"), (3, "flat"), (4, "flat")])
def test_auto_layout_on_deepgemm_takes_its_next_n(next_n, layout):
    assert IndexerConfig(**LIMITS, next_n=next_n, logits_backend="deepgemm").layout == layout


def test_native_layout_takes_any_next_n_off_deepgemm():
    cfg = IndexerConfig(**LIMITS, next_n=4, decode_layout="native", logits_backend="triton")
    assert cfg.layout == "native"


def test_derived_sizes_with_compression_and_kernel_blocks():
    cfg = IndexerConfig(**LIMITS, compress_ratio=4, kernel_block_size=16)
    assert cfg.table_factor == 4
    assert cfg.max_blocks_per_req == 16  # 4096 tokens -> 1024 states -> 16 blocks of 64
    assert cfg.block_table_width == 64  # of the engine's blocks of 16
    assert IndexerConfig(**LIMITS, dcp_world=3).block_table_width == 22  # ceil(64 / 3)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_num_reqs": 0}, ValueError, "max_num_reqs must be a positive int, got 0"),
        ({"next_n": 0}, ValueError, "next_n must be a positive int"),
        ({"head_dim": 12.0}, ValueError, "head_dim must be a positive int, got 12.0"),
        ({"topk": True}, ValueError, "topk must be a positive int, got True"),
        ({"kpool": -1}, ValueError, "kpool must be a positive int"),
        ({"kernel_block_size": 48}, ValueError, "kernel_block_size must divide block_size=64"),
        ({"kernel_block_size": 128}, ValueError, "kernel_block_size must divide"),
        ({"dcp_world": 2, "dcp_rank": 2}, ValueError, r"dcp_rank must be in \[0, dcp_world=2\)"),
        ({"dcp_world": 2, "dcp_interleave": 2}, NotImplementedError, "interleave > 1"),
        ({"max_num_batched_tokens": 4}, ValueError, "max_num_batched_tokens must be >= "),
        ({"kv_cache_dtype": "bf16"}, ValueError, r"kv_cache_dtype must be one of \['fp8', "
         r"'mxfp4'\], got 'bf16'"),
        ({"logits_backend": "cuda"}, ValueError, "logits_backend must be one of"),
        ({"decode_layout": "packed"}, ValueError, "decode_layout must be one of"),
        ({"ue8m0_scales": "no"}, ValueError, "ue8m0_scales must be a bool, got 'no'"),
        ({"decode_layout": "native", "logits_backend": "deepgemm", "next_n": 3}, ValueError,
         "native decode layout takes next_n in"),
    ],
)
def test_validation_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        IndexerConfig(**{**LIMITS, **kwargs})


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10,
                    reason="mxfp4 is valid on sm_10x")
def test_mxfp4_needs_blackwell():
    with pytest.raises(ValueError, match=r"mxfp4.*sm_10x"):
        IndexerConfig(**LIMITS, kv_cache_dtype="mxfp4")


def test_interleave_without_dcp_is_harmless():
    assert IndexerConfig(**LIMITS, dcp_interleave=4).dcp_interleave == 4


def test_compress_ratio_may_equal_max_model_len():
    """compress_ratio up to max_model_len is valid (a longest sequence has one state); one
    more is not."""
    cfg = IndexerConfig(**LIMITS, compress_ratio=4096)
    assert cfg.max_blocks_per_req == 1
    with pytest.raises(ValueError, match="compress_ratio must be <= max_model_len=4096"):
        IndexerConfig(**LIMITS, compress_ratio=4097)


@pytest.mark.parametrize(("max_model_len", "ratio", "blocks"),
                         [(4097, 1, 65), (4100, 4, 17), (100, 1, 2), (63, 1, 1)])
def test_max_blocks_per_req_counts_a_partial_last_block(max_model_len, ratio, blocks):
    """A request of max_model_len tokens spans ceil((max_model_len // R) / block_size)
    blocks: a partial last block is a block."""
    cfg = IndexerConfig(**{**LIMITS, "max_model_len": max_model_len}, compress_ratio=ratio)
    assert cfg.max_blocks_per_req == blocks
