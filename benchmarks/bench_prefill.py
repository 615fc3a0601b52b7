"""Chunked prefill on the GPU: ragged MQA logits and top-k per chunk, against the fp8 floor.

    python benchmarks/bench_prefill.py [--out BENCHMARKS.md] [--logits-gib 2]

Prompts (1 x 32K), (4 x 8K) and (1 x 128K), H=64, D=128, top-k 2048, planned into chunks by
``dsa.build_prefill_metadata`` under a logits budget (``--logits-gib``), each chunk run as
the Indexer runs it (``gather_k`` once per chunk, then logits and top-k per query slice).
Per prompt, the sum over its chunks of: dsa's Triton ``mqa_logits`` and DeepGEMM's
``mqa_logits_deepgemm`` (when it runs here), ``topk_indices`` and the masked ``torch.topk``
that DeepGEMM's logits need (-inf past each row's span, then the top-k). FLOPs count the
valid (query, key) pairs only: 2 * H * D per pair. The floor is those FLOPs at the fp8 rate
of a large ``torch._scaled_mm`` measured in the same run (the H200's dense fp8 spec, 1979
TFLOP/s, if that cannot run). Times: CUDA events, medians (``triton.testing.do_bench``).
"""

from __future__ import annotations

import sys
from itertools import accumulate

import torch

import dsa
from dsa.ops.logits.deepgemm import deepgemm_mqa_supported

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _report import add_row, bench_parser, device_us, markdown_table, publish, report
from bench_leaves import BS, TOPK, D, H, random_cache

PROMPTS = {"1 x 32K": [32768], "4 x 8K": [8192] * 4, "1 x 128K": [131072]}
SPEC_FP8_FLOPS = 1979e12  # H200 dense fp8, no sparsity
ops = torch.ops.dsa


def ms(fn) -> float:
    """Median device time of ``fn`` in ms (a few calls: these kernels take milliseconds)."""
    return device_us(fn, warmup=5, rep=20) / 1e3


def fp8_flops_per_s() -> tuple[float, str]:
    """The fp8 GEMM rate this GPU reaches (8192^3 ``torch._scaled_mm``, bf16 out), and where
    it comes from."""
    n = 8192
    try:
        a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        best = min(ms(lambda fast=fast: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one,
                                                            out_dtype=torch.bfloat16,
                                                            use_fast_accum=fast))
                   for fast in (False, True))
        return 2 * n**3 / (best * 1e-3), f"measured: torch._scaled_mm {n}^3"
    except Exception as error:  # an older torch or another GPU: fall back to the spec
        print(f"torch._scaled_mm unavailable ({error}); using the spec rate", file=sys.stderr)
        return SPEC_FP8_FLOPS, "H200 dense fp8 spec"


