"""Versioned artifacts (see [Note: artifacts] in autotune/artifacts.py).

The committed fixtures under ``tests/data/artifacts/`` are what released versions wrote
(``*_v1.json``: the first release's writers' shape; ``*_v2.json``: the second's (typed
artifacts); ``*_v3.json``: the third's, with the paired measurement's fields; ``metrics_v4.json``,
``search_v3.json`` and ``trial_spec_v4.json``: today's writers, metrics with the profiler's cost
(``trial_spec_v1.json``: the second release's spec)). All describe one search of ``tiny`` on 2 gloo
ranks: 4 trials, trial 1 the best (its ``metrics.json`` is ``metrics_v*.json``, whose
trace summary is that of ``tests/data/cpu_tiny_2rank``), trial 2 faster but over the
memory budget. See ``tests/data/artifacts/README.md``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from _artifact_fixtures import ARTIFACTS, load_fixture, write_json

from autotune.analysis import SUMMARY_SCHEMA_VERSION
from autotune.compare import CompareRecord
from autotune.plan import PlanRecord
from autotune.report import get_tables, load_report
from autotune.search import SearchRecord, TrialRow, read_results
from autotune.search.results import write_results
from autotune.trials import TrialMetrics, TrialSpec
from fsdp_runtime import RuntimeConfig

# The numbers the fixtures hold (the trial measured 2 ranks; rank 0 has the larger peak).
PROCESS_PEAK = 623411200
RANK_PEAKS = [623411200, 618659840]
RANK_BASELINES = [402653184, 401408000]
STEP_MS = 138.91
# Profiler peaks of tests/data/cpu_tiny_2rank: per rank, per step, aggregate (max).
PROFILER_PEAKS = {0: (2532124, [1974300, 2532124]), 1: (2400284, [1875484, 2400284])}
PROFILER_PEAK_AGGREGATE = 2532124


# --------------------------------------------------------------------------- reading the fixtures


def test_the_fixtures_are_the_versions_they_are_named_after():
    """Guards the fixtures themselves: a regenerated v1 file must still be v1 through and through."""
    metrics_v1 = load_fixture("metrics_v1.json")
    assert (metrics_v1["kind"], metrics_v1["schema_version"]) == ("trial_metrics", 1)
    assert (metrics_v1["trace_metrics"]["kind"], metrics_v1["trace_metrics"]["schema_version"]) == ("trace_metrics", 1)
    for name in ("metrics_v1.json", "search_v1.json", "results_v1.json"):
        text = (ARTIFACTS / name).read_text(encoding="utf-8")
        assert (
            "peak_memory_bytes" in text
            and "process_peak_bytes" not in text
            and "profiler_peak_allocated_bytes" not in text
        ), name
    for name, kind, version in [
        ("metrics_v11.json", "trial_metrics", 11),
        ("metrics_v12.json", "trial_metrics", 12),
        ("metrics_v13.json", "trial_metrics", TrialMetrics.SCHEMA_VERSION),
        ("search_v11.json", "search_summary", 11),
        ("search_v12.json", "search_summary", SearchRecord.SCHEMA_VERSION),
        ("trial_spec_v4.json", "trial_spec", TrialSpec.SCHEMA_VERSION),
        ("plan_v3.json", "plan_summary", PlanRecord.SCHEMA_VERSION),
        ("compare_v1.json", "compare_summary", CompareRecord.SCHEMA_VERSION),
    ]:
        data = load_fixture(name)
        assert (data["kind"], data["schema_version"]) == (kind, version), name
        assert "peak_memory_bytes" not in (ARTIFACTS / name).read_text(encoding="utf-8"), name
    assert load_fixture("metrics_v11.json")["trace_metrics"]["schema_version"] == SUMMARY_SCHEMA_VERSION
    assert load_fixture("metrics_v5.json")["trace_metrics"]["schema_version"] == 3
    plan_v1 = load_fixture("plan_v1.json")
    assert plan_v1["schema_version"] == 1 and "at_edge" not in (ARTIFACTS / "plan_v1.json").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", [f"metrics_v{v}.json" for v in range(1, 10)])
def test_metrics_of_every_released_version_read(name):
    metrics = TrialMetrics.read(ARTIFACTS / name)

    assert (metrics.status, metrics.model, metrics.world_size, metrics.backend, metrics.memory_source) == (
        "ok",
        "tiny",
        2,
        "gloo",
        "peak_rss",
    )
    assert metrics.step_ms == STEP_MS and len(metrics.step_ms_per_step) == 5
    assert metrics.process_peak_bytes == PROCESS_PEAK
    assert [r.process_peak_bytes for r in metrics.ranks] == RANK_PEAKS
    assert [r.process_baseline_bytes for r in metrics.ranks] == RANK_BASELINES
    assert [r.median_step_ms for r in metrics.ranks] == [138.405, 138.91]
    assert metrics.traces == ["trace_rank0.json.gz", "trace_rank1.json.gz"]

    summary = metrics.trace_metrics
    assert (summary["kind"], summary["schema_version"], summary["num_ranks"]) == (
        "trace_metrics",
        SUMMARY_SCHEMA_VERSION,
        2,
    )
    for rank in summary["per_rank"]:
        rank_peak, step_peaks = PROFILER_PEAKS[rank["rank"]]
        assert rank["profiler_peak_allocated_bytes"] == rank_peak
        assert [s["profiler_peak_allocated_bytes"] for s in rank["steps"]] == step_peaks
        assert all("peak_memory_bytes" not in s for s in rank["steps"]) and "peak_memory_bytes" not in rank
    assert summary["aggregate"]["profiler_peak_allocated_bytes"] == PROFILER_PEAK_AGGREGATE
    assert "peak_memory_bytes" not in summary["aggregate"]


def test_v1_metrics_migrate_to_exactly_what_today_writes():
    """metrics_v1.json and metrics_v2.json hold the same trial: the migration loses nothing."""
    assert (
        TrialMetrics.read(ARTIFACTS / "metrics_v1.json")
        == TrialMetrics.read(ARTIFACTS / "metrics_v2.json")
        == TrialMetrics.read(ARTIFACTS / "metrics_v3.json")
    )
    assert (
        TrialMetrics.read(ARTIFACTS / "metrics_v3.json")
        == TrialMetrics.read(ARTIFACTS / "metrics_v4.json")
        == TrialMetrics.read(ARTIFACTS / "metrics_v5.json")
        == TrialMetrics.read(ARTIFACTS / "metrics_v7.json")
        == TrialMetrics.read(ARTIFACTS / "metrics_v8.json")
        == TrialMetrics.read(ARTIFACTS / "metrics_v9.json")
        == TrialMetrics.read(ARTIFACTS / "metrics_v10.json")
        == TrialMetrics.read(ARTIFACTS / "metrics_v11.json")
        == TrialMetrics.read(ARTIFACTS / "metrics_v12.json")
        == TrialMetrics.read(ARTIFACTS / "metrics_v13.json")
    )


def test_v3_metrics_read_without_profiler_costs():
    """v4 added each rank's CPU time and page faults per step and the profiler's cost: a v3 file has none."""
    metrics = TrialMetrics.read(ARTIFACTS / "metrics_v3.json")
    assert (metrics.profiler, metrics.profiler_cpu_overhead) == ({}, None)
    assert all(
        r.own_step_ms == r.step_cpu_ms == r.profiled_page_faults == [] and r.get_profiler_figures() is None
        for r in metrics.ranks
    )
    assert metrics.to_dict()["schema_version"] == TrialMetrics.SCHEMA_VERSION and metrics.to_dict()["profiler"] == {}


def test_v2_trace_summaries_read_as_v3():
    """Summary v3 added ``send_recv_ms`` (v2 counted send/recv as other: null, not measured apart)
    and ``overlap_ratio_time_weighted``, derived from a v2 summary's steps."""
    stored = load_fixture("metrics_v3.json")["trace_metrics"]
    assert stored["schema_version"] == 2 and "send_recv_ms" not in json.dumps(stored)
    summary = TrialMetrics.read(ARTIFACTS / "metrics_v3.json").trace_metrics
    assert summary["schema_version"] == SUMMARY_SCHEMA_VERSION
    for rank, old in zip(summary["per_rank"], stored["per_rank"]):
        assert all(s["send_recv_ms"] is None for s in rank["steps"]) and all(
            u["send_recv_ms"] is None for u in rank["per_unit"]
        )
        expected = 1 - sum(s["exposed_comm_ms"] for s in old["steps"]) / sum(s["comm_ms"] for s in old["steps"])
        assert rank["overlap_ratio_time_weighted"] == pytest.approx(expected, abs=1e-12)
    all_steps = [s for r in stored["per_rank"] for s in r["steps"]]
    expected = 1 - sum(s["exposed_comm_ms"] for s in all_steps) / sum(s["comm_ms"] for s in all_steps)
    assert summary["aggregate"]["overlap_ratio_time_weighted"] == pytest.approx(expected, abs=1e-12)
    assert (
        summary["aggregate"]["send_recv_ms"] is None
        and summary["aggregate"]["overlap_ratio"] == stored["aggregate"]["overlap_ratio"]
    )
    assert summary == load_fixture("metrics_v11.json")["trace_metrics"]  # what today's writer stores


