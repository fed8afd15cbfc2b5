"""Refinement: the last trials of a search recombine and nudge the best configs found so far.

[Note: refinement]
A dozen TPE trials over ~9 categorical knobs sample little more than at random: two
TPE-only searches of one workload (``studies/search_noise.py``, small, 4 microbatches, 12
trials) emitted configs measured at 1.23x and 1.12x the defaults, each holding some of the knobs
that pay (one skipped gradient sync on all blocks and kept them unsharded, the other only
on the second half). So the last ``num_refine`` trials of a search are not sampled: each
is a neighbour of the incumbent (the best trial so far, :func:`pick_best`):

1. donor moves: the incumbent with one knob taken from a runner-up (the next best trials in
   order), so knobs that different trials found are combined: first the runner-ups'
   departures from the defaults (what they found), then their other differences;
2. knob moves: the incumbent with one knob moved to another of its choices.

The two kinds take turns (even refinement trials a donor move, odd ones a knob move; each
kind falls back to the other when it has nothing unmeasured left). Knob moves are ranked by
the evidence of the finished trials: an additive model of the log objective, one effect per
(knob, value), fitted to all finished trials by ridge regression (``RIDGE``; about 15 trials
over about 30 values, so it is underdetermined without the penalty), each knob's columns
centred over the trials that used it so that a conditional knob explains only the
differences between its own values. A move's expected change is the new value's effect
minus the current one's; a value no trial holds is taken optimistically, as good as the
knob's best measured value is over its worst (the spread of its values' effects), so the
unexplored values of the knobs that matter come first.

Why a joint fit and not each value's median objective: TPE samples knobs together, so a
value's marginal median carries the other knobs it happened to be sampled with. In three
``search_noise`` studies the trials holding ``root_reshard_after_forward = false`` were
slower for other reasons (median 0.824 vs 0.804, 0.809 vs 0.759, 0.872 vs 0.709): ranked by
medians, that move comes last and is never tried, although a hand-written config with it beat
every emitted one by 1.4-3.1% head to head
(``test_a_value_sampled_with_slow_knobs_is_not_blamed_for_them``; docs/studies.md, "Search noise",
has those studies). Why unmeasured values first: a short TPE phase
can miss the value that pays most altogether. In a ``search_noise`` study (seed 1, 18
trials, whole default space) no trial sampled "no sync on all blocks", every donor carried
"no sync on every second block", and six refinement trials of donor moves then knob moves in
the space's order never reached it (``test_an_unmeasured_value_of_a_knob_that_pays_is_moved_early``).

The incumbent's lead is often luck: the best of a dozen noisy medians is biased low. In
``search_noise`` (18 trials, a busy loop on one core) trial 2 measured 0.736 and 0.793 when
re-measured; all six refinement trials were "trial 2 + one knob", each measured worse than
its lucky 0.736, so the two moves that paid (no sync on all blocks, keep unsharded) were
never combined. So moves that did not hurt are stacked (:func:`pick_base`): the base of the
next neighbour is the latest refinement trial whose median lies within the incumbent's
upper quartile (a tie within the incumbent's own noise), else the incumbent. A move
measured worse than a lucky incumbent is not ruled out: it is tried again from the next
base when its turn comes (keep unsharded was neutral from trial 2, and pays with no sync on
all blocks). The last base is a finalist of the final round even where its median is not
among the best few.

A knob that only matters under the new value (e.g. the sync level once a block skips
sync) takes the donor's value, else the incumbent's, else the same knob's value under the
other mesh kind (a move from FSDP to HSDP keeps the root's and the blocks' sync levels: in
``search_noise`` seed 2 the move to HSDP 2x1 fell back to syncing the root every microbatch
and measured worse than its base), else its first choice. A neighbour
whose effective config was already measured (same ``config_hash``) is skipped. The chosen
neighbour is enqueued with ``study.enqueue_trial``: Optuna still owns the trial, its
parameters and storage, and the next ``ask()`` (of whichever worker comes first) gets it.
When the incumbent has no unmeasured neighbour left, the sampler samples as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import optuna

from autotune.search.results import TrialRow, pick_best
from autotune.search.space import SearchSpace
from fsdp_runtime import RuntimeConfig

MAX_DONORS = 3
"""Runner-ups the incumbent takes knobs from, best first."""
ORIGIN_ATTR = "refined_from"
"""User attribute of an enqueued neighbour: how it was made (``trial 5 + keep_unsharded=True from trial 3``)."""


SIBLINGS = {
    "nosync_level_fsdp": "nosync_level_hsdp",
    "nosync_level_hsdp": "nosync_level_fsdp",
    "root_sync_fsdp": "root_sync_hsdp",
    "root_sync_hsdp": "root_sync_fsdp",
}
"""The same knob under the other mesh kind: a move from FSDP to HSDP keeps the sync levels it had."""


class _ParamsTrial:
    """Answers :meth:`SearchSpace.suggest`'s questions from a dict (an ``optuna.Trial`` stand-in):
    a knob the dict lacks takes ``fallback``'s value, else its sibling's under the other mesh
    kind (``SIBLINGS``), else its first choice."""

    def __init__(self, params: dict[str, Any], fallback: dict[str, Any]) -> None:
        self.params, self.fallback = params, fallback
        self.used: dict[str, Any] = {}

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        sibling = SIBLINGS.get(name, "")
        options = [d[key] for key in (name, sibling) for d in (self.params, self.fallback) if key in d]
        # e.g. a reshard choice that only exists for another shard size, or replica_last under FSDP
        value = next((v for v in options if v in choices), choices[0])
        self.used[name] = value
        return value


def _resolve(
    space: SearchSpace, params: dict[str, Any], fallback: dict[str, Any]
) -> tuple[dict[str, Any], RuntimeConfig]:
    """The parameters ``space.suggest`` would consume for ``params``, and the config they make."""
    trial = _ParamsTrial(params, fallback)
    config = space.suggest(trial)  # type: ignore[arg-type]
    return trial.used, config


def _ties(row: TrialRow, best: TrialRow) -> bool:
    """``row``'s median lies within ``best``'s upper quartile: the two are not told apart by
    ``best``'s own pairs (without quartiles, only an equal objective ties)."""
    assert row.objective is not None and best.objective is not None
    upper = best.ratio_q75 if best.ratio is not None and best.ratio_q75 is not None else best.objective
    return row.objective <= upper


