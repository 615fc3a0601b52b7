"""Test set-up: Triton runs under its interpreter on CPU-only machines.

TRITON_INTERPRET must be set before triton is imported, hence here, before torch's
compiler or dsa pull triton in.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("dsa", deadline=None, print_blob=True)
settings.load_profile("dsa")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