def test_v3_trace_summaries_read_as_v4_without_pipeline_figures():
    """Summary v4 added the pipeline figures: a v3 summary reads with them null, its numbers as stored."""
    stored = load_fixture("metrics_v5.json")["trace_metrics"]
    assert stored["schema_version"] == 3 and "bubble_ms" not in json.dumps(stored)
    summary = TrialMetrics.read(ARTIFACTS / "metrics_v5.json").trace_metrics
    assert summary["schema_version"] == SUMMARY_SCHEMA_VERSION == 4 and summary["pipeline"] is None
    for rank, old in zip(summary["per_rank"], stored["per_rank"]):
        assert rank["stages"] is None
        for new_step, old_step in zip(rank["steps"], old["steps"], strict=True):
            assert new_step == {**old_step, "p2p_ms": None, "bubble_ms": None}
            assert list(new_step)[-3:] == ["p2p_ms", "bubble_ms", "profiler_peak_allocated_bytes"]
        assert all(u == {**o, "stage": None} for u, o in zip(rank["per_unit"], old["per_unit"], strict=True))
        assert all(list(u)[:2] == ["unit", "stage"] for u in rank["per_unit"])
    assert summary["aggregate"]["bubble_ms"] is None and summary["aggregate"]["per_unit"][0]["stage"] is None
    assert summary == load_fixture("metrics_v11.json")["trace_metrics"]


