"""The in-job tuner's decisions (fsdp_runtime/tuning/walk.py, moves.py) on a simulated job: which
config each step runs, what is adopted, and the bounds on what tuning costs. No ranks."""

from __future__ import annotations

import random

import pytest

from fsdp_runtime import RuntimeConfig, UnitConfig, get_structural_differences
from fsdp_runtime.tuning import TuningWalk, get_interval, get_moves, get_pair_schedule
from fsdp_runtime.tuning.moves import Move
from fsdp_runtime.tuning.walk import FINAL_WINDOW

BLOCKS = [f"layers.{i}" for i in range(4)]


def _seed(num_microbatches: int = 2) -> RuntimeConfig:
    return RuntimeConfig(
        units=[*(UnitConfig(name=b) for b in BLOCKS), UnitConfig(name="root")], num_microbatches=num_microbatches
    )


Effects = list[tuple[str, object, float]]
"""(knob of the first block, value, factor on the step): a simulated job's response to the knobs."""


def _step_ms(config: RuntimeConfig, rng: random.Random, *, effects: Effects) -> float:
    """100 ms, times each effect whose knob the config holds on its first block; +-1% noise."""
    factor = 1.0
    for field, value, effect in effects:
        if getattr(config.units[0], field) == value:
            factor *= effect
    return 100.0 * factor * rng.uniform(0.99, 1.01)


def _run(walk: TuningWalk, effects: Effects, *, steps: int = 400, seed: int = 0) -> list[str | None]:
    """Run the walk as a job would; the candidate (or None) of every step."""
    rng, names = random.Random(seed), []
    for _ in range(steps):
        config, name = walk.plan()
        names.append(name)
        walk.record(_step_ms(config, rng, effects=effects))
        if walk.done:
            break
    return names


def test_the_walk_adopts_what_is_faster_keeps_it_and_leaves_ties():
    """A move 20% faster and one 10% faster on top of it are adopted; ties are not; the speedup over
    the seed is measured by the final window (the product of the adopted ratios kept beside it)."""
    effects = [("forward_prefetch", ["layers.1", "layers.2"], 0.8), ("sync", "last", 0.9)]
    walk = TuningWalk(_seed(), get_moves(_seed(), device_type="cpu"), max_steps=1000)
    _run(walk, effects, steps=1000)
    adopted = [d.name for d in walk.decisions if d.outcome == "adopted"]
    assert adopted == ["forward_prefetch=depth2", "sync=last@all"], [d.describe() for d in walk.decisions]
    assert walk.best.units[0].forward_prefetch == ["layers.1", "layers.2"] and walk.best.units[0].sync == "last"
    assert walk.speedup == pytest.approx(1 / 0.72, rel=0.03) and walk.speedup_measured
    assert walk.adopted_product == pytest.approx(1 / 0.72, rel=0.03)
    low, high = walk.speedup_interval
    assert low < walk.speedup < high and walk.decisions[-1].outcome == "final"
    # every other move that changed the config was measured and left (a tie is not a speedup)
    assert all(d.outcome != "adopted" for d in walk.decisions if d.name not in adopted)
    assert walk.done and walk.candidate is None


def test_each_candidate_runs_the_search_s_pair_schedule_against_the_best():
    """[Note: in-job measurement]: the steps of a candidate are the pair schedule's, candidate first
    (the best stepped last), a settle step after every switch; the warm-up steps run the seed."""
    walk = TuningWalk(_seed(), get_moves(_seed(), device_type="cpu"), max_steps=1000, num_pairs=4, warmup_steps=3)
    names = _run(walk, [], steps=3 + 12)
    schedule = get_pair_schedule(4, first="candidate", last="reference")
    assert names[:3] == [None] * 3
    first = walk.decisions[0] if walk.decisions else None
    ran = names[3 : first.step if first else None]  # the first candidate's steps, up to its decision
    assert [name is not None for name in ran] == [s.side == "candidate" for s in schedule][: len(ran)]
    assert len(ran) >= 6 and len({name for name in ran if name}) == 1  # two pairs at least: a block


