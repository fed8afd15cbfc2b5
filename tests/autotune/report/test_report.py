"""``autotune report``: trial and search reports from fixture dirs (no rank launches)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import shutil
import statistics
import sys
from pathlib import Path

import pytest
from _fixtures import get_fixture_traces
from _search_fixtures import complete_row
from typer.testing import CliRunner

from autotune.analysis import summarize_traces
from autotune.report import ReportError, TrialSummary, get_tables, load_report, write_report
from autotune.search import SearchRecord, TrialRow
from autotune.search.results import write_results
from autotune.trials import TrialFigures, TrialMetrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_metrics(
    trial_dir: Path,
    *,
    status: str = "ok",
    step_ms: float | None = 150.0,
    trace_metrics: dict | None = None,
    reason: str = "",
) -> None:
    trial_dir.mkdir(parents=True, exist_ok=True)
    metrics = TrialMetrics(
        status=status,
        reason=reason,
        model="tiny",
        world_size=2,
        backend="gloo",
        step_ms=step_ms,
        process_peak_bytes=3 * 2**20,
        trace_metrics=trace_metrics,
    )
    metrics.write(trial_dir / "metrics.json")


@pytest.fixture(scope="module")
def trial_dir(tmp_path_factory) -> Path:
    """A trial dir as autotune.trial writes it: metrics.json with the trace summary, plus the traces."""
    folder = tmp_path_factory.mktemp("trial")
    traces = get_fixture_traces("cpu_tiny_2rank")
    for trace in traces:
        shutil.copy(trace, folder / trace.name)
    write_metrics(folder, trace_metrics=summarize_traces(traces))
    return folder


@pytest.fixture(scope="module")
def search_dir(tmp_path_factory, trial_dir) -> Path:
    folder = tmp_path_factory.mktemp("search")
    summary = json.loads((trial_dir / "metrics.json").read_text())["trace_metrics"]
    write_metrics(folder / "trials" / "t0", step_ms=150.0, trace_metrics=summary)
    write_metrics(folder / "trials" / "t1", step_ms=120.0, trace_metrics=summary)
    write_metrics(folder / "trials" / "t2", status="timeout", step_ms=None, reason="no result after 60s")
    write_metrics(folder / "trials" / "t3", status="crash", step_ms=90.0, reason="rank 1 exited with 1")
    return folder


@pytest.fixture(scope="module")
def trial_report(trial_dir):
    return load_report(trial_dir)


def test_search_rows_and_report_trials_hold_one_set_of_figures():
    """A trial's status and measured figures are declared once (TrialFigures), with the objective they are ranked by."""
    shared = {f.name for f in dataclasses.fields(TrialFigures)}
    for cls in (TrialRow, TrialSummary):
        assert issubclass(cls, TrialFigures) and shared <= {f.name for f in dataclasses.fields(cls)}
        assert not shared & set(inspect.get_annotations(cls)), f"{cls.__name__} redeclares a field of TrialFigures"
    summary = TrialSummary(name="t", path=Path("t"), status="ok", step_ms=90.0, ratio=0.8)
    row = complete_row(1, 90.0, ratio=0.8)
    assert summary.objective == row.objective == 0.8


def test_trial_report_tables_and_json(trial_report):
    report = trial_report
    assert report.kind == "trial" and report.best is report.trials[0]
    summary, steps, units = get_tables(report)
    assert dict(summary.rows)["status"] == "ok"
    assert dict(summary.rows)["step ms (unprofiled, median)"] == "150.0"
    assert dict(summary.rows)["profiled overlap (median)"] == "39.4%"
    assert steps.columns[:4] == ["rank", "step#", "step", "compute"]
    assert steps.rows[0][:4] == ["0", "1", "167.9", "100.7"]  # golden: test_analysis CPU_GOLDEN_STEPS
    assert [row[0] for row in units.rows] == ["root", "layers.0", "layers.1"]
    data = report.to_json()
    assert data["kind"] == "trial_report" and data["status"] == "ok"
    assert data["trace_metrics"]["aggregate"]["num_steps"] == 4
    assert set(report.timeline["lane"]) >= {"compute", "all_gather", "reduce_scatter", "exposed"}


