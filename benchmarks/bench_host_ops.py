"""Host time of dsa's ops outside a CUDA graph: custom_op vs triton_op registration.

    python benchmarks/bench_host_ops.py [--out BENCHMARKS.md]

Runs itself twice, with ``DSA_TRITON_OP=0`` (every op an opaque ``custom_op``) and ``=1``
(Triton faces as ``triton_op``, design §12), and prints one table. Rows: each decode op
called eagerly (dispatcher -> Python face -> Triton launch), the whole one-layer decode step
eagerly, the step compiled with ``torch.compile(fullgraph=True)`` without a CUDA graph
(with ``triton_op`` Inductor launches dsa's kernels itself, without the Python faces), and
the step's CUDA-graph replay (device time: the two registrations should match). Host time
is the wall time of one call with the GPU drained first (median).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

import dsa

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _report import bench_parser, graph_us, host_us, markdown_table, publish, report
from bench_step import HIDDEN, Q_LORA_RANK, full_decode

BATCH, LENGTH = 64, 4096


def measure() -> dict[str, float]:
    """µs per row of the table, with this process's registration."""
    ops = torch.ops.dsa
    cfg, layer, batch = full_decode(BATCH, LENGTH, logits_backend="triton")
    table, seq_lens, slots = batch.block_table, batch.seq_lens, batch.slot_mapping
    blocks = cfg.num_blocks
    hidden = torch.randn(BATCH, HIDDEN, device="cuda", dtype=torch.bfloat16)
    q_latent = torch.randn(BATCH, Q_LORA_RANK, device="cuda", dtype=torch.bfloat16)
    meta = dsa.build_decode_metadata(cfg, batch)
    k = torch.randn(BATCH, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(BATCH, cfg.num_heads, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(BATCH, cfg.num_heads, device="cuda")
    q_fp8, head_w = ops.quantize_q(q, w)
    lens = meta.context_lens
    logits = ops.paged_mqa_logits(q_fp8.view(BATCH, 1, cfg.num_heads, cfg.head_dim),
                                  layer.kv_cache, head_w, lens, table, LENGTH)
    indices = ops.topk_indices(logits, lens.view(-1), cfg.topk)

    def step(b: dsa.Batch, hidden: torch.Tensor, q_latent: torch.Tensor) -> torch.Tensor:
        return layer(hidden, q_latent, b.positions, dsa.build_decode_metadata(cfg, b)).slots

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    rows = {
        "decode_token_lens": lambda: ops.decode_token_lens(batch.query_start_loc, seq_lens,
                                                           BATCH),
        "quantize_and_cache_k": lambda: ops.quantize_and_cache_k(k, layer.kv_cache, slots),
        "quantize_q": lambda: ops.quantize_q(q, w),
        "paged_mqa_logits": lambda: ops.paged_mqa_logits(
            q_fp8.view(BATCH, 1, cfg.num_heads, cfg.head_dim), layer.kv_cache, head_w, lens,
            table, LENGTH),
        "topk_indices": lambda: ops.topk_indices(logits, lens.view(-1), cfg.topk),
        "indices_to_slots": lambda: ops.indices_to_slots(indices, table, meta.token_requests,
                                                         cfg.block_size, blocks),
        "step, eager": lambda: step(batch, hidden, q_latent),
        "step, compiled": lambda: compiled(batch, hidden, q_latent),
    }
    result = {name: host_us(fn) for name, fn in rows.items()}
    result["step, CUDA graph (device)"] = graph_us(lambda: compiled(batch, hidden, q_latent))
    return result


def main() -> None:
    parser = bench_parser()
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure()))
        return
    runs = {}
    for flag in ("0", "1"):
        env = {**os.environ, "DSA_TRITON_OP": flag}
        out = subprocess.run([sys.executable, __file__, "--child"], env=env, check=True,
                             capture_output=True, text=True).stdout
        runs[flag] = json.loads(out.strip().splitlines()[-1])
    rows = [[name, f"{runs['0'][name]:.1f}", f"{runs['1'][name]:.1f}",
             f"{runs['0'][name] / runs['1'][name]:.2f}x"] for name in runs["0"]]
    text = report(
        f"Host time per call outside a graph: custom_op vs triton_op (B = {BATCH}, "
        f"L = {LENGTH})",
        markdown_table(["call", "custom_op µs", "triton_op µs", "custom / triton"], rows),
        "host µs with the GPU drained first, except the last row (device µs of a replay)",
    )
    publish(text, args.out)


if __name__ == "__main__":
    main()
