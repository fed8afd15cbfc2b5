"""torchtitan 0.3.0 beside the venv's 0.2.2, for the tests of the 0.3.0 registry ([Note: torchtitan models]).

The venv's torchtitan is 0.2.2 (its models train on CPU); ``./dev`` also installs 0.3.0's wheel
with ``--no-deps`` into ``<venv>/torchtitan-0.3.0`` (with ``spmd_types``, which 0.3.0's model
modules import). A test puts that directory first on ``PYTHONPATH`` in a subprocess, where
``import torchtitan`` and its package metadata are 0.3.0's. Absent: the test skips, or fails
under ``AUTOTUNE_REQUIRE_ALL=1`` (CI).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _required import skip_unless_required

REPO = Path(__file__).resolve().parents[1]
TORCHTITAN_030 = Path(sys.prefix) / "torchtitan-0.3.0"
"""Where ``./dev`` installs torchtitan 0.3.0 (``pip install --no-deps --target``)."""


def require_torchtitan_030(*, torch_can: bool = True) -> Path:
    """The directory holding torchtitan 0.3.0; skips (fails in CI) where it is absent. With
    ``torch_can``, also skips where this torch cannot import 0.3.0 (2.11: refused in one line,
    which ``test_0_3_0_on_a_torch_it_cannot_import_is_refused_in_one_line`` checks everywhere)."""
    if not (TORCHTITAN_030 / "torchtitan").is_dir():
        skip_unless_required(
            f"torchtitan 0.3.0 is not installed in {TORCHTITAN_030}: "
            f"pip install --no-deps --target {TORCHTITAN_030} torchtitan==0.3.0 spmd_types==0.2.3 (./dev does)"
        )
    if torch_can:
        import torch.distributed.fsdp as fsdp

        if not hasattr(fsdp, "DataParallelMeshDims"):
            pytest.skip("torchtitan 0.3.0 needs torch >= 2.12: refused on this torch (tested apart)")
    return TORCHTITAN_030


def get_env_030(*, torch_can: bool = True) -> dict[str, str]:
    """This process's environment with torchtitan 0.3.0 first on ``PYTHONPATH``, then the repo."""
    paths = [str(require_torchtitan_030(torch_can=torch_can)), str(REPO), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def run_with_030(args: list[str], *, timeout_s: float = 300, torch_can: bool = True) -> subprocess.CompletedProcess:
    """``python ARGS`` in the repo with torchtitan 0.3.0 importable instead of 0.2.2."""
    env = get_env_030(torch_can=torch_can)
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