def test_trial_dir_with_traces_only_is_analysed(tmp_path):
    for trace in get_fixture_traces("cpu_tiny_2rank"):
        shutil.copy(trace, tmp_path / trace.name)
    report = load_report(tmp_path)
    assert report.trials[0].status == "unknown"
    assert report.trials[0].trace_metrics["num_ranks"] == 2


def test_write_trial_report_html_and_pngs(trial_dir, trial_report, tmp_path):
    before = {p.name: p.read_bytes() for p in trial_dir.glob("trace_rank*")}
    paths = write_report(trial_report, tmp_path / "out")
    assert sorted(p.name for p in paths) == ["report.html", "steps.png", "timeline.png", "units.png"]
    page = (tmp_path / "out" / "report.html").read_text()
    assert "<script src=" not in page and "Plotly.newPlot" in page  # plotly.js inline: opens offline
    assert page.count("Plotly.newPlot") == 3 and "layers.1" in page
    for png in paths[1:]:
        assert png.read_bytes()[:8] == PNG_MAGIC
    assert before == {p.name: p.read_bytes() for p in trial_dir.glob("trace_rank*")}  # traces untouched


def test_search_report_lists_trials_and_best(search_dir, tmp_path):
    report = load_report(search_dir)
    assert report.kind == "search"
    assert [t.name for t in report.trials] == ["t0", "t1", "t2", "t3"]
    assert report.best.name == "t1"  # t3 is faster but crashed
    (table,) = get_tables(report)
    assert table.title == "4 trials, best: t1"
    assert [row[0] for row in table.rows] == ["t3", "t1", "t0", "t2"]  # by step time, failures without one last
    assert table.rows[1][-1] == "best" and table.rows[3][-1] == "no result after 60s"
    assert report.to_json()["best"] == "t1"
    paths = write_report(report, tmp_path)
    assert [p.name for p in paths] == ["report.html", "trials.png"]


def test_search_report_takes_best_from_search_json(search_dir, tmp_path):
    folder = tmp_path / "search"
    shutil.copytree(search_dir, folder)
    best = complete_row(0, 150.0, trial_dir="trials/t0")
    SearchRecord(model="tiny", best=best).write(folder / "search.json")
    assert load_report(folder).best.name == "t0"  # the search knows better (e.g. t1 broke a memory budget)


def test_search_report_without_search_json_applies_the_memory_budget(search_dir, tmp_path):
    folder = tmp_path / "search"
    shutil.copytree(search_dir, folder)
    rows = [
        complete_row(i, ms, feasible=name != "t1", trial_dir=f"trials/{name}")
        for i, (name, ms) in enumerate([("t0", 150.0), ("t1", 120.0)])
    ]
    write_results(rows, folder)
    assert load_report(folder).best.name == "t0"  # t1 is faster but over the memory budget


def test_failed_trial_with_a_truncated_trace_still_reports(tmp_path):
    write_metrics(
        tmp_path, status="timeout", step_ms=None, reason="no result after 60s (deadlock or too slow); all ranks killed"
    )
    (tmp_path / "trace_rank0.json.gz").write_bytes(get_fixture_traces("cpu_tiny_2rank")[0].read_bytes()[:5000])
    report = load_report(tmp_path)
    rows = dict(get_tables(report)[0].rows)
    assert rows["status"].startswith("timeout (no result after 60s")
    assert rows["trace metrics"].startswith("unavailable: ") and "truncated" in rows["trace metrics"]
    paths = write_report(report, tmp_path / "out")
    assert [p.name for p in paths] == ["report.html"]
    assert "Timeline unavailable" in (tmp_path / "out" / "report.html").read_text()


