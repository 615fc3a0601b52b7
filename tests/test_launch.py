"""Launch helpers (dsa/ops/_launch.py): the ``DSA_PDL`` level and where it applies."""

from __future__ import annotations

import pytest
import torch

from dsa.ops import _launch


@pytest.mark.parametrize(("value", "level"), [(None, 1), ("0", 0), ("1", 1), (" 2 ", 2)])
def test_pdl_level(value, level):
    assert _launch.pdl_level(value) == level


@pytest.mark.parametrize("value", ["", "3", "-1", "on", "1.0"])
def test_pdl_level_rejects_other_values(value):
    with pytest.raises(ValueError, match=r"DSA_PDL must be one of 0, 1, 2 .*got"):
        _launch.pdl_level(value)


@pytest.mark.parametrize("level", [0, 1, 2])
def test_pdl_never_on_the_cpu(monkeypatch, level):
    monkeypatch.setattr(_launch, "PDL", level)
    x = torch.zeros(1)
    assert not any(_launch.pdl_enabled(x, small) for small in (None, False, True))
    assert _launch.pdl_launch(False) == {} and _launch.pdl_launch(True) == {"launch_pdl": True}


def test_pdl_never_on_rocm(monkeypatch):
    """ROCm's devices are "cuda" too (MI300 reports compute capability 9.4), but the PDL
    waits and triggers are PTX: never there, whatever the level."""
    monkeypatch.setattr(_launch, "PDL", 2)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 4))

    class RocmTensor:
        is_cuda = True
        device = torch.device("cuda", 0)

    assert not any(_launch.pdl_enabled(RocmTensor(), small) for small in (None, False, True))


@pytest.mark.parametrize(("small", "rows", "mode"),
                         [(False, 1, 0), (True, 1, 2), (True, 2, 1), (True, 16, 1)])
def test_chain_pdl_starts_dependents_first_only_for_one_row(monkeypatch, small, rows, mode):
    monkeypatch.setattr(_launch, "pdl_enabled", lambda x, small=None: bool(small))
    assert _launch.chain_pdl(torch.zeros(1), small, rows) == mode


def test_chain_pdl_off_on_the_cpu():
    assert _launch.chain_pdl(torch.zeros(1), True, 1) == 0
