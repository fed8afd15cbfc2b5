"""`autotune search` end to end on the tiny model with 2 real gloo ranks.

Every trial has a hard wall-clock limit (trial_timeout_s), and every subprocess a
``timeout=``; nothing here can hang CI.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
from _search_fixtures import FAST, start_search
from _search_programs import INJECTED

from autotune.pipeline import search_and_report
from autotune.report import get_tables, load_report
from autotune.search import SearchError, SearchSettings, SearchSpace, SilentReporter, TrialRow, pick_best, run_search
from autotune.search.cost import RoundLedger
from autotune.search.loop import plateaued
from fsdp_runtime import config_to_dict, load_config

REPO = Path(__file__).resolve().parents[3]


def _settings(out: Path, **kw) -> SearchSettings:
    return SearchSettings(out_dir=out, **{**FAST, **kw})


@pytest.mark.multirank
def test_search_emits_a_config_that_applies_and_trains(tmp_path, shared_pool):
    # No pruning (an unreachable prune ratio): every trial completes, so the final round has finalists.
    settings = _settings(tmp_path, num_trials=4, num_confirm_pairs=1, memory_budget_bytes=2**40, prune_ratio=1e9)
    summary = search_and_report(settings)
    rows = summary.rows
    assert [r.number for r in rows] == [0, 1, 2, 3]
    assert rows[0].is_default and rows[0].params["forward_prefetch"] == "implicit"
    # Every trial is paired with the defaults: its objective is the median step-time ratio.
    assert all(r.state == "COMPLETE" and r.step_ms > 0 and r.ratio > 0 for r in rows), rows
    # The last third (one trial of four) is a neighbour of the incumbent ([Note: refinement]), not sampled.
    assert [r.refined_from is not None for r in rows] == [False, False, False, True], [r.refined_from for r in rows]
    assert rows[3].refined_from.startswith(f"trial {pick_best(rows[:3]).number} + ")
    assert summary.best is not None and summary.best.ratio == min(r.ratio for r in rows if r.state == "COMPLETE")
    metrics = json.loads((tmp_path / rows[1].trial_dir / "metrics.json").read_text())
    assert (
        len(metrics["reference_step_ms_per_step"]) == len(metrics["step_ms_per_step"]) == metrics["num_measured"]
    )  # one per pair
    assert metrics["paired"]["pair_ratios"] == [
        c / r for c, r in zip(metrics["step_ms_per_step"], metrics["reference_step_ms_per_step"])
    ]
    # a settle step wherever the ranks switch models: the candidate's in even pairs, the reference's in odd
    n = metrics["num_measured"]
    assert [(len(r["settle_step_ms"]), len(r["reference_settle_step_ms"])) for r in metrics["ranks"]] == [
        ((n + 1) // 2, n // 2)
    ] * 2
    assert metrics["paired"]["estimator"] == "blocks" and metrics["paired"]["num_blocks"] == (n + 1) // 2
    conf = summary.confirmation
    finalists = [r for r in rows if not r.is_default and r.duplicate_of is None]
    assert finalists, [(r.number, r.duplicate_of) for r in rows]
    # The final round re-measured up to 3 of them against the defaults, 2 pairs each.
    assert [f["trial"] for f in conf["finalists"]] == [r.number for r in sorted(finalists, key=lambda r: r.ratio)][:3]
    # 2 pairs per window; a contested final round (see confirm.py) gave its contenders a second window.
    assert all(f["num_pairs"] == 2 * f.get("windows", 1) for f in conf["finalists"] if f["status"] == "ok")
    assert sorted(f["trial"] for f in conf["finalists"] if f.get("windows") == 2) == sorted(conf["contested"])
    winner = min((f for f in conf["finalists"] if f.get("ratio")), key=lambda f: f["ratio"])
    # The fastest finalist, if faster than the defaults there, is measured once more in a window of its own,
    # emitted only where that window calls it faster, with that window's speedup ([Note: emitted on an interval]).
    window = conf["verdict_window"]
    assert conf["chosen"] == (winner["trial"] if winner["ratio"] < 1 else None)
    assert (window is not None) == (winner["ratio"] < 1) and (window is None or window["trial"] == winner["trial"])
    assert conf["emitted"] == ("best" if window and window["faster"] else "defaults")
    assert conf["speedup_median"] == pytest.approx(1 / (window or winner)["ratio"])
    # the window ran its pairs (never stopped as faster) and calls it faster on their interval
    assert window is None or window["stopped"] != "faster"
    assert window is None or window["faster"] == (
        window["stopped"] in ("max_blocks", "settled") and window["ratio_high"] < 1
    )
    best = load_config(tmp_path / "best.toml")
    assert best == load_config(tmp_path / "best.json")
    assert best.provenance.measured and best.provenance.model == "tiny" and best.provenance.world_size == 2
    # Units may group blocks (grouping is searched by default) and split off the edges; every block is in one, in order.
    assert [m for u in best.units for m in u.get_modules() if m.startswith("layers.")] == [
        f"layers.{i}" for i in range(4)
    ] and best.units[-1].name == "root"
    # Tables and trial dirs are on disk.
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["trials"]) == 4
    assert (tmp_path / "results.csv").read_text().count("\n") == 5
    assert all((tmp_path / r.trial_dir / "metrics.json").exists() for r in rows)
    search_json = json.loads((tmp_path / "search.json").read_text())
    assert search_json["best"]["number"] == summary.best.number
    # Every round that ran is recorded with its steps and builds, within the most planned ([Note: round costs]).
    rounds = search_json["rounds"]
    ran = ["warm-up", "trials", "final round", *(["verdict"] if window else []), "recipe", "consolidation"]
    assert list(rounds["by_round"]) == ran, rounds["by_round"]
    assert all(
        0 < r["steps"] <= r["max_steps"] and 0 < r["builds"] <= r["max_builds"] for r in rounds["by_round"].values()
    )
    assert rounds["by_round"]["trials"]["runs"] == 4 and rounds["by_round"]["final round"]["runs"] == len(
        conf["finalists"]
    ) + len(conf["contested"])
    assert rounds["total"]["steps"] == sum(r["steps"] for r in rounds["runs"])
    assert rounds["eta_after_first_trial_s"] > 0
    # Consolidation of the emitted config was timed once (all_gather and the broadcast baseline).
    assert "seconds" in search_json["consolidation"], search_json["consolidation"]
    seconds = search_json["consolidation"]["seconds"]
    assert set(seconds) == {"all_gather", "broadcast"} and all(v > 0 for v in seconds.values())
    assert best.provenance.metrics["consolidation_s_all_gather"] == seconds["all_gather"]
    assert best.checkpoint.consolidation == min(seconds, key=seconds.get) == search_json["consolidation"]["chosen"]
    # The config to emit was measured against torchtitan's recipe too, as against the defaults
    # ([Note: beating the recipe]); under this memory budget a recipe that wins is not emitted in its place.
    recipe = search_json["recipe"]
    assert recipe["measured"] and recipe["status"] == "ok", recipe
    assert recipe["units"] == ["tok_embeddings", *(f"layers.{i}" for i in range(4)), "norm+output", "root"]
    assert recipe["estimator"] == "blocks" and recipe["speedup_median"] == pytest.approx(1 / recipe["ratio"])
    assert recipe["emitted"] == "search" and bool(recipe["reason"]) == (not recipe["faster"])
    assert best.provenance.metrics["speedup_median_vs_torchtitan"] == pytest.approx(recipe["speedup_median"])
    assert (tmp_path / "final" / "vs_torchtitan" / "metrics.json").exists()
    # The config to emit was profiled there, once ([Note: the emitted config's trace]): no search
    # trial but the defaults' took a trace, and the report's best-vs-defaults reads that one.
    assert [any((tmp_path / r.trial_dir).glob("trace_rank*")) for r in rows] == [True, False, False, False]
    # The search report shows it.
    report = load_report(tmp_path)
    if conf["emitted"] == "best":
        assert recipe["profiled"] and report.comparison.best.path == tmp_path / "final" / "vs_torchtitan"
        assert report.comparison.best.trace_metrics is not None
    summary_rows = {row[0]: row[1] for row in get_tables(report)[0].rows}
    assert "all_gather" in summary_rows["checkpoint consolidation"] and summary_rows["model"] == "tiny"
    who = "the search's config" if conf["emitted"] == "best" else "the defaults (emitted by the final round)"
    assert summary_rows["vs torchtitan's recipe"].startswith(f"{who} {recipe['speedup_median']:.3f}x")
    assert (tmp_path / "report" / "report.html").exists() and search_json["report_error"] is None
    # The emitted config applies with fsdp_runtime unchanged and trains.
    run = shared_pool.run(
        "_harness:train_losses", {"model": "tiny", "config": config_to_dict(best), "num_steps": 2}, timeout_s=90
    )
    assert run.ok, run.reason
    assert all(len(losses) == 2 and all(0 < x < 20 for x in losses) for losses in run.results)


@pytest.mark.multirank
def test_failed_trials_are_recorded_and_do_not_stop_the_search(tmp_path, shared_pool):
    # Seed 1 samples explicit forward prefetch in trials 1 and 2 (a seed whose samples all lack it tests nothing).
    summary = run_search(
        _settings(
            tmp_path,
            num_trials=4,
            num_confirm_pairs=0,
            sampler="random",
            seed=1,
            rank_program="_search_programs:crash_on_explicit_prefetch",
        )
    )
    states = [r.state for r in summary.rows]
    assert len(states) == 4 and "FAIL" in states and "COMPLETE" in states
    failed = [r for r in summary.rows if r.state == "FAIL"]
    assert all(r.status == "crash" and INJECTED in r.reason for r in failed)
    assert summary.best is not None and summary.best.state == "COMPLETE"


@pytest.mark.multirank
def test_a_burst_does_not_prune_a_config_but_a_slow_config_is_pruned(tmp_path, shared_pool):
    # Rank 1 sleeps (_search_programs.burst_or_slow) in every candidate step of trial 1, and in
    # the candidate steps of trial 2's first block only. Two blocks at most, pruned from the second.
    settings = _settings(
        tmp_path,
        num_trials=3,
        num_measured=4,
        num_refine=0,
        num_confirm_pairs=0,
        sampler="random",
        seed=5,
        rank_program="_search_programs:burst_or_slow",
    )
    rows = run_search(settings).rows
    assert rows[0].is_default and rows[0].state == "COMPLETE"
    slow, burst = rows[1], rows[2]
    assert slow.duplicate_of is None and burst.duplicate_of is None, "the sampler repeated a config: pick another seed"
    # Trial 1: clearly slower in both blocks: pruned after its second (not its first) block, no traces.
    metrics = json.loads((tmp_path / slow.trial_dir / "metrics.json").read_text())
    assert (slow.state, slow.stopped, metrics["paired"]["num_pairs"]) == ("PRUNED", "slower", 4), metrics["paired"]
    # It had to beat the best so far (the defaults trial, paired with itself: its own noise about 1.0).
    assert metrics["traces"] == [] and metrics["stopping"]["prune_above"] == settings.prune_ratio * rows[0].ratio
    # Trial 2: the burst made its first block look several times slower, but the second did not:
    # the interval spans the threshold, so it is measured to the end and ranked, not pruned.
    metrics = json.loads((tmp_path / burst.trial_dir / "metrics.json").read_text())
    assert (burst.state, burst.stopped, metrics["paired"]["num_pairs"]) == ("COMPLETE", "max_blocks", 4), burst
    assert metrics["paired"]["pair_ratios"][0] > 2.0 > metrics["paired"]["pair_ratios"][2]


@pytest.mark.multirank
def test_a_slow_rank_makes_a_trial_slow_not_failed_and_a_hang_is_still_killed(tmp_path, monkeypatch):
    """[Note: trial timeouts]: trial 1's rank 1 sleeps in every step (a busy box), trial 2's hangs.
    Limits follow what this box measured; a fixed limit the size of a clean trial would have
    failed trial 1. The search starts ranks of its own (not the session's warm pool): its first
    run, started cold, is what prices the limits."""
    from _search_programs import SLOW_RANK_S

    from autotune.search import timeouts

    monkeypatch.setattr(timeouts, "FLOOR_S", 1.0)  # the test's limits are the box's, not the floor's
    monkeypatch.setattr(timeouts, "FACTOR", 2.0)
    settings = _settings(
        tmp_path,
        num_trials=3,
        num_refine=0,
        num_confirm_pairs=0,
        sampler="random",
        seed=1,
        trial_timeout_s=None,
        rank_program="_search_programs:slowed_then_hung",
    )
    summary = run_search(settings)
    rows = summary.rows
    slowed, hung = rows[1], rows[2]
    metrics = json.loads((tmp_path / slowed.trial_dir / "metrics.json").read_text())
    assert slowed.state in ("COMPLETE", "PRUNED") and slowed.status != "timeout", slowed
    # Rank 1 slept inside every timed step: each step (the slowest rank's) holds the sleep.
    assert all(ms >= 1e3 * SLOW_RANK_S for ms in metrics["step_ms_per_step"]), metrics["step_ms_per_step"]
    assert (hung.state, hung.status) == ("FAIL", "timeout") and "no result after" in hung.reason, hung
    limit = float(hung.reason.split("no result after ")[1].split("s")[0])
    assert limit < timeouts.FIRST_S, hung.reason  # killed at a limit the box set, not the start-up limit
    assert summary.record.shortfall == ["1 of 3 trials failed (1 timeout); their configs were not ranked"]


def test_existing_study_needs_resume(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    optuna.create_study(study_name="s", storage=storage)
    with pytest.raises(SearchError, match=r"study 's' already exists .* \(use --resume to continue it"):
        run_search(_settings(tmp_path, num_trials=1, storage=storage, study_name="s"))
    with pytest.raises(SearchError, match=r"number of trials must be >= 1, got 0"):
        _settings(tmp_path, num_trials=0)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "import cli; cli.main()", "search", *args]


@pytest.mark.multirank
def test_two_workers_share_one_study_without_duplicates(tmp_path):
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    common = [
        "--model",
        "tiny",
        "--trials",
        "4",
        "--storage",
        storage,
        "--study-name",
        "shared",
        "--resume",
        "--confirm-pairs",
        "0",
        "--patience",
        "0",
        "--json",
    ]
    workers = [
        subprocess.Popen(
            _cli(*common, "--out", str(tmp_path / f"w{i}")),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for i in range(2)
    ]
    try:
        outputs = [w.communicate(timeout=400) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGKILL)
    assert all(w.returncode == 0 for w in workers), [o[1][-1500:] for o in outputs]
    trials = optuna.load_study(study_name="shared", storage=storage).get_trials()
    numbers = [t.number for t in trials]
    # Each worker checks the count before asking, so the study may overshoot by one per extra worker.
    assert 4 <= len(trials) <= 5 and sorted(numbers) == list(range(len(trials)))
    # Finished, none failed (a noisy trial may be pruned against the other worker's best).
    assert all(t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED) for t in trials)
    assert sum(t.user_attrs.get("is_default", False) for t in trials) == 1
    # Every trial ran exactly once, in exactly one worker's run dir; a point another trial
    # already measured is not run again but recorded as its duplicate.
    dirs = [p.name for i in range(2) for p in (tmp_path / f"w{i}" / "trials").glob("trial_*")]
    ran = [t.number for t in trials if "duplicate_of" not in t.user_attrs]
    assert sorted(dirs) == [f"trial_{n:04d}" for n in sorted(ran)]
    assert all(t.user_attrs["duplicate_of"] in ran for t in trials if t.number not in ran)
    assert len({t.user_attrs["worker"] for t in trials}) == 2


def _row(number: int, state: str, step_ms: float | None, feasible: bool = True) -> TrialRow:
    return TrialRow(number=number, state=state, status=state.lower(), step_ms=step_ms, feasible=feasible)


def test_plateau_counts_finished_trials_since_the_last_1pct_gain():
    rows = [_row(0, "COMPLETE", 100.0), _row(1, "COMPLETE", 99.5), _row(2, "PRUNED", None), _row(3, "FAIL", None)]
    assert plateaued(rows, 3)  # 99.5 is not a 1% gain over 100
    assert not plateaued(rows, 4)
    assert not plateaued([*rows[:1], _row(1, "COMPLETE", 98.0), *rows[2:]], 3)  # 98 is: the count restarts
    assert not plateaued([_row(0, "COMPLETE", 100.0, feasible=False), _row(1, "FAIL", None)], 1)  # no feasible best yet
    assert not plateaued([*rows, _row(4, "RUNNING", None)], 4)  # a running trial is not finished
    assert not plateaued(rows, None)


def test_search_loop_refines_on_the_plateau_then_stops(monkeypatch):
    from dataclasses import replace

    from autotune.search import loop

    told: list[TrialRow] = []
    queued: list[str] = []

    def fake_enqueue(study, space, rows, config_hash):
        queued.append(f"neighbour {sum(r.refined_from is not None for r in rows)}")
        return queued[-1]

    def fake_run_one(ctx, best):
        origin = queued.pop() if queued else None  # the enqueued neighbour is the next trial asked
        told.append(
            replace(_row(len(told), "COMPLETE", 100.0 - 0.1 * len(told)), refined_from=origin)
        )  # 0.1% gains only
        return told[-1]

    monkeypatch.setattr(loop, "get_rows", lambda study: list(told))
    monkeypatch.setattr(loop, "run_one", fake_run_one)
    monkeypatch.setattr(loop, "enqueue_neighbour", fake_enqueue)
    settings = SimpleNamespace(num_trials=50, patience=3, get_num_refine=lambda: 2)
    ctx = SimpleNamespace(settings=settings, reporter=SilentReporter(), study=None, space=None, ledger=RoundLedger())
    assert loop.search_loop(ctx) == "plateau: no >=1% improvement in 3 trials"
    # The first trial sets the best, three more without a 1% gain: plateau. Then the two
    # refinement trials the settings allow, and only then the search stops.
    assert [r.refined_from for r in told] == [None] * 4 + ["neighbour 0", "neighbour 1"]


def test_an_effective_config_is_measured_once(monkeypatch, tmp_path):
    """Two parameter sets that expand to one config: the second trial is told the first's result."""
    from autotune.search import context, loop
    from autotune.search.context import SearchContext
    from autotune.trials import TrialMetrics, TrialResult

    space = SearchSpace(block_names=("layers.0", "layers.1"), world_size=2, num_microbatches=1)
    default = space.get_default_params()
    # With two blocks, depth 2 and depth 3 prefetch expand to the same explicit lists.
    assert space.build_config({**default, "forward_prefetch": "depth2"}) == space.build_config(
        {**default, "forward_prefetch": "depth3"}
    )
    study = optuna.create_study(direction="minimize")
    for depth in ("depth2", "depth3"):
        study.enqueue_trial({**default, "forward_prefetch": depth})
    runs = []

    def fake_run_trial(spec, *, pool=None):
        runs.append(spec.out_dir.name)
        metrics = TrialMetrics(
            status="ok", model="tiny", world_size=2, backend="gloo", step_ms=42.0, process_peak_bytes=1
        )
        return TrialResult(status="ok", out_dir=spec.out_dir, metrics=metrics)

    monkeypatch.setattr(context, "run_trial", fake_run_trial)
    ctx = SearchContext(
        study=study,
        space=space,
        settings=_settings(tmp_path),
        plan=SimpleNamespace(trial_model="tiny"),
        reporter=SilentReporter(),
    )
    first, second = loop.run_one(ctx, None), loop.run_one(ctx, None)
    assert runs == ["trial_0000"]
    assert (first.state, first.step_ms, second.state, second.step_ms) == ("COMPLETE", 42.0, "COMPLETE", 42.0)
    assert study.trials[1].user_attrs["duplicate_of"] == 0 and second.trial_dir == first.trial_dir


def test_search_space_follows_the_settings(monkeypatch):
    """Grouping and the root's knobs are searched by default, checkpointing under a memory budget
    (or when asked), the edge modules come from the run model, and the CLI flags reach the settings."""
    from autotune.search.run import make_space
    from autotune.search.search_plan import make_search_plan

    def space_of(settings):
        return make_space(settings, make_search_plan(settings))

    space = space_of(SearchSettings())
    assert (space.grouping, space.root_knobs, space.checkpointing) == (True, True, False)
    assert (space.embedding_names, space.head_names) == (("tok_embeddings",), ("norm", "output"))
    assert space.can_split and "root_split" in space.get_default_params()
    assert space_of(SearchSettings(memory_budget_bytes=2**30)).checkpointing
    assert space_of(SearchSettings(checkpointing=True)).checkpointing
    off = space_of(SearchSettings(grouping=False, root_knobs=False, checkpointing=False, memory_budget_bytes=2**30))
    assert not (off.grouping or off.root_knobs or off.checkpointing or off.embedding_names)
    # A custom rank program builds its own model: the root is searched but never split.
    own = space_of(SearchSettings(rank_program="my_pkg.train:step"))
    assert own.root_knobs and not own.can_split

    from typer.testing import CliRunner

    import cli

    seen = {}

    def fake_search_and_report(settings, reporter=None):
        seen["settings"] = settings
        raise RuntimeError("stop here")

    monkeypatch.setattr("autotune.pipeline.search_and_report", fake_search_and_report)
    CliRunner().invoke(cli.app, ["search", "--no-grouping", "--no-root-knobs", "--checkpointing", "--out", "unused"])
    assert (seen["settings"].grouping, seen["settings"].root_knobs, seen["settings"].checkpointing) == (
        False,
        False,
        True,
    )
    CliRunner().invoke(cli.app, ["search", "--memory-budget-gib", "1.5", "--out", "unused"])
    assert (seen["settings"].grouping, seen["settings"].root_knobs, seen["settings"].get_checkpointing()) == (
        True,
        True,
        True,
    )


def test_a_worker_at_the_trial_count_waits_for_other_workers_trials(tmp_path):
    """The race the PostgreSQL two-worker test hit: the survivor reached the trial count while the
    killed worker's last trial was RUNNING, and exited leaving it so. Now it waits: a live
    worker's trial is waited for until it finishes, a dead worker's is closed as interrupted."""
    import socket
    import threading

    from autotune.search.loop import wait_for_other_workers

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}")
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = study.ask()
    gone.set_user_attr("worker", f"{socket.gethostname()}:{dead.pid}")
    live = study.ask()
    live.set_user_attr("worker", "otherhost:1")
    threading.Timer(1.5, lambda: study.tell(live, 1.0)).start()
    wait_for_other_workers(study, timeout_s=60, poll_s=0.1)
    # Returned only once the live worker's trial finished (it was RUNNING for 1.5 s).
    states = {t.number: (t.state.name, t.user_attrs.get("status")) for t in study.get_trials()}
    assert states == {0: ("FAIL", "interrupted"), 1: ("COMPLETE", None)}
    # A trial whose worker cannot be seen (another host) is given up on after the timeout.
    unseen = study.ask()
    unseen.set_user_attr("worker", "otherhost:2")
    wait_for_other_workers(study, timeout_s=0.5, poll_s=0.1)
    assert study.get_trials()[unseen.number].state.name == "RUNNING"  # left for --resume, not failed


