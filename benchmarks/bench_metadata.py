"""Decode metadata build on the GPU: the fused ``dsa::decode_metadata`` against the small ops.

    python benchmarks/bench_metadata.py [--out BENCHMARKS.md]

For B = 1, 8, 64 (native layout, next_n 1, full contexts, ``num_blocks`` set) and each
logits backend: ``dsa.build_decode_metadata`` (the fused op, plus DeepGEMM's schedule with
that backend) against the same metadata composed of the small ops it fuses
(``tests/decode_composition.py``, how the build ran before), both under
``torch.compile(fullgraph=True)`` and timed as CUDA-graph replays. "kernels" counts the
device kernels one eager call of the compiled build launches (torch.profiler).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import dsa
from dsa.meta.decode import max_context_len

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from _report import add_row, bench_parser, graph_us, markdown_table, publish, report
from decode_composition import composed_decode_metadata

SHAPES = [(1, 4096), (1, 65536), (8, 32768), (64, 65536)]
BACKENDS = ("deepgemm", "triton")
BS = 64


def decode_batch(batch: int, length: int) -> dsa.Batch:
    blocks = batch * length // BS
    table = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    positions = (seq_lens - 1).long()
    slots = (table.gather(1, (positions // BS).view(-1, 1).int()).view(-1).long() * BS
             + positions % BS)
    return dsa.Batch(query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
                     seq_lens=seq_lens, block_table=table, slot_mapping=slots,
                     positions=positions)


def kernels_launched(fn) -> str:
    """Device kernels one call of ``fn`` launches (warm), or "n/a" without a profiler."""
    try:
        fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return str(sum(1 for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA))
    except Exception as error:  # a profiler-less build: report the rest
        print(f"kernel count unavailable: {error}", file=sys.stderr)
        return "n/a"


def bench_shape(batch: int, length: int, backend: str) -> list[object] | None:
    """One row, or None where ``backend`` cannot run."""
    cfg = dsa.IndexerConfig(max_num_reqs=batch, max_num_batched_tokens=batch,
                            max_model_len=length, num_blocks=batch * length // BS,
                            logits_backend=backend)
    b = decode_batch(batch, length)
    try:
        dsa.build_decode_metadata(cfg, b)
    except ValueError as error:  # DeepGEMM cannot run here
        print(f"skipping {backend} at B={batch}, L={length}: {error}", file=sys.stderr)
        return None
    torch._dynamo.reset()
    fused = torch.compile(lambda: dsa.build_decode_metadata(cfg, b), fullgraph=True,
                          dynamic=False)
    args = (b.query_start_loc, b.seq_lens, b.block_table, b.positions, b.slot_mapping, True,
            cfg.next_n, 1, 1, 0, 1, cfg.num_blocks, cfg.block_size, max_context_len(cfg),
            cfg.max_model_len, backend == "deepgemm")
    composed = torch.compile(lambda: composed_decode_metadata(*args), fullgraph=True,
                             dynamic=False)
    meta, want = fused(), composed()
    same = all(torch.equal(x, y) for x, y in zip(
        (meta.global_context_lens, meta.context_lens, meta.block_table, meta.token_requests,
         meta.valid_tokens, meta.slot_mapping), want))
    fused_us, composed_us = graph_us(fused), graph_us(composed)
    return [batch, length, backend, f"{fused_us:.1f}", kernels_launched(fused),
            f"{composed_us:.1f}", kernels_launched(composed),
            f"{composed_us / fused_us:.2f}x", "yes" if same else "NO"]


def main() -> None:
    out = bench_parser().parse_args().out
    torch.manual_seed(0)
    header = ["B", "L", "backend", "fused build µs", "kernels", "small ops µs", "kernels",
              "speed-up", "equal"]
    rows = []
    for batch, length in SHAPES:
        for backend in BACKENDS:
            row = bench_shape(batch, length, backend)
            if row is not None:
                add_row(rows, row)
    text = report(
        "Decode metadata build: fused op vs the small ops",
        markdown_table(header, rows),
        notes=("native layout, next_n 1, full contexts, block 64, `num_blocks` set; both "
               "builds compiled (fullgraph) and timed as CUDA-graph replays (10 builds per "
               "graph, median); backend: the paged-logits backend (DeepGEMM adds its schedule "
               "kernel); kernels: device kernels of one eager call "
               f"(torch.profiler); dsa v{dsa.__version__}"),
    )
    publish(text, out)


if __name__ == "__main__":
    main()
