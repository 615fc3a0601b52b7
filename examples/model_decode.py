"""A model's decode step: N indexer layers, some sharing an earlier layer's top-k, one graph.

Each layer is full (runs its own ``dsa.Indexer``) or shared (runs none and reuses the top-k of
the nearest full layer before it: IndexCache / GLM-5.2's IndexShare, ``dsa.IndexShare``).
A stand-in for sparse MLA then reads the selected slots of the layer's own latent cache into
the hidden state that feeds the next layer, so every selection counts. The metadata is built
once per step and shared by every layer. The whole step is one ``torch.compile(fullgraph=True)``
function: on a GPU it replays as one CUDA graph and is checked bit for bit against the same
compiled step run without the graph; on a CPU it is checked against eager. Layer sizes are
DeepSeek V3.2's on a GPU and toy ones on a CPU (``--sizes``).

    python examples/model_decode.py                       # 8 layers, pattern FFSFSFSF
    python examples/model_decode.py --layers 61 --index-topk-freq 4   # DeepSeek V3.2's 61
    python examples/model_decode.py --pattern FSSS --device cpu
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from decode import ToyEngine, progress
from torch import Tensor, nn

import dsa
from dsa.graphs import DecodeGraphRunner, StaticBatch


@dataclass(frozen=True)
class Sizes:
    hidden: int
    q_lora_rank: int
    num_heads: int
    head_dim: int
    topk: int
    rope_dim: int
    latent_dim: int  # width of the stand-in attention's latent cache (MLA's is 576)
    ue8m0_scales: bool  # q and k quantised with power-of-two scales (V3.2's scale_fmt)


TOY = Sizes(hidden=128, q_lora_rank=64, num_heads=16, head_dim=64, topk=32, rope_dim=32,
            latent_dim=16, ue8m0_scales=False)
V32 = Sizes(hidden=7168, q_lora_rank=1536, num_heads=64, head_dim=128, topk=2048, rope_dim=64,
            latent_dim=16, ue8m0_scales=True)


class DecoderLayer(nn.Module):
    """What a decoder layer does around the indexer: its indexer (full layers only) and a
    stand-in for sparse MLA over its own paged latent cache (one row per K-cache slot)."""

    def __init__(self, cfg: dsa.IndexerConfig, sizes: Sizes, *, full: bool, device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.indexer = dsa.Indexer(
            cfg, hidden_size=sizes.hidden, q_lora_rank=sizes.q_lora_rank,
            rope_dim=sizes.rope_dim, device=device, dtype=dtype,
        ) if full else None
        num_slots = cfg.num_blocks * cfg.block_size
        self.register_buffer("latent_cache", torch.randn(num_slots, sizes.latent_dim,
                                                         device=device, dtype=dtype))
        self.wo = nn.Linear(sizes.latent_dim, sizes.hidden, bias=False, device=device,
                            dtype=dtype)

    def attend(self, hidden: Tensor, slots: Tensor) -> Tensor:
        """The mean latent of the selected slots (-1: none), projected into the residual."""
        picked = self.latent_cache[slots.clamp(min=0).long()] * (slots >= 0).unsqueeze(-1)
        return F.rms_norm(hidden + self.wo(picked.mean(1)), (hidden.shape[-1],))


class Model(nn.Module):
    """A stack of decoder layers; ``share`` says which ones run an indexer."""

    def __init__(self, cfg: dsa.IndexerConfig, sizes: Sizes, share: dsa.IndexShare, *,
                 device, dtype: torch.dtype) -> None:
        super().__init__()
        self.q_lora_rank = sizes.q_lora_rank
        self.sources = share.sources
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, sizes, full=share.is_full(i), device=device, dtype=dtype)
            for i in range(share.num_layers)
        )

    def forward(self, hidden: Tensor, positions: Tensor,
                meta: dsa.DecodeMetadata | dsa.PrefillMetadata
                ) -> tuple[Tensor, list[dsa.IndexerOutput]]:
        """The last hidden state and every layer's top-k (a shared layer's is its source's)."""
        outputs: list[dsa.IndexerOutput] = []
        for layer, source in zip(self.layers, self.sources):
            if layer.indexer is not None:
                # Stand-in for q_a_proj + q_a_layernorm: the query latent of this layer.
                q_latent = F.rms_norm(hidden[:, : self.q_lora_rank], (self.q_lora_rank,))
                outputs.append(layer.indexer(hidden, q_latent, positions, meta))
            else:
                outputs.append(outputs[source])
            hidden = layer.attend(hidden, outputs[-1].slots)
        return hidden, outputs


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--index-topk-freq", type=int, default=2,
                        help="full layers: vLLM's index_topk_freq rule (1: every layer)")
    parser.add_argument("--pattern", help="'F'/'S' per layer (overrides --layers and the freq)")
    parser.add_argument("--sizes", choices=["toy", "v3.2"],
                        help="layer sizes (default: v3.2 on a GPU, toy on a CPU)")
    parser.add_argument("--steps", type=int, default=None, help="decode steps")
    parser.add_argument("--next-n", type=int, default=2, help="1 + MTP draft tokens")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    on_gpu = args.device.startswith("cuda")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    real = (args.sizes or ("v3.2" if on_gpu else "toy")) == "v3.2"
    sizes = V32 if real else TOY
    share = (dsa.IndexShare(args.pattern) if args.pattern
             else dsa.IndexShare.every(args.layers, args.index_topk_freq))
    capture_size = 8  # 5 live requests replay in the 8-request bucket: 3 padding requests
    prompt_lens, max_model_len = ([3000, 700, 5100, 64, 1800], 8192) if real else (
        [64, 20, 100, 9, 40], 512)
    cfg = dsa.IndexerConfig(
        max_num_reqs=capture_size, next_n=args.next_n, max_model_len=max_model_len,
        max_num_batched_tokens=max(sum(prompt_lens), capture_size * args.next_n),
        num_heads=sizes.num_heads, head_dim=sizes.head_dim, topk=sizes.topk,
        ue8m0_scales=sizes.ue8m0_scales,
        num_blocks=len(prompt_lens) * max_model_len // 64,  # the engine's blocks, 64 tokens each
    )
    # The decode step's inputs, owned by the engine: one bucket of capture_size requests.
    static = StaticBatch(capture_size, capture_size * args.next_n, cfg.block_table_width,
                         token_inputs={"hidden": ((sizes.hidden,), dtype)}, device=args.device)
    engine = ToyEngine(prompt_lens, cfg, static, args.device)
    steps = args.steps or (16 if on_gpu else 3)
    model = Model(cfg, sizes, share, device=args.device, dtype=dtype)

    def step(batch: dsa.Batch, hidden: Tensor) -> tuple[Tensor, list[Tensor]]:
        meta = dsa.build_decode_metadata(cfg, batch)  # once per step, shared by every layer
        hidden, outputs = model(hidden, batch.positions, meta)
        return hidden, [out.slots for out in outputs]

    # Prefill: every prompt at once, chunked on the host, eagerly (it fills the K caches).
    batch, qsl = engine.prefill_batch(prompt_lens)
    meta = dsa.build_prefill_metadata(cfg, batch, seq_lens_cpu=engine.seq_lens,
                                      query_start_loc_cpu=qsl)
    model(torch.randn(batch.num_tokens, sizes.hidden, device=args.device, dtype=dtype),
          batch.positions, meta)
    print(f"model: {share.num_layers} layers, pattern {share.pattern} "
          f"({share.pattern.count('F')} indexers), {'V3.2' if real else 'toy'} sizes on "
          f"{args.device}; prefill: {batch.num_tokens} tokens")

    if on_gpu:  # the step replays as one CUDA graph, checked against the compiled step
        runner = DecodeGraphRunner(step, cfg, buffers=static, sizes=[capture_size])
        runner.capture()
        print(f"GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB peak")
        run = lambda: runner.replay_in_place(capture_size)  # outputs: the graph's own
        check = runner.step
    else:  # the step runs compiled, checked against eager
        compiled = torch.compile(step, fullgraph=True, dynamic=False)
        run = lambda: compiled(static.batch, **static.inputs)
        check = step

    latencies, matched = [], 0
    for i in range(steps):
        query_lens = [1 if (i + r) % 3 == 0 else args.next_n for r in range(len(prompt_lens))]
        tokens = engine.write_decode_step(query_lens)  # into `static`, the bucket padded
        static.inputs["hidden"][:tokens].normal_()  # stand-in for the embeddings
        (got_hidden, got_slots), seconds = timed(run, sync=on_gpu)
        latencies.append(seconds)
        got_hidden, got_slots = got_hidden.clone(), [s.clone() for s in got_slots]
        want_hidden, want_slots = check(static.batch, **static.inputs)
        matched += same_step(got_hidden, got_slots, want_hidden, want_slots, tokens,
                             exact=on_gpu)
        progress(i, steps, f"{seconds * 1e6:.0f} us/step")
    print(file=sys.stderr)

    mode = "CUDA graph replay" if on_gpu else "compiled step (CPU)"
    median = sorted(latencies[1:] or latencies)[len(latencies[1:] or latencies) // 2]
    print(f"decode: {steps} steps, next_n={args.next_n}, {len(prompt_lens)} requests in a "
          f"{capture_size}-request bucket")
    print(f"{mode}: median {median * 1e6:.0f} us/step, {median * 1e6 / share.num_layers:.0f} "
          f"us/layer")
    print(f"check against the step without graph/compile: {matched}/{steps} steps matched")
    if matched != steps:
        raise SystemExit("mismatch between the compiled step and its check")


def timed(fn, *args, sync: bool):
    """``fn(*args)`` and its wall time in seconds (the GPU drained before and after)."""
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(*args)
    if sync:
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def same_step(hidden: Tensor, slots: list[Tensor], want_hidden: Tensor,
              want_slots: list[Tensor], live: int, *, exact: bool) -> bool:
    """The live tokens' rows bitwise equal (exact), or the same selected set per row and a
    close hidden state (eager and inductor round the fp32 projections apart)."""
    hidden, want_hidden = hidden[:live], want_hidden[:live]
    if exact:
        return torch.equal(hidden, want_hidden) and all(
            torch.equal(a[:live], b[:live]) for a, b in zip(slots, want_slots))
    return torch.allclose(hidden, want_hidden, rtol=1e-3, atol=1e-3) and all(
        torch.equal(a[:live].sort(-1).values, b[:live].sort(-1).values)
        for a, b in zip(slots, want_slots))


if __name__ == "__main__":
    main()
