"""A trial's time limit counts the models it builds, not only its steps ([Note: trial timeouts]):
a trial whose two models are built in turn ([Note: models built in turn]) builds ``n + 2`` of
them, each warmed up, and its limit is priced so."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from autotune.search.context import SearchContext, builds_in_turn
from autotune.search.timeouts import BUILD_FLOOR_S, FACTOR, TrialTimeouts, count_builds, count_steps, count_steps_run
from autotune.trials.metrics import RankMetrics, TrialMetrics, TrialResult
from autotune.trials.sides import PAIRED_MODELS_ENV
from fsdp_runtime import MeshConfig, default_config
from profiles import load_model_profile

BLOCKS = list(load_model_profile("tiny").block_names)
DEFAULTS = default_config(BLOCKS)
STRUCTURAL = dataclasses.replace(DEFAULTS, mesh=MeshConfig(kind="hsdp", replicate=2))
IN_PLACE = dataclasses.replace(
    DEFAULTS, units=[dataclasses.replace(u, reshard_after_forward=False) for u in DEFAULTS.units]
)


def _result(wall_s: float, *, pairs: int, builds: int, models: int, step_ms: float = 100.0) -> TrialResult:
    """A paired trial of ``pairs`` pairs (2 warm-up steps per model built), its steps ``step_ms`` each."""
    rank = RankMetrics(
        rank=0,
        step_ms=[step_ms] * pairs,
        reference_step_ms=[step_ms] * pairs,
        settle_step_ms=[step_ms] * ((pairs + 1) // 2),
        reference_settle_step_ms=[step_ms] * (pairs // 2),
        num_models=models,
        num_builds=builds,
    )
    metrics = TrialMetrics(
        status="ok", model="tiny", world_size=2, backend="gloo", num_warmup=2, ranks=[rank],
        reference_step_ms_per_step=[step_ms] * pairs, step_ms_per_step=[step_ms] * pairs,
        num_models=models, num_builds=builds,
    )  # fmt: skip
    return TrialResult(status="ok", out_dir=None, metrics=metrics, wall_s=wall_s)


def test_builds_and_their_warm_up_steps_are_counted():
    counts = {"num_pairs": 4, "paired": True, "self_paired": False, "profiled": 2}
    assert count_builds(**counts, in_turn=True) == 4 + 2 + 1
    assert count_builds(**counts, in_turn=False) == 2
    assert count_builds(**{**counts, "self_paired": True}, in_turn=True) == 1
    assert count_builds(**{**counts, "paired": False}, in_turn=True) == 1
    assert count_steps(num_warmup=2, **counts, in_turn=True) == 7 * 2 + 3 * 4 + 3  # every build warms up
    assert count_steps(num_warmup=2, **counts) == 2 * 2 + 3 * 4 + 3
    # what a finished in-turn trial ran: 6 builds for 4 pairs, each warmed up
    assert count_steps_run(_result(60.0, pairs=4, builds=6, models=1).metrics) == 6 * 2 + 3 * 4


def test_a_trial_built_in_turn_gets_longer_than_one_build_with_the_same_steps():
    timeouts = TrialTimeouts()
    timeouts.observe(_result(30.0, pairs=4, builds=1, models=1))  # 16 steps of 0.1 s: 28.4 s to its one build
    assert timeouts.build_s == pytest.approx(30.0 - 1.6)
    assert timeouts.rate_s == pytest.approx(30.0 / 16)  # one build's share stays in the rate
    one, in_turn = timeouts.get(40), timeouts.get(40, num_builds=7)
    assert in_turn == pytest.approx(one + FACTOR * 6 * (30.0 - 1.6))
    # a build cost never priced under the floor
    fast = TrialTimeouts()
    fast.observe(_result(1.6, pairs=4, builds=1, models=1))
    assert fast.build_s == BUILD_FLOOR_S
    # an in-turn trial's record teaches the build cost without inflating the step rate
    learnt = TrialTimeouts()
    learnt.observe(_result(6 * 20.0 + 24 * 0.1, pairs=4, builds=6, models=1))  # 24 steps, 6 builds of 20 s
    assert learnt.build_s == pytest.approx(20.0)
    assert learnt.rate_s == pytest.approx((20.0 + 2.4) / 24)
    assert TrialTimeouts(fixed_s=30.0).get(40, num_builds=7) == 30.0


def _context() -> SearchContext:
    settings = SimpleNamespace(
        trial_timeout_s=None, rank_program=None, world_size=2, num_warmup=2, num_measured=6, num_profiled=2,
        seed=0, cluster=None,
    )  # fmt: skip
    ctx = SearchContext(
        study=None, space=None, settings=settings, plan=SimpleNamespace(trial_model="tiny"), reporter=None
    )
    ctx.timeouts.observe(_result(30.0, pairs=4, builds=1, models=1))
    return ctx


def test_a_search_prices_a_trial_s_builds_in_turn(monkeypatch, tmp_path):
    ctx = _context()
    monkeypatch.setenv(PAIRED_MODELS_ENV, "turn")
    assert builds_in_turn(STRUCTURAL, DEFAULTS) and not builds_in_turn(IN_PLACE, DEFAULTS)
    turn = ctx.trial_spec(STRUCTURAL, tmp_path / "a", profile=False, reference=DEFAULTS).timeout_s
    in_place = ctx.trial_spec(IN_PLACE, tmp_path / "b", profile=False, reference=DEFAULTS).timeout_s
    monkeypatch.setenv(PAIRED_MODELS_ENV, "two")
    two = ctx.trial_spec(STRUCTURAL, tmp_path / "c", profile=False, reference=DEFAULTS).timeout_s
    assert not builds_in_turn(STRUCTURAL, DEFAULTS)
    assert two == in_place  # the same steps, a second model: priced as before
    # 8 builds (6 pairs + 2), each warmed up: 12 more warm-up steps and 6 more builds than two models
    rate, build_s = ctx.timeouts.rate_s, ctx.timeouts.build_s
    assert turn == pytest.approx(two + FACTOR * (12 * rate + 6 * build_s))
    assert ctx.get_trial_timeout_s() > 0
    monkeypatch.setenv(PAIRED_MODELS_ENV, "turn")
    assert ctx.get_trial_timeout_s() > turn  # profiled: one build more