def _usable(rows: list[TrialRow]) -> list[TrialRow]:
    return [r for r in rows if r.succeeded and r.feasible and r.duplicate_of is None and r.objective is not None]


def pick_base(rows: list[TrialRow]) -> TrialRow | None:
    """The config the next neighbour departs from ([Note: refinement]): the latest refinement
    trial after the incumbent that ties with it, else the incumbent."""
    best = pick_best(rows)
    if best is None:
        return None
    tied = [r for r in _usable(rows) if r.refined_from is not None and r.number > best.number and _ties(r, best)]
    return max(tied, key=lambda r: r.number) if tied else best


RIDGE = 0.1
"""Ridge penalty of the per-value effects ([Note: refinement]): as a Gaussian prior, the noise
variance over the effects' prior variance, (0.03 / 0.1)^2 ~ 0.1: a trial's log objective is
good to ~3% (its pairs' spread in ``search_noise``), and the knobs that matter move it by ~10%
or more."""


def _value_effects(rows: list[TrialRow]) -> dict[tuple[str, Any], float]:
    """Each (knob, value)'s effect on the log objective: a ridge fit of an additive model over all
    finished trials ([Note: refinement]). Knobs a trial did not use (conditional ones) add nothing.
    Written here rather than taken from a library: it is one linear solve in numpy, not worth
    a regression package as a dependency."""
    usable = _usable(rows)
    keys = sorted({(name, value) for r in usable for name, value in r.params.items()}, key=repr)
    if not usable or not keys:
        return {}
    column = {key: j for j, key in enumerate(keys)}
    x = np.zeros((len(usable), len(keys)))
    for i, r in enumerate(usable):
        for item in r.params.items():
            x[i, column[item]] = 1.0
    y = np.log([r.objective for r in usable])  # type: ignore[arg-type]
    # Each knob's columns are centred over the trials that used it: a knob then explains only
    # the differences between its values, not its own presence (a conditional knob is present
    # exactly where its parent has a value, e.g. keep_unsharded where some block skips sync,
    # and would otherwise take a share of the parent's effect). The intercept is not
    # penalized: centre y, then solve (X'X + RIDGE I) b = X'y.
    for name in {name for name, _ in keys}:
        columns = [j for (knob, _), j in column.items() if knob == name]
        present = [i for i, r in enumerate(usable) if name in r.params]
        x[np.ix_(present, columns)] -= x[np.ix_(present, columns)].mean(axis=0)
    y -= y.mean()
    effects = np.linalg.solve(x.T @ x + RIDGE * np.eye(len(keys)), x.T @ y)
    return {key: float(effects[j]) for key, j in column.items()}