def test_metrics_round_trip_is_lossless(tmp_path):
    original = load_fixture("metrics_v13.json")
    metrics = TrialMetrics.read(ARTIFACTS / "metrics_v13.json")
    assert metrics.to_dict() == original

    written = metrics.write(tmp_path / "metrics.json")
    assert json.loads(written.read_text(encoding="utf-8")) == original
    assert TrialMetrics.read(written).to_dict() == original


def test_migrated_v1_metrics_are_written_back_as_today_s_version(tmp_path):
    written = TrialMetrics.read(ARTIFACTS / "metrics_v1.json").write(tmp_path / "metrics.json")
    assert json.loads(written.read_text(encoding="utf-8")) == load_fixture("metrics_v13.json")


@pytest.mark.parametrize("name", [f"search_v{v}.json" for v in range(1, 12)])
def test_search_summary_of_every_released_version_reads(name):
    record = SearchRecord.read(ARTIFACTS / name)

    assert (record.model, record.num_trials, record.stopped_because, record.proxy["is_proxy"]) == (
        "tiny",
        4,
        "plateau",
        False,
    )
    assert isinstance(record.best, TrialRow) and isinstance(record.default, TrialRow)
    assert (record.best.number, record.best.trial_dir, record.best.step_ms) == (1, "trials/trial_0001", STEP_MS)
    assert record.best.process_peak_bytes == PROCESS_PEAK
    assert (record.default.number, record.default.is_default, record.default.process_peak_bytes) == (0, True, 631799808)
    assert record.confirmation["emitted"] == "best" and len(record.confirmation["pairs"]) == 3
    assert record.consolidation["chosen"] == "broadcast"
    assert record.best_config == "runs/tiny/best.toml"


def test_v1_search_summary_migrates_to_what_today_writes():
    """Same search; only the report list differs (v1 wrote search.json before the report)."""
    v1, v2 = SearchRecord.read(ARTIFACTS / "search_v1.json"), SearchRecord.read(ARTIFACTS / "search_v11.json")
    assert v1.report == [] and v2.report
    assert v1.recipe is None and v2.recipe["measured"]  # v10: the final round against torchtitan's recipe
    assert dataclasses.replace(v1, report=v2.report, recipe=v2.recipe) == v2


