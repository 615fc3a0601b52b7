"""``torch.ops.dsa.*``: every metadata step and compute leaf of the DSA indexer.

Importing this package registers the ops; ``FACES`` maps op names to their three faces
(CPU torch, CUDA Triton/DeepGEMM, fake). One module or folder per family:

- ``decode_meta``, ``decode_fused`` (all of a decode step's metadata in one launch),
  ``prefill_meta``, ``dcp``, ``layout``, ``write_slots``: metadata;
- ``pad``: a live batch padded into a captured bucket's static buffers;
- ``quant``, ``kcache``: fp8 quantisation, the paged K cache (write, gather);
- ``block_fp8``: DeepSeek's block-scaled fp8 weights (helpers, not ops);
- ``prologue``: RoPE, Hadamard and quantisation of q and k in one launch each;
- ``project``: a few tokens' whole prologue from the hidden state (the three projections,
  then the two above) in two launches;
- ``logits/``: MQA logits (paged, ragged, DeepGEMM schedule);
- ``topk/``: top-k selection and the index-to-slot transform.

Adding an op: see "Adding an op" in ``docs/design.md``.
"""

from dsa.ops import (
    block_fp8,
    dcp,
    decode_fused,
    decode_meta,
    kcache,
    layout,
    logits,
    pad,
    prefill_meta,
    project,
    prologue,
    quant,
    topk,
    write_slots,
)
from dsa.ops._registry import FACES

__all__ = [
    "FACES",
    "block_fp8",
    "dcp",
    "decode_fused",
    "decode_meta",
    "kcache",
    "layout",
    "logits",
    "pad",
    "prefill_meta",
    "project",
    "prologue",
    "quant",
    "topk",
    "write_slots",
]
