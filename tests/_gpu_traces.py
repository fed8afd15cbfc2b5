"""The real GPU trials in ``shared/gpu-traces`` (one H200, world 1, torch 2.11), beside the clone.

CI checks out the repository with ``shared/`` beside it; on a box without it the tests that
read these trials skip (and fail under ``AUTOTUNE_REQUIRE_ALL=1``).
"""

from __future__ import annotations

from pathlib import Path

from tests._required import skip_unless_required

GPU_TRACES = Path(__file__).resolve().parents[2] / "shared" / "gpu-traces"
L8B4 = "h200-l8b4-defaults"
LLAMA1B = "h200-llama1b-defaults"


def get_gpu_trial(name: str) -> Path:
    """The trial dir ``name`` of ``shared/gpu-traces``; skips where it is absent."""
    path = GPU_TRACES / name
    if not (path / "metrics.json").is_file():
        skip_unless_required(f"no GPU trial at {path} (shared/gpu-traces beside the clone)")
    return path
