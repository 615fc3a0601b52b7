"""Hostile values the ops meet only on the device: block ids outside the cache, ragged
spans wider than their rows, DeepGEMM builds with another API, division rounding.

Each case must stay in bounds and give defined output on every face (design §9)."""

from __future__ import annotations

import types

import pytest
import torch
from faces import FACE_NAMES, i32, run_op

import dsa
from dsa.ops.logits import deepgemm
from dsa.ops.quant import quantize_rows

HAS_CUDA = torch.cuda.is_available()


# --- DeepGEMM's API ------------------------------------------------------------------------


class _Builtin:
    """Stands in for a pybind11 builtin: a name and a signature line, no Python signature."""

    def __init__(self, doc: str) -> None:
        self.__name__ = doc.split("(")[0]
        self.__doc__ = doc + "\n\nSome text.\n"


def test_parameter_names_from_a_pybind_signature_line():
    fn = _Builtin("fp8_fp4_mqa_logits(q: tuple[torch.Tensor, torch.Tensor | None], kv: "
                  "tuple[torch.Tensor, torch.Tensor], weights: torch.Tensor, "
                  "cu_seq_len_k_start: torch.Tensor, cu_seq_len_k_end: torch.Tensor, "
                  "max_seqlen_k: typing.SupportsInt, schedule_meta: torch.Tensor | None = None"
                  ") -> torch.Tensor")
    assert deepgemm.parameter_names(fn) == (
        "q", "kv", "weights", "cu_seq_len_k_start", "cu_seq_len_k_end", "max_seqlen_k",
        "schedule_meta")
    assert deepgemm.parameter_names(_Builtin("f() -> None")) == ()
    assert deepgemm.parameter_names(object()) is None


def _fake_deepgemm(mqa_logits) -> types.SimpleNamespace:
    def metadata(context_lens, block_kv, num_sms, indices=None): ...

    def paged(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
              indices=None): ...

    return types.SimpleNamespace(__version__="test", get_paged_mqa_logits_metadata=metadata,
                                 fp8_fp4_paged_mqa_logits=paged, fp8_fp4_mqa_logits=mqa_logits)


def _use(monkeypatch, module) -> None:
    monkeypatch.setattr(deepgemm, "deep_gemm", lambda: module)
    monkeypatch.setattr(deepgemm, "_API_CHECK", [])


def test_known_api_with_reordered_parameters_is_accepted(monkeypatch):
    # Upstream puts clean_logits where 2.8.2 takes max_seqlen_k: dsa passes keywords.
    def upstream(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True,
                 max_seqlen_k=0): ...

    _use(monkeypatch, _fake_deepgemm(upstream))
    assert deepgemm.api_mismatch() is None


def test_unknown_api_is_refused_with_its_signature(monkeypatch):
    def renamed(q, kv, weights, ks, ke, clean_logits=True): ...

    _use(monkeypatch, _fake_deepgemm(renamed))
    reason = deepgemm.api_mismatch()
    assert "fp8_fp4_mqa_logits" in reason and "max_seqlen_k" in reason and "'ks'" in reason
    if HAS_CUDA and deepgemm.arch_major(torch.device("cuda")) == 9:
        device = torch.device("cuda")
        assert deepgemm.mqa_unsupported_reason(device, 64, 128) == reason
        with pytest.raises(ValueError, match="backend='deepgemm' cannot run this call"):
            dsa.ops.logits.ragged_backend("deepgemm", device, 64, 128)
        assert dsa.ops.logits.ragged_backend("auto", device, 64, 128) == "triton"


# --- block ids outside the cache, end to end --------------------------------------------------


