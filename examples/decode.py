"""A few lightning-indexer layers over a paged cache: prefill the prompts, then decode.

On a GPU every decode step (metadata build + all layers) replays as one CUDA graph; on a CPU
the same step runs compiled (torch.compile, fullgraph). Each step is checked against the
same step run without the graph (GPU: bit for bit) or uncompiled (CPU).

    python examples/decode.py            # default config, GPU if there is one
    python examples/decode.py --steps 64 --layers 4 --device cuda
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import dsa
from dsa.graphs import DecodeGraphRunner, pad_batch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="decode steps")
    parser.add_argument("--next-n", type=int, default=2, help="1 + MTP draft tokens")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


class ToyEngine:
    """The engine's side of the contract: requests, their blocks, and each step's batch."""

    def __init__(self, prompt_lens: list[int], cfg: dsa.IndexerConfig, device: str) -> None:
        self.cfg, self.device = cfg, device
        self.width = cfg.max_blocks_per_req
        self.seq_lens = [0] * len(prompt_lens)
        self.prompt_lens = prompt_lens
        # Request r owns blocks r*W .. r*W + W - 1.
        self.block_table = torch.arange(len(prompt_lens) * self.width, dtype=torch.int32,
                                        device=device).view(len(prompt_lens), self.width)

    def step(self, query_lens: list[int]) -> tuple[dsa.Batch, list[int]]:
        """The batch that appends ``query_lens[r]`` tokens to request r."""
        qsl, positions, slots = [0], [], []
        for r, q in enumerate(query_lens):
            start = self.seq_lens[r]
            for pos in range(start, start + q):
                positions.append(pos)
                slots.append(int(self.block_table[r, pos // self.cfg.block_size])
                             * self.cfg.block_size + pos % self.cfg.block_size)
            self.seq_lens[r] += q
            qsl.append(qsl[-1] + q)
        as_tensor = lambda x, dt: torch.tensor(x, dtype=dt, device=self.device)
        batch = dsa.Batch(
            query_start_loc=as_tensor(qsl, torch.int32),
            seq_lens=as_tensor(self.seq_lens, torch.int32),
            block_table=self.block_table,
            slot_mapping=as_tensor(slots, torch.int64),
            positions=as_tensor(positions, torch.int64),
        )
        return batch, qsl


def progress(i: int, n: int, note: str) -> None:
    done = 30 * (i + 1) // n
    print(f"\r[{'#' * done}{'.' * (30 - done)}] {i + 1}/{n} {note}", end="", file=sys.stderr,
          flush=True)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    on_gpu = args.device.startswith("cuda")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    hidden_size, q_lora_rank = (2048, 1536) if on_gpu else (256, 128)
    prompt_lens = [3000, 700, 5100, 64, 1800] if on_gpu else [300, 70, 410, 9, 150]
    steps = args.steps or (32 if on_gpu else 6)
    capture_size = 8  # 5 live requests replay in the 8-request bucket: 3 padding requests
    max_model_len = 8192 if on_gpu else 1024
    cfg = dsa.IndexerConfig(
        max_num_reqs=capture_size,
        max_num_batched_tokens=max(sum(prompt_lens), capture_size * args.next_n),
        max_model_len=max_model_len,
        topk=2048 if on_gpu else 64,
        next_n=args.next_n,
        num_blocks=len(prompt_lens) * max_model_len // 64,  # the engine's blocks, 64 tokens each
    )
    engine = ToyEngine(prompt_lens, cfg, args.device)
    layers = [
        dsa.Indexer(cfg, hidden_size=hidden_size, q_lora_rank=q_lora_rank, device=args.device,
                    dtype=dtype)
        for _ in range(args.layers)
    ]

    def step(batch: dsa.Batch, hidden: torch.Tensor, q_latent: torch.Tensor):
        meta = dsa.build_decode_metadata(cfg, batch)  # once per step, shared by all layers
        return [layer(hidden, q_latent, batch.positions, meta).slots for layer in layers]

    def inputs(num_tokens: int) -> dict[str, torch.Tensor]:
        return {
            "hidden": torch.randn(num_tokens, hidden_size, device=args.device, dtype=dtype),
            "q_latent": torch.randn(num_tokens, q_lora_rank, device=args.device, dtype=dtype),
        }

    # Prefill: every prompt at once, chunked on the host, eagerly.
    batch, qsl = engine.step(prompt_lens)
    meta = dsa.build_prefill_metadata(cfg, batch, seq_lens_cpu=engine.seq_lens,
                                      query_start_loc_cpu=qsl)
    x = inputs(batch.num_tokens)
    for layer in layers:
        layer(x["hidden"], x["q_latent"], batch.positions, meta)
    print(f"prefill: {len(prompt_lens)} prompts, {batch.num_tokens} tokens, "
          f"{len(meta.chunks)} chunk(s), {args.layers} layers on {args.device}")

    if on_gpu:
        runner = DecodeGraphRunner(
            step, cfg, sizes=[capture_size], table_width=engine.width,
            token_inputs={"hidden": ((hidden_size,), dtype), "q_latent": ((q_lora_rank,), dtype)},
        )
        runner.capture()
        run_graph = runner.replay
        run_check = runner.step  # the same compiled step, without the graph
    else:
        run_graph = torch.compile(step, fullgraph=True, dynamic=False)
        run_check = step

    latencies, matched = [], 0
    for i in range(steps):
        # MTP: most requests verify next_n tokens, every third one only 1 (uneven lengths).
        query_lens = [1 if (i + r) % 3 == 0 else args.next_n for r in range(len(prompt_lens))]
        batch, _ = engine.step(query_lens)
        x = inputs(batch.num_tokens)
        padded = pad_batch(batch, capture_size, capture_size * args.next_n)
        padded_x = {k: torch.cat([v, v.new_zeros(padded.num_tokens - v.shape[0], v.shape[1])])
                    for k, v in x.items()}
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        if on_gpu:
            got = run_graph(batch, **x)
            torch.cuda.synchronize()
        else:
            got = [s[: batch.num_tokens] for s in run_graph(padded, **padded_x)]
        latencies.append(time.perf_counter() - start)
        want = [s[: batch.num_tokens] for s in run_check(padded, **padded_x)]
        matched += all(_same_selection(g, w, exact=on_gpu) for g, w in zip(got, want))
        progress(i, steps, f"{latencies[-1] * 1e6:.0f} us/step")
    print(file=sys.stderr)

    mode = "CUDA graph replay" if on_gpu else "compiled step (CPU)"
    steady = sorted(latencies[1:] or latencies)
    print(f"decode: {steps} steps x {args.layers} layers, next_n={args.next_n}, "
          f"{len(prompt_lens)} requests in a {capture_size}-request bucket")
    print(f"{mode}: median {steady[len(steady) // 2] * 1e6:.0f} us/step")
    print(f"check against the step without graph/compile: {matched}/{steps} steps matched")
    if matched != steps:
        raise SystemExit("mismatch between graph replay and eager")


def _same_selection(a: torch.Tensor, b: torch.Tensor, *, exact: bool) -> bool:
    """Bitwise equal (exact) or the same selected set per row (order is free)."""
    if exact:
        return torch.equal(a, b)
    return torch.equal(a.sort(dim=-1).values, b.sort(dim=-1).values)


if __name__ == "__main__":
    main()