def test_a_v9_search_summary_reads_with_no_recipe_measured():
    """v10 added the final round against torchtitan's recipe ([Note: beating the recipe]); an older
    search measured none, and its report says nothing of one."""
    assert "recipe" not in load_fixture("search_v9.json")
    assert SearchRecord.read(ARTIFACTS / "search_v9.json").recipe is None
    recipe = SearchRecord.read(ARTIFACTS / "search_v10.json").recipe
    assert (recipe["emitted"], recipe["speedup_median"], recipe["ratio"]) == ("search", 1.0728, 0.9321)


def test_a_v11_search_reads_with_no_plan_and_fsdp2s_defaults_as_its_baseline():
    """v12 added the search plan, the baseline and the rounds ([Note: the search plan]); an older
    record has none of them."""
    old = SearchRecord.read(ARTIFACTS / "search_v11.json")
    assert (old.search_plan, old.baseline, old.rounds) == (None, None, None)
    new = SearchRecord.read(ARTIFACTS / "search_v12.json")
    assert new.baseline["name"] == "FSDP2's defaults" and new.search_plan["target"]["backend"] == "gloo"
    assert [r["name"] for r in new.rounds["planned"]][:2] == ["warm-up", "trials"]


def test_search_summary_round_trip_is_lossless(tmp_path):
    original = load_fixture("search_v12.json")
    record = SearchRecord.read(ARTIFACTS / "search_v12.json")
    assert record.to_dict() == original
    assert SearchRecord.read(record.write(tmp_path / "search.json")).to_dict() == original


def test_a_v10_search_reads_as_emitted_on_a_median_with_the_choosing_round_s_speedup():
    """v11 emits a config over a baseline only where a window that did not choose it calls it faster,
    and reports that window's speedup ([Note: emitted on an interval]); a v10 record's final round
    emitted on a median below 1 and reported the figure of the round that chose it, and says so once read."""
    old = load_fixture("search_v10.json")
    assert "emit_rule" not in old["confirmation"] and "emit_rule" not in old["recipe"]
    record = SearchRecord.read(ARTIFACTS / "search_v10.json")
    assert (record.confirmation["emit_rule"], record.confirmation["speedup_from"]) == ("median", "selection")
    assert record.recipe["emit_rule"] == "median"
    assert SearchRecord.read(ARTIFACTS / "search_v9.json").recipe is None  # none measured: nothing to mark


def test_a_v6_final_round_reads_as_medians_of_single_pairs():
    """v7 measures the final round in ABBA blocks after settle steps ([Note: switch cost]); a v6
    record's figures were medians of single pairs, and say so once read."""
    assert "estimator" not in load_fixture("search_v6.json")["confirmation"]
    assert SearchRecord.read(ARTIFACTS / "search_v6.json").confirmation["estimator"] == "pairs"


def test_plan_summary_v1_reads_and_round_trips(tmp_path):
    """``autotune plan --model llama8b --cluster h100-node --nodes 1 --microbatches 1 --mesh fsdp --top 3``."""
    record = PlanRecord.read(ARTIFACTS / "plan_v1.json")

    assert (record.model, record.cluster, record.num_nodes, record.world_size, record.num_microbatches) == (
        "llama8b",
        "h100-node",
        1,
        8,
        1,
    )
    assert record.activation_checkpointing == "per_unit"
    assert (record.num_evaluated, record.num_fit, record.num_dropped) == (674, 288, 386)
    assert record.default["fits"] is False and record.best["fits"] is True
    assert record.best["params"]["ac_units"] == "all_but_last" and len(record.best["units"]) == 33
    assert record.best["predicted_step_ms"] == pytest.approx(979.6146)
    assert [t["num_alike"] for t in record.top] == [8, 8, 8] and record.top[0]["config"] == record.best["config"]
    # v2 flags predictions at the edge of memory: unknown (null) for a v1 plan, which had no margin.
    assert record.memory_margin is None and record.num_at_edge is None
    assert (
        record.default["at_edge"] is record.best["at_edge"] is None and [t["at_edge"] for t in record.top] == [None] * 3
    )
    original = load_fixture("plan_v1.json")
    flagged = {**original, "schema_version": 3, "memory_margin": None, "num_at_edge": None}
    flagged |= {"pp_degrees": [1], "best_per_pp": []}
    flagged |= {k: {**original[k], "at_edge": None, "pipeline": _NO_PIPELINE} for k in ("default", "best")}
    flagged["top"] = [{**row, "at_edge": None, "pipeline": _NO_PIPELINE} for row in original["top"]]
    assert record.to_dict() == flagged
    assert PlanRecord.read(record.write(tmp_path / "plan.json")) == record


