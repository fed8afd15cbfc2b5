"""``autotune report`` of a pipeline trial: the "Pipeline stages" table, units by stage; none for other trials.

The pipeline trial is ``tests/data/cpu_pp2_1f1b`` (4 ranks, ``mesh.pp = 2``, 1F1B; its figures:
``tests/autotune/analysis/test_pipeline_analysis.py``), the other one ``tests/data/cpu_tiny_2rank``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from _fixtures import DATA, get_fixture_traces
from typer.testing import CliRunner

from autotune.analysis import PipelineLayout, summarize_traces
from autotune.report import get_pipeline_tables, get_tables, load_report, write_report
from autotune.report.model import scale_trace_metrics
from autotune.report.pipeline_tables import describe_blocks
from autotune.trials import TrialMetrics
from fsdp_runtime import load_config

PP_TRIAL = "cpu_pp2_1f1b"


def make_trial(folder: Path, case: str, *, layout: PipelineLayout | None) -> Path:
    """A trial dir: the case's traces and config, ``metrics.json`` with their summary under ``layout``."""
    folder.mkdir(parents=True, exist_ok=True)
    traces = get_fixture_traces(case)
    for path in [*traces, *(DATA / case).glob("config.toml")]:
        shutil.copy(path, folder / path.name)
    metrics = TrialMetrics(
        status="ok",
        model="tiny",
        world_size=len(traces),
        backend="gloo",
        step_ms=400.0,
        trace_metrics=summarize_traces(traces, pipeline=layout),
    )
    metrics.write(folder / "metrics.json")
    return folder


def pp_layout() -> PipelineLayout:
    return PipelineLayout.from_config(load_config(DATA / PP_TRIAL / "config.toml"))


@pytest.fixture(scope="module")
def pp_trial(tmp_path_factory) -> Path:
    return make_trial(tmp_path_factory.mktemp("pp"), PP_TRIAL, layout=pp_layout())


@pytest.fixture(scope="module")
def plain_trial(tmp_path_factory) -> Path:
    return make_trial(tmp_path_factory.mktemp("plain"), "cpu_tiny_2rank", layout=None)


def test_a_pipeline_trial_shows_its_stages(pp_trial):
    report = load_report(pp_trial)
    [table] = get_pipeline_tables(report)
    assert table.title.startswith("Pipeline stages (pp 2, 1f1b)")
    assert table.columns == [
        "stage",
        "ranks",
        "blocks",
        "step",
        "compute",
        "FSDP comm",
        "exposed",
        "overlap",
        "P2P",
        "bubble",
    ]
    stages = report.trials[0].trace_metrics["pipeline"]["stages"]
    assert [row[:3] for row in table.rows] == [["0", "0, 1", "layers.0-1"], ["1", "2, 3", "layers.2-3"]]
    assert [row[5] for row in table.rows] == [f"{s['fsdp_comm_ms']:.1f}" for s in stages]
    assert [row[9] for row in table.rows] == [f"{s['bubble_ms']:.2f}" for s in stages]  # 99.31, 34.61 ms


def test_a_pipeline_trial_s_units_carry_their_stage(pp_trial):
    units = get_tables(load_report(pp_trial))[2]
    assert units.columns[:2] == ["stage", "unit"]
    assert [row[:2] for row in units.rows] == [
        ["0", "root"],
        ["0", "layers.0"],
        ["0", "layers.1"],
        ["1", "root"],
        ["1", "layers.2"],
        ["1", "layers.3"],
    ]


def test_a_trial_without_stages_has_no_pipeline_table(plain_trial):
    report = load_report(plain_trial)
    assert get_pipeline_tables(report) == []
    assert get_tables(report)[2].columns[0] == "unit"


def test_report_html_has_the_stages_table_for_a_pipeline_trial_only(pp_trial, plain_trial, tmp_path):
    for trial, shown in [(pp_trial, True), (plain_trial, False)]:
        write_report(load_report(trial), tmp_path / trial.name)
        page = (tmp_path / trial.name / "report.html").read_text(encoding="utf-8")
        assert ("Pipeline stages" in page) is shown
        assert ("root (stage 1)" in page) is shown  # the unit figure names each stage's root


def test_cli_report_prints_the_stages_table(pp_trial, tmp_path):
    from cli import app

    result = CliRunner().invoke(app, ["report", str(pp_trial), "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert "Pipeline stages" in result.stdout and "layers.2-3" in result.stdout


def test_a_pipeline_trial_summarized_before_v4_is_analysed_again(tmp_path):
    """metrics.json from before pipeline figures (here: summarized without the layout, as a v3 one
    reads): the report reads the traces again with the layout of the dir's config.toml."""
    trial = make_trial(tmp_path / "old", PP_TRIAL, layout=None)
    assert TrialMetrics.read(trial / "metrics.json").trace_metrics["pipeline"] is None
    summary = load_report(trial).trials[0].trace_metrics
    assert summary["pipeline"]["pp"] == 2 and summary["aggregate"]["send_recv_ms"] == 0
    (trial / "config.toml").unlink()  # no config: no layout, the stored summary stands
    assert load_report(trial).trials[0].trace_metrics["pipeline"] is None


def test_scaled_trace_times_scale_each_stage_by_its_ranks():
    summary = summarize_traces(get_fixture_traces(PP_TRIAL), pipeline=pp_layout())
    scaled = scale_trace_metrics(summary, {0: 0.5, 1: 0.5, 2: 2.0, 3: 2.0})
    for old, new, factor in zip(summary["pipeline"]["stages"], scaled["pipeline"]["stages"], [0.5, 2.0]):
        assert new["bubble_ms"] == pytest.approx(factor * old["bubble_ms"])
        assert new["step_ms"] == pytest.approx(factor * old["step_ms"])
        assert new["overlap_ratio"] == old["overlap_ratio"] and new["ranks"] == old["ranks"]


def test_blocks_are_described_compactly():
    assert describe_blocks(["layers.0", "layers.1", "layers.2"]) == "layers.0-2"
    assert describe_blocks(["layers.0", "layers.2", "layers.3"]) == "layers.0, layers.2-3"
    assert describe_blocks(["model.layers.9", "model.layers.10", "norm"]) == "model.layers.9-10, norm"
    assert describe_blocks([]) == "-"
