"""A pipeline trial's trace metrics are analysed with its config's pipeline layout ([Note: pipeline bubble])."""

from __future__ import annotations

from _fixtures import DATA, get_fixture_traces

from autotune.trials.trialdir import _analyze
from fsdp_runtime import RuntimeConfig, load_config


def test_a_pipeline_trial_is_analysed_with_its_layout():
    traces = get_fixture_traces("cpu_pp2_1f1b")
    summary, error = _analyze(traces, load_config(DATA / "cpu_pp2_1f1b" / "config.toml"))
    assert error is None and summary["pipeline"]["pp"] == 2
    assert [r["stages"] for r in summary["per_rank"]] == [[0], [0], [1], [1]]
    assert summary["aggregate"]["send_recv_ms"] == 0 and summary["aggregate"]["bubble_ms"] > 0
    summary, error = _analyze(traces, RuntimeConfig())  # the same traces as a trial without stages
    assert error is None and summary["pipeline"] is None and summary["aggregate"]["send_recv_ms"] > 0
