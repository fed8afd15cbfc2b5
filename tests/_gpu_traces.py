"""Real GPU trial dirs in ``tests/data/gpu_traces`` (one NVIDIA H200 SXM 141 GB, world 1, torch
2.11.0+cu130, measured 2026-11-26 and 2026-11-27): what ``autotune trial`` and
``benchmarks/gpu_sim_accuracy.py`` wrote there, traces included (``tests/data/gpu_traces/README.md``)."""

from __future__ import annotations

from pathlib import Path

GPU_TRACES = Path(__file__).resolve().parent / "data" / "gpu_traces"
L8B4 = "h200-l8b4-defaults"
LLAMA1B = "h200-llama1b-defaults"
LLAMA1B_GSA = "h200-llama1b-gsa-defaults"
"""``gpu_sim_accuracy.py``'s calibration trial: its model a dict (``llama1b`` at ``seq_len`` 8192)."""
LLAMA1B_SELECTIVE, LLAMA1B_FULL = "h200-llama1b-selective-ac", "h200-llama1b-full-ac"


def get_gpu_trial(name: str) -> Path:
    """The trial dir ``name`` of ``tests/data/gpu_traces``."""
    path = GPU_TRACES / name
    assert (path / "metrics.json").is_file(), f"no GPU trial at {path}"
    return path