def _layer_and_batch(device: str, cfg: dsa.IndexerConfig, table: torch.Tensor,
                     seq_lens: list[int]) -> tuple[dsa.Indexer, dsa.Batch]:
    torch.manual_seed(0)
    layer = dsa.Indexer(cfg, hidden_size=64, q_lora_rank=32, device=device, dtype=torch.bfloat16)
    num_reqs = len(seq_lens)
    i32 = {"dtype": torch.int32, "device": device}
    batch = dsa.Batch(
        query_start_loc=torch.arange(num_reqs + 1, **i32),
        seq_lens=torch.tensor(seq_lens, **i32),
        block_table=table.to(device=device, dtype=torch.int32),
        slot_mapping=torch.full((num_reqs,), -1, dtype=torch.int64, device=device),
        positions=torch.tensor([s - 1 for s in seq_lens], device=device),
    )
    return layer, batch


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_keys_on_invalid_blocks_are_never_selected(device):
    """Request 0's table points outside the cache at column 1, request 1's holds -1 at
    column 2, request 2's entry 2**30 (whose slot would overflow int32) at column 0."""
    num_blocks, block = 8, 64
    cfg = dsa.IndexerConfig(max_num_reqs=3, max_num_batched_tokens=3, max_model_len=512,
                            num_heads=64, head_dim=128, topk=128, block_size=block,
                            num_blocks=num_blocks)
    table = torch.tensor([[0, 9, 1, 2, 3, 4, 5, 6],
                          [7, 6, -1, 5, 4, 3, 2, 1],
                          [2**30, 1, 2, 3, 4, 5, 6, 7]])
    layer, batch = _layer_and_batch(device, cfg, table, [300, 400, 200])

    def step(batch, hidden, q_latent):
        meta = dsa.build_decode_metadata(cfg, batch)
        return meta.context_lens, layer(hidden, q_latent, batch.positions, meta)

    if device == "cpu":  # host values are checked; the device path is what compiles
        with pytest.raises(ValueError, match=r"indexer block 9 at column 1"):
            dsa.build_decode_metadata(cfg, batch)
        step = torch.compile(step, fullgraph=True, backend="aot_eager")
    lens, out = step(batch, torch.randn(3, 64, device=device, dtype=torch.bfloat16),
                     torch.randn(3, 32, device=device, dtype=torch.bfloat16))
    assert lens.view(-1).tolist() == [64, 128, 0]
    indices, slots = out.indices.cpu(), out.slots.cpu()
    for row, cap in enumerate([64, 128, 0]):
        picked = indices[row][indices[row] >= 0]
        assert sorted(picked.tolist()) == list(range(cap))
    assert ((slots == -1) | ((slots >= 0) & (slots < num_blocks * block))).all()
    assert ((slots >= 0) == (indices >= 0)).all()


# --- ragged spans wider than their rows --------------------------------------------------------


def _ragged_inputs(device: str, num_q: int, num_keys: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(1)
    q, _ = quantize_rows(torch.randn(num_q, 64, 128), False)
    k, k_scale = quantize_rows(torch.randn(num_keys, 128), False)
    weights = torch.rand(num_q, 64)
    return tuple(x.to(device) for x in (q, k, k_scale, weights))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "deepgemm"])
def test_ragged_span_wider_than_its_row_stays_in_its_row(backend):
    """Row 1's span is 3x max_seqlen_k and row 2's runs past the workspace: every row still
    equals the same row computed alone, cut to max_seqlen_k and to the workspace."""
    if backend == "deepgemm" and not deepgemm.deepgemm_mqa_supported(torch.device("cuda"), 64,
                                                                      128):
        pytest.skip("DeepGEMM cannot run here")
    width, num_keys = 256, 1024
    q, k, k_scale, weights = _ragged_inputs("cuda", 4, num_keys)
    ks = torch.tensor([0, 100, 900, 10], dtype=torch.int32, device="cuda")
    ke = torch.tensor([200, 100 + 3 * width, 2000, 266], dtype=torch.int32, device="cuda")
    op = torch.ops.dsa.mqa_logits_deepgemm if backend == "deepgemm" else torch.ops.dsa.mqa_logits
    out = op(q, k, k_scale, weights, ks, ke, width)
    lens = [200, width, num_keys - 900, 256]
    for row, n in enumerate(lens):
        alone = torch.ops.dsa.mqa_logits(q[row:row + 1], k, k_scale, weights[row:row + 1],
                                         ks[row:row + 1], ks[row:row + 1] + n, width)
        torch.testing.assert_close(out[row, :n], alone[0, :n], rtol=2e-3, atol=1e-3)


