"""The search report: knobs and noise per trial, Optuna's figures, best vs defaults, HTA on GPU
traces, and the page in headless Chromium. Search dirs are built from fixture traces and a
small Optuna study (no rank launches)."""

from __future__ import annotations

import copy
import dataclasses
import html
import re
import shutil
from pathlib import Path

import optuna
import pytest
from _fixtures import DATA, get_fixture_traces
from _required import skip_unless_required
from _search_fixtures import complete_row

from autotune.analysis import summarize_traces
from autotune.report import get_final_round_table, get_tables, load_report, write_report
from autotune.report.browser import check_page, find_chromium
from autotune.report.hta import CPU_TRACES_LINE
from autotune.report.html import FIGURES_META, get_search_sections
from autotune.report.study import why_no_importances
from autotune.report.trials_table import TRIALS_COLUMNS
from autotune.search import SearchRecord, TrialRow
from autotune.search.results import write_results
from autotune.trials import TrialMetrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CHOICES = {
    "mesh": ("fsdp", "hsdp:2x1"),
    "forward_prefetch": ("implicit", "depth1", "depth2"),
    "reshard_after_forward": ("true", "false"),
}
DEFAULTS = {"mesh": "fsdp", "forward_prefetch": "implicit", "reshard_after_forward": "true"}
SEARCH_FIGURES = [
    "compare_units",
    "compare_timelines",
    "optuna_history",
    "optuna_importances",
    "optuna_parallel",
    "optuna_slice",
    "trials",
]


def _rows() -> list[TrialRow]:
    """Trial 1 has the lowest ratio; trial 2 (measured twice) won the final round and was emitted."""
    return [
        complete_row(
            0,
            150.0,
            ratio=1.01,
            ratio_q25=0.98,
            ratio_q75=1.03,
            ratio_spread=0.05,
            is_default=True,
            trial_dir="trials/trial_0000",
            params=dict(DEFAULTS),
        ),
        complete_row(
            1,
            118.0,
            ratio=0.80,
            ratio_q25=0.70,
            ratio_q75=0.95,
            ratio_spread=0.31,
            noisy=True,
            trial_dir="trials/trial_0001",
            params={"mesh": "hsdp:2x1", "forward_prefetch": "depth1", "reshard_after_forward": "false"},
        ),
        complete_row(
            2,
            125.0,
            ratio=0.85,
            ratio_q25=0.82,
            ratio_q75=0.88,
            ratio_spread=0.07,
            attempts=2,
            first_status="pruned",
            first_ratio=1.52,
            trial_dir="trials/trial_0002/remeasured",
            params={"mesh": "fsdp", "forward_prefetch": "depth2", "reshard_after_forward": "false"},
        ),
        TrialRow(
            number=3,
            state="PRUNED",
            status="pruned",
            reason="slower than 1.3x the best in both windows",
            attempts=2,
            first_status="pruned",
            refined_from="trial 1 + forward_prefetch=depth2 (from trial 2)",
            trial_dir="trials/trial_0003",
            params={"mesh": "hsdp:2x1", "forward_prefetch": "depth2", "reshard_after_forward": "false"},
        ),
    ]


def _confirmation(winner: int) -> dict:
    finalists = [
        {"trial": 1, "status": "ok", "ratio": 0.97, "pair_ratios": [0.97]},
        {
            "trial": 2,
            "status": "ok",
            "ratio": 0.90,
            "ratio_q25": 0.88,
            "ratio_q75": 0.93,
            "pair_ratios": [0.92, 0.88],
            "order_ratios": {"reference_first": 0.92, "candidate_first": 0.88},
            "switch_cost": {"candidate": 0.09, "reference": 0.08},
        },
    ]
    return {
        "estimator": "blocks",
        "finalists": finalists,
        "num_pairs": 2,
        "emitted": "best",
        "winner": winner,
        "speedup_median": 1 / 0.9,
        "speedup_q25": 1.05,
        "speedup_q75": 1.2,
        "speedup_min": 1.0,
        "speedup_max": 1.3,
        "speedups": [1 / 0.9],
    }


def _halve_exposed(summary: dict) -> dict:
    """The best trial's summary: every unit's exposed communication halved (so the bars differ)."""
    summary = copy.deepcopy(summary)
    for unit in summary["aggregate"]["per_unit"]:
        unit["exposed_comm_ms"] /= 2
    return summary


def _write_trial(trial_dir: Path, row: TrialRow, summary: dict | None, traces: list[Path]) -> None:
    trial_dir.mkdir(parents=True, exist_ok=True)
    for i, trace in enumerate(traces):
        shutil.copy(trace, trial_dir / f"trace_rank{i}.json.gz")
    TrialMetrics(
        status=row.status,
        reason=row.reason,
        model="tiny",
        world_size=2,
        backend="gloo",
        step_ms=row.step_ms,
        process_peak_bytes=3 * 2**20,
        trace_metrics=summary,
    ).write(trial_dir / "metrics.json")


