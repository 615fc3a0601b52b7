"""Chunked prefill with the lightning indexer: a logits budget that forces several chunks.

The prompts are planned into chunks on the host (``dsa.split_prefill_chunks`` under both
budgets: K workspace rows and logits bytes); the longest prompt alone is over the logits
budget, so its queries are split into sub-chunks that reuse its gathered K. The selection
is checked against the same prefill run as one unbudgeted chunk.

    python examples/prefill.py [--device cuda]
"""

from __future__ import annotations

import argparse

import torch

import dsa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    on_gpu = args.device.startswith("cuda")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    prompts = [1500, 300, 4000, 40] if on_gpu else [150, 30, 400, 4]
    hidden_size, q_lora_rank = 512, 256
    limits = {"max_num_reqs": len(prompts), "max_num_batched_tokens": sum(prompts),
              "max_model_len": 4096, "topk": 256 if on_gpu else 32}
    # Room for about a quarter of the longest prompt's logits rows at a time.
    budget = 4 * prompts[2] * prompts[2] // 4
    limits["num_blocks"] = len(prompts) * -(-limits["max_model_len"] // 64)
    chunked = dsa.IndexerConfig(**limits, max_logits_bytes=budget)
    whole = dsa.IndexerConfig(**limits)

    layer = dsa.Indexer(chunked, hidden_size=hidden_size, q_lora_rank=q_lora_rank,
                        device=args.device, dtype=dtype)
    width = chunked.max_blocks_per_req
    table = torch.arange(len(prompts) * width, dtype=torch.int32, device=args.device)
    table = table.view(len(prompts), width)
    qsl = [0]
    for n in prompts:
        qsl.append(qsl[-1] + n)
    positions = torch.cat([torch.arange(n) for n in prompts]).to(args.device)
    requests = torch.repeat_interleave(torch.arange(len(prompts)), torch.tensor(prompts))
    slots = table.cpu()[requests, positions.cpu() // 64].long() * 64 + positions.cpu() % 64
    batch = dsa.Batch(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=args.device),
        seq_lens=torch.tensor(prompts, dtype=torch.int32, device=args.device),
        block_table=table,
        slot_mapping=slots.to(args.device),
        positions=positions,
    )
    hidden = torch.randn(batch.num_tokens, hidden_size, device=args.device, dtype=dtype)
    q_latent = torch.randn(batch.num_tokens, q_lora_rank, device=args.device, dtype=dtype)

    outputs = {}
    for name, cfg in (("chunked", chunked), ("whole", whole)):
        meta = dsa.build_prefill_metadata(cfg, batch, seq_lens_cpu=prompts,
                                          query_start_loc_cpu=qsl)
        outputs[name] = layer(hidden, q_latent, batch.positions, meta)
        print(f"{name}: {len(meta.chunks)} chunk(s)")
        for c in meta.chunks:
            print(f"  requests [{c.req_start}, {c.req_end}) tokens [{c.token_start}, "
                  f"{c.token_end}) K rows {c.num_rows}"
                  + ("  (reuses the gathered K)" if c.skip_gather else ""))

    sort = lambda t: t.sort(dim=-1).values
    same = torch.equal(sort(outputs["chunked"].indices), sort(outputs["whole"].indices))
    print(f"chunked selection == unchunked selection: {same}")
    if not same:
        raise SystemExit("chunked prefill disagrees with the single-chunk run")


if __name__ == "__main__":
    main()
