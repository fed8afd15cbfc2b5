"""FSDP2's own host time from the traces ([Note: host-bound steps]), on recorded trials: the H200
ones of ``tests/data/gpu_traces`` and the 2-rank CPU ``tiny`` trial of ``tests/data``."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from autotune.analysis import HOST_BOUND_SHARE, FsdpTraceAnalysis
from autotune.analysis._host_analysis import get_top_labels, is_backward_phase
from autotune.report import get_host_tables, load_report
from autotune.report.host import get_found_line
from autotune.report.host_time import HostTime, get_host_time
from tests._gpu_traces import L8B4, LLAMA1B, LLAMA1B_FULL, LLAMA1B_SELECTIVE, get_gpu_trial

CPU_TINY = Path(__file__).resolve().parents[2] / "data" / "cpu_tiny_2rank"


def _analysis(path: Path) -> FsdpTraceAnalysis:
    return FsdpTraceAnalysis(sorted(path.glob("trace_rank*.json.gz")))


@pytest.mark.parametrize(
    ("trial", "host_bound"), [(LLAMA1B_SELECTIVE, True), (LLAMA1B_FULL, True), (LLAMA1B, False), (L8B4, False)]
)
def test_the_recorded_gpu_trials_host_bound_ones_are_named(trial, host_bound):
    # The checkpointed Llama 1B trials are the ones the simulator's host path calls host-bound
    # (their step waits on launches); the defaults and Llama 8B are device-bound.
    host = get_host_time(_analysis(get_gpu_trial(trial)))
    assert host.device == "gpu" and host.host_bound is host_bound, host.share
    assert (host.share >= 0.07) if host_bound else (host.share < 0.02)  # far from the 5% line either way
    assert host.describe().startswith("host-bound" if host_bound else "not host-bound")


@pytest.mark.parametrize("path", [CPU_TINY, get_gpu_trial(LLAMA1B_SELECTIVE)])
def test_host_time_is_inside_the_hooks_and_splits_into_forward_and_backward(path):
    steps, units = _analysis(path).get_host_metrics()
    assert len(steps) and (steps["hook_ms"] > 0).all()
    assert (steps["host_ms"] <= steps["hook_ms"] + 1e-9).all() and (steps["hook_ms"] <= steps["step_ms"]).all()
    # every hook is either a forward or a backward one, and they do not overlap on one thread
    assert (steps["forward_host_ms"] + steps["backward_host_ms"] - steps["host_ms"]).abs().max() < 1e-6
    by_step = units.groupby(["rank", "step"])[["forward_host_ms", "backward_host_ms"]].sum()
    joined = steps.set_index(["rank", "step"]).join(by_step.add_suffix("_units"))
    # the units' hooks add up to the step's (the root's labels carry no FQN: root)
    assert (joined["forward_host_ms"] - joined["forward_host_ms_units"]).abs().max() < 1e-6
    assert (joined["backward_host_ms"] - joined["backward_host_ms_units"]).abs().max() < 1e-6


def test_cpu_host_time_counts_only_the_training_thread_s_ops_inside_the_hooks():
    analysis = _analysis(CPU_TINY)
    steps, _ = analysis.get_host_metrics()
    # gloo waits inside the hooks (all-gather copy-out, the reduce-scatter's wait) are not host work
    assert (steps["host_ms"] < 0.6 * steps["hook_ms"]).all()
    host = get_host_time(analysis)
    assert host.device == "cpu" and host.threshold == HOST_BOUND_SHARE["cpu"] and not host.host_bound
    assert host.num_units == 3  # layers.0, layers.1, root


def test_nested_labels_belong_to_the_hook_around_them():
    labels = pd.DataFrame(
        {
            "start": [0.0, 1.0, 2.0, 10.0, 11.0, 20.0],
            "end": [5.0, 3.0, 2.5, 15.0, 12.0, 21.0],
            "phase": ["pre_backward", "all_gather", "all_gather_copy_out", "pre_forward", "all_gather", "post_forward"],
            "unit": ["a", "b", "b", "b", "c", "b"],
        }
    )
    top = get_top_labels(labels)
    assert top["phase"].tolist() == ["pre_backward", "pre_forward", "post_forward"]
    assert [is_backward_phase(p) for p in ("post_backward_reduce", "backward_prefetch", "root_pre_forward")] == [
        True,
        True,
        False,
    ]


def test_a_trial_report_shows_the_hooks_per_unit_and_names_a_host_bound_step():
    tables = get_host_tables(load_report(get_gpu_trial(LLAMA1B_SELECTIVE)))
    assert len(tables) == 1 and "host-bound: FSDP's own host work is" in tables[0].title
    assert tables[0].columns == ["unit", "forward hooks", "backward hooks", "share of step"]
    assert tables[0].rows[0][0] == "root"  # the most host time: the root's hooks
    assert tables[0].rows[-2][0] == "FSDP's own host work (the step's)" and tables[0].rows[-1][0] == "step"
    assert any(r[0].endswith("more units") for r in tables[0].rows)  # 17 units: 8 shown, the rest summed


class _Comparison:
    best_label, default_label = "best: trial 4 (emitted)", "defaults: trial 0"


class _Report:
    comparison = _Comparison()


def _host(share: float, num_units: int) -> HostTime:
    units = pd.DataFrame({"unit": [f"u{i}" for i in range(num_units)], "forward_host_ms": 0.0, "backward_host_ms": 0.0})
    return HostTime(device="cpu", num_steps=2, step_ms=100.0, hook_ms=60.0, host_ms=100 * share, units=units)


def test_what_the_search_found_for_host_bound_defaults_is_said_with_the_units():
    line = get_found_line(_Report(), _host(0.12, 3), _host(0.30, 5))
    assert line == (
        "the defaults are host-bound (30.0% of their step in FSDP's own host work); "
        "best: trial 4 (emitted) spends 12.0% (3 units instead of 5: larger units)"
    )
    same = get_found_line(_Report(), _host(0.25, 5), _host(0.30, 5))
    assert same.endswith("spends 25.0% (the same units: the search changed no unit's size)")