@pytest.mark.parametrize("setup", ["missing", "empty", "bad_metrics", "wrong_kind"])
def test_report_errors_are_one_line(tmp_path, setup):
    target = tmp_path / "dir"
    if setup != "missing":
        target.mkdir()
    if setup == "bad_metrics":
        (target / "metrics.json").write_text("{not json")
    if setup == "wrong_kind":
        (target / "metrics.json").write_text('{"kind": "something_else"}')
    with pytest.raises(ReportError) as info:
        load_report(target)
    assert str(info.value).startswith(str(target)) and "\n" not in str(info.value)


def test_cli_report_json_is_pure_json(trial_dir):
    from cli import app

    result = CliRunner().invoke(app, ["report", str(trial_dir), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["trace_metrics"]["num_ranks"] == 2
    assert not (trial_dir / "report").exists()  # --json writes no files


def test_cli_report_writes_files_and_maps_errors(search_dir, tmp_path, monkeypatch, capsys):
    from cli import app, main

    result = CliRunner().invoke(app, ["report", str(search_dir), "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert "best: t1" in result.stdout and (tmp_path / "r" / "report.html").exists()
    monkeypatch.setattr(sys, "argv", ["autotune", "report", str(tmp_path / "nope")])
    monkeypatch.delenv("AUTOTUNE_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {tmp_path / 'nope'}: no such directory"]


# --------------------------------------------------------------------------- profiler overhead: trace times scaled


def _profiled_trial(
    trial_dir: Path, trace_metrics: dict, *, rank1_profiled_ms: float = 110.0, rank0_profiled_ms: float = 125.0
) -> TrialMetrics:
    """A trial whose profiled steps took 125/100 (rank 0) and 110/99 (rank 1) of its unprofiled ones,
    with 15% more training-thread CPU and 3.1x the page faults (ranks summed)."""
    from autotune.trials import RankMetrics

    ranks = [
        RankMetrics(
            rank=0,
            step_ms=[100.0, 100.0, 100.0],
            own_step_ms=[100.0, 98.0, 100.0],
            profiled_step_ms=[rank0_profiled_ms] * 2,
            step_cpu_ms=[80.0] * 3,
            profiled_cpu_ms=[96.0] * 2,
            step_page_faults=[100] * 3,
            profiled_page_faults=[300] * 2,
        ),
        RankMetrics(
            rank=1,
            step_ms=[100.0, 100.0, 100.0],
            own_step_ms=[99.0] * 3,
            profiled_step_ms=[rank1_profiled_ms] * 2,
            step_cpu_ms=[80.0] * 3,
            profiled_cpu_ms=[88.0] * 2,
            step_page_faults=[100] * 3,
            profiled_page_faults=[320] * 2,
        ),
    ]
    metrics = TrialMetrics.from_ranks(
        ranks, status="ok", model="tiny", world_size=2, backend="gloo", trace_metrics=trace_metrics
    )
    trial_dir.mkdir(parents=True, exist_ok=True)
    metrics.write(trial_dir / "metrics.json")
    return metrics


def test_trial_report_scales_trace_times_to_the_unprofiled_step_and_says_how(trial_dir, tmp_path):
    raw = json.loads((trial_dir / "metrics.json").read_text())["trace_metrics"]
    _profiled_trial(tmp_path / "t", raw)
    report = load_report(tmp_path / "t")
    trial = report.trials[0]
    assert trial.trace_scale == {0: 100.0 / 125.0, 1: 99.0 / 110.0}
    summary, steps, units = get_tables(report)
    rows = dict(summary.rows)
    assert (
        rows["profiler"]
        == "trace times scaled to the unprofiled step: ×0.80 rank 0, ×0.90 rank 1; profiler overhead +25% wall, +15% CPU, page faults ×3.1"
    )
    # Times scale per rank; ratios stay as measured; metrics.json keeps the raw summary.
    first = raw["per_rank"][0]["steps"][0]
    assert steps.rows[0][:4] == [
        "0",
        str(first["step"]),
        f"{first['step_ms'] * 0.8:.1f}",
        f"{first['compute_ms'] * 0.8:.2f}",
    ]
    rank1 = raw["per_rank"][1]["steps"][0]
    shown = trial.shown_trace_metrics
    assert shown["per_rank"][1]["steps"][0]["exposed_comm_ms"] == pytest.approx(rank1["exposed_comm_ms"] * 0.9)
    assert shown["per_rank"][1]["steps"][0]["overlap_ratio"] == rank1["overlap_ratio"]
    scaled_steps = [s["step_ms"] for r in shown["per_rank"] for s in r["steps"]]
    assert shown["aggregate"]["step_ms"] == pytest.approx(statistics.median(scaled_steps))
    assert rows["profiled overlap (median)"] == f"{100 * raw['aggregate']['overlap_ratio']:.1f}%"
    assert rows["profiled step ms (median, scaled)"] == f"{shown['aggregate']['step_ms']:.1f}"
    assert shown["aggregate"]["per_unit"][0]["comm_ms"] == pytest.approx(
        raw["aggregate"]["per_unit"][0]["comm_ms"] * statistics.median([0.8, 0.9])
    )
    assert "scaled" in steps.title and "scaled" in units.title
    assert TrialMetrics.read(tmp_path / "t" / "metrics.json").trace_metrics == raw
    assert report.to_json()["trace_metrics"] == raw and report.to_json()["trace_scale"] == {0: 0.8, 1: 0.9}
    write_report(report, tmp_path / "out")
    assert "×0.80 rank 0, ×0.90 rank 1" in (tmp_path / "out" / "report.html").read_text()


def test_trial_report_within_3_percent_shows_trace_times_as_measured(trial_dir, tmp_path):
    raw = json.loads((trial_dir / "metrics.json").read_text())["trace_metrics"]
    _profiled_trial(tmp_path / "t", raw, rank0_profiled_ms=102.0, rank1_profiled_ms=101.0)
    trial = load_report(tmp_path / "t").trials[0]
    assert trial.trace_scale is None and trial.shown_trace_metrics == raw
    rows = dict(get_tables(load_report(tmp_path / "t"))[0].rows)
    assert rows["profiler"].startswith(
        "trace times as measured (within 3% of the unprofiled step); profiler overhead +2% wall"
    )
    assert rows["profiled overlap (median)"] == f"{100 * raw['aggregate']['overlap_ratio']:.1f}%"


def _one_rank_trial(trial_dir: Path, trace_metrics: dict, *, steps: list[float], profiled: list[float]) -> None:
    from autotune.trials import RankMetrics

    rank = RankMetrics(
        rank=0,
        step_ms=steps,
        own_step_ms=steps,
        profiled_step_ms=profiled,
        step_cpu_ms=[80.0] * len(steps),
        profiled_cpu_ms=[84.0] * len(profiled),
        step_page_faults=[100] * len(steps),
        profiled_page_faults=[100] * len(profiled),
    )
    metrics = TrialMetrics.from_ranks(
        [rank], status="ok", model="tiny", world_size=1, backend="gloo", trace_metrics=trace_metrics
    )
    trial_dir.mkdir(parents=True, exist_ok=True)
    metrics.write(trial_dir / "metrics.json")


def test_a_trace_scale_from_disagreeing_steps_is_not_applied_and_the_report_says_why(trial_dir, tmp_path):
    """The case behind the check: a world-1 trial on a busy box, unprofiled steps 141 and 412 ms, profiled 29.4 ms:
    the per-rank scale would be 276.5 / 29.4 = 9.4x."""
    raw = json.loads((trial_dir / "metrics.json").read_text())["trace_metrics"]
    _one_rank_trial(tmp_path / "t", raw, steps=[141.0, 412.0], profiled=[29.4, 29.4])
    report = load_report(tmp_path / "t")
    trial = report.trials[0]
    assert trial.profiler["per_rank"][0]["trace_scale"] == pytest.approx(9.40, abs=0.01)
    assert trial.trace_scale is None and trial.shown_trace_metrics == raw
    rows = dict(get_tables(report)[0].rows)
    # |141 - 276.5| / 276.5 = 49% of the median
    assert rows["profiler"].startswith(
        "trace times as measured, not scaled: rank 0's unprofiled steps disagree (141 to 412 ms, deviation 49% of "
        "their median > 20%); profiler overhead -89% wall"
    ), rows["profiler"]
    assert report.to_json()["trace_scale"] is None and "disagree" in report.to_json()["trace_scale_refused"]


@pytest.mark.parametrize(
    ("steps", "profiled", "scale", "why"),
    [
        (
            [100.0, 101.0, 99.0],
            [40.0, 40.0],
            None,
            "rank 0's scale ×2.50 is outside ×0.5-×2.0 (the load differed between the timed and the traced steps)",
        ),
        (
            [100.0, 101.0, 99.0],
            [250.0, 250.0],
            None,
            "rank 0's scale ×0.40 is outside ×0.5-×2.0 (the load differed between the timed and the traced steps)",
        ),
        # two steps 1.5x apart (a deviation of 20%) still agree; the scale is theirs: 125 / 100
        ([100.0, 150.0], [100.0, 100.0], 1.25, None),
        ([100.0, 101.0, 99.0], [52.0, 52.0], 100.0 / 52.0, None),
    ],
    ids=["scale-2.5", "scale-0.4", "two-steps-1.5x-apart", "scale-1.92"],
)
def test_trace_scales_apply_only_from_agreeing_steps_in_a_plausible_range(
    trial_dir, tmp_path, steps, profiled, scale, why
):
    raw = json.loads((trial_dir / "metrics.json").read_text())["trace_metrics"]
    _one_rank_trial(tmp_path / "t", raw, steps=steps, profiled=profiled)
    trial = load_report(tmp_path / "t").trials[0]
    assert trial.trace_scale == (None if scale is None else {0: pytest.approx(scale)})
    assert trial.trace_scale_refused == why
    rows = dict(get_tables(load_report(tmp_path / "t"))[0].rows)
    assert rows["profiler"].startswith(
        f"trace times as measured, not scaled: {why};"
        if why
        else f"trace times scaled to the unprofiled step: ×{scale:.2f} rank 0;"
    )


def test_search_tables_show_each_trial_s_profiler_overhead(trial_dir, tmp_path):
    from autotune.report.trials_table import get_search_trials_table

    raw = json.loads((trial_dir / "metrics.json").read_text())["trace_metrics"]
    _profiled_trial(tmp_path / "s" / "trials" / "t0", raw)
    write_metrics(tmp_path / "s" / "trials" / "t1", step_ms=200.0, trace_metrics=raw)
    (table,) = get_tables(load_report(tmp_path / "s"))
    prof, exposed = table.columns.index("prof"), table.columns.index("exposed")
    by_name = {row[0]: row for row in table.rows}
    assert (by_name["t0"][prof], by_name["t1"][prof]) == ("+25%", "-")
    assert by_name["t0"][exposed].endswith("*") and not by_name["t1"][exposed].endswith("*")
    assert table.title.endswith("* trace times scaled to the unprofiled step")
    # a search's own rows: the report's trials table (the terminal's leaves it to the report, for 100 columns)
    rows = get_search_trials_table([complete_row(0, 100.0, profiler_overhead=1.18)])
    assert rows.rows[0][rows.columns.index("prof")] == "+18%"


# --------------------------------------------------------------------------- any directory of chrome traces


def test_cli_report_on_a_dir_of_traces_with_foreign_names(tmp_path, cli_main):
    """``autotune report DIR`` on traces named as other tools name them, one per rank, beside other JSON."""
    import gzip

    folder = tmp_path / "my traces"
    folder.mkdir()
    rank0, rank1 = get_fixture_traces("cpu_tiny_2rank")
    anonymous = {k: v for k, v in json.loads(gzip.decompress(rank1.read_bytes())).items() if k != "distributedInfo"}
    # tensorboard_trace_handler's name, no distributedInfo: sorted first, it takes the rank no other trace claims (2)
    (folder / "host-b_123.1700000000.pt.trace.json.gz").write_bytes(gzip.compress(json.dumps(anonymous).encode()))
    (folder / "rank_1.json").write_text(json.dumps(anonymous))  # rank from the file name
    (folder / "worker0.pt.trace.json").write_bytes(
        gzip.decompress(rank0.read_bytes())
    )  # rank 0 from its distributedInfo
    (folder / "config.json").write_text(json.dumps({"lr": 3e-4, "traceEvents_note": "not a trace"}))
    (folder / "losses.json").write_text("[1.5, 1.25]")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    result = cli_main("report", str(folder), "--json")  # in-process: the console script's entry point
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)["trace_metrics"]
    assert summary["num_ranks"] == 3
    names = {r["rank"]: r["trace"] for r in summary["per_rank"]}
    assert names == {0: "worker0.pt.trace.json", 1: "rank_1.json", 2: "host-b_123.1700000000.pt.trace.json.gz"}
    expected = summarize_traces([rank0, rank1])["per_rank"]
    for rank, want in ((0, expected[0]), (1, expected[1]), (2, expected[1])):
        got = summary["per_rank"][rank]
        assert [s["step"] for s in got["steps"]] == [1, 2]
        for field in ("step_ms", "compute_ms", "comm_ms", "exposed_comm_ms", "overlap_ratio"):
            assert [s[field] for s in got["steps"]] == pytest.approx([s[field] for s in want["steps"]], abs=1e-9), (
                rank,
                field,
            )
        assert got["overlap_ratio_time_weighted"] == pytest.approx(want["overlap_ratio_time_weighted"], abs=1e-12)

    result = cli_main("report", str(folder))
    assert result.returncode == 0, result.stderr
    assert (folder / "report" / "report.html").exists()
    assert before == {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "report"}  # traces untouched


def test_trial_report_of_metrics_without_per_rank_profiler_figures_says_so(tmp_path):
    """metrics.json before v4 has the trial's overhead but no per-rank steps to scale by."""
    TrialMetrics(status="ok", model="tiny", world_size=2, backend="gloo", step_ms=100.0, profiler_overhead=1.2).write(
        tmp_path / "metrics.json"
    )
    trial = load_report(tmp_path).trials[0]
    assert trial.trace_scale is None
    assert dict(get_tables(load_report(tmp_path))[0].rows)["profiler"] == (
        "trace times as measured (this metrics.json has no per-rank unprofiled figures to scale by); profiler overhead +20% wall"
    )


def test_tables_piped_to_a_log_keep_their_rows_on_one_line(monkeypatch, capsys):
    """Rich lays out an 80-column table when stdout is no terminal, which wrapped a search's knobs
    column letter by letter in `autotune search | tee log`; the CLI's console is wider there,
    unless COLUMNS says otherwise."""
    from rich.table import Table

    from autotune.cli import render

    knobs = (
        "hsdp:2x1 fwd=depth3 bwd=depth1 raf=false rsbuf=2 async=on nosync=all level=last keep=true defer=true group=4"
    )
    monkeypatch.delenv("COLUMNS", raising=False)
    console = render.make_console()
    assert not console.is_terminal and console.width == render.PIPED_WIDTH
    table = Table("trial", "status", "ratio", "knobs")
    table.add_row("14", "ok", "0.761x", knobs)
    console.print(table)
    assert knobs in capsys.readouterr().out  # one line, unbroken
    monkeypatch.setenv("COLUMNS", "100")
    assert render.make_console().width == 100
