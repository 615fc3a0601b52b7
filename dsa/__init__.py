"""dsa: the DeepSeek Sparse Attention lightning indexer as torch custom ops.

Importing ``dsa`` registers ``torch.ops.dsa.*``. The public API: ``IndexerConfig``,
``Batch``, ``build_decode_metadata`` / ``build_prefill_metadata`` and their metadata types,
the ``Indexer`` layer (``Indexer.from_hf_config``, ``Indexer.load_checkpoint`` for DeepSeek
V3.2 checkpoints) with its ``YarnScaling`` RoPE, ``IndexShare`` (which layers reuse an earlier
layer's top-k), ``dsa.graphs`` for CUDA-graph capture of decode steps, and
``dsa.distributed`` for the exact top-k across DCP ranks.
"""

from dsa import distributed, graphs, ops
from dsa.config import IndexerConfig
from dsa.index_share import IndexShare
from dsa.indexer import Indexer, IndexerOutput
from dsa.meta import (
    Batch,
    DecodeMetadata,
    PrefillChunk,
    PrefillMetadata,
    build_decode_metadata,
    build_prefill_metadata,
    split_prefill_chunks,
)
from dsa.rope import YarnScaling

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "DecodeMetadata",
    "IndexShare",
    "Indexer",
    "IndexerConfig",
    "IndexerOutput",
    "PrefillChunk",
    "PrefillMetadata",
    "YarnScaling",
    "build_decode_metadata",
    "build_prefill_metadata",
    "distributed",
    "graphs",
    "ops",
    "split_prefill_chunks",
]