# --- correctly rounded scales on every face ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [17, 64, 4096])
def test_torch_face_on_cuda_rounds_scales_like_ieee_division(num_tokens):
    """The CPU face's arithmetic run on CUDA tensors, the Triton K-cache write and a float64
    division rounded once agree on every scale (torch's CUDA division by a Python scalar
    multiplies by the reciprocal, which differs in the last bit)."""
    torch.manual_seed(num_tokens)
    k = (torch.randn(num_tokens, 128) * torch.rand(num_tokens, 1) * 3).to(torch.bfloat16)
    values, scales = quantize_rows(k.cuda(), False)
    exact = (k.float().abs().amax(-1).clamp(min=1e-4).double() / 448).float()
    assert torch.equal(scales.cpu(), exact)
    cache = torch.zeros(num_tokens // 64 + 1, 64, 1, 132, dtype=torch.uint8, device="cuda")
    slots = torch.arange(num_tokens, device="cuda")
    torch.ops.dsa.quantize_and_cache_k(k.cuda(), cache, slots)
    cpu_cache = torch.zeros_like(cache, device="cpu")
    torch.ops.dsa.quantize_and_cache_k(k, cpu_cache, slots.cpu())
    assert torch.equal(cache.cpu(), cpu_cache)
    q_cuda = torch.ops.dsa.quantize_q(k.view(num_tokens, 1, 128).cuda(),
                                      torch.ones(num_tokens, 1, device="cuda"))
    q_cpu = torch.ops.dsa.quantize_q(k.view(num_tokens, 1, 128), torch.ones(num_tokens, 1))
    assert torch.equal(q_cuda[0].cpu().view(torch.uint8), q_cpu[0].view(torch.uint8))
    assert torch.equal(q_cuda[1].cpu(), q_cpu[1])
    assert torch.equal(values.cpu().view(torch.uint8), q_cpu[0].view(num_tokens, 128)
                       .view(torch.uint8))


# --- tokens that must not write or select ------------------------------------------------------


@pytest.mark.parametrize("layout", ["native", "flat"])  # flat: top-k takes select_lens
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_out_of_range_positions_and_padding_tokens_write_and_select_nothing(device, layout):
    """Token 1's position is max_model_len (past the RoPE table), token 2's is negative,
    token 3 is padding whose slot points into request 0's live block: none writes K or
    selects a key, nothing crashes, and token 0 still works (the step compiled, so no host
    check reads the positions)."""
    cfg = dsa.IndexerConfig(max_num_reqs=3, max_num_batched_tokens=4, max_model_len=256,
                            num_heads=64, head_dim=128, topk=32, block_size=64, num_blocks=8,
                            decode_layout=layout)
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [1, 2, 3, 4]])
    layer, batch = _layer_and_batch(device, cfg, table, [100, 200, 50])
    batch = dsa.Batch(query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
                      block_table=batch.block_table,
                      slot_mapping=torch.tensor([99, 300, 130, 5], device=device),
                      positions=torch.tensor([99, 256, -3, 5], device=device))
    before = layer.kv_cache.clone()

    def step(batch, hidden, q_latent):
        return layer(hidden, q_latent, batch.positions, dsa.build_decode_metadata(cfg, batch))

    if device == "cpu":
        step = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = step(batch, torch.randn(4, 64, device=device, dtype=torch.bfloat16),
               torch.randn(4, 32, device=device, dtype=torch.bfloat16))
    written = (layer.kv_cache != before).view(8, -1).any(dim=1).nonzero().view(-1).tolist()
    assert written == [1]  # block 1 holds token 0's slot 99; nothing else changed
    values, _ = dsa.ops.kcache.kcache_views(layer.kv_cache)
    assert torch.equal(values.view(torch.uint8)[0, 5], before.view(8, -1)[0, 5 * 128:6 * 128])
    indices = out.indices.cpu()
    assert (indices[1:] == -1).all() and (out.slots.cpu()[1:] == -1).all()
    assert sorted(indices[0][indices[0] >= 0].tolist()) != []


def test_prefill_built_while_tracing_selects_nothing_for_invalid_positions():
    """Built under torch.compile (the values fake, so no host check reads the positions), a
    prefill token at a position past max_model_len writes no K and selects nothing; the
    others select as usual."""
    cfg = dsa.IndexerConfig(max_num_reqs=2, max_num_batched_tokens=8, max_model_len=256,
                            num_heads=64, head_dim=128, topk=32, block_size=64, num_blocks=8)
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    layer, _ = _layer_and_batch("cpu", cfg, table, [3, 2])
    batch = dsa.Batch(query_start_loc=i32([0, 3, 5]), seq_lens=i32([3, 2]),
                      block_table=table.int(), slot_mapping=torch.tensor([0, 1, 2, 256, 257]),
                      positions=torch.tensor([0, 1, 999, 0, 1]))
    build = torch.compile(lambda b: dsa.build_prefill_metadata(
        cfg, b, seq_lens_cpu=[3, 2], query_start_loc_cpu=[0, 3, 5]), backend="aot_eager")
    meta = build(batch)
    assert meta.valid_tokens.tolist() == [True, True, False, True, True]
    out = layer(torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(5, 32, dtype=torch.bfloat16),
                batch.positions, meta)
    assert (out.indices[2] == -1).all() and (out.slots[2] == -1).all()
    assert [int((row >= 0).sum()) for row in out.indices] == [1, 2, 0, 1, 2]