def test_a_candidate_step_over_the_slow_bound_ends_it_at_once():
    """With the best's steps known, a candidate's first step (its settle step) over 1.5x their median
    ends it; before any (no warm-up, the first candidate) its first pair is measured, then it ends."""
    effects = [("reshard_after_forward", False, 3.0)]
    moves = [m for m in get_moves(_seed(), device_type="cpu") if m.name.startswith("reshard_after_forward")]
    walk = TuningWalk(_seed(), moves, max_steps=1000, warmup_steps=0)
    names = _run(walk, effects)
    first, second = walk.decisions[:2]
    assert (first.name, first.outcome) == ("reshard_after_forward=False@all", "too slow")
    assert [round(r) for r in first.ratios] == [3]
    assert (second.name, second.outcome, second.ratios) == ("reshard_after_forward=False@all_but_last", "too slow", [])
    assert names[first.step : second.step].count(second.name) == 1  # its settle step alone
    assert walk.best == _seed() and walk.done  # the last move (none) is the seed: skipped


def test_a_failed_candidate_is_never_tried_again():
    """A move that fails is dropped; the same config reached again by another move is skipped."""
    same = Move("again", lambda c: get_moves(_seed(), device_type="cpu")[1].apply(c))
    moves = [get_moves(_seed(), device_type="cpu")[1], same]  # forward_prefetch=depth1, twice
    walk = TuningWalk(_seed(), moves, warmup_steps=0)
    config, name = walk.plan()
    assert name == "forward_prefetch=depth1" and config != _seed()
    decision = walk.record(100.0, failed=True)
    assert (decision.outcome, walk.failed) == ("failed", ["forward_prefetch=depth1"])
    assert walk.plan() == (_seed(), None) and walk.done
    # a switch that raises drops the candidate the same way
    walk = TuningWalk(_seed(), moves[:1], warmup_steps=0)
    walk.plan()
    assert walk.fail_switch().outcome == "failed" and walk.plan() == (_seed(), None)
    # one the tuner refuses (no headroom) is dropped under that outcome, not counted as failed
    walk = TuningWalk(_seed(), moves[:1], warmup_steps=0)
    walk.plan()
    assert walk.fail_switch("no headroom").outcome == "no headroom" and walk.failed == []
    assert walk.plan() == (_seed(), None) and walk.done


def test_tuning_stops_after_its_steps_and_a_candidate_cut_short_is_not_adopted():
    """20% faster, but its one block (two pairs) cannot be called faster (a burst could reach both):
    eight steps end it before its second block, and the seed stays."""
    effects = [("forward_prefetch", ["layers.1"], 0.8)]  # depth1: the first move
    walk = TuningWalk(_seed(), get_moves(_seed(), device_type="cpu"), max_steps=8, warmup_steps=2)
    names = _run(walk, effects)
    assert walk.done and walk.step == 10 and len(names) == 10
    (cut,) = walk.decisions
    assert (cut.name, cut.outcome, len(cut.ratios)) == ("forward_prefetch=depth1", "out of steps", 2)
    assert cut.ratio == pytest.approx(0.8, rel=0.03) and walk.best == _seed() and walk.speedup == 1.0
    assert walk.plan() == (_seed(), None)


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_every_move_switches_in_place(num_microbatches):
    """[Note: in-job moves]: the moves touch only knobs a sharded model switches in place; sync,
    reshard after backward and concat deferral only under accumulation; the root is left as it is."""
    seed = _seed(num_microbatches)
    moves = get_moves(seed, device_type="cpu")
    names = [m.name for m in moves]
    assert any(n.startswith("sync=") for n in names) == (num_microbatches > 1)
    assert not any(n.startswith("unshard_async") for n in names)  # CUDA only
    for move in moves:
        moved = move.apply(seed)
        assert get_structural_differences(seed, moved) == [], move.name
        assert moved.units[-1] == seed.units[-1], move.name
    assert len(set(names)) == len(names)


