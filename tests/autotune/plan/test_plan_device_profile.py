"""``autotune calibrate`` writes a device profile from a GPU trial; ``autotune plan --device-profile`` prices with it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from autotune.plan import PlanSettings, run_plan
from autotune.sim import DeviceProfile
from fsdp_runtime import load_config
from tests._gpu_traces import L8B4, get_gpu_trial

REPO = Path(__file__).resolve().parents[3]


def _cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import cli; cli.main()", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """``autotune calibrate`` on the H200 trial, run once for the module as the console script
    runs (its own process): the device profile written and what the command printed."""
    out = tmp_path_factory.mktemp("calibrated") / "h200.toml"
    return out, _cli("calibrate", str(get_gpu_trial(L8B4)), "--out", str(out))


def test_calibrate_then_plan_with_the_measured_profile(tmp_path, calibrated):
    path, done = calibrated
    assert done.returncode == 0, done.stderr
    assert (
        "NVIDIA H200: GEMM 791 TFLOP/s" in done.stdout and "measured 377.3 ms (-1.6%)" in done.stdout
    )  # idle scaled to the unprofiled step: [Note: GPU calibration]
    # the memory margin's simulator-error share, checked on the trial (+0.24% on this one)
    assert "CUDA max allocated 50.31 GiB (+0.24%: within the plan's 0.84% margin" in done.stdout
    profile = DeviceProfile.read(path)
    assert profile.measured_on["model"] == "l8b4" and profile.torch.startswith("2.11")

    settings = dict(model="tiny", cluster="h200-node", num_nodes=1, num_workers=1, memory_knobs=False)
    lines: list[str] = []

    class Reporter:
        def on_phase(self, message: str) -> None:
            lines.append(message)

        def on_start(self, total: int) -> None: ...

        def on_advance(self, count: int) -> None: ...

    measured = run_plan(PlanSettings(**settings, out_dir=tmp_path / "m", device_profile=path), reporter=Reporter())
    datasheet = run_plan(PlanSettings(**settings, out_dir=tmp_path / "d"))
    assert any(line.startswith("prices measured on NVIDIA H200") for line in lines)
    assert any("datasheet: collectives" in line for line in lines)
    # Measured rates are slower than the datasheet's (eager elementwise kernels, copies): a longer step.
    assert measured.default.prediction.step_s > datasheet.default.prediction.step_s
    notes = load_config(tmp_path / "m" / "best.toml").provenance.notes
    assert any(note.startswith("prices measured on NVIDIA H200") for note in notes)


def test_a_device_profile_of_another_gpu_or_precision_is_refused_in_one_line(tmp_path, calibrated, cli_main):
    # In-process (``cli.main()``, the console script's entry point): the refusals need no process of their own.
    path, done = calibrated
    assert done.returncode == 0, done.stderr
    for args, message in (
        (("--cluster", "h100-node"), "error: --device-profile: device profile"),
        (("--cluster", "h200-node", "--param-dtype", "float32"), "error: --device-profile: device profile"),
    ):
        done = cli_main("plan", "--model", "tiny", *args, "--device-profile", str(path), "--out", str(tmp_path / "o"))
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith(message) and len(done.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "o").exists()
    done = cli_main("calibrate", str(tmp_path), "--out", str(tmp_path / "x.toml"))
    assert done.returncode == 2 and "not a trial dir" in done.stderr and not (tmp_path / "x.toml").exists()
