"""dsa: the DeepSeek Sparse Attention lightning indexer, torch.compile-first."""

from dsa import ops

__all__ = ["ops"]