def test_on_cuda_the_search_runs_bf16_and_names_cuda_device_max_connections(fake_cuda, tmp_path, monkeypatch):
    """On CUDA (torch asked, no kernel run): every config of the space in bf16 params / fp32 reduction, the
    plan of a CUDA cluster in the same precision, and CUDA_DEVICE_MAX_CONNECTIONS=1 said in one line with its fix."""
    from autotune.plan import PlanSettings, get_plan_precision
    from autotune.search.run import get_environment_notes
    from autotune.sim import Hardware
    from autotune.trials import get_overlap_warning
    from fsdp_runtime import MixedPrecisionConfig
    from profiles import load_cluster_profile

    fake_cuda.num_devices = 2
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    space, phases = start_search(_settings(tmp_path / "run"), monkeypatch)
    bf16 = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")
    assert space.device_type == "cuda" and space.mixed_precision == bf16
    assert space.build_config(space.get_default_params()).mixed_precision == bf16
    line = get_overlap_warning({"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "cuda")
    assert phases.count(line) == 1 and get_environment_notes("cuda") == [line]  # finish_search records the same
    # `autotune plan` on a CUDA cluster resolves the same default, from the cluster's device.
    h100 = Hardware(load_cluster_profile("h100-node"), 1)
    assert get_plan_precision(PlanSettings(), h100) == bf16
    fp32 = MixedPrecisionConfig(param_dtype="float32", reduce_dtype="float32")
    assert get_plan_precision(PlanSettings(param_dtype="float32"), h100) == fp32
    # Unset (or on CPU), nothing is said.
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    assert get_environment_notes("cuda") == [] and get_environment_notes("cpu") == []


def test_a_study_resumed_in_another_precision_is_refused(tmp_path, monkeypatch):
    space, _ = start_search(_settings(tmp_path / "run", param_dtype="bfloat16"), monkeypatch)
    assert space.mixed_precision.param_dtype == "bfloat16" and space.device_type == "cpu"
    with pytest.raises(SearchError, match=r"was run with mixed_precision=.*'bfloat16'.*not .*'float32'"):
        start_search(_settings(tmp_path / "run", resume=True), monkeypatch)
    with pytest.raises(SearchError, match=r"--search-reduce-dtype searches the reduce dtype"):
        _settings(tmp_path, search_reduce_dtype=True, reduce_dtype="bfloat16")


@pytest.mark.multirank
def test_a_bf16_search_runs_every_trial_in_bf16_and_emits_it(tmp_path, monkeypatch):
    """``autotune search --param-dtype bfloat16`` on CPU: every trial's config (the defaults', which is
    every trial's reference, too) and the emitted config carry it; env.json records the overlap variables."""
    from fsdp_runtime import MixedPrecisionConfig

    out = tmp_path / "run"
    env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # recorded by every rank; said only on CUDA
    args = ["--model", "tiny", "--trials", "3", "--confirm-pairs", "1", "--param-dtype", "bfloat16", "--json"]
    done = subprocess.run(
        _cli(*args, "--out", str(out)), cwd=REPO, env=env, capture_output=True, text=True, timeout=500
    )
    assert done.returncode == 0, done.stderr[-2000:]
    bf16 = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")
    assert load_config(out / "best.toml").mixed_precision == bf16
    assert '[mixed_precision]\nparam_dtype = "bfloat16"' in (out / "best.toml").read_text()
    record = json.loads((out / "search.json").read_text())
    assert record["mixed_precision"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    assert record["notes"] == []
    rows = json.loads((out / "results.json").read_text())["trials"]
    trial_dirs = [out / r["trial_dir"] for r in rows if r.get("trial_dir")]
    assert rows[0]["is_default"] and (out / rows[0]["trial_dir"]) in trial_dirs and len(trial_dirs) >= 2
    configs = sorted(out.rglob("config.toml"))  # the trials', the warm-up's and the final round's
    assert set(d / "config.toml" for d in trial_dirs) <= set(configs)
    assert all(load_config(p).mixed_precision == bf16 for p in configs), configs
    overlap = json.loads((trial_dirs[0] / "env.json").read_text())["overlap_env"]
    assert overlap["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


def test_a_bare_autotune_search_runs_the_settings_defaults(monkeypatch):
    """The README's main command (``autotune search``, no options) searches with ``SearchSettings``'
    own defaults, the trial budget included (10: docs/studies.md, "Trial budget"): the CLI cannot
    drift from the defaults the benchmarks and the library run."""
    import dataclasses

    from typer.testing import CliRunner

    import cli

    seen = {}

    def fake_search_and_report(settings, reporter=None):
        seen["settings"] = settings
        raise RuntimeError("stop here")

    monkeypatch.setattr("autotune.pipeline.search_and_report", fake_search_and_report)
    CliRunner().invoke(cli.app, ["search"])
    bare, defaults = seen["settings"], SearchSettings()
    differ = {
        f.name: (getattr(bare, f.name), getattr(defaults, f.name))
        for f in dataclasses.fields(SearchSettings)
        if getattr(bare, f.name) != getattr(defaults, f.name)
    }
    assert differ == {}
    assert bare.num_trials == 10 and bare.get_num_refine() == 3
