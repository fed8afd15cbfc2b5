"""Refinement ([Note: refinement]): the last trials are neighbours of the incumbent, made from
its runner-ups' knobs first, never a config already measured."""

from __future__ import annotations

import optuna
from _search_fixtures import nosync_params

from autotune.search import SearchSpace
from autotune.search.confirm import get_finalists
from autotune.search.loop import get_config_hash, get_rows
from autotune.search.refine import (
    ORIGIN_ATTR,
    _rank_knob_moves,
    _resolve,
    _value_effects,
    enqueue_neighbour,
    get_candidates,
    get_choices,
    pick_base,
)
from autotune.search.results import pick_best

BLOCKS = tuple(f"layers.{i}" for i in range(4))


def _study_with(space: SearchSpace, trials: list[tuple[dict, float]]) -> optuna.Study:
    """A study holding finished trials with these params and objectives, as the search records them."""
    study = optuna.create_study()
    for i, (params, value) in enumerate(trials):
        study.enqueue_trial(params, user_attrs={"is_default": i == 0})
        trial = study.ask()
        config = space.suggest(trial)
        trial.set_user_attr("config_hash", get_config_hash(config))
        trial.set_user_attr("ratio", value)
        study.tell(trial, value)
    return study


def _space() -> SearchSpace:
    return SearchSpace(block_names=BLOCKS, world_size=2, num_microbatches=4)


def test_the_incumbent_takes_a_runner_ups_knob_first():
    space = _space()
    defaults = space.get_default_params()
    best = {**defaults, "reshard_after_forward": "false"}
    runner_up = nosync_params(defaults, keep_unsharded=True, defer_concat=True)
    study = _study_with(space, [(defaults, 1.0), (best, 0.8), (runner_up, 0.9)])
    rows = get_rows(study)
    candidates = get_candidates(rows, {})
    params, fallback, origin = candidates[0]
    # The runner-up's departure from the defaults comes first (not its reshard_after_forward=true).
    assert params == {**best, "nosync_blocks": "all"} and fallback == runner_up
    assert origin == "trial 1 + nosync_blocks=all from trial 2"
    assert [c[2] for c in candidates[1:3]] == [
        "trial 1 + reshard_after_forward=true from trial 2",
        "trial 1 + reshard_after_forward=true from trial 0",
    ]

    origin = enqueue_neighbour(study, space, rows, get_config_hash)
    assert origin == "trial 1 + nosync_blocks=all from trial 2"
    queued = study.ask()
    # The knobs that only matter once blocks skip sync came from the donor.
    config = space.suggest(queued)
    assert queued.params == nosync_params(best, keep_unsharded=True, defer_concat=True)
    assert queued.user_attrs[ORIGIN_ATTR] == origin
    assert all(u.sync == "last" and u.reshard_after_forward is False for u in config.units if u.name != "root")


def test_measured_neighbours_are_skipped_then_one_knob_moves():
    space = _space()
    defaults = space.get_default_params()
    best = {**defaults, "reshard_after_forward": "false"}
    runner_up = {**defaults, "reduce_scatter_buffers": 2}
    combined = {**best, "reduce_scatter_buffers": 2}  # the donor move, already measured
    study = _study_with(space, [(defaults, 1.0), (best, 0.8), (runner_up, 0.9), (combined, 0.85)])
    rows = get_rows(study)
    origin = enqueue_neighbour(study, space, rows, get_config_hash)
    # Donor moves from trials 2 and 3 give configs measured already (3 is best + runner-up's knob;
    # 0's knob gives 0 back): the first one-knob move of the incumbent is next.
    assert origin is not None and "from trial" not in origin and origin.startswith("trial 1 + ")
    queued = study.ask()
    assert get_config_hash(space.suggest(queued)) not in {
        t.user_attrs.get("config_hash") for t in study.trials if t.number != queued.number
    }
    # While a neighbour waits, no second one is queued.
    study.enqueue_trial(best)
    assert enqueue_neighbour(study, space, get_rows(study), get_config_hash) == "queued"
    assert len(study.get_trials(states=(optuna.trial.TrialState.WAITING,))) == 1


def test_no_incumbent_no_neighbour():
    space = _space()
    study = optuna.create_study()
    assert enqueue_neighbour(study, space, get_rows(study), get_config_hash) is None


def _rows_with_a_lucky_incumbent(space: SearchSpace):
    """Trial 1 led on one lucky window (0.736, upper quartile 0.761); refinement trial 3, the
    incumbent + a donor's knob, measured 0.755: a tie within trial 1's own noise (the
    ``search_noise`` seed-1 run); refinement trial 4 measured clearly worse (0.79)."""
    defaults = space.get_default_params()
    lucky = nosync_params(defaults, "second_half", keep_unsharded=False, defer_concat=False)
    donor = nosync_params(defaults, keep_unsharded=False, defer_concat=False, reshard_after_forward="false")
    stacked = {**lucky, "nosync_blocks": "all"}
    worse = {**lucky, "reduce_scatter_buffers": 2}
    study = _study_with(space, [(defaults, 1.0), (lucky, 0.736), (donor, 0.75), (stacked, 0.755), (worse, 0.79)])
    rows = get_rows(study)
    rows[1].ratio_q25, rows[1].ratio_q75 = 0.713, 0.761
    rows[3].refined_from = "trial 1 + nosync_blocks=all from trial 2"
    rows[4].refined_from = "trial 1 + reduce_scatter_buffers=2"
    return rows