def _write_study(root: Path, rows: list[TrialRow]) -> None:
    distributions = {k: optuna.distributions.CategoricalDistribution(v) for k, v in CHOICES.items()}
    study = optuna.create_study(
        study_name="tiny-w2-mb2", storage=f"sqlite:///{root / 'study.db'}", direction="minimize"
    )
    for row in rows:
        state = optuna.trial.TrialState[row.state]
        study.add_trial(
            optuna.trial.create_trial(
                params=row.params,
                distributions=distributions,
                state=state,
                value=row.ratio if state == optuna.trial.TrialState.COMPLETE else None,
            )
        )


def make_search_dir(
    root: Path,
    rows: list[TrialRow],
    summary: dict | None,
    traces: list[Path],
    *,
    winner: int | None = 2,
    study: bool = True,
) -> Path:
    """A finished search's dir: trial dirs (traces in the defaults' and the winner's), results.json,
    search.json (lowest ratio: trial 1; emitted: ``winner``) and the study."""
    for row in rows:
        best = summary is not None and row.number == winner
        dirs = [
            root / row.trial_dir,
            *([root / Path(row.trial_dir).parent] if row.attempts > 1 and row.trial_dir.endswith("remeasured") else []),
        ]
        for d in dirs:
            _write_trial(
                d,
                row,
                _halve_exposed(summary) if best else summary,
                traces if (row.is_default or best) and d == dirs[0] else [],
            )
    write_results(rows, root)
    lowest = min((r for r in rows if r.state == "COMPLETE" and not r.is_default), key=lambda r: r.ratio, default=None)
    confirmation = _confirmation(winner) if winner is not None else None
    SearchRecord(
        model="tiny",
        num_trials=len(rows),
        stopped_because=f"reached {len(rows)} trials",
        best=lowest,
        default=rows[0],
        confirmation=confirmation,
    ).write(root / "search.json")
    if study:
        _write_study(root, rows)
    return root


@pytest.fixture(scope="module")
def cpu_summary() -> dict:
    return summarize_traces(get_fixture_traces("cpu_tiny_2rank"))


@pytest.fixture(scope="module")
def cpu_search(tmp_path_factory, cpu_summary) -> Path:
    return make_search_dir(
        tmp_path_factory.mktemp("search"), _rows(), cpu_summary, get_fixture_traces("cpu_tiny_2rank")
    )


