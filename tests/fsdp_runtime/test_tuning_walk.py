"""The in-job tuner's decisions (fsdp_runtime/tuning/walk.py, moves.py) on a simulated job: which
config each step runs, what is adopted, and the bounds on what tuning costs. No ranks."""

from __future__ import annotations

import random

import pytest

from fsdp_runtime import RuntimeConfig, UnitConfig, get_structural_differences
from fsdp_runtime.tuning import TuningWalk, get_moves, get_pair_schedule
from fsdp_runtime.tuning.moves import Move

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
    the seed is the product of the adopted ratios."""
    effects = [("forward_prefetch", ["layers.1", "layers.2"], 0.8), ("sync", "last", 0.9)]
    walk = TuningWalk(_seed(), get_moves(_seed(), device_type="cpu"), max_steps=1000)
    _run(walk, effects, steps=1000)
    adopted = [d.name for d in walk.decisions if d.outcome == "adopted"]
    assert adopted == ["forward_prefetch=depth2", "sync=last@all"], [d.describe() for d in walk.decisions]
    assert walk.best.units[0].forward_prefetch == ["layers.1", "layers.2"] and walk.best.units[0].sync == "last"
    assert walk.speedup == pytest.approx(1 / 0.72, rel=0.03)
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
    from fsdp_runtime.tuning import Interval, is_faster

    below, across = Interval(0.85, 0.73, 0.97, 6), Interval(0.95, 0.85, 1.05, 6)
    assert is_faster("faster", None)  # the rule's own call (burst guard included)
    assert is_faster("max_blocks", below) and is_faster("settled", below) and not is_faster("max_blocks", across)
    # stopped for another reason before its last pair: no call, whatever its interval
    assert not is_faster("unlikely", below) and not is_faster("slower", below) and not is_faster("max_blocks", None)
