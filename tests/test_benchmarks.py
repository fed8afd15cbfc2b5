"""The GPU check script's dry run: it runs here, without CUDA, as it will run on a GPU box up to the first CUDA call."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_plans_the_run_and_tabulates_a_recorded_trial(tmp_path):
    recorded = tmp_path / "recorded"
    recorded.mkdir()
    shutil.copy(ROOT / "tests" / "data" / "artifacts" / "metrics_v8.json", recorded / "metrics.json")
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/gpu_check.py",
            "--dry-run",
            "--out",
            str(tmp_path / "out"),
            "--recorded",
            str(recorded),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    model = next(line for line in lines if line.startswith("model: "))
    assert "'name': 'llama8b'" in model and "of 80 GiB" in model
    assert any(
        line.startswith("search: 6 trials of llama8b-") and line.endswith("blocks on 1 GPU(s), bfloat16/float32")
        for line in lines
    )
    assert sum(line.startswith("numerics ") for line in lines) == 2
    row = lines[lines.index(next(line for line in lines if line.strip().startswith("trial"))) + 1].split()
    assert row[:2] == ["recorded", "ok"] and lines[-1] == "dry run: no trial ran"
    assert not list((tmp_path / "out").rglob("metrics.json"))  # nothing ran
    (toml,) = (tmp_path / "out").glob("llama8b-*blocks.toml")  # the sized model, as the search will get it
    assert "dim = 4096" in toml.read_text(encoding="utf-8")