def prefill(prompts: list[int], budget: int) -> tuple[dsa.PrefillMetadata, torch.Tensor,
                                                       torch.Tensor, torch.Tensor]:
    """Prefill metadata of the prompts (whole prompts, no cached context), a K cache of
    random fp8 keys, and the tokens' fp8 queries and head weights."""
    length, tokens = max(prompts), sum(prompts)
    width = -(-length // BS)
    cfg = dsa.IndexerConfig(max_num_reqs=len(prompts), max_num_batched_tokens=tokens,
                            max_model_len=length, num_blocks=len(prompts) * width,
                            max_logits_bytes=budget)
    table = torch.arange(len(prompts) * width, dtype=torch.int32, device="cuda")
    table = table.view(len(prompts), width)
    qsl = [0, *accumulate(prompts)]
    positions = torch.cat([torch.arange(n, device="cuda") for n in prompts])
    requests = torch.repeat_interleave(torch.arange(len(prompts), device="cuda"),
                                       torch.tensor(prompts, device="cuda"))
    slots = table[requests, positions // BS].long() * BS + positions % BS
    batch = dsa.Batch(query_start_loc=torch.tensor(qsl, dtype=torch.int32, device="cuda"),
                      seq_lens=torch.tensor(prompts, dtype=torch.int32, device="cuda"),
                      block_table=table, slot_mapping=slots, positions=positions)
    meta = dsa.build_prefill_metadata(cfg, batch, seq_lens_cpu=prompts, query_start_loc_cpu=qsl)
    q = torch.randn(tokens, H, D, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    weights = torch.randn(tokens, H, device="cuda") * H**-0.5
    return meta, random_cache(cfg.num_blocks), q, weights


def time_query_slice(args: tuple, lens: torch.Tensor, deepgemm: bool) -> dict[str, float]:
    """ms of one query slice's logits (each backend) and top-k (dsa's, masked torch.topk)."""
    max_seqlen_k = args[-1]
    t = {"triton": ms(lambda: ops.mqa_logits(*args))}
    if deepgemm:
        t["deepgemm"] = ms(lambda: ops.mqa_logits_deepgemm(*args))
    logits = ops.mqa_logits(*args)  # -inf past each row's span
    t["topk"] = ms(lambda: ops.topk_indices(logits, lens, TOPK))
    past = torch.arange(max_seqlen_k, device="cuda") >= lens[:, None]
    k = min(TOPK, max_seqlen_k)
    t["masked"] = ms(lambda: torch.topk(logits.masked_fill(past, -float("inf")), k, dim=-1))
    return t


def bench_prompts(name: str, prompts: list[int], budget: int, rate: float) -> list[object]:
    meta, cache, q, weights = prefill(prompts, budget)
    deepgemm = deepgemm_mqa_supported(q.device, H, D)
    t = dict.fromkeys(("gather", "triton", "deepgemm", "topk", "masked"), 0.0)
    flops = 0
    for chunk in meta.chunks:
        if chunk.num_local_rows == 0:
            continue
        if not chunk.skip_gather:
            gather = lambda c=chunk: ops.gather_k(cache, c.block_table, c.local_cu_seq_lens,
                                                  c.num_local_rows)
            t["gather"] += ms(gather)
            k_fp8, k_scale = gather()
        span = slice(chunk.token_start, chunk.token_end)
        args = (q[span], k_fp8, k_scale, weights[span], chunk.ks, chunk.ke, chunk.max_seqlen_k)
        lens = (chunk.ke - chunk.ks).clamp(0, chunk.max_seqlen_k)
        flops += 2 * H * D * int(lens.sum())
        for part, took in time_query_slice(args, lens, deepgemm).items():
            t[part] += took
    floor = flops / rate * 1e3
    tflops = lambda t_ms: f"{flops / (t_ms * 1e-3) / 1e12:.0f}"
    of_floor = lambda t_ms: f"{100 * floor / t_ms:.0f}%"
    best = min(t["triton"], t["deepgemm"]) if deepgemm else t["triton"]
    baseline = t["deepgemm"] if deepgemm else t["triton"]
    dg = [f"{t['deepgemm']:.2f}", tflops(t["deepgemm"]), of_floor(t["deepgemm"]),
          f"{(t['deepgemm'] / t['triton']):.2f}x"] if deepgemm else ["n/a"] * 4
    return [name, len(meta.chunks), f"{flops / 1e12:.1f}", f"{floor:.2f}", f"{t['gather']:.2f}",
            f"{t['triton']:.2f}", tflops(t["triton"]), of_floor(t["triton"]), *dg,
            f"{t['topk']:.2f}", f"{t['masked']:.2f}", f"{t['masked'] / t['topk']:.1f}x",
            f"{t['gather'] + best + t['topk']:.2f}",
            f"{t['gather'] + baseline + t['masked']:.2f}"]


def main() -> None:
    parser = bench_parser()
    parser.add_argument("--logits-gib", type=float, default=2.0,
                        help="prefill logits budget per chunk (IndexerConfig.max_logits_bytes)")
    args = parser.parse_args()
    torch.manual_seed(0)
    budget = int(args.logits_gib * 2**30)
    rate, source = fp8_flops_per_s()
    print(f"fp8 rate {rate / 1e12:.0f} TFLOP/s ({source})", flush=True)
    header = ["prompts", "chunks", "TFLOP", "floor ms", "gather_k ms", "dsa Triton logits ms",
              "TFLOP/s", "of floor", "DeepGEMM logits ms", "TFLOP/s", "of floor",
              "Triton / DeepGEMM throughput", "dsa top-k ms", "masked torch.topk ms",
              "speed-up", "dsa best logits + top-k ms", "DeepGEMM + masked torch.topk ms"]
    rows = []
    for name, prompts in PROMPTS.items():
        add_row(rows, bench_prompts(name, prompts, budget, rate))
        torch.cuda.empty_cache()
    text = report(
        "Chunked prefill: ragged logits and top-k per chunk",
        markdown_table(header, rows),
        notes=(f"H={H}, D={D}, top-k {TOPK}, whole prompts (causal), logits budget "
               f"{args.logits_gib:g} GiB per chunk; each time is the sum over the prompt's "
               f"chunks of CUDA-event medians; TFLOP = 2*H*D per valid (query, key) pair; "
               f"floor at {rate / 1e12:.0f} TFLOP/s fp8 ({source}); masked torch.topk = "
               f"-inf past each row's span + torch.topk; gather_k counted in both totals; "
               f"dsa v{dsa.__version__}"),
    )
    publish(text, args.out)


if __name__ == "__main__":
    main()
