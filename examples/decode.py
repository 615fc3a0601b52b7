"""A few lightning-indexer layers over a paged cache: prefill the prompts, then decode.

On a GPU every decode step (metadata build + all layers) replays as one CUDA graph; on a CPU
the same step runs compiled (torch.compile, fullgraph). The engine owns the step's input
buffers and writes each step's batch straight into them (one host-to-device copy, one
padding launch): the graph reads them in place. Each step is checked against the same step
run without the graph (GPU: bit for bit) or uncompiled (CPU); then as many steps run back to
back, timed, against the graph's own device time.

    python examples/decode.py            # default config, GPU if there is one
    python examples/decode.py --steps 64 --layers 4 --device cuda
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import dsa
from dsa.graphs import DecodeGraphRunner, StaticBatch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="decode steps")
    parser.add_argument("--next-n", type=int, default=2, help="1 + MTP draft tokens")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


class ToyEngine:
    """The engine's side of the contract: requests, their blocks, and each step's batch.

    It owns the decode step's input buffers (``static``, a whole bucket) and writes each
    step there: the step's small integer tensors packed into one pinned host buffer, one
    non-blocking copy to the device, and one ``pad_batch_out`` launch that unpacks them
    into ``static`` and pads the bucket.
    """

    def __init__(self, prompt_lens: list[int], cfg: dsa.IndexerConfig, static: StaticBatch,
                 device: str) -> None:
        self.cfg, self.device, self.static = cfg, device, static
        self.width = cfg.max_blocks_per_req
        self.seq_lens = [0] * len(prompt_lens)
        # Request r owns blocks r*W .. r*W + W - 1. The host keeps its own copy: reading the
        # device table would sync every step.
        table = torch.arange(len(prompt_lens) * self.width, dtype=torch.int32)
        self.host_table = table.view(len(prompt_lens), self.width).tolist()
        self.block_table = table.view(len(prompt_lens), self.width).to(device)
        size = 2 * (len(prompt_lens) + 1) + 2 * cfg.max_num_batched_tokens
        on_gpu = torch.device(device).type == "cuda"
        self._host = torch.empty(size, dtype=torch.int64, pin_memory=on_gpu)
        self._staging = torch.empty(size, dtype=torch.int64, device=device)
        self._copied = torch.cuda.Event() if on_gpu else None

    def host_step(self, query_lens: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Appends ``query_lens[r]`` tokens to request r; (query_start_loc, positions, slots)
        of the step, on the host."""
        bs = self.cfg.block_size
        qsl, positions, slots = [0], [], []
        for r, q in enumerate(query_lens):
            start = self.seq_lens[r]
            for pos in range(start, start + q):
                positions.append(pos)
                slots.append(self.host_table[r][pos // bs] * bs + pos % bs)
            self.seq_lens[r] += q
            qsl.append(qsl[-1] + q)
        return qsl, positions, slots

    def prefill_batch(self, prompt_lens: list[int]) -> tuple[dsa.Batch, list[int]]:
        """The batch that prefills every prompt (its own tensors, not the decode buffers)."""
        qsl, positions, slots = self.host_step(prompt_lens)
        as_tensor = lambda x, dt: torch.tensor(x, dtype=dt, device=self.device)
        batch = dsa.Batch(as_tensor(qsl, torch.int32), as_tensor(self.seq_lens, torch.int32),
                          self.block_table, as_tensor(slots, torch.int64),
                          as_tensor(positions, torch.int64))
        return batch, qsl

    def write_decode_step(self, query_lens: list[int]) -> int:
        """Writes the decode step that appends ``query_lens[r]`` tokens to request r into
        ``static`` (padding the bucket); returns its number of tokens."""
        qsl, positions, slots = self.host_step(query_lens)
        packed = qsl + self.seq_lens + slots + positions
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the host buffer
        self._host[: len(packed)] = torch.tensor(packed)
        staging = self._staging[: len(packed)]
        staging.copy_(self._host[: len(packed)], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        reqs, tokens = len(query_lens), len(slots)
        qsl_t, seq_t, slot_t, pos_t = staging.split([reqs + 1, reqs, tokens, tokens])
        self.static.load_batch(dsa.Batch(qsl_t, seq_t, self.block_table, slot_t, pos_t))
        return tokens


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
    # The decode step's inputs, owned by the engine: one bucket of capture_size requests.
    static = StaticBatch(capture_size, capture_size * args.next_n, cfg.block_table_width,
                         token_inputs={"hidden": ((hidden_size,), dtype),
                                       "q_latent": ((q_lora_rank,), dtype)},
                         device=args.device)
    engine = ToyEngine(prompt_lens, cfg, static, args.device)
    layers = [
        dsa.Indexer(cfg, hidden_size=hidden_size, q_lora_rank=q_lora_rank, device=args.device,
                    dtype=dtype)
        for _ in range(args.layers)
    ]

    def step(batch: dsa.Batch, hidden: torch.Tensor, q_latent: torch.Tensor):
        meta = dsa.build_decode_metadata(cfg, batch)  # once per step, shared by all layers
        return [layer(hidden, q_latent, batch.positions, meta).slots for layer in layers]

    # Prefill: every prompt at once, chunked on the host, eagerly.
    batch, qsl = engine.prefill_batch(prompt_lens)
    meta = dsa.build_prefill_metadata(cfg, batch, seq_lens_cpu=engine.seq_lens,
                                      query_start_loc_cpu=qsl)
    hidden = torch.randn(batch.num_tokens, hidden_size, device=args.device, dtype=dtype)
    q_latent = torch.randn(batch.num_tokens, q_lora_rank, device=args.device, dtype=dtype)
    for layer in layers:
        layer(hidden, q_latent, batch.positions, meta)
    print(f"prefill: {len(prompt_lens)} prompts, {batch.num_tokens} tokens, "
          f"{len(meta.chunks)} chunk(s), {args.layers} layers on {args.device}")

    if on_gpu:
        runner = DecodeGraphRunner(step, cfg, buffers=static, sizes=[capture_size])
        runner.capture()
        run_graph = lambda: runner.replay_in_place(capture_size)  # outputs: views
        run_check = runner.step  # the same compiled step, without the graph
    else:
        compiled = torch.compile(step, fullgraph=True, dynamic=False)
        run_graph = lambda: compiled(static.batch, **static.inputs)
        run_check = step

    def decode_step(i: int) -> int:
        # MTP: most requests verify next_n tokens, every third one only 1 (uneven lengths).
        query_lens = [1 if (i + r) % 3 == 0 else args.next_n for r in range(len(prompt_lens))]
        tokens = engine.write_decode_step(query_lens)
        for value in static.inputs.values():  # stand-ins for the model's activations
            value[:tokens].normal_()
        return tokens

    matched = 0
    for i in range(steps):
        tokens = decode_step(i)
        got = [s[:tokens].clone() for s in run_graph()]
        want = [s[:tokens] for s in run_check(static.batch, **static.inputs)]
        matched += all(_same_selection(g, w, exact=on_gpu) for g, w in zip(got, want))
        progress(i, steps, "checked against the step without graph/compile")
    print(file=sys.stderr)
    print(f"decode: {steps} steps x {args.layers} layers, next_n={args.next_n}, "
          f"{len(prompt_lens)} requests in a {capture_size}-request bucket")
    print(f"check against the step without graph/compile: {matched}/{steps} steps matched")

    # Timed: as many steps back to back, the host writing step i + 1 while the GPU runs i.
    sync = torch.cuda.synchronize if on_gpu else lambda: None
    sync()
    start = time.perf_counter()
    for i in range(steps, 2 * steps):
        decode_step(i)
        run_graph()
    sync()
    per_step = (time.perf_counter() - start) / steps
    mode = "CUDA graph replay in place" if on_gpu else "compiled step (CPU)"
    print(f"{mode}: {per_step * 1e6:.0f} us/step ({steps} steps back to back: engine writes "
          "+ replay)")
    if on_gpu:
        graph_us = _graph_device_us(run_graph)
        print(f"graph device time: {graph_us:.0f} us/step; per-step / device = "
              f"{per_step * 1e6 / graph_us:.2f}")
    if matched != steps:
        raise SystemExit("mismatch between graph replay and eager")


def _graph_device_us(replay, replays: int = 20) -> float:
    """Device time of one replay: CUDA events around ``replays`` back-to-back replays."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay()
    start.record()
    for _ in range(replays):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def _same_selection(a: torch.Tensor, b: torch.Tensor, *, exact: bool) -> bool:
    """Bitwise equal (exact) or the same selected set per row (order is free)."""
    if exact:
        return torch.equal(a, b)
    return torch.equal(a.sort(dim=-1).values, b.sort(dim=-1).values)


if __name__ == "__main__":
    main()