def test_plan_summary_v2_reads_and_round_trips(tmp_path):
    """The same command as v1's, with the memory margin ([Note: memory margin]): the two fastest
    configs are at the edge of memory, the emitted one is the third."""
    record = PlanRecord.read(ARTIFACTS / "plan_v2.json")

    assert (record.model, record.cluster, record.world_size, record.num_evaluated) == ("llama8b", "h100-node", 8, 674)
    margin = record.memory_margin
    assert margin is not None and (margin["capacity_gib"], margin["usable_gib"]) == (79.6, pytest.approx(77.6))
    assert [p["name"] for p in margin["parts"]] == ["simulator_error", "allocator_fragmentation"]
    assert margin["edge_gib"] + margin["margin_gib"] == pytest.approx(margin["usable_gib"])
    assert sum(p["gib"] for p in margin["parts"]) == pytest.approx(margin["margin_gib"])
    assert record.num_at_edge == 128 and [t["at_edge"] for t in record.top] == [True, True, False]
    assert record.best["at_edge"] is False and record.best["config"] == record.top[2]["config"]
    assert record.best["predicted_peak_memory_gib"] <= margin["edge_gib"] < record.top[0]["predicted_peak_memory_gib"]
    # v3 ranks PP degrees: a v2 plan ranked FSDP2 alone, every config with the plan's one microbatch
    original = load_fixture("plan_v2.json")
    upgraded = {**original, "schema_version": 3, "pp_degrees": [1], "best_per_pp": []}
    upgraded |= {k: {**original[k], "pipeline": _NO_PIPELINE} for k in ("default", "best")}
    upgraded["top"] = [{**row, "pipeline": _NO_PIPELINE} for row in original["top"]]
    assert record.to_dict() == upgraded
    assert PlanRecord.read(record.write(tmp_path / "plan.json")) == record


_NO_PIPELINE = {"pp": 1, "schedule": None, "virtual_stages": 1, "num_microbatches": 1}


def test_plan_summary_v3_reads_and_round_trips(tmp_path):
    """The same command with ``--pp 1,2``: PP 2's best (interleaved 1F1B, 4 stages per rank, 2 microbatches
    per step: the same tokens as 1 microbatch on each of 8 data-parallel ranks) beside FSDP2 alone's, which is emitted."""
    record = PlanRecord.read(ARTIFACTS / "plan_v3.json")

    assert record.pp_degrees == [1, 2] and record.num_microbatches == 1
    assert [row["pipeline"]["pp"] for row in record.best_per_pp] == [1, 2]
    piped = record.best_per_pp[1]
    assert piped["pipeline"] == {"pp": 2, "schedule": "interleaved_1f1b", "virtual_stages": 4, "num_microbatches": 2}
    assert piped["params"]["pp"] == 2 and 0 < piped["predicted_bubble_fraction"] < 1
    assert piped["predicted_step_ms"] > record.best["predicted_step_ms"] == record.best_per_pp[0]["predicted_step_ms"]
    assert record.best["pipeline"] == record.default["pipeline"] == _NO_PIPELINE
    assert record.to_dict() == load_fixture("plan_v3.json")
    assert PlanRecord.read(record.write(tmp_path / "plan.json")) == record


def test_results_v1_read(tmp_path):
    shutil.copy(ARTIFACTS / "results_v1.json", tmp_path / "results.json")
    rows = read_results(tmp_path)

    assert [r.number for r in rows] == [0, 1, 2, 3]
    assert [r.process_peak_bytes for r in rows] == [631799808, PROCESS_PEAK, 701235200, 640942080]
    assert [r.feasible for r in rows] == [True, True, False, True]
    assert [r.state for r in rows] == ["COMPLETE", "COMPLETE", "COMPLETE", "PRUNED"]
    assert [r.trial_dir for r in rows] == [f"trials/trial_{n:04d}" for n in range(4)]
    # The rows agree with search.json's best and default.
    record = SearchRecord.read(ARTIFACTS / "search_v1.json")
    assert (rows[1], rows[0]) == (record.best, record.default)