def test_a_measurement_ends_faster_on_an_early_call_or_on_the_interval_of_all_its_pairs():
    from fsdp_runtime.tuning import Interval, StoppingRule, get_rule_interval, is_faster

    rule = StoppingRule(max_blocks=3, noise_sd=0.05, noise_df=24)
    ratios = [0.84, 0.86, 0.85, 0.83, 0.86, 0.85]
    below, across = get_rule_interval(rule, ratios), Interval(0.95, 0.85, 1.05, 6)
    assert below.high < 1.0

    def faster(stopped, interval):
        return is_faster(stopped, interval, pair_ratios=ratios)

    assert faster("faster", None)  # the rule's own call (burst guard included)
    assert faster("max_blocks", below) and faster("settled", below) and not faster("max_blocks", across)
    # stopped for another reason before its last pair: no call, whatever its interval
    assert not faster("unlikely", below) and not faster("slower", below) and not faster("max_blocks", None)


def test_a_window_of_one_block_never_emits_however_tight_and_far_below_one():
    """Two pairs, settled: one burst over the reference's two adjacent steps slows both alike, so
    the window shows no spread and a settled interval wholly below 1 for a tie ([Note: burst
    windows]); the call on the interval alone, as it was, emitted it."""
    from fsdp_runtime.tuning import (
        StoppingRule,
        decide,
        get_burst_windows,
        get_pair_schedule,
        get_rule_interval,
        is_faster,
    )

    rule = StoppingRule(max_blocks=2, noise_sd=0.03, noise_df=24)  # a quiet box's pooled spread
    # the candidate leading (a warm reference): c0 r0 r1 c1, its two reference steps adjacent
    windows = get_burst_windows(get_pair_schedule(2, first="candidate"))
    burst = [0.80, 0.81]  # a tie whose two reference steps one 1.25x burst slowed
    interval = get_rule_interval(rule, burst)
    assert decide(rule, burst, windows) == "settled" and interval.high < 1.0
    assert not is_faster("settled", interval, pair_ratios=burst)
    # a second block, which that burst does not reach, agreeing: the call holds
    four = [0.80, 0.81, 0.80, 0.81]
    assert is_faster("max_blocks", get_rule_interval(rule, four), pair_ratios=four)


def _depth1() -> Move:
    return get_moves(_seed(), device_type="cpu")[1]  # forward_prefetch=depth1


def _drive(walk: TuningWalk, step_ms, *, steps: int = 400) -> list[tuple[str | None, RuntimeConfig, bool]]:
    """Run the walk on ``step_ms(config, name, in_final_window)``; per step its name, config and whether
    it ran in the final window."""
    ran = []
    while not walk.done and len(ran) < steps:
        config, name = walk.plan()
        in_final = walk.final is not None
        ran.append((name, config, in_final))
        walk.record(step_ms(config, name, in_final))
    return ran


def _twice_as_fast_then(seed_ms: float, best_ms: float, settle_ms: float = 100.0):
    """depth1 runs in 50 ms against the seed's 100 (a 2x product); the final window's seed steps take
    ``seed_ms`` +-2% (alternating), its best's ``best_ms``, and the first step after a switch ``settle_ms``."""
    state = {"last": None, "k": 0}

    def step_ms(config: RuntimeConfig, name: str | None, in_final: bool) -> float:
        switched, state["last"] = state["last"] is not None and state["last"] != name, name
        if not in_final:
            return 100.0 if config == _seed() else 50.0
        if switched:
            return settle_ms
        state["k"] += 1
        return seed_ms * (1.02 if state["k"] % 2 else 0.98) if name == FINAL_WINDOW else best_ms

    return step_ms


