"""Each round's most steps and builds, what a search's rounds ran, and the ETA over all of them ([Note: round costs])."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from autotune.report import get_rounds_table
from autotune.search import SearchRecord, SearchSettings
from autotune.search.cost import (
    RoundCost,
    RoundLedger,
    estimate_round_s,
    estimate_search_cost,
    estimate_wall_s,
)
from autotune.trials.metrics import RankMetrics, TrialMetrics, TrialResult
from autotune.trials.sides import PAIRED_MODELS_ENV


def _estimate(settings, **kwargs):
    """The rounds as the search plans them (:func:`autotune.search.search_plan.get_rounds` reads the same)."""
    from autotune.search.calibration_trials import CALIBRATION_CHANGES
    from autotune.search.verdict import MIN_PAIRS

    return estimate_search_cost(
        settings, min_verdict_pairs=MIN_PAIRS, num_calibration_changes=len(CALIBRATION_CHANGES), **kwargs
    )


ARTIFACTS = Path(__file__).resolve().parents[2] / "data" / "artifacts"
SMALL = {"model": "tiny", "world_size": 2, "num_warmup": 1, "num_measured": 2, "num_profiled": 1, "num_trials": 4}
SMALL |= {"num_finalists": 3, "num_confirm_pairs": 1}


def _settings(**kw) -> SearchSettings:
    return SearchSettings(**{**SMALL, **kw})


def test_each_round_s_most_steps_and_builds_are_counted_by_hand():
    # warm-up: 1 warm-up step + 2 unpaired steps, one build. trials: the defaults against themselves
    # (1 warm-up, 2 pairs of 2 steps, a profiled window of 1 + 1) and 3 trials against the defaults,
    # unprofiled (the recipe round profiles: [Note: the emitted config's trace]): 2 warm-ups, 2 pairs
    # of 3 steps (a settle step each), 2 builds. final round: 3 finalists (not 3 + the refinement's
    # base: there are only 3 trials but the defaults), a second window each, 2 pairs a window. verdict
    # and recipe: 4 pairs (MIN_PAIRS), the recipe's window profiled. consolidation: a build and a step.
    assert _estimate(_settings(), in_turn=False) == [
        RoundCost("warm-up", 1, 2, 1 + 2, 1),
        RoundCost("trials", 4, 2, (1 + 4 + 2) + 3 * (2 + 6), 1 + 3 * 2),
        RoundCost("final round", 6, 2, 6 * (2 + 6), 6 * 2, expected_runs=3),
        RoundCost("verdict", 1, 4, 2 + 12, 2),
        RoundCost("recipe", 1, 4, 2 + 12 + 2, 2),
        RoundCost("consolidation", 1, 0, 1, 1),
    ]
    # built in turn: n + 2 builds of n pairs (one more before a profiled window), each warmed up
    turn = {r.name: (r.steps, r.builds) for r in _estimate(_settings(), in_turn=True)}
    assert turn == {
        "warm-up": (3, 1),
        "trials": (7 + 3 * (4 + 6), 1 + 3 * 4),
        "final round": (6 * (4 + 6), 6 * 4),
        "verdict": (6 + 12, 6),
        "recipe": (7 + 12 + 2, 7),
        "consolidation": (1, 1),
    }
    # without a recipe round every trial may profile; without a final round none of the three rounds after the trials
    no_recipe = _estimate(_settings(), in_turn=False, recipe=False)
    assert [r.name for r in no_recipe] == ["warm-up", "trials", "final round", "verdict", "consolidation"]
    assert no_recipe[1] == RoundCost("trials", 4, 2, 7 + 3 * (2 + 6 + 2), 7)
    assert [(r.name, r.steps) for r in _estimate(_settings(num_confirm_pairs=0), in_turn=False)] == [
        ("warm-up", 3),
        ("trials", 7 + 3 * 10),
        ("consolidation", 1),
    ]
    # more trials: 3 finalists and the refinement's base, each with a second window, 3 pairs a window;
    # a search usually measures the 3 finalists' first windows
    final = _estimate(_settings(num_trials=10, num_confirm_pairs=3), in_turn=False)[2]
    assert final == RoundCost("final round", 8, 6, 8 * (2 + 18), 8 * 2, expected_runs=3)
    rounds = _estimate(_settings(), in_turn=False)
    assert estimate_round_s(rounds[0], step_s=0.5, build_s=10.0) == 3 * 0.5 + 10.0
    assert estimate_wall_s(rounds, step_s=0.5, build_s=10.0) == pytest.approx(
        0.5 * (3 + 31 + 48 + 14 + 16 + 1) + 10.0 * (1 + 7 + 12 + 2 + 2 + 1)
    )


def _result(name: str, wall_s: float, *, pairs: int, builds: int, paired: bool = True) -> TrialResult:
    """A finished run of ``pairs`` pairs (or unpaired steps) of 100 ms steps, one warm-up step per side."""
    rank = RankMetrics(
        rank=0,
        step_ms=[100.0] * pairs,
        reference_step_ms=[100.0] * pairs if paired else [],
        settle_step_ms=[100.0] * ((pairs + 1) // 2) if paired else [],
        reference_settle_step_ms=[100.0] * (pairs // 2) if paired else [],
        num_models=2 if paired else 1,
        num_builds=builds,
    )
    metrics = TrialMetrics(
        status="ok", model="tiny", world_size=2, backend="gloo", num_warmup=1, ranks=[rank],
        reference_step_ms_per_step=[100.0] * pairs if paired else [], step_ms_per_step=[100.0] * pairs,
        num_models=rank.num_models, num_builds=builds,
    )  # fmt: skip
    return TrialResult(status="ok", out_dir=Path("trials") / name, metrics=metrics, wall_s=wall_s)


def _spec(num_pairs: int) -> SimpleNamespace:
    """A paired, unprofiled spec of ``num_pairs`` pairs, one warm-up step: at most 2 + 3 * num_pairs steps, 2 builds."""
    return SimpleNamespace(
        config="candidate", reference="defaults", num_measured=num_pairs, num_warmup=1, num_profiled=1, profile=False
    )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_ledger_sums_each_round_and_estimates_every_round_left(monkeypatch):
    monkeypatch.setenv(PAIRED_MODELS_ENV, "two")  # two models per pair, whatever the backend
    clock = Clock()
    ledger = RoundLedger(rounds=_estimate(_settings(), in_turn=False), clock=clock)
    ledger.enter("warm-up")
    clock.now += 5.0
    ledger.observe("warm-up", _result("warmup", 5.0, pairs=2, builds=1, paired=False))  # 3 steps, 4.7 s to build
    assert ledger.get_eta_s() is None  # no trial yet
    ledger.enter("trials")
    clock.now += 15.7
    first = ledger.observe("trials", _result("trial_0000", 8.8, pairs=2, builds=2), _spec(4))
    # 2 warm-ups + 2 pairs + 2 settle steps of the 14 its spec allowed; (8.8 - 0.8) / 2 s a build
    assert (first.steps, first.builds, first.max_steps, first.max_builds) == (8, 2, 14, 2)
    assert first.build_s == pytest.approx(4.0)
    assert ledger.get_step_s() == pytest.approx(0.1) and ledger.get_build_s() == pytest.approx(4.0)  # no cold start
    assert ledger.get_fill() == pytest.approx((8 / 14, 1.0))
    # left: 3 of the 4 trials and every round after them (of the final round's 6 windows the 3 first
    # ones), at 8/14 of their steps and all their builds; the search's 20.7 s over its runs' 13.8 s
    # scales it by 1.5
    steps = 0.75 * 31 + 0.5 * 48 + 14 + 16 + 1
    builds = 0.75 * 7 + 0.5 * 12 + 2 + 2 + 1
    eta = 1.5 * (steps * 8 / 14 * 0.1 + builds * 4.0)
    assert ledger.estimate_remaining_s() == pytest.approx(eta)
    assert ledger.eta_after_first_trial_s == pytest.approx(eta) and ledger.first_trial_at_s == pytest.approx(20.7)
    clock.now += 10.0
    assert ledger.get_eta_s() == pytest.approx(eta - 10.0)  # counting down between runs
    ledger.set_trials_done(3)  # a resumed study's trials count too: one trial left
    # and the search's 30.7 s over its runs' 13.8 s is more than MAX_OVERHEAD: 2
    steps, builds = 0.25 * 31 + 0.5 * 48 + 14 + 16 + 1, 0.25 * 7 + 0.5 * 12 + 2 + 2 + 1
    assert ledger.estimate_remaining_s() == pytest.approx(2.0 * (steps * 8 / 14 * 0.1 + builds * 4.0))
    ledger.observe("trials", _result("trial_0001", 4.4, pairs=1, builds=2), _spec(4))
    ledger.enter("final round")
    clock.now += 3.0
    ledger.observe("final round", _result("trial_0001", 8.8, pairs=2, builds=2), _spec(2))
    ledger.enter("consolidation")  # no verdict, no recipe: the rounds before consolidation are over
    assert [r.name for r, _ in ledger.get_remaining()] == ["consolidation"]
    clock.now += 1.0
    record = ledger.to_dict()
    assert list(record["by_round"]) == ["warm-up", "trials", "final round", "consolidation"]
    assert record["by_round"]["warm-up"] == pytest.approx(
        {"runs": 1, "steps": 3, "builds": 1, "run_s": 5.0, "seconds": 5.0, "max_steps": 3, "max_builds": 1}
    )  # seconds: until the trials round was entered
    trials = record["by_round"]["trials"]
    assert (trials["runs"], trials["steps"], trials["builds"]) == (2, 8 + 5, 4)
    assert trials["run_s"] == pytest.approx(8.8 + 4.4) and trials["seconds"] == pytest.approx(25.7)
    assert (record["by_round"]["final round"]["steps"], record["by_round"]["consolidation"]["runs"]) == (8, 0)
    assert record["total"]["steps"] == 3 + 13 + 8 and record["total"]["builds"] == 1 + 4 + 2
    assert record["total"]["elapsed_s"] == pytest.approx(5.0 + 25.7 + 3.0 + 1.0)
    assert [r["name"] for r in record["runs"]] == ["warmup", "trial_0000", "trial_0001", "trial_0001"]
    assert record["eta_after_first_trial_s"] == pytest.approx(eta)
    table = get_rounds_table(record)
    assert [row[:4] for row in table.rows] == [
        ["warm-up", "1", "3 of 3", "1 of 1"],
        ["trials", "2", "13 of 31", "4 of 7"],
        ["final round", "1", "8 of 48", "2 of 12"],
        ["consolidation", "0", "0 of 1", "0 of 1"],
        ["total", "4", "24", "7"],
    ]
    assert "ETA after the first trial" in table.title


def test_a_failed_run_counts_its_wall_but_no_steps():
    ledger = RoundLedger(rounds=_estimate(_settings(), in_turn=False))
    ledger.observe(
        "trials", TrialResult(status="timeout", out_dir=Path("trials/trial_0002"), metrics=None, wall_s=90.0)
    )
    assert ledger.to_dict()["by_round"] == {}  # no round entered: nothing by round, the run kept
    assert ledger.runs[0].steps == ledger.runs[0].builds == 0 and ledger.runs[0].wall_s == 90.0


def test_search_json_keeps_the_rounds(tmp_path, monkeypatch):
    monkeypatch.setenv(PAIRED_MODELS_ENV, "two")
    ledger = RoundLedger(rounds=_estimate(_settings(), in_turn=False))
    ledger.enter("warm-up")
    ledger.observe("warm-up", _result("warmup", 5.0, pairs=2, builds=1, paired=False))
    ledger.enter("trials")
    ledger.observe("trials", _result("trial_0000", 8.8, pairs=2, builds=2), _spec(4))
    old = SearchRecord.read(ARTIFACTS / "search_v11.json")
    assert old.rounds is None  # an older search recorded none
    record = dataclasses.replace(old, rounds=ledger.to_dict())
    back = SearchRecord.read(record.write(tmp_path / "search.json"))
    assert back.rounds == record.rounds and back.to_dict() == record.to_dict()
    assert back.rounds["by_round"]["trials"]["steps"] == 8 and back.rounds["total"]["builds"] == 3