def test_results_csv_leads_with_number_and_state_then_every_row_field(tmp_path):
    shutil.copy(ARTIFACTS / "results_v1.json", tmp_path / "results.json")
    (tmp_path / "out").mkdir()
    write_results(read_results(tmp_path), tmp_path / "out")
    with (tmp_path / "out" / "results.csv").open(newline="") as f:
        table = list(csv.DictReader(f))
    header = list(table[0])
    assert header[:2] == ["number", "state"]
    assert sorted(header) == sorted(f.name for f in dataclasses.fields(TrialRow))
    assert [(r["number"], r["state"], r["feasible"]) for r in table][1:3] == [
        ("1", "COMPLETE", "True"),
        ("2", "COMPLETE", "False"),
    ]


def test_trial_spec_reads_and_round_trips(tmp_path):
    original = load_fixture("trial_spec_v4.json")
    spec = TrialSpec.read(ARTIFACTS / "trial_spec_v4.json")

    assert (spec.model, spec.world_size, spec.backend, spec.out_dir) == (
        "tiny",
        2,
        "gloo",
        Path("runs/tiny/trials/trial_0001"),
    )
    assert isinstance(spec.config, RuntimeConfig)
    assert [u.name for u in spec.config.units] == ["layers.0", "layers.1", "layers.2", "layers.3", "root"]
    assert spec.to_dict() == original
    assert TrialSpec.read(spec.write(tmp_path / "spec.json")).to_dict() == original


# --------------------------------------------------------------------------- a previous release's search dir


def make_v1_search_dir(root: Path) -> Path:
    """A search dir as the previous release left it: trial 1 (the best) and trial 2 (faster, over budget)."""
    search = load_fixture("search_v1.json")
    write_json(root / "search.json", search)
    write_json(root / "results.json", load_fixture("results_v1.json"))
    best = load_fixture("metrics_v1.json")
    write_json(root / search["best"]["trial_dir"] / "metrics.json", best)
    over_budget = next(r for r in load_fixture("results_v1.json")["trials"] if not r["feasible"])
    faster = {**best, "step_ms": over_budget["step_ms"], "peak_memory_bytes": over_budget["peak_memory_bytes"]}
    write_json(root / over_budget["trial_dir"] / "metrics.json", faster)
    return root


def test_report_of_a_v1_search_dir(tmp_path):
    report = load_report(make_v1_search_dir(tmp_path / "run"))

    assert report.kind == "search"
    assert [t.name for t in report.trials] == ["trial_0001", "trial_0002"]
    assert report.best is not None and report.best.name == "trial_0001"
    assert (report.best.step_ms, report.best.process_peak_bytes) == (STEP_MS, PROCESS_PEAK)
    assert report.best.get_aggregate("profiler_peak_allocated_bytes") == PROFILER_PEAK_AGGREGATE
    assert [t.feasible for t in report.trials] == [True, False]  # from results_v1.json
    assert report.search is not None and report.search.best.process_peak_bytes == PROCESS_PEAK
    assert get_tables(report)  # the tables render from migrated data


def test_report_of_a_v1_search_dir_picks_the_best_without_search_json(tmp_path):
    """Without search.json the best-trial rule runs on the trials, with results.json's feasibility."""
    root = make_v1_search_dir(tmp_path / "run")
    (root / "search.json").unlink()
    report = load_report(root)

    assert report.best is not None and report.best.name == "trial_0001"  # trial_0002 is faster but infeasible
    assert report.best.process_peak_bytes == PROCESS_PEAK


def test_trial_spec_v1_reads_as_an_unpaired_trial():
    spec = TrialSpec.read(ARTIFACTS / "trial_spec_v1.json")
    assert spec.reference is None and spec.prune_if_ratio_above is None
    assert spec == TrialSpec.read(ARTIFACTS / "trial_spec_v3.json") == TrialSpec.read(ARTIFACTS / "trial_spec_v4.json")
    assert spec.keep_reference is False


def test_the_architecture_page_names_the_versions_the_code_writes():
    """docs/architecture.md lists each artifact with its schema version."""
    text = " ".join(
        (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text(encoding="utf-8").split()
    )
    for name, record in [
        ("autotune.trials.TrialMetrics", TrialMetrics),
        ("autotune.search.SearchRecord", SearchRecord),
        ("autotune.trials.TrialSpec", TrialSpec),
        ("autotune.plan.PlanRecord", PlanRecord),
        ("autotune.compare.CompareRecord", CompareRecord),
    ]:
        assert f"(`{name}`, v{record.SCHEMA_VERSION}" in text, name
