"""One indexer layer's decode step: the three replay paths of the CUDA graph vs eager with
host-built metadata.

    python benchmarks/bench_step.py [--shapes 1x4096,...] [--out BENCHMARKS.md]

Paths, measured in the same run on the same batch (a full bucket):

- in place: the engine wrote the step's batch into ``runner.static_batch(B)``;
  ``runner.replay_in_place(B)`` launches the graph and returns its outputs as views;
- padding path: ``runner.load(live, ...)`` (one ``pad_batch_out`` launch, one copy of
  all token inputs), then ``replay_in_place``; also with one live request fewer than the bucket;
- replay: ``runner.replay(live, ...)``: the padding path plus clones of the live outputs;
- eager: the same layer run eagerly on metadata built on the host each step
  (``host_metadata.py``, the way engines do it today);
- in place, fp8 weights: the same layer built with ``fp8_weights`` (``wq_b`` and ``wk`` as
  DeepSeek ships them, fp8 with a scale per 128x128 block; the bf16 layer holds them
  dequantised, so both select the same slots).

Host time: µs per call of 20 calls back to back without a sync (what the host spends per
step while the GPU works); device time: CUDA events (``triton.testing.do_bench``: one
call, the L2 flushed before it, the graph's own launch latency included). A path is
host-bound when its host time exceeds its device time. For the in-place path, also the
span of the graph's kernels (first start to last end, torch.profiler) after 256 MB written
over (dirty L2 lines, which the step's reads write back, as in the device column), after
256 MB read over (clean lines, as a model's other layers leave them) and warm: a layer's
cost inside a model's graph, which pays one launch for all its layers. Floor: the bytes the
step must read (its requests' K-cache entries and the layer's weights) at the copy bandwidth
measured in the run, against the in-place device time.
"""

from __future__ import annotations

import sys

import torch

import dsa
from dsa.graphs import DecodeGraphRunner
from dsa.ops import block_fp8

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _report import (
    add_row,
    add_shapes_option,
    bench_parser,
    copy_bandwidth,
    device_us,
    host_us_per_call,
    kernel_span_us,
    markdown_table,
    publish,
    report,
    shapes_flag,
)
from bench_leaves import random_cache
from host_metadata import host_built_decode_metadata

SHAPES = [(1, 4096), (64, 65536), (128, 32768)]
HIDDEN, Q_LORA_RANK = 7168, 1536  # DeepSeek V3.2
IN_PLACE = "in place (`replay_in_place`)"
FP8_IN_PLACE = "in place, fp8 `wq_b` / `wk`"
BATCH_FIELDS = ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "positions")


