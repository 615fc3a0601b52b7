"""``torch.ops.dsa.*``: every metadata step and compute leaf of the DSA indexer.

Importing this package registers the ops. Each module holds a family of ops with their
three faces (CPU torch, CUDA Triton/DeepGEMM, fake); ``FACES`` maps op names to them.
"""

from dsa.ops import (
    dcp,
    decode_meta,
    kcache,
    layout,
    logits,
    prefill_meta,
    quant,
    slot_mapping,
    slots,
    topk,
)
from dsa.ops._registry import FACES

__all__ = [
    "FACES",
    "dcp",
    "decode_meta",
    "kcache",
    "layout",
    "logits",
    "prefill_meta",
    "quant",
    "slot_mapping",
    "slots",
    "topk",
]