@pytest.mark.gpu
def test_prefill_checks_device_block_ids_decode_does_not_sync():
    """Prefill syncs anyway, so it reads device values: a block id outside the cache raises
    there (its key would be gathered as zeros and could be selected). Decode never syncs:
    the same batch builds, with the request's lengths cut at the bad block."""
    cfg = dsa.IndexerConfig(max_num_reqs=2, max_num_batched_tokens=2, max_model_len=256,
                            num_heads=64, head_dim=128, topk=32, block_size=64, num_blocks=4)
    table = torch.tensor([[0, 1, 2, 3], [3, 9, 1, 2]])
    _, batch = _layer_and_batch("cuda", cfg, table, [100, 150])
    with pytest.raises(ValueError, match=r"indexer block 9 at column 1"):
        dsa.build_prefill_metadata(cfg, batch)
    with torch.cuda.device("cuda"):
        torch.cuda.set_sync_debug_mode("error")
        try:
            meta = dsa.build_decode_metadata(cfg, batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert meta.context_lens.view(-1).tolist() == [100, 64]


# --- lengths at int32's edge -----------------------------------------------------------------


@pytest.mark.parametrize("face", FACE_NAMES)
def test_lengths_near_int32_min_count_no_keys(face):
    """A garbage length of -2**31 gives no keys and writes no slot on every face: the
    kernels compute in int64 where the torch faces do (int32 wrapped to a long length)."""
    qsl, seq = i32([0, 2]), i32([-(2**31)])
    assert run_op(face, "decode_token_lens", qsl, seq, 2).tolist() == [0, 0]
    assert run_op(face, "native_decode_lens", seq, 2).tolist() == [[0, 0]]
    fused = (qsl, seq, i32([[0, 1]]), torch.tensor([-1, -1]), torch.tensor([5, 6]), True, 2, 1,
             1, 0, 1, 4, 4, 8, 16, False)
    global_lens, context_lens = run_op(face, "decode_metadata", *fused)[:2]
    assert global_lens.tolist() == [[0, 0]] and context_lens.tolist() == [[0, 0]]
    compressed = (i32([0, 1, 2**31 - 1]), i32([0, -(2**31)]), i32([[0, 0], [0, 3]]), 3, 2, 2, 1,
                  0, 1)
    assert run_op(face, "compressed_slot_mapping", *compressed).tolist() == [-1, -1, -1]


@pytest.mark.parametrize("face", FACE_NAMES)
def test_widths_near_int32_max_still_cut_lengths_at_the_table(face):
    """A row width (``max_context_len``) near 2**31 - 1, a natural "no cap": the count of
    blocks a length spans does not wrap, so a length past the table's valid blocks is cut
    at them on every face, also inside ``decode_metadata``."""
    most = 2**31 - 1
    for lens in (most, most - 9, 100):
        capped = run_op(face, "cap_context_lens", i32([[lens]]), i32([[0]]), 1, 64, most)
        assert capped.tolist() == [[64]]
    fused = (i32([0, 1]), i32([most]), i32([[0]]), torch.tensor([0]), torch.tensor([0]), False,
             1, 1, 1, 0, 1, 1, 64, most, most, False)
    assert run_op(face, "decode_metadata", *fused)[1].tolist() == [[64]]


@pytest.mark.parametrize("face", FACE_NAMES)
def test_prefill_chunk_bounds_at_int32_edges(face):
    """A garbage length of -2**31 gives no keys (the kernel adds in int64, as the torch
    face); lengths summing past 2**31 saturate the offsets, which stay non-decreasing, so
    every face maps the workspace rows to the same request."""
    bounds = run_op(face, "prefill_chunk_bounds", i32([0, 3]), i32([-(2**31)]), 0, 1, 0, 3, 0)
    assert [t.tolist() for t in bounds] == [[0, 0], [0, 0], [], [0, 0, 0], [0, 0, 0],
                                            [0, 0, 0]]
    most = 2**31 - 1
    cu, local_cu, token_to_seq = run_op(face, "prefill_chunk_bounds", i32([0, 1, 2]),
                                        i32([most, most]), 0, 2, 0, 2, 4)[:3]
    assert cu.tolist() == local_cu.tolist() == [0, most, most]
    assert token_to_seq.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("face", FACE_NAMES)
def test_pack_decode_rows_with_a_garbage_start_near_int32_min(face):
    """A request's token count past int32 (``end - start``) computes in int64 on every face,
    so the kernel reads the rows the torch face reads."""
    x = torch.arange(1, 4, dtype=torch.int32).view(3, 1)
    assert run_op(face, "pack_decode_rows", x, i32([-(2**31), 2]), 4).flatten().tolist() == [
        0, 0, 1, 2]