def _rank_knob_moves(base: TrialRow, rows: list[TrialRow], choices: dict[str, Sequence[Any]]) -> list[tuple[str, Any]]:
    """The base's one-knob moves, the most promising first ([Note: refinement]): the expected
    change of the log objective, from the fitted per-value effects."""
    effects = _value_effects(rows)
    scored = []
    for name, current in base.params.items():
        options = choices.get(name, ())
        seen = [effects[(name, v)] for v in options if (name, v) in effects]
        spread = max(seen) - min(seen) if seen else 0.0
        for index, value in enumerate(options):
            if value == current:
                continue
            if (name, value) in effects and (name, current) in effects:
                gain = effects[(name, value)] - effects[(name, current)]
            else:  # never measured: optimistic, as far as the knob's measured values differ
                gain = -spread
            scored.append((gain, name, index, value))
    return [(name, value) for _, name, _, value in sorted(scored, key=lambda s: s[:3])]


def get_candidates(
    rows: list[TrialRow], choices: dict[str, Sequence[Any]]
) -> list[tuple[dict[str, Any], dict[str, Any], str]]:
    """Neighbours of the base, in the order of [Note: refinement]: (params, fallback, origin)."""
    base = pick_base(rows)
    if base is None:
        return []
    ranked = sorted((r for r in _usable(rows) if r.number != base.number), key=lambda r: r.objective)
    defaults = next((r.params for r in rows if r.is_default), {})
    discoveries, others = [], []
    for donor in ranked[:MAX_DONORS]:
        for name, value in donor.params.items():
            if base.params.get(name, value) != value:
                move = (name, value, donor.params, f" from trial {donor.number}")
                (discoveries if defaults.get(name) != value else others).append(move)
    moves = [(name, value, base.params, "") for name, value in _rank_knob_moves(base, rows, choices)]
    # Turns alternate between the donors' moves and the base's own moves; each list is the
    # other's fallback once the first has nothing unmeasured left.
    turn = sum(1 for r in rows if r.refined_from is not None)
    ordered = discoveries + others + moves if turn % 2 == 0 else moves + discoveries + others
    return [
        ({**base.params, name: value}, fallback, f"trial {base.number} + {name}={value}{donor}")
        for name, value, fallback, donor in ordered
    ]


def get_choices(study: optuna.Study) -> dict[str, Sequence[Any]]:
    """Each categorical parameter's choices, as the study's trials recorded them."""
    choices: dict[str, Sequence[Any]] = {}
    for t in study.get_trials(deepcopy=False):
        for name, dist in t.distributions.items():
            if isinstance(dist, optuna.distributions.CategoricalDistribution):
                choices.setdefault(name, dist.choices)
    return choices


def enqueue_neighbour(
    study: optuna.Study, space: SearchSpace, rows: list[TrialRow], config_hash: Callable[[RuntimeConfig], str]
) -> str | None:
    """Enqueue the first unmeasured neighbour of the incumbent; returns its origin (or a waiting
    trial's), or None when there is none left to try."""
    measured = {t.user_attrs.get("config_hash") for t in study.get_trials(deepcopy=False)}
    waiting = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
    if waiting:  # one already queued (by this worker or another): it runs first
        return str(waiting[0].user_attrs.get(ORIGIN_ATTR, "queued"))
    for params, fallback, origin in get_candidates(rows, get_choices(study)):
        used, config = _resolve(space, params, fallback)
        if config_hash(config) in measured:
            continue
        study.enqueue_trial(used, user_attrs={ORIGIN_ATTR: origin})
        return origin
    return None
