"""The indexer's decode prologue on the GPU: the layer's torch projections and the two
prologue ops against ``dsa::project_quantize_and_cache_k``.

    python benchmarks/bench_project.py [--tokens 1,2,...] [--out BENCHMARKS.md]

For T = 1 to 1024 tokens at DeepSeek V3.2's sizes (hidden 7168, q_lora_rank 1536, D 128, H
64, bf16 activations, ``wq_b`` and ``wk``, fp32 ``weights_proj`` and LayerNorm): the
projections as ``dsa.Indexer`` writes them above ``KERNEL_TOKENS`` (GEMMs, LayerNorm, casts)
followed by ``rope_hadamard_quantize_and_cache_k`` and ``rope_hadamard_quantize_q``, against
the op (its two kernels up to ``KERNEL_TOKENS`` tokens, the same chain above), both under
``torch.compile(fullgraph=True)``, and the op given ``wq_b`` and ``wk`` as fp8 blocks
(power-of-two scales, as V3.2 ships them; the other two run them dequantised). Device µs
from CUDA-graph replays: L2 warm (10 calls a graph) and L2 flushed (one call, 256 MB
written before each replay; the weights, 29 MB, fit in L2); the kernels one call launches
(profiler); the floor: bytes read and written at the measured copy bandwidth.
"""

from __future__ import annotations

import pathlib
import sys

import torch

import dsa  # noqa: F401  (registers torch.ops.dsa)
from dsa.ops import block_fp8
from dsa.ops.kcache import kcache_views
from dsa.ops.project import KERNEL_TOKENS, project_torch
from dsa.rope import rope_table

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from _report import add_row, bench_parser, copy_bandwidth, graph_us, markdown_table, publish, report  # noqa: E402
from bench_prologue import kernels_per_call  # noqa: E402
from test_prologue import signed_steps  # noqa: E402

TOKENS = (1, 2, 4, 8, 16, 64, 128, 256, 512, 1024)
HIDDEN, Q_LORA, D, H, ROPE_DIM, MAX_LEN = 7168, 1536, 128, 64, 64, 1 << 16
ops = torch.ops.dsa


def torch_prologue(hidden, q_latent, wq_b, wk, norm_weight, norm_bias, weights_proj, cache,
                   slots, cos_sin, positions):
    q, k, weights = project_torch(hidden, q_latent, wq_b, wk, norm_weight, norm_bias, 1e-6,
                                  weights_proj)
    ops.rope_hadamard_quantize_and_cache_k(k, cache, slots, cos_sin, positions)
    return ops.rope_hadamard_quantize_q(q, weights, cos_sin, positions)


def op_prologue(hidden, q_latent, wq_b, wk, norm_weight, norm_bias, weights_proj, cache, slots,
                cos_sin, positions):
    return ops.project_quantize_and_cache_k(hidden, q_latent, wq_b, wk, norm_weight, norm_bias,
                                            1e-6, weights_proj, cache, slots, cos_sin,
                                            positions)


def op_prologue_fp8(hidden, q_latent, wq_b, wk, norm_weight, norm_bias, weights_proj, cache,
                    slots, cos_sin, positions, wq_b_scale, wk_scale):
    return ops.project_quantize_and_cache_k(hidden, q_latent, wq_b, wk, norm_weight, norm_bias,
                                            1e-6, weights_proj, cache, slots, cos_sin,
                                            positions, wq_b_scale=wq_b_scale,
                                            wk_scale=wk_scale)


def code_steps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The most e4m3 steps between two tensors' codes."""
    return int((signed_steps(a) - signed_steps(b)).abs().max())