def test_a_move_that_ties_with_the_incumbent_becomes_the_base():
    space = _space()
    rows = _rows_with_a_lucky_incumbent(space)
    assert pick_best(rows).number == 1 and pick_base(rows).number == 3
    candidates = get_candidates(rows, {})
    # Neighbours stack on the tie: trial 3 (no sync on all blocks) + the incumbent's knobs and the donor's.
    assert candidates and all(origin.startswith("trial 3 + ") for _, _, origin in candidates)
    # The incumbent's own knob (second half) gives trial 1 back, measured: the enqueue skips it.
    assert candidates[0][0] == rows[1].params
    assert candidates[1][0] == {**rows[3].params, "reshard_after_forward": "false"}
    # A move over the incumbent's upper quartile (0.761) is no base: trial 4 (0.79) never was, nor is trial 3 at 0.77.
    rows[3].ratio = 0.77
    assert pick_base(rows).number == 1


def test_the_last_base_is_a_finalist():
    space = _space()
    rows = _rows_with_a_lucky_incumbent(space)
    assert [r.number for r in get_finalists(rows, 1)] == [1, 3]
    assert [r.number for r in get_finalists(rows, 3)] == [1, 2, 3]


def test_an_unmeasured_value_of_a_knob_that_pays_is_moved_early():
    """The ``search_noise`` seed-1 case: every trial that skipped gradient sync did so on every
    second block, and "all blocks" was never sampled. That move ranks among the base's first
    one-knob moves, and every second refinement trial is such a move, not a donor's."""
    space = _space()
    defaults = space.get_default_params()
    every_2nd = nosync_params(defaults, "every_2nd", keep_unsharded=False, defer_concat=True)
    best = {**every_2nd, "reshard_after_forward": "false"}
    buffers = {**defaults, "reduce_scatter_buffers": 2}
    study = _study_with(space, [(defaults, 1.0), (every_2nd, 0.8), (best, 0.78), (buffers, 0.99)])
    rows = get_rows(study)
    choices = get_choices(study)
    candidates = get_candidates(rows, choices)
    assert "from trial" in candidates[0][2]  # turn 0: a donor's knob first
    moves = [c[2] for c in candidates if "from trial" not in c[2]]
    # Never-measured values of the two knobs whose fitted effects differ most come first: no-sync
    # blocks (trial 1 against the defaults: 1.0 -> 0.8), then reshard after forward (trial 2
    # against trial 1: 0.8 -> 0.78); moving back to a value measured worse comes last.
    assert moves[:4] == [
        "trial 2 + nosync_blocks=all",
        "trial 2 + nosync_blocks=first_half",
        "trial 2 + nosync_blocks=second_half",
        "trial 2 + reshard_after_forward=last_block_false",
    ]
    assert moves[-2:] == ["trial 2 + reshard_after_forward=true", "trial 2 + nosync_blocks=none"]
    # Once one refinement trial ran (measured worse, so the base stays), the base's own move comes first.
    rows[3].refined_from = "trial 2 + reduce_scatter_buffers=2 from trial 3"
    assert get_candidates(rows, choices)[0][2] == "trial 2 + nosync_blocks=all"


def test_a_move_to_hsdp_keeps_the_sync_levels_it_had():
    space = SearchSpace(block_names=BLOCKS, world_size=4, num_microbatches=4, root_knobs=True)
    defaults = space.get_default_params()
    best = nosync_params(
        defaults,
        keep_unsharded=True,
        defer_concat=True,
        root_reshard_after_forward="false",
        root_sync_fsdp="last",
        root_keep_unsharded=True,
    )
    study = _study_with(space, [(defaults, 1.0), (best, 0.7)])
    rows = get_rows(study)
    move = next(
        (p, f) for p, f, origin in get_candidates(rows, get_choices(study)) if origin == "trial 1 + mesh=hsdp:2x2"
    )
    used, config = _resolve(space, *move)
    # Not the first choices (every microbatch): the levels of the FSDP knobs the base had.
    assert used["mesh"] == "hsdp:2x2" and used["root_sync_hsdp"] == "last" and used["nosync_level_hsdp"] == "last"
    assert all(u.sync == "last" for u in config.units)


def test_a_value_sampled_with_slow_knobs_is_not_blamed_for_them():
    """The ``search_noise`` run-3 case: the trials holding ``root_reshard_after_forward = false``
    were slow for other reasons (no skipped sync, a bad prefetch), so its median objective was
    the worst, though the one trial that can tell (trial 4: the incumbent with that value and a
    prefetch trial 5 shows is slow) says it pays. The joint fit ranks the move back to it first
    among the moves to measured values; by marginal medians it came last."""
    space = SearchSpace(block_names=BLOCKS, world_size=2, num_microbatches=4, root_knobs=True)
    defaults = space.get_default_params()
    nosync = nosync_params(defaults, keep_unsharded=True, defer_concat=True)
    best = {**nosync, "root_reshard_after_forward": "true"}
    study = _study_with(
        space,
        [
            (defaults, 1.0),
            (best, 0.70),
            ({**best, "reshard_after_forward": "false"}, 0.72),
            ({**defaults, "reduce_scatter_buffers": 2}, 0.99),
            ({**nosync, "forward_prefetch": "depth2"}, 0.71),  # root_reshard_after_forward = false, the default
            ({**defaults, "forward_prefetch": "depth2"}, 1.08),
        ],
    )
    rows = get_rows(study)
    choices = get_choices(study)
    effects = _value_effects(rows)
    assert effects[("root_reshard_after_forward", "false")] < effects[("root_reshard_after_forward", "true")]
    assert effects[("forward_prefetch", "depth2")] > effects[("forward_prefetch", "implicit")]
    moves = _rank_knob_moves(pick_base(rows), rows, choices)
    measured = [m for m in moves if m in effects]
    assert measured[0] == ("root_reshard_after_forward", "false"), measured