def test_the_final_window_runs_the_seed_against_the_best_on_the_pair_schedule_to_its_end():
    """[Note: final window]: once no move is left, the best (depth1) and the seed alternate in the pair
    schedule, the seed first and named FINAL_WINDOW, the best named None; every pair runs (no early
    call), settle steps are not measured and a seed step 10x the best's ends nothing (no slow bound);
    the walk is done only after it."""
    walk = TuningWalk(_seed(), [_depth1()], num_pairs=4, warmup_steps=0)
    ran = _drive(walk, _twice_as_fast_then(seed_ms=80.0, best_ms=64.0, settle_ms=1000.0))
    final = [(name, config) for name, config, in_final in ran if in_final]
    schedule = get_pair_schedule(4, first="candidate", last="reference")
    assert [name for name, _ in final] == [FINAL_WINDOW if s.side == "candidate" else None for s in schedule]
    assert all(config == (_seed() if name else walk.best) for name, config in final) and walk.best != _seed()
    assert [d.outcome for d in walk.decisions] == ["adopted", "final"] and walk.done
    assert walk.decisions[-1].step == walk.step and len(walk.decisions[-1].ratios) == 4
    assert walk.speedup == pytest.approx(1.25, rel=0.01)  # the settle steps' 1000 ms not in it
    assert walk.plan() == (walk.best, None)


def test_the_reported_speedup_is_the_final_window_s_own_not_the_adopted_product():
    """The candidate's pairs say 2x; the final window's steps say 1.25x: the speedup and its interval
    are the window's (its pairs alone, no pool yet), the product stays beside it for the log."""
    walk = TuningWalk(_seed(), [_depth1()], num_pairs=4, warmup_steps=0)
    _drive(walk, _twice_as_fast_then(seed_ms=80.0, best_ms=64.0))
    final = walk.decisions[-1]
    assert all(r == pytest.approx(1.25, rel=0.03) for r in final.ratios)
    assert walk.speedup == pytest.approx(1.25, rel=0.01) and walk.speedup_measured
    assert walk.adopted_product == pytest.approx(2.0)
    expected = get_interval(final.ratios)
    assert walk.speedup_interval == final.interval == pytest.approx((expected.low, expected.high))
    assert expected.low < 1.25 < expected.high and expected.high - expected.low > 0.01
    assert f"{walk.speedup:.3f}x the seed's speed over 4 pairs (90% interval {expected.low:.3f}-" in final.describe()


def test_no_final_window_where_nothing_was_adopted():
    """Ties only: the walk is done after its last move, no step runs the seed as FINAL_WINDOW, and the
    speedup is 1.0 by definition, unmeasured and without an interval."""
    walk = TuningWalk(_seed(), get_moves(_seed(), device_type="cpu")[:3], num_pairs=4, warmup_steps=0)
    ran = _drive(walk, lambda config, name, in_final: 100.0)
    assert walk.done and walk.best == _seed() and FINAL_WINDOW not in [name for name, _, _ in ran]
    assert all(d.outcome not in ("adopted", "final") for d in walk.decisions)
    assert (walk.speedup, walk.speedup_measured, walk.speedup_interval) == (1.0, False, None)


def test_the_final_window_follows_max_steps_which_bound_the_walk_not_the_window():
    """depth1 adopted at the last of max_steps: the next move is never tried, the window still runs."""
    probe = TuningWalk(_seed(), [_depth1()], num_pairs=4, warmup_steps=0)
    _drive(probe, _twice_as_fast_then(80.0, 64.0))
    adopted_at = probe.decisions[0].step
    walk = TuningWalk(_seed(), [_depth1(), get_moves(_seed(), device_type="cpu")[2]], num_pairs=4, warmup_steps=0)
    walk.max_steps = adopted_at
    ran = _drive(walk, _twice_as_fast_then(80.0, 64.0))
    assert [d.outcome for d in walk.decisions] == ["adopted", "final"]
    window = get_pair_schedule(4, first="candidate", last="reference")
    assert len(ran) == adopted_at + len(window) and walk.speedup_measured