def bench_tokens(tokens: int, bandwidth: float) -> list[object]:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    cuda = {"generator": gen, "device": "cuda"}
    bf16 = torch.bfloat16
    hidden = torch.randn(tokens, HIDDEN, **cuda).to(bf16)
    q_latent = torch.randn(tokens, Q_LORA, **cuda).to(bf16)
    fp8 = [block_fp8.quantize(torch.randn(rows, cols, **cuda) * cols**-0.5, ue8m0=True)
           for rows, cols in ((H * D, Q_LORA), (D, HIDDEN))]
    wq_b, wk = (block_fp8.dequantize(codes, scale, bf16) for codes, scale in fp8)
    norm_weight = torch.rand(D, **cuda) + 0.5
    norm_bias = torch.randn(D, **cuda) * 0.1
    weights_proj = torch.randn(H, HIDDEN, **cuda) * HIDDEN**-0.5
    caches = {name: torch.zeros(64, 64, 1, D + 4, dtype=torch.uint8, device="cuda")
              for name in ("torch", "op", "fp8")}
    slots = torch.randperm(64 * 64, **cuda)[:tokens]
    cos_sin = rope_table(MAX_LEN, ROPE_DIM, 10000.0, device="cuda")
    positions = torch.randint(0, MAX_LEN, (tokens,), **cuda)
    weights_args = (hidden, q_latent, wq_b, wk, norm_weight, norm_bias, weights_proj)
    (wq_codes, wq_scale), (wk_codes, wk_scale) = fp8
    fp8_args = (hidden, q_latent, wq_codes, wk_codes, norm_weight, norm_bias, weights_proj)
    compiled = {"torch": torch.compile(torch_prologue, fullgraph=True, dynamic=False),
                "op": torch.compile(op_prologue, fullgraph=True, dynamic=False),
                "fp8": torch.compile(op_prologue_fp8, fullgraph=True, dynamic=False)}
    calls = {name: (lambda fn=fn, name=name: fn(*weights_args, caches[name], slots, cos_sin,
                                                   positions))
             for name, fn in compiled.items() if name != "fp8"}
    calls["fp8"] = lambda: compiled["fp8"](*fp8_args, caches["fp8"], slots, cos_sin, positions,
                                           wq_scale, wk_scale)
    warm = {name: graph_us(call) for name, call in calls.items()}
    flushed = {name: graph_us(call, replays=1) for name, call in calls.items()}
    launches = {name: kernels_per_call(call) for name, call in calls.items()}
    (q_torch, w_torch), (q_op, w_op), _ = (call() for call in calls.values())
    outputs = tokens * (H * D + H * 4 + D + 4) + 2 * D * 4
    floor_us, fp8_floor_us = (
        (sum(w.numel() * w.element_size() for w in args) + outputs) / bandwidth * 1e6
        for args in (weights_args, (*fp8_args, wq_scale, wk_scale)))
    return [tokens, f"{warm['torch']:.1f}", f"{flushed['torch']:.1f}", launches["torch"],
            f"{warm['op']:.1f}", f"{flushed['op']:.1f}", launches["op"],
            f"{flushed['torch'] / flushed['op']:.1f}x", f"{floor_us:.2f}",
            f"{warm['fp8']:.1f}", f"{flushed['fp8']:.1f}", f"{fp8_floor_us:.2f}",
            code_steps(q_op, q_torch),
            code_steps(kcache_views(caches["op"])[0], kcache_views(caches["torch"])[0]),
            f"{((w_op - w_torch).abs() / w_torch.abs()).max().item():.1e}"]


def main() -> None:
    parser = bench_parser()
    parser.add_argument("--tokens", type=lambda s: [int(t) for t in s.split(",")],
                        default=list(TOKENS), help="comma-separated token counts")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    header = ["T", "torch warm µs", "torch flushed µs", "torch kernels", "op warm µs",
              "op flushed µs", "op kernels", "flushed speed-up", "bytes floor µs",
              "op fp8 warm µs", "op fp8 flushed µs", "fp8 bytes floor µs",
              "q codes: most steps apart", "K cache codes: most steps apart",
              "head weights: max rel. diff"]
    rows = []
    for tokens in args.tokens:
        add_row(rows, bench_tokens(tokens, bandwidth))
    notes = (f"hidden {HIDDEN}, q_lora_rank {Q_LORA}, D={D}, H={H}, rope_dim {ROPE_DIM}; bf16 "
             "activations, wq_b and wk, fp32 weights_proj and LayerNorm; torch = the GEMMs, "
             "LayerNorm and casts, then rope_hadamard_quantize_and_cache_k and "
             "rope_hadamard_quantize_q, under torch.compile; op = "
             "dsa::project_quantize_and_cache_k under torch.compile (its kernels up to "
             f"{KERNEL_TOKENS} tokens); op fp8 = the op given wq_b and wk as fp8 blocks "
             "(power-of-two scales; the other two hold them dequantised), its floor by fp8 "
             "bytes; medians of CUDA-graph replays (warm: 10 calls per "
             "graph; flushed: one call after 256 MB written); kernels: device activities of "
             f"one call (profiler); copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    title = "Indexer prologue from the hidden state: projections, RoPE, Hadamard, fp8, K write"
    command = "python benchmarks/bench_project.py" + (
        f" --tokens {','.join(map(str, args.tokens))}" if args.tokens != list(TOKENS) else "")
    publish(report(title, markdown_table(header, rows), notes, command=command), args.out)


if __name__ == "__main__":
    main()
