"""Puts ``tests/autotune`` (the ``_*`` helpers) on ``sys.path``, which the launchers pass on to
the ranks, for the tests in its stage folders."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture
def fake_cuda(monkeypatch):
    """This box as a CUDA node for code that only asks torch about it (no kernel runs):
    ``state.num_devices`` GPUs of ``state.total_memory`` bytes each."""
    import torch

    from autotune.sim.model_work import get_optimizer_bytes_per_element

    # The simulator's AdamW probe steps a CPU optimizer once (cached): before CUDA is faked, since a
    # CUDA build's optimizer asks the real accelerator for its stream where CUDA seems available.
    get_optimizer_bytes_per_element()
    state = SimpleNamespace(num_devices=1, total_memory=80 * 2**30, name="NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state.num_devices)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda device=None: SimpleNamespace(total_memory=state.total_memory, name=state.name),
    )
    return state
