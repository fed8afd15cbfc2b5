"""[Note: fit and held-out sets]: every fitted constant names its trials, and no trial is in both sets."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autotune.sim import fit_split
from autotune.sim.fit_split import (
    CPU_HELD_OUT,
    FITTED,
    GPU_HELD_OUT,
    GPU_RECORDED,
    check_split,
    get_fit_trials,
    is_held_out,
    split_gpu_recorded,
)
from autotune.sim.fitted import CPU_STEP, FIGURES, GPU_STEP, GSA_CASE, Fitted
from tests._gpu_traces import GPU_TRACES


def test_no_recorded_trial_is_both_fitted_on_and_held_out():
    check_split()
    for figure in FIGURES:
        fit, held = split_gpu_recorded(figure)
        assert not {r.name for r in fit} & {r.name for r in held}
        assert not {r.config for r in held} & {r.config for r in fit}  # a rerun of a fit config is not held out
        assert not {r.name for r in held} & get_fit_trials(figure)
    assert not set(CPU_HELD_OUT) & get_fit_trials(CPU_STEP)
    assert set(GPU_HELD_OUT) == {r.name for r in split_gpu_recorded(GPU_STEP)[1]}


@pytest.mark.parametrize(
    ("fit_on", "figure"),
    [
        (("gpu_sim_accuracy/seq 4096",), GPU_STEP),  # a held-out case
        (("h200-l8b4-defaults",), GPU_STEP),  # a held-out trial dir
        (("small/emulated",), CPU_STEP),
    ],
)
def test_the_split_check_fails_when_a_constant_is_fitted_on_a_held_out_trial(monkeypatch, fit_on, figure):
    leak = Fitted(name="test.LEAK", value=1.0, fit_on=fit_on, how="read off a held-out trial", figure=figure)
    monkeypatch.setattr(fit_split, "FITTED", (*FITTED, leak))
    with pytest.raises(ValueError, match="held out"):
        check_split()


def test_a_rerun_of_a_fit_config_is_in_the_fit_set():
    """``gpu_sim_accuracy``'s selective case is another run of the config ``PROFILER_FACTOR`` was read off."""
    selective = next(r for r in GPU_RECORDED if r.name == f"{GSA_CASE}selective checkpointing")
    assert not is_held_out(selective.name, GPU_STEP, selective.config)
    assert is_held_out(selective.name, GPU_STEP)  # by name alone it would pass: the config decides


def test_every_fitted_constant_names_recorded_trials_and_carries_its_live_value():
    from autotune.sim import host_path, margin, trace_costs
    from profiles import load_cluster_profile

    live = {
        "host_path.PROFILER_FACTOR": host_path.PROFILER_FACTOR,
        "host_path.LAUNCH_US": host_path.LAUNCH_US,
        "host_path.DEFAULT_RATIOS": host_path.DEFAULT_RATIOS,
        "trace_costs.HOOK_QUANTILE": trace_costs.HOOK_QUANTILE,
        "margin.SIMULATOR_MEMORY_ERROR": margin.SIMULATOR_MEMORY_ERROR,
        "margin.ALLOCATOR_FRAGMENTATION": margin.ALLOCATOR_FRAGMENTATION,
    }
    for fitted in FITTED:
        if fitted.name in live:
            assert fitted.value == live[fitted.name], fitted.name
    for cluster in ("h200-node", "h100-node"):
        assert load_cluster_profile(cluster).accelerator.host_floor_us == fit_split.H200_HOST_FLOOR_FIT.value
    with pytest.raises(ValueError, match="names the trials"):
        dataclasses.replace(FITTED[0], fit_on=())


def test_the_recorded_gpu_trials_are_the_trial_dirs_and_their_steps():
    dirs = {p.name for p in GPU_TRACES.iterdir() if (p / "metrics.json").is_file()}
    recorded = {r.name: r for r in GPU_RECORDED if not r.name.startswith(GSA_CASE)}
    assert set(recorded) == dirs
    for name, r in recorded.items():
        assert json.loads((GPU_TRACES / name / "metrics.json").read_text())["step_ms"] == pytest.approx(
            r.step_ms, abs=0.05
        ), name
