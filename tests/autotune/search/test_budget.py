"""A search never stops before measuring, and never times a trial out for being slow ([Note: trial
timeouts]): the budget counts measured trials, limits follow the box, a shortfall is said."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from _search_fixtures import complete_row

from autotune.search import SilentReporter, TrialRow
from autotune.search.cost import RoundLedger
from autotune.search.timeouts import FIRST_S, FLOOR_S, TrialTimeouts, count_steps, count_steps_run
from autotune.trials.metrics import RankMetrics, TrialMetrics, TrialResult


def _result(wall_s: float, *, pairs: int, status: str = "ok") -> TrialResult:
    """A paired trial between two models that ran ``pairs`` pairs after 2 warm-up steps a side."""
    rank = RankMetrics(
        rank=0,
        step_ms=[1.0] * pairs,
        reference_step_ms=[1.0] * pairs,
        settle_step_ms=[1.0] * ((pairs + 1) // 2),
        reference_settle_step_ms=[1.0] * (pairs // 2),
    )
    metrics = TrialMetrics(
        status=status, model="tiny", world_size=2, backend="gloo", num_warmup=2, ranks=[rank],
        reference_step_ms_per_step=[1.0] * pairs,
    )  # fmt: skip
    return TrialResult(status=status, out_dir=None, metrics=metrics, wall_s=wall_s)


def test_a_trial_s_steps_are_counted_as_it_runs_them():
    assert count_steps(num_warmup=2, num_pairs=4, paired=True, self_paired=False, profiled=2) == 2 * 2 + 3 * 4 + 3
    assert count_steps(num_warmup=2, num_pairs=4, paired=True, self_paired=True, profiled=0) == 2 + 2 * 4
    assert count_steps(num_warmup=2, num_pairs=4, paired=False, self_paired=False, profiled=0) == 2 + 4
    assert count_steps_run(_result(10.0, pairs=4).metrics) == 2 * 2 + 3 * 4


def test_limits_follow_the_box_with_a_stand_in_clock():
    timeouts = TrialTimeouts()
    assert timeouts.get(16) == FIRST_S  # nothing ran on this box yet
    timeouts.observe(_result(16.0, pairs=4))  # the defaults: 1 s per step
    assert timeouts.get(16) == max(FLOOR_S, 5 * 1.0 * 16)
    assert timeouts.get(40) == 200.0
    # The box slows down (one core kept busy): three trials at 3 s per step raise the limits.
    for _ in range(3):
        timeouts.observe(_result(48.0, pairs=4))
    assert timeouts.rate_s == pytest.approx(3.0) and timeouts.get(40) == pytest.approx(600.0)
    # It speeds up again: never below what the defaults measured.
    for _ in range(3):
        timeouts.observe(_result(1.6, pairs=4))
    assert timeouts.rate_s == pytest.approx(1.0)
    # A failure (a hang killed at its limit) teaches nothing.
    timeouts.observe(_result(900.0, pairs=4, status="timeout"))
    assert timeouts.rate_s == pytest.approx(1.0)
    # --trial-timeout fixes every limit.
    assert TrialTimeouts(fixed_s=30.0).get(1000) == 30.0


def _row(number: int, state: str, **fields) -> TrialRow:
    return TrialRow(number=number, state=state, status=fields.pop("status", state.lower()), **fields)


def test_enqueued_trials_do_not_use_the_budget(monkeypatch):
    """A search on a 2-core box with one core kept busy (``--presearch sim``): the defaults, three
    calibration trials (two failed), four enqueued presearch picks; 8 rows for 8 trials. Every
    enqueued trial must still run."""
    from autotune.search import loop

    rows = [
        complete_row(0, 100.0, ratio=1.0, is_default=True),
        _row(1, "FAIL", status="timeout", calibration="unshard_async"),
        _row(2, "FAIL", status="timeout", calibration="replicated"),
        complete_row(3, 90.0, ratio=0.9, calibration="eager_concat"),
        *[_row(n, "WAITING", status="waiting", presearch_rank=n - 3) for n in range(4, 8)],
    ]

    def fake_run_one(ctx, best):  # Optuna asks the oldest WAITING trial first
        i = next(i for i, r in enumerate(rows) if r.state == "WAITING")
        rows[i] = replace(rows[i], state="COMPLETE", status="ok", ratio=0.5, step_ms=50.0)
        return rows[i]

    monkeypatch.setattr(loop, "get_rows", lambda study: list(rows))
    monkeypatch.setattr(loop, "run_one", fake_run_one)
    monkeypatch.setattr(loop, "wait_for_other_workers", lambda *a, **k: None)
    settings = SimpleNamespace(num_trials=8, patience=None, get_num_refine=lambda: 0)
    ctx = SimpleNamespace(
        settings=settings, reporter=SilentReporter(), study=None, get_trial_timeout_s=lambda: 1.0, ledger=RoundLedger()
    )
    assert loop.search_loop(ctx) == "reached 8 trials"
    assert [r.state for r in rows] == ["COMPLETE", "FAIL", "FAIL", *["COMPLETE"] * 5]


def test_interrupted_and_running_trials_count_as_they_should():
    from autotune.search.loop import count_budget_used, count_measured

    rows = [
        complete_row(0, 100.0),
        _row(1, "PRUNED"),
        _row(2, "FAIL", status="interrupted"),  # closed when its worker died: it measured nothing
        _row(3, "RUNNING"),  # another worker's
        _row(4, "WAITING"),
    ]
    assert count_measured(rows) == 2 and count_budget_used(rows) == 3


def test_a_shortfall_is_said_in_one_line_each(monkeypatch):
    from autotune.search.shortfall import get_shortfall

    space = SimpleNamespace()
    ctx = SimpleNamespace(
        settings=SimpleNamespace(num_trials=8, presearch="sim"),
        study=SimpleNamespace(user_attrs={"presearch": {}}),
        space=space,
    )
    rows = [
        complete_row(0, 100.0, ratio=1.0, is_default=True),
        _row(1, "FAIL", status="timeout", calibration="unshard_async"),
        complete_row(2, 90.0, ratio=0.9, calibration="eager_concat"),
        _row(3, "WAITING"),
    ]
    points = {"unshard_async": {}, "replicated": {}, "eager_concat": {}}
    monkeypatch.setattr("autotune.search.shortfall.get_calibration_params", lambda space: points)
    lines = get_shortfall(ctx, rows, "plateau")
    assert lines == [
        "measured 3 of the 8 trials asked for (stopped: plateau)",
        "1 of 4 trials failed (1 timeout); their configs were not ranked",
        "1 enqueued trial(s) never ran (trials 3)",
        "the simulator was calibrated without calibration trial(s) unshard_async (timeout), replicated (not run)",
    ]
    full = [complete_row(n, 100.0) for n in range(8)]
    ctx.settings.presearch = None
    assert get_shortfall(ctx, full, "reached 8 trials") == []
