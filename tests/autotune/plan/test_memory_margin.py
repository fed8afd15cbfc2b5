"""The plan's memory margin ([Note: memory margin] in autotune/sim/margin.py): its parts from the
measured GPU trials, and a plan whose fastest configs are at the edge of memory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _trace_builders import memory, step, trace, write

from autotune.analysis import FsdpTraceAnalysis
from autotune.plan import PlanRecord, PlanSettings, get_config_lines, get_plan_lines, get_plan_table, run_plan
from autotune.sim import (
    ALLOCATOR_FRAGMENTATION,
    SIMULATOR_MEMORY_ERROR,
    Hardware,
    MemoryMargin,
    compare_trial_peak,
)
from fsdp_runtime import load_config
from profiles import load_cluster_profile
from tests._gpu_traces import get_gpu_trial

REPO = Path(__file__).resolve().parents[3]
GPU_TRIALS = ("h200-l8b4-defaults", "h200-llama1b-defaults")
_GIB = 2**30


def _gpu_trial(name: str) -> Path:
    return get_gpu_trial(name)


def test_the_simulator_error_part_is_the_measured_one():
    """Predicted peak vs CUDA max allocated of the two defaults H200 trials: +0.24% and +0.84%; the part is the
    larger (the checkpointing trials, smaller, in tests/autotune/sim/test_gpu_peak_memory.py)."""
    comparisons = [compare_trial_peak(_gpu_trial(name)) for name in GPU_TRIALS]
    measured = [c.measured_bytes / _GIB for c in comparisons]
    assert measured == [pytest.approx(50.31, abs=0.005), pytest.approx(46.93, abs=0.005)]
    errors = [c.error for c in comparisons]
    assert errors == [pytest.approx(0.0024, abs=5e-5), pytest.approx(0.0084, abs=5e-5)]
    assert round(max(abs(e) for e in errors), 4) == SIMULATOR_MEMORY_ERROR


def test_the_fragmentation_part_is_our_h200_measurement_by_default():
    """Without a device profile of its own the plan takes the largest reserved / allocated - 1 measured
    on one H200 (8.1%, full checkpointing), and says where it comes from."""
    margin = Hardware(load_cluster_profile("h100-node")).memory_margin
    assert margin is not None
    parts = {p.name: p for p in margin.parts}
    assert parts["allocator_fragmentation"].share == ALLOCATOR_FRAGMENTATION == 0.081
    assert (
        parts["allocator_fragmentation"].source.startswith("measured")
        and "H200" in parts["allocator_fragmentation"].source
    )
    assert parts["simulator_error"].source.startswith("measured")


def test_a_device_profile_s_trials_give_the_fragmentation_share(tmp_path):
    """``autotune calibrate`` on trials that recorded their reserved peak (metrics v8) writes the largest
    share into the device profile; a plan priced with it uses that share and names the trials."""
    import dataclasses
    import shutil

    from autotune.sim import calibrate_trials
    from autotune.trials import TrialMetrics

    trial_dir = tmp_path / "h200-v8"
    shutil.copytree(_gpu_trial(GPU_TRIALS[0]), trial_dir)
    path = trial_dir / "metrics.json"
    metrics = TrialMetrics.read(path)
    path.chmod(0o644)
    dataclasses.replace(metrics, trial_peak_bytes=40 * _GIB, reserved_peak_bytes=44 * _GIB).write(path)
    profile, _ = calibrate_trials([trial_dir])
    assert profile.allocator_fragmentation == pytest.approx(0.10)
    assert "h200-v8 10.0%" in profile.allocator_fragmentation_source
    margin = Hardware(load_cluster_profile("h200-node"), num_ranks=1, device=profile).memory_margin
    part = {p.name: p for p in margin.parts}["allocator_fragmentation"]
    assert part.share == pytest.approx(0.10) and part.source == profile.allocator_fragmentation_source
    unmeasured, _ = calibrate_trials([_gpu_trial(GPU_TRIALS[0])])  # a v4 trial: no reserved peak
    assert unmeasured.allocator_fragmentation is None
    margin = Hardware(load_cluster_profile("h200-node"), num_ranks=1, device=unmeasured).memory_margin
    assert {p.name: p.share for p in margin.parts}["allocator_fragmentation"] == ALLOCATOR_FRAGMENTATION


def test_allocator_peaks_read_reserved_at_the_allocation_peak(tmp_path):
    """With ``[memory]`` events carrying ``Total Reserved``: the reservation at the largest allocation
    (device events when there are any); without them, no row."""
    events = [
        step(1, 0, 1000),
        memory(10, 500, total_reserved=800, device_type=1),
        memory(20, 900, total_reserved=1080, device_type=1),  # the device's allocation peak
        memory(30, 700, total_reserved=1200, device_type=1),  # reserved peaks later, after a free
        memory(40, 5000, total_reserved=5000),  # a CPU event: not the device's
    ]
    peaks = FsdpTraceAnalysis([write(tmp_path / "t.json", trace(events))]).get_allocator_peaks()
    assert peaks.to_dict("records") == [
        {"rank": 0, "allocated_bytes": 900, "reserved_bytes": 1080, "fragmentation": pytest.approx(0.2)}
    ]
    bare = FsdpTraceAnalysis([write(tmp_path / "u.json", trace([step(1, 0, 1000), memory(10, 500)]))])
    assert bare.get_allocator_peaks().empty


def test_the_margin_is_a_share_of_the_peak_below_the_usable_memory():
    margin = MemoryMargin(capacity_bytes=82 * _GIB, outside_allocator_bytes=2 * _GIB)
    shares = SIMULATOR_MEMORY_ERROR + ALLOCATOR_FRAGMENTATION
    assert margin.usable_bytes == 80 * _GIB and margin.edge_bytes == pytest.approx(80 * _GIB / (1 + shares))
    assert margin.is_at_edge(margin.edge_bytes + 1) and not margin.is_at_edge(margin.edge_bytes)
    assert not margin.is_at_edge(80 * _GIB + 1)  # over the usable memory: does not fit at all
    parts = margin.to_dict()["parts"]
    assert sum(p["gib"] for p in parts) == pytest.approx(margin.margin_bytes / _GIB)
    assert Hardware(load_cluster_profile("cpu-gloo")).memory_margin is None  # no caching allocator to fragment


def _plan(tmp_path: Path, name: str, usable_bytes: float | None = None):
    """``tiny`` on one node of h100-node, or of a copy whose usable memory is ``usable_bytes``."""
    cluster = "h100-node"
    if usable_bytes is not None:
        text = (REPO / "profiles" / "clusters" / "h100-node.toml").read_text(encoding="utf-8")
        text = re.sub(r"(?m)^memory_per_rank_gib = .*$", f"memory_per_rank_gib = {usable_bytes / _GIB + 0.5!r}", text)
        text = re.sub(r"(?m)^reserved_gib = .*$", "reserved_gib = 0.5", text)
        cluster = str(tmp_path / f"{name}.toml")
        Path(cluster).write_text(text.replace('name = "h100-node"', f'name = "{name}"'), encoding="utf-8")
    settings = PlanSettings(  # the same configs on every device: no checkpointing chosen by the memory
        model="tiny",
        cluster=cluster,
        fixed_mesh="fsdp",
        out_dir=tmp_path / name,
        num_workers=1,
        memory_knobs=False,
        activation_checkpointing="none",
    )
    return run_plan(settings)


def test_a_plan_whose_fastest_config_is_at_the_edge_emits_the_next_safe_one(tmp_path):
    roomy = _plan(tmp_path, "roomy")
    assert roomy.num_at_edge == 0 and roomy.best is roomy.ranked[0]
    # A device whose usable memory is 5% over the fastest config's peak: that one is at the edge.
    usable = 1.05 * roomy.ranked[0].prediction.peak_memory_bytes
    edge = usable / (1 + SIMULATOR_MEMORY_ERROR + ALLOCATOR_FRAGMENTATION)
    expected = next(r for r in roomy.ranked if r.prediction.peak_memory_bytes <= edge)
    tight = _plan(tmp_path, "tight", usable)

    assert tight.memory_margin is not None and tight.memory_margin.edge_bytes == pytest.approx(edge)
    assert tight.ranked[0].prediction.at_edge and tight.ranked[0].params == roomy.ranked[0].params
    assert tight.best is not None and tight.best.params == expected.params and not tight.best.prediction.at_edge
    faster = tight.faster_at_edge
    assert faster and all(r.prediction.at_edge for r in faster)
    assert tight.num_at_edge >= len(faster)
    config = load_config(tmp_path / "tight" / "best.toml")
    assert config.provenance.measured is False
    assert any(f"{len(faster)} faster configs fit but are at the edge of memory" in n for n in config.provenance.notes)
    record = PlanRecord.read(tmp_path / "tight" / "plan.json")
    assert record.best["at_edge"] is False and record.best["params"] == expected.params
    assert record.top[0]["at_edge"] is True and record.num_at_edge == tight.num_at_edge
    assert record.memory_margin is not None and record.memory_margin["edge_gib"] == pytest.approx(edge / _GIB)
    table = get_plan_table(tight)
    assert table.rows[0][table.columns.index("mem")] == "edge"
    assert "[emitted]" in "\n".join(get_config_lines(tight))
    assert any(
        line.startswith(f"{len(faster)} faster configs fit but are at the edge") for line in get_plan_lines(tight)
    )


def test_a_plan_where_only_configs_at_the_edge_fit_emits_the_fastest_and_says_so(tmp_path):
    roomy = _plan(tmp_path, "roomy")
    smallest = min(r.prediction.peak_memory_bytes for r in roomy.ranked)
    cramped = _plan(tmp_path, "cramped", 1.01 * smallest)  # what fits, fits within the margin

    assert cramped.ranked and all(r.prediction.at_edge for r in cramped.ranked)
    assert cramped.best is cramped.ranked[0] and cramped.faster_at_edge == []
    note = "at the edge of memory: every config that fits predicts a peak within the memory margin"
    assert any(n.startswith(note) for n in load_config(tmp_path / "cramped" / "best.toml").provenance.notes)
    assert any(line.startswith(f"WARNING: best is {note}") for line in get_plan_lines(cramped))
    assert PlanRecord.read(tmp_path / "cramped" / "plan.json").best["at_edge"] is True