@pytest.mark.parametrize("how", ["step", "switch", "no headroom"])
def test_a_failed_final_window_gives_no_figure_and_keeps_the_best(how):
    """A failed seed step (or switch to the seed) ends the window: no measured speedup (the product,
    flagged unmeasured, no interval), the best stays, the seed is not counted as a failed move."""
    walk = TuningWalk(_seed(), [_depth1()], num_pairs=4, warmup_steps=0)
    step_ms = _twice_as_fast_then(80.0, 64.0)
    for _ in range(100):  # up to the final window's first step
        planned = walk.plan()
        if walk.final is not None:
            break
        walk.record(step_ms(*planned, False))
    for _ in range(5):  # c_s c0 r_s r0 r1: the window's first pair and the best's first of the second
        walk.record(step_ms(*walk.plan(), True))
    assert walk.plan()[1] == FINAL_WINDOW and not walk.done and len(walk.final.ratios) == 1
    if how == "step":
        decision, outcome = walk.record(100.0, failed=True), "failed"
    else:
        outcome = "failed" if how == "switch" else how
        decision = walk.fail_switch(outcome)
    assert (decision.name, decision.outcome, decision.interval) == (FINAL_WINDOW, outcome, None)
    assert walk.done and walk.best != _seed() and walk.failed == []
    assert (walk.speedup, walk.speedup_measured, walk.speedup_interval) == (pytest.approx(2.0), False, None)
    assert "the speedup is not measured" in decision.describe()
    assert walk.plan() == (walk.best, None)


def test_the_final_window_s_interval_pools_the_box_s_noise_as_a_decision_does():
    """Three ties measured at +-5% give the walk a pooled noise; a quieter final window (+-0.5%) takes
    its interval with that pool (wider than its own pairs'), as a decision's interval does."""
    by_name = {m.name: m for m in get_moves(_seed(), device_type="cpu")}
    names = ["backward_prefetch=depth1", "backward_prefetch=depth2", "reshard_after_forward=False@all"]
    walk = TuningWalk(_seed(), [*(by_name[n] for n in names), _depth1()], num_pairs=4, warmup_steps=0)
    rng, k = random.Random(1), iter(range(1000))

    def step_ms(config: RuntimeConfig, name: str | None, in_final: bool) -> float:
        if in_final:
            return (80.0 if name else 64.0) * (1.005 if next(k) % 2 else 0.995)
        return (50.0 if config.units[0].forward_prefetch == ["layers.1"] else 100.0) * rng.uniform(0.95, 1.05)

    _drive(walk, step_ms)
    assert [d.outcome for d in walk.decisions][-2:] == ["adopted", "final"] and walk.noise.get() is not None
    final = walk.decisions[-1]
    pooled, own = get_interval(final.ratios, *walk.noise.get()), get_interval(final.ratios)
    assert walk.speedup_interval == pytest.approx((pooled.low, pooled.high))
    assert pooled.high - pooled.low > 2 * (own.high - own.low)


def test_a_best_the_final_window_measures_slower_than_the_seed_is_reverted_to_the_seed():
    """The candidate's pairs said 2x, the final window says the seed runs 0.8x the best's step (its
    interval wholly below 1): the walk goes back to the seed, speedup 1.0, unmeasured."""
    walk = TuningWalk(_seed(), [_depth1()], num_pairs=4, warmup_steps=0)
    _drive(walk, _twice_as_fast_then(seed_ms=64.0, best_ms=80.0))
    final = walk.decisions[-1]
    assert final.outcome == "reverted" and final.interval[1] < 1.0
    assert walk.best == _seed() and walk.done and (walk.speedup, walk.speedup_measured) == (1.0, False)
    assert "slower than the seed, so the seed runs on" in final.describe()