def full_decode(batch: int, length: int,
                **overrides: object) -> tuple[dsa.IndexerConfig, dsa.Indexer, dsa.Batch]:
    """A V3.2-sized layer on a random, full K cache, and ``batch`` one-token decode requests
    at context ``length`` (``overrides``: more IndexerConfig fields). q and k are quantised
    with ue8m0 scales unless overridden, as V3.2's config asks (its ``scale_fmt``)."""
    blocks = batch * -(-length // 64)
    overrides.setdefault("ue8m0_scales", True)
    cfg = dsa.IndexerConfig(max_num_reqs=batch, max_num_batched_tokens=batch,
                            max_model_len=length, num_blocks=blocks, **overrides)
    layer = dsa.Indexer(cfg, hidden_size=HIDDEN, q_lora_rank=Q_LORA_RANK, device="cuda")
    layer.kv_cache.copy_(random_cache(blocks))
    table = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    positions = (seq_lens - 1).long()
    slots = (table.gather(1, (positions // 64).view(-1, 1).int()).view(-1).long() * 64
             + positions % 64)
    live = dsa.Batch(query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
                     seq_lens=seq_lens, block_table=table, slot_mapping=slots,
                     positions=positions)
    return cfg, layer, live


def fp8_twin(cfg: dsa.IndexerConfig, layer: dsa.Indexer) -> dsa.Indexer:
    """``layer`` built with ``fp8_weights``: its ``wq_b`` and ``wk`` quantised to fp8 blocks
    (power-of-two scales, as V3.2's checkpoints), ``layer`` given them dequantised."""
    twin = dsa.Indexer(cfg, hidden_size=HIDDEN, q_lora_rank=Q_LORA_RANK, device="cuda",
                       fp8_weights=True)
    state = layer.state_dict()
    for name in ("wq_b", "wk"):
        codes, scale = block_fp8.quantize(state[f"{name}.weight"], ue8m0=True)
        state[f"{name}.weight"], state[f"{name}.weight_scale_inv"] = codes, scale
        getattr(layer, name).weight.data.copy_(block_fp8.dequantize(codes, scale, layer.dtype))
    twin.load_state_dict(state)
    twin.kv_cache.copy_(layer.kv_cache)
    return twin


def capture(cfg: dsa.IndexerConfig, layer: dsa.Indexer, live: dsa.Batch,
            inputs: dict[str, torch.Tensor]) -> DecodeGraphRunner:
    """The layer's decode step captured for ``live``'s batch size, its static buffers
    holding ``live`` and ``inputs`` (the engine's own writes, once: the batch is fixed)."""
    batch = live.num_reqs

    def step(b: dsa.Batch, hidden: torch.Tensor, q_latent: torch.Tensor):
        return layer(hidden, q_latent, b.positions, dsa.build_decode_metadata(cfg, b)).slots

    runner = DecodeGraphRunner(
        step, cfg, sizes=[batch], table_width=live.block_table.shape[1],
        token_inputs={"hidden": ((HIDDEN,), torch.bfloat16),
                      "q_latent": ((Q_LORA_RANK,), torch.bfloat16)},
    )
    runner.capture()
    fill_bucket(runner, live, inputs)
    return runner


def fill_bucket(runner: DecodeGraphRunner, live: dsa.Batch,
                inputs: dict[str, torch.Tensor]) -> None:
    """Writes ``live`` and ``inputs`` into the static buffers of ``live``'s bucket (capturing
    leaves a warm-up batch there)."""
    static = runner.static_batch(live.num_reqs)
    for name in BATCH_FIELDS:
        getattr(static.batch, name).copy_(getattr(live, name))
    for name, value in inputs.items():
        static.inputs[name].copy_(value)


def token_inputs(batch: int) -> dict[str, torch.Tensor]:
    """Random hidden states and q latents of ``batch`` tokens."""
    return {"hidden": torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16),
            "q_latent": torch.randn(batch, Q_LORA_RANK, device="cuda", dtype=torch.bfloat16)}


def captured_layer(batch: int, length: int, fp8_weights: bool = False
                   ) -> tuple[DecodeGraphRunner, dsa.Batch, dict[str, torch.Tensor]]:
    """:func:`full_decode`'s layer (:func:`fp8_twin` with ``fp8_weights``) captured on random
    token inputs: the runner, the live batch and the inputs in its bucket."""
    cfg, layer, live = full_decode(batch, length)
    if fp8_weights:
        layer = fp8_twin(cfg, layer)
    inputs = token_inputs(batch)
    return capture(cfg, layer, live, inputs), live, inputs


def floor_us(layer: dsa.Indexer, batch: int, length: int, bandwidth: float) -> float:
    """µs to move the bytes a step must read at ``bandwidth`` (the copy's bytes read +
    written per second, as ``bench_logits_sweep.py``'s floors): every request's K-cache
    entries (D values and a scale each) and the layer's weights."""
    cache_entry = layer.kv_cache.shape[-1] * layer.kv_cache.element_size()
    weights = sum(p.numel() * p.element_size() for p in layer.parameters())
    return (batch * length * cache_entry + weights) / bandwidth * 1e6


def bench_shape(batch: int, length: int, bandwidth: float) -> list[list[object]]:
    cfg, layer, live = full_decode(batch, length)
    twin = fp8_twin(cfg, layer)
    floors = {layer: floor_us(layer, batch, length, bandwidth),
              twin: floor_us(twin, batch, length, bandwidth)}
    qsl_cpu = live.query_start_loc.cpu()
    inputs = token_inputs(batch)
    runner = capture(cfg, layer, live, inputs)
    twin_runner = capture(cfg, twin, live, inputs)

    def padding_path():
        return runner.replay_in_place(runner.load(live, **inputs))

    def eager_step():
        meta = host_built_decode_metadata(cfg, live, qsl_cpu)
        return layer(inputs["hidden"], inputs["q_latent"], live.positions, meta).slots

    # One request fewer than the bucket (B > 1): the padding path pads a request and its
    # token (the token inputs' padding row keeps what it held).
    short = batch - 1 or batch
    short_live = dsa.Batch(*(getattr(live, name)[: short + (name == "query_start_loc")]
                             for name in BATCH_FIELDS))
    short_inputs = {name: value[:short] for name, value in inputs.items()}

    def short_padding_path():
        return runner.replay_in_place(runner.load(short_live, **short_inputs))

    want = runner.replay_in_place(batch).clone()
    paths = {
        IN_PLACE: lambda: runner.replay_in_place(batch),
        "padding path (`load` + `replay_in_place`)": padding_path,
        **({f"padding path, {short} live requests": short_padding_path} if short < batch
           else {}),
        "`replay` (load, replay, clone)": lambda: runner.replay(live, **inputs),
        "eager, host-built metadata": eager_step,
        FP8_IN_PLACE: lambda: twin_runner.replay_in_place(batch),
    }
    rows = []
    for path, fn in paths.items():
        in_place = path in (IN_PLACE, FP8_IN_PLACE)
        floor = floors[twin if path == FP8_IN_PLACE else layer]
        got = fn().clone()
        rows_equal = torch.equal(got[:short], want[:short])
        result = (f"{100 * slot_overlap(got, want):.2f}% overlap" if fn is eager_step
                  else "equal" if rows_equal else "DIFFERENT")
        host, dev = host_us_per_call(fn), device_us(fn)
        kernels = (" / ".join(f"{kernel_span_us(fn, flush=flush):.1f}"
                              for flush in ("write", "read", None))
                   if in_place else "")
        rows.append([batch, length, path, f"{host:.1f}", f"{dev:.1f}", kernels,
                     f"{floor:.1f}" if in_place else "", f"{dev / floor:.2f}" if in_place else "",
                     f"{host / dev:.2f}", result])
    return rows


def slot_overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of selected slots the two runs share (their bf16 projections round apart:
    inductor fuses them, eager does not, so near-ties may flip)."""
    shared = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1) & (a >= 0)
    return float(shared.sum() / (a >= 0).sum().clamp(min=1))


def main() -> None:
    parser = bench_parser()
    add_shapes_option(parser, SHAPES, what="BxL")
    args = parser.parse_args()
    torch.manual_seed(0)
    header = ["B", "L", "path", "host µs/step", "device µs/step",
              "kernels µs/step (L2 written over / read over / warm)", "floor µs",
              "device / floor", "host / device", "top-k slots vs in place (live rows)"]
    bandwidth = copy_bandwidth()
    rows = []
    for shape in args.shapes or SHAPES:
        for row in bench_shape(*shape, bandwidth):
            add_row(rows, row)
        torch.cuda.empty_cache()
    text = report(
        "Decode step of one indexer layer: replay paths of the CUDA graph vs eager",
        markdown_table(header, rows),
        notes=(f"hidden {HIDDEN}, q_lora_rank {Q_LORA_RANK}, H=64, D=128, top-k 2048, "
               "next_n 1, ue8m0 scales (V3.2's `scale_fmt`), full contexts, bf16, logits "
               "backend auto, `num_blocks` set; a full "
               "bucket (no padding requests) except the row with B - 1 live requests; host µs "
               "per step of 20 steps back to back, no sync; eager top-k overlap: slots both "
               "runs select (their bf16 projections round differently: inductor fuses them); "
               "floor: the K-cache entries of every request and the layer's weights (fp8 "
               "`wq_b` / `wk` and their scales in the fp8 row) read once at the copy "
               f"bandwidth measured in this run ({bandwidth / 1e12:.2f} TB/s, "
               "read + write)"),
        command="python benchmarks/bench_step.py" + shapes_flag(args.shapes),
    )
    publish(text, args.out)


if __name__ == "__main__":
    main()