@pytest.fixture(scope="module")
def cpu_page(cpu_search, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report")
    write_report(load_report(cpu_search), out)
    return out / "report.html"


def test_trials_table_shows_knobs_noise_attempts_and_origin(cpu_search):
    summary, final, trials = get_tables(load_report(cpu_search))
    assert trials.columns == TRIALS_COLUMNS
    # the final round with each finalist's order figures ([Note: switch cost]), fastest first
    assert "median of blocks" in final.title and "* emitted" in final.title
    assert final.rows == [
        ["2 *", "0.900x", "0.880-0.930", "0.920x", "0.880x", "4.5%", "9.0%/8.0%", "1"],
        ["1", "0.970x", "-", "-", "-", "-", "-/-", "1"],
    ]
    rows = {row[0]: dict(zip(trials.columns, row)) for row in trials.rows}
    assert list(rows) == ["0 (defaults)", "1 (lowest ratio)", "2 (emitted)", "3"]
    emitted = rows["2 (emitted)"]
    assert (emitted["/defaults"], emitted["IQR"], emitted["spread"], emitted["attempts"]) == (
        "0.850x",
        "0.820-0.880",
        "7.0%",
        "2 (first: pruned 1.520x)",
    )
    # knobs: what differs from the defaults trial's; every knob in the HTML cell's title
    assert emitted["knobs"] == "fwd=depth2 raf=false" and emitted["made from"] == "sampled"
    assert rows["0 (defaults)"]["knobs"] == "defaults" and rows["1 (lowest ratio)"]["knobs"] == (
        "hsdp:2x1 fwd=depth1 raf=false"
    )
    knobs = trials.columns.index("knobs")
    assert trials.cell_titles[2, knobs] == "fsdp fwd=depth2 raf=false" and trials.one_line
    assert rows["1 (lowest ratio)"]["status"] == "ok (noisy)"
    assert rows["3"]["made from"] == "trial 1 + forward_prefetch=depth2 (from trial 2)" and rows["3"][
        "note"
    ].startswith("slower than 1.3x")
    assert rows["0 (defaults)"]["made from"] == "defaults"
    # The emitted trial is named first; the lowest ratio is said to be another trial.
    lines = dict(summary.rows)
    assert lines["best"] == (
        "best = trial 2, the emitted config: the fastest of 2 finalists re-measured against the defaults in the final round "
        "(ratio 0.900, 1.111x the defaults' speed); the lowest ratio in the search was trial 1 (0.800 in the search, 0.970 in the final round)"
    )
    assert lines["lowest ratio in the search"].startswith("trial 1: ratio 0.800x, 118.0 ms")


def test_best_is_the_emitted_trial_s_remeasured_dir(cpu_search, tmp_path):
    report = load_report(cpu_search)
    comparison = report.comparison
    assert (comparison.best_number, comparison.default_number, comparison.lowest_number) == (2, 0, 1)
    assert (
        comparison.best.path == cpu_search / "trials/trial_0002/remeasured"
        and comparison.default.path == cpu_search / "trials/trial_0000"
    )
    assert (comparison.best_label, comparison.default_label) == ("best: trial 2 (emitted)", "defaults: trial 0")
    # search.json naming a re-measured trial's dir as its best still finds the trial
    folder = tmp_path / "s"
    shutil.copytree(cpu_search, folder)
    record = SearchRecord.read(folder / "search.json")
    record.best = _rows()[2]
    record.write(folder / "search.json")
    assert load_report(folder).best.name == "trial_0002"


def test_the_emitted_config_s_trace_comes_from_the_recipe_round_where_its_trial_took_none(
    cpu_search, cpu_summary, tmp_path
):
    """[Note: the emitted config's trace]: the search's trials skip their profiled windows and
    the recipe round profiles the config to emit; the comparison shows that trace."""
    folder = tmp_path / "s"
    shutil.copytree(cpu_search, folder)
    winner = folder / "trials/trial_0002/remeasured"
    for trace in winner.glob("trace_rank*"):
        trace.unlink()
    _write_trial(winner, _rows()[2], None, [])
    final = folder / "final" / "vs_torchtitan"
    _write_trial(final, _rows()[2], _halve_exposed(cpu_summary), get_fixture_traces("cpu_tiny_2rank"))
    record = SearchRecord.read(folder / "search.json")
    record.recipe = {"name": "torchtitan", "measured": True, "candidate": "search", "emitted": "search"}
    record.recipe |= {"dir": str(tmp_path / "elsewhere" / "final" / "vs_torchtitan"), "profiled": True}
    record.write(folder / "search.json")
    comparison = load_report(folder).comparison
    assert comparison.best.path == final and comparison.best.trace_metrics is not None
    assert (comparison.best_number, comparison.best_label) == (2, "best: trial 2 (emitted)")
    # not profiled there: the trial's own dir, without a trace
    record.recipe["profiled"] = False
    record.write(folder / "search.json")
    assert load_report(folder).comparison.best.path == winner


def test_without_a_final_round_best_is_the_lowest_ratio(cpu_summary, tmp_path):
    folder = make_search_dir(
        tmp_path, _rows(), cpu_summary, get_fixture_traces("cpu_tiny_2rank"), winner=None, study=False
    )
    comparison = load_report(folder).comparison
    assert (comparison.best_number, comparison.emitted) == (1, False)
    assert comparison.note == "best = trial 1, the lowest ratio in the search (no final round ran)"


def test_search_page_draws_every_figure_once_with_plotly_inline(cpu_page, cpu_summary):
    import plotly.offline

    page = cpu_page.read_text()
    names = re.search(rf"<meta name='{FIGURES_META}' content='([^']*)'>", page).group(1).split(",")
    assert names == SEARCH_FIGURES
    assert page.count("data-figure=") == page.count("Plotly.newPlot") == len(SEARCH_FIGURES)
    assert "<script src=" not in page and page.count(plotly.offline.get_plotlyjs()[:300]) == 1  # plotly.js inline once
    assert html.escape(CPU_TRACES_LINE) in page
    lead = re.search(r"<p class='lead'>(.*?)</p>", page).group(1)
    assert lead.index("trial 2") < lead.index("trial 1")  # the emitted trial named first


def test_the_trials_table_of_the_page_is_one_line_per_trial_with_every_knob_on_hover(cpu_page):
    """The page's trials table: one line per trial (its cells do not wrap), a trial's knobs as the
    change from the defaults', every knob in the cell's title; a long note cut, whole on hover."""
    page = cpu_page.read_text()
    table = re.search(r"<table class='one-line'><caption>4 trials .*?</table>", page).group(0)
    assert "<td class='text' title='fsdp fwd=depth2 raf=false'>fwd=depth2 raf=false</td>" in table
    assert "<td class='text' title='fsdp fwd=implicit raf=true'>defaults</td>" in table
    assert "table.one-line td{white-space:nowrap}" in page


def test_a_long_note_is_cut_in_the_trials_table_and_whole_in_its_title():
    from autotune.report.trials_table import NOTE_CHARS, get_search_trials_table

    reason = "trial failed: " + "RuntimeError: a very long message from the ranks " * 3
    table = get_search_trials_table([*_rows()[:1], dataclasses.replace(_rows()[3], reason=reason)])
    note = table.columns.index("note")
    assert len(table.rows[1][note]) <= NOTE_CHARS and table.rows[1][note].endswith("…")
    assert table.cell_titles[1, note] == reason and (0, note) not in table.cell_titles


def test_best_vs_defaults_figures(cpu_search, cpu_summary):
    compare = get_search_sections(load_report(cpu_search))[0]
    units = compare.figures["compare_units"]
    assert [t.name for t in units.data] == [
        "best: trial 2 (emitted)",
        "defaults: trial 0",
    ] and units.layout.barmode == "group"
    expected = [u["exposed_comm_ms"] for u in cpu_summary["aggregate"]["per_unit"]]
    assert list(units.data[1].y) == pytest.approx(expected) and list(units.data[0].y) == pytest.approx(
        [e / 2 for e in expected]
    )
    timelines = compare.figures["compare_timelines"]
    assert timelines.layout.xaxis.matches == "x2"  # two subplots, one time axis
    by_axis = {}
    for trace in timelines.data:
        by_axis.setdefault(trace.yaxis, set()).update(trace.y)
    assert set(by_axis) == {"y", "y2"} and all({"rank 0 compute", "rank 1 exposed"} <= ys for ys in by_axis.values())
    titles = [a.text for a in timelines.layout.annotations]
    assert titles[0].startswith("best: trial 2 (emitted): step 125.0 ms") and titles[1].startswith(
        "defaults: trial 0: step 150.0 ms"
    )


def test_optuna_figures_come_from_the_study(cpu_search):
    study = get_search_sections(load_report(cpu_search))[1]
    assert (
        list(study.figures) == ["optuna_history", "optuna_importances", "optuna_parallel", "optuna_slice"]
        and not study.absent
    )
    history = study.figures["optuna_history"]
    assert sorted(y for t in history.data for y in (t.y or []) if t.mode == "markers") == [0.8, 0.85, 1.01]
    assert (
        study.lines[0]
        == "study 'tiny-w2-mb2': 4 trials, 3 completed; objective: step-time ratio vs defaults (lower is faster)"
    )


def test_a_finished_search_reports_its_own_rows_and_study_storage(cpu_search, tmp_path):
    """write_search_report takes the rows and the study from the search (here: a journal file, results.json gone)."""
    from types import SimpleNamespace

    from autotune.report import write_search_report

    folder = tmp_path / "run"
    shutil.copytree(cpu_search, folder)
    (folder / "results.json").unlink()
    journal = tmp_path / "study.journal"
    optuna.copy_study(
        from_study_name="tiny-w2-mb2",
        from_storage=f"sqlite:///{folder / 'study.db'}",
        to_storage=_journal(journal),
        to_study_name="elsewhere",
    )
    (folder / "study.db").unlink()
    summary = SimpleNamespace(
        record=SearchRecord.read(folder / "search.json"),
        rows=_rows(),
        study_dir=folder,
        out_dir=folder,
        report_paths=[],
    )
    write_search_report(summary, storage=f"journal:{journal}", study_name="elsewhere")
    page = (folder / "report" / "report.html").read_text()
    assert summary.record.report_error is None and "fwd=depth2 raf=false" in page and "2 (emitted)" in page
    assert "study &#x27;elsewhere&#x27;: 4 trials, 3 completed" in page and "data-absent='optuna_" not in page


def _journal(path: Path):
    from optuna.storages.journal import JournalFileBackend

    return optuna.storages.JournalStorage(JournalFileBackend(str(path)))


def test_too_few_trials_or_no_study_are_one_line_each(cpu_summary, tmp_path):
    rows = _rows()[:1] + [
        TrialRow(
            number=1,
            state="FAIL",
            status="crash",
            reason="rank 1 exited with 1",
            trial_dir="trials/trial_0001",
            params=dict(DEFAULTS),
        )
    ]
    folder = make_search_dir(tmp_path / "one", rows, cpu_summary, get_fixture_traces("cpu_tiny_2rank"), winner=None)
    study = get_search_sections(load_report(folder))[1]
    assert list(study.figures) == ["optuna_history", "optuna_parallel", "optuna_slice"]
    assert study.absent == {
        "optuna_importances": "parameter importances need at least 2 completed trials with a value; this study has 1"
    }
    (folder / "study.db").unlink()
    write_report(load_report(folder), tmp_path / "out")
    page = (tmp_path / "out" / "report.html").read_text()
    assert (
        page.count("data-absent='optuna_") == 4
        and f"No slice figure: no Optuna study: {folder / 'study.db'} does not exist" in page
    )


def test_why_no_importances():
    class T:
        def __init__(self, value, **params):
            self.value, self.params = value, params

    assert (
        why_no_importances([T(0.9, a=1), T(0.9, a=2)])
        == "all 2 completed trials have the same objective value: there is no variation to attribute"
    )
    assert why_no_importances([T(0.9, a=1), T(0.8, a=1, b=2)]).startswith(
        "no parameter takes two values in the 2 completed trials"
    )
    assert why_no_importances([T(0.9, a=1), T(0.8, a=2)]) is None


def test_gpu_traces_get_hta_analyses(tmp_path):
    traces = [DATA / "hta_nccl" / f"sampled_rank-{r}.json.gz" for r in (0, 1)]
    folder = make_search_dir(tmp_path, _rows(), summarize_traces(traces), traces, study=False)
    compare, _, _, hta = get_search_sections(load_report(folder))
    assert (
        "compare_units" in compare.absent and "compare_timelines" in compare.figures
    )  # HTA's traces have no FSDP units
    assert list(hta.figures) == ["hta_temporal", "hta_kernels", "hta_idle", "gpu_attribution"]
    assert CPU_TRACES_LINE not in hta.lines and hta.title.startswith("HTA analyses and the GPU step attribution")
    # beside HTA's figures, each trial's GPU step attribution: no FSDP2 labels in HTA's traces, so every
    # kernel is "other"; NCCL kernels run under compute, so the classes add up to more than the busy time
    assert [t.title.split(":")[0] for t in hta.tables] == ["best", "best", "best", "defaults", "defaults", "defaults"]
    by_part = hta.tables[1]
    assert {row[0]: row[1] for row in by_part.rows}["model forward"] == "0.00"
    assert any(row[0].startswith("kernels running at once") for row in hta.tables[0].rows)
    assert any(line.startswith("best: trial 2 (emitted): GPU step attribution") for line in hta.lines)
    temporal = hta.figures["hta_temporal"]
    bars = {(t.name, who, rank): y for t in temporal.data for who, rank, y in zip(t.x[0], t.x[1], t.y)}
    for who in ("best: trial 2 (emitted)", "defaults: trial 0"):
        for rank in ("rank 0", "rank 1"):
            assert sum(v for (_, w, r), v in bars.items() if (w, r) == (who, rank)) == pytest.approx(100, abs=0.05)
    kinds = {x for t in hta.figures["hta_kernels"].data for x in t.x}
    assert {"COMMUNICATION", "COMPUTATION"} <= kinds
    idle = hta.figures["hta_idle"].data
    assert {t.name for t in idle} <= {"host_wait", "kernel_wait", "other"} and {
        "best: trial 2 (emitted)",
        "defaults: trial 0",
    } == set(idle[0].x[0])


# --------------------------------------------------------------------------- the page in headless Chromium


@pytest.fixture
def needs_chromium() -> None:
    if find_chromium() is None:
        skip_unless_required("no chromium on PATH (Debian: apt-get install chromium)")


@pytest.mark.usefixtures("needs_chromium")
def test_search_page_renders_offline_in_chromium(cpu_page, tmp_path):
    check = check_page(cpu_page, screenshot=tmp_path / "page.png", expect=SEARCH_FIGURES)
    assert check.ok, "\n".join(check.describe())
    assert check.rendered == SEARCH_FIGURES and check.num_plots == len(SEARCH_FIGURES) and check.errors == []
    assert check.screenshot.read_bytes()[:8] == PNG_MAGIC and check.height_px > 2000


@pytest.mark.usefixtures("needs_chromium")
def test_chromium_check_fails_on_errors_missing_figures_and_network(cpu_page, tmp_path):
    page = cpu_page.read_text()
    page = page.replace('if (document.getElementById("figure-optuna_slice"))', "if (false)")  # one figure never drawn
    page = page.replace(
        "</body>",
        "<script>notDefinedAnywhere()</script><script src='https://cdn.example.com/plotly.js'></script></body>",
    )
    broken = tmp_path / "broken.html"
    broken.write_text(page)
    check = check_page(broken, expect=SEARCH_FIGURES)
    assert not check.ok and check.missing == ["optuna_slice"]
    assert any("notDefinedAnywhere" in e for e in check.errors), check.errors
    assert any("failed to load https://cdn.example.com/plotly.js" in e for e in check.errors), check.errors


def test_the_summary_shows_the_precision_and_the_environment_line():
    """The search report's summary (and the terminal's outcome lines) carry ``search.json``'s
    precision and its environment notes (``CUDA_DEVICE_MAX_CONNECTIONS=1`` with its fix)."""
    from types import SimpleNamespace

    from autotune.report import get_search_outcome_lines
    from autotune.report.tables import get_search_summary_table
    from autotune.trials import get_overlap_warning

    line = get_overlap_warning({"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "cuda")
    record = SearchRecord(
        model="tiny",
        stopped_because="plateau",
        mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"},
        searched_reduce_dtype=True,
        notes=[line],
    )
    rows = get_search_summary_table(record).rows
    assert ["precision", "bfloat16 params, float32 reduce, reduce dtype searched"] in rows
    assert ["environment", line] in rows
    summary = SimpleNamespace(
        record=record, confirmation=None, plan=SimpleNamespace(is_proxy=False), best_config_path=None
    )
    assert get_search_outcome_lines(summary)[0] == line
    # An older search.json (no precision recorded, no notes): neither row.
    old = get_search_summary_table(SearchRecord(model="tiny")).rows
    assert not any(r[0] in ("precision", "environment") for r in old)


def test_the_summary_says_what_was_not_measured_and_which_references_were_anchored():
    """A search's shortfall (a search on a busy box once stopped after half its trials, silently)
    and its drift anchors are rows of the summary and lines of the terminal's outcome."""
    from types import SimpleNamespace

    from autotune.report import get_search_outcome_lines
    from autotune.report.tables import get_search_summary_table

    short = "measured 5 of the 8 trials asked for (stopped: reached 8 trials)"
    anchor = {"ratio": 0.6, "previous_ratio": 0.5, "drift": 0.3, "at_trial": 7}
    record = SearchRecord(model="tiny", stopped_because="x", shortfall=[short], anchors={"3": anchor})
    rows = get_search_summary_table(record).rows
    assert ["not measured", short] in rows
    assert [
        "anchor",
        "trial 3 against the defaults again at trial 7 (its steps moved 30.0%): 0.500x -> 0.600x",
    ] in rows
    summary = SimpleNamespace(
        record=record, confirmation=None, plan=SimpleNamespace(is_proxy=False), best_config_path=None
    )
    assert f"warning: {short}" in get_search_outcome_lines(summary)
    assert not any(r[0] in ("not measured", "anchor") for r in get_search_summary_table(SearchRecord(model="t")).rows)


def test_the_summary_and_the_terminal_give_the_speedup_over_torchtitan_s_recipe():
    """search.json's ``recipe`` (v10, [Note: beating the recipe]) is a row of the summary and a line
    of the terminal's outcome, with its spread; a recipe that won says it was emitted."""
    from types import SimpleNamespace

    from autotune.report import get_search_outcome_lines
    from autotune.report.tables import get_search_summary_table

    recipe = SearchRecord.read(DATA / "artifacts" / "search_v10.json").recipe
    expected = (
        "the search's config 1.073x the recipe's speed, median of 2 blocks "
        "(interquartile 1.071-1.075, min 1.069, max 1.077)"
    )
    record = SearchRecord(model="tiny", stopped_because="x", recipe=recipe)
    assert ["vs torchtitan's recipe", expected] in get_search_summary_table(record).rows
    summary = SimpleNamespace(
        record=record, confirmation=None, plan=SimpleNamespace(is_proxy=False), best_config_path=None
    )
    assert f"vs torchtitan's recipe: {expected}" in get_search_outcome_lines(summary)
    lost = dict(recipe, speedup_median=0.95, emitted="recipe")
    row = get_search_summary_table(SearchRecord(model="tiny", recipe=lost)).rows[-1]
    assert row[1].startswith("the search's config 0.950x") and row[1].endswith("not faster, so the recipe is emitted")
    # the terminal then names what its figures are of: the search's config, not the emitted recipe
    confirmation = {
        "speedup_median": 1.2,
        "speedup_q25": 1.1,
        "speedup_q75": 1.3,
        "speedup_min": 1.0,
        "speedup_max": 1.4,
    }
    confirmation["speedups"] = [1.2]
    won = SimpleNamespace(
        record=SearchRecord(model="tiny", stopped_because="x", recipe=lost),
        confirmation=confirmation,
        plan=SimpleNamespace(is_proxy=False),
        best_config_path=None,
    )
    lines = get_search_outcome_lines(won)
    assert not any(line.startswith("emitted config vs") for line in lines), lines
    subject = "the search's config (not emitted: torchtitan's recipe is)"
    assert any(line.startswith(f"{subject} vs defaults: ") for line in lines)
    assert any(line.startswith("vs torchtitan's recipe: the search's config 0.950x") for line in lines)
    skipped = {"name": "torchtitan", "measured": False, "reason": "no final round ran (--confirm-pairs 0)"}
    row = get_search_summary_table(SearchRecord(model="tiny", recipe=skipped)).rows[-1]
    assert row == ["vs torchtitan's recipe", "not measured: no final round ran (--confirm-pairs 0)"]
    assert not any(r[0] == "vs torchtitan's recipe" for r in get_search_summary_table(SearchRecord(model="t")).rows)


def _v11_confirmation(faster: bool) -> dict:
    """A v11 final round: two finalists, trial 3 chosen at 0.80, then its verdict window."""
    from autotune.search.verdict import get_speedups
    from autotune.trials.paired import summarize_pairs

    window = summarize_pairs([0.97, 1.02, 0.99, 1.01], [1.0] * 4) | {"ratio_low": 0.97, "ratio_high": 1.02}
    finalists = [{"trial": n, "status": "ok", **summarize_pairs([r] * 4, [1.0] * 4)} for n, r in ((3, 0.8), (5, 0.9))]
    verdict = (
        {"emitted": "best", "winner": 3}
        if faster
        else {
            "emitted": "defaults",
            "winner": None,
            "verdict": "the defaults are emitted: trial 3 (the fastest finalist) ...",
        }
    )
    return {
        "estimator": "blocks",
        "finalists": finalists,
        "emit_rule": "interval",
        "speedup_from": "verdict",
        "chosen": 3,
        "verdict_window": window | {"faster": faster},
        "selection_speedup": 1.25,
        **get_speedups(window),
        **verdict,
    }


def test_the_terminal_gives_the_speedup_of_a_window_that_did_not_choose_the_config_and_says_when_it_is_not_emitted():
    """[Note: emitted on an interval] (search.json v11): the speedup over the defaults is the verdict
    window's with its 90% interval, beside the figure the choosing round gave; where the window did not
    call the chosen config faster, the line names it as not emitted and gives the verdict."""
    from types import SimpleNamespace

    from autotune.report import get_search_outcome_lines

    def lines(confirmation):
        record = SearchRecord(model="tiny", stopped_because="x", confirmation=confirmation)
        summary = SimpleNamespace(
            record=record, confirmation=confirmation, plan=SimpleNamespace(is_proxy=False), best_config_path=None
        )
        return [line for line in get_search_outcome_lines(summary) if " vs defaults: " in line]

    emitted = lines(_v11_confirmation(faster=True))
    assert emitted == [
        "emitted config vs defaults: 1.003x (90% interval 0.980-1.031x, 4 pairs: the noise of this window's pairs, not a run alone) in a window that did not choose it "
        "(trial 3, the fastest of 2 finalists at 1.250x); emitted trial 3"
    ]
    tie = lines(_v11_confirmation(faster=False))
    assert len(tie) == 1 and tie[0].startswith("the fastest finalist (not emitted) vs defaults: 1.003x (90% interval")
    assert tie[0].endswith("; the defaults are emitted: trial 3 (the fastest finalist) ...")


def test_the_final_round_table_ends_with_the_round_against_torchtitan_s_recipe():
    """The recipe's round has the finalists' figures (ratio, quartiles, orders, switch costs): the
    final-round table shows them as its last row, named by what was measured against the recipe."""
    from autotune.trials.paired import summarize_pairs

    recipe = SearchRecord.read(DATA / "artifacts" / "search_v10.json").recipe
    finalists = [
        {"trial": n, "status": "ok", **summarize_pairs(ratios, [1.0] * len(ratios))}
        for n, ratios in ((4, [0.80, 0.82, 0.81, 0.83]), (7, [0.85, 0.86, 0.84, 0.87]))
    ]
    conf = {"estimator": "blocks", "finalists": finalists, "winner": 4}
    table = get_final_round_table(conf, recipe)
    assert table.title.endswith("; last row: against torchtitan's recipe")
    assert [row[0] for row in table.rows] == ["4 *", "7", "search's config / recipe"]
    last = dict(zip(table.columns, table.rows[-1]))
    assert (last["/baseline"], last["ref 1st"], last["cand 1st"]) == ("0.932x", "0.932x", "0.932x")
    # Without a recipe round (or one that did not measure), the finalists only.
    skipped = {"name": "torchtitan", "measured": False, "reason": "no final round ran"}
    assert get_final_round_table(conf, skipped).rows == get_final_round_table(conf).rows == table.rows[:2]


# A real search's params: every knob of the space, the defaults trial's and a sampled trial's
SEARCH_DEFAULTS = {
    "mesh": "fsdp",
    "forward_prefetch": "implicit",
    "backward_prefetch": "implicit",
    "reshard_after_forward": "true",
    "reduce_scatter_buffers": 1,
    "unshard_async": "off",
    "nosync_blocks": "none",
    "blocks_per_unit": 1,
    "root_reshard_after_forward": "false",
    "root_sync_fsdp": "every",
    "root_split": "none",
}
SAMPLED = SEARCH_DEFAULTS | {
    "mesh": "hsdp:2x1",
    "forward_prefetch": "depth2",
    "backward_prefetch": "paired",
    "reshard_after_forward": "false",
    "nosync_blocks": "second_half",
    "nosync_level_fsdp": "last",
    "keep_unsharded": True,
    "defer_concat": True,
    "blocks_per_unit": 4,
    "root_reshard_after_forward": "true",
}
SAMPLED_DIFF = (
    "hsdp:2x1 fwd=depth2 bwd=paired raf=false nosync=second_half level=last keep=true defer=true group=4 rootraf=true"
)


def test_a_search_s_terminal_output_fits_100_columns(monkeypatch):
    """What ``autotune search`` prints at the end (trials, final round, outcome) and a trial's progress
    line, on a 100-column terminal: no line longer, the knobs as the change from the defaults (whole
    ``knob=value`` words, two lines at most), the final round's figures unbroken on one line each."""
    from types import SimpleNamespace

    from rich.console import Console

    from autotune.cli import render

    out, err = Console(width=100, record=True), Console(width=100, record=True)
    monkeypatch.setattr(render, "console", out)
    monkeypatch.setattr(render, "err_console", err)
    long_note = "slower than 1.3x the best in both windows; " * 4
    rows = [
        complete_row(0, 954.7, ratio=0.996, ratio_spread=0.089, is_default=True, params=SEARCH_DEFAULTS),
        complete_row(1, 814.1, ratio=0.803, ratio_spread=0.01, params=SAMPLED),
        TrialRow(number=2, state="PRUNED", status="pruned", reason=long_note, noisy=True, params=SAMPLED),
    ]
    recipe = SearchRecord.read(DATA / "artifacts" / "search_v10.json").recipe
    record = SearchRecord(model="small", stopped_because="reached 3 trials", recipe=recipe)
    summary = SimpleNamespace(
        rows=rows,
        best=rows[1],
        confirmation=_confirmation(2) | {"speedup_q25": 1.05, "speedup_q75": 1.2},
        record=record,
        plan=SimpleNamespace(is_proxy=False),
        best_config_path=Path("runs/search/best.toml"),
        out_dir=Path("runs/search"),
        report_paths=[Path("runs/search/report/report.html")],
    )
    render.print_search_summary(summary)
    progress = render.SearchProgress()
    progress.task = progress.progress.add_task("search", total=3, best="")
    progress.on_trial_end(rows[2], rows[1])
    lines = out.export_text().splitlines()
    assert max(len(line) for line in lines) <= 100, "\n".join(lines)
    header = next(i for i, line in enumerate(lines) if "knobs / note" in line)
    column = lines[header].index("knobs / note")
    end = next(i for i in range(header, len(lines)) if not lines[i].strip())
    cells = [line[column:].strip() for line in lines[header + 2 : end]]
    assert cells[0] == "defaults" and " ".join(cells[1:4]) == SAMPLED_DIFF  # whole words, three lines
    assert " ".join(cells[4:7]) == SAMPLED_DIFF and cells[7].startswith("note: slower than 1.3x")
    assert re.fullmatch(r"\s+0\s+ok\s+0\.996x\s+8\.9%\s+defaults\s*", lines[header + 2])
    assert any(
        re.fullmatch(r"\s*2 \*\s+0\.900x\s+0\.880-0\.930\s+0\.920x\s+0\.880x\s+4\.5%\s+9\.0%/8\.0%\s+1\s*", line)
        for line in lines
    ), "\n".join(lines)
    # on an 80-column terminal too the final round's rows stay whole (one space between columns)
    narrow = Console(width=80, record=True)
    monkeypatch.setattr(render, "console", narrow)
    render.print_tables([get_final_round_table(summary.confirmation)])
    assert any(
        re.fullmatch(r"\s*2 \*\s+0\.900x\s+0\.880-0\.930\s+0\.920x\s+0\.880x\s+4\.5%\s+9\.0%/8\.0%\s+1\s*", line)
        for line in narrow.export_text().splitlines()
    ), narrow.export_text()
    (progress_line,) = err.export_text().splitlines()
    assert len(progress_line) <= 100 and progress_line.startswith("trial   2: pruned - slower than 1.3x")
    assert progress_line.endswith("…")


def test_the_host_table_sets_the_emitted_config_beside_the_defaults(cpu_search, cpu_page):
    from autotune.report import get_host_tables

    (table,) = get_host_tables(load_report(cpu_search))
    assert table.columns == ["trial", "step", "FSDP's own host work", "share", "verdict"]
    # both trial dirs hold the same CPU tiny traces: one figure, not host-bound (10-21% < 20%)
    assert [r[0] for r in table.rows] == ["best: trial 2 (emitted)", "defaults: trial 0"]
    assert table.rows[0][1:] == table.rows[1][1:] and table.rows[0][-1] == "not host-bound"
    assert "FSDP hooks on the host, emitted vs defaults" in cpu_page.read_text()
