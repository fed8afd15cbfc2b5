"""Refinement: the last trials of a search recombine and nudge the best configs found so far.

[Note: refinement]
A dozen TPE trials over ~9 categorical knobs sample little more than at random: two
searches of one workload (``benchmarks/search_noise.py``, small, 4 microbatches, 12 trials)
emitted configs measured at 1.23x and 1.12x the defaults, each holding some of the knobs
that pay (one skipped gradient sync on all blocks and kept them unsharded, the other only
on the second half). So the last ``num_refine`` trials of a search are not sampled: each
is a neighbour of the incumbent (the best trial so far, :func:`pick_best`):

1. the incumbent with one knob taken from a runner-up (the next best trials in order), so
   knobs that different trials found are combined: first the runner-ups' departures from
   the defaults (what they found), then their other differences;
2. then the incumbent with one knob moved to another of its choices.

A knob that only matters under the new value (e.g. the sync level once a block skips
sync) takes the donor's value, else the incumbent's, else its first choice. A neighbour
whose effective config was already measured (same ``config_hash``) is skipped. The chosen
neighbour is enqueued with ``study.enqueue_trial``: Optuna still owns the trial, its
parameters and storage, and the next ``ask()`` (of whichever worker comes first) gets it.
When the incumbent has no unmeasured neighbour left, the sampler samples as usual.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import optuna

from autotune.search.results import TrialRow, pick_best
from autotune.search.space import SearchSpace
from fsdp_runtime import RuntimeConfig

MAX_DONORS = 3
"""Runner-ups the incumbent takes knobs from, best first."""
ORIGIN_ATTR = "refined_from"
"""User attribute of an enqueued neighbour: how it was made (``trial 5 + keep_unsharded=True from trial 3``)."""


class _ParamsTrial:
    """Answers :meth:`SearchSpace.suggest`'s questions from a dict (an ``optuna.Trial`` stand-in):
    a knob the dict lacks takes ``fallback``'s value, else its first choice."""

    def __init__(self, params: dict[str, Any], fallback: dict[str, Any]) -> None:
        self.params, self.fallback = params, fallback
        self.used: dict[str, Any] = {}

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        value = self.params.get(name, self.fallback.get(name, choices[0]))
        if value not in choices:  # e.g. a reshard choice that only exists for another shard size
            value = choices[0]
        self.used[name] = value
        return value


def _resolve(space: SearchSpace, params: dict[str, Any], fallback: dict[str, Any]) -> tuple[dict[str, Any], RuntimeConfig]:
    """The parameters ``space.suggest`` would consume for ``params``, and the config they make."""
    trial = _ParamsTrial(params, fallback)
    config = space.suggest(trial)  # type: ignore[arg-type]
    return trial.used, config


def get_candidates(rows: list[TrialRow], choices: dict[str, Sequence[Any]]) -> list[tuple[dict[str, Any], dict[str, Any], str]]:
    """Neighbours of the incumbent, in the order of [Note: refinement]: (params, fallback, origin)."""
    best = pick_best(rows)
    if best is None:
        return []
    ranked = sorted((r for r in rows if r.succeeded and r.feasible and r.duplicate_of is None and r.number != best.number and r.objective is not None), key=lambda r: r.objective)
    defaults = next((r.params for r in rows if r.is_default), {})
    discoveries, others = [], []
    for donor in ranked[:MAX_DONORS]:
        for name, value in donor.params.items():
            if best.params.get(name, value) != value:
                move = ({**best.params, name: value}, donor.params, f"trial {best.number} + {name}={value} from trial {donor.number}")
                (discoveries if defaults.get(name) != value else others).append(move)
    out = discoveries + others
    for name, value in best.params.items():
        for other in choices.get(name, ()):
            if other != value:
                out.append(({**best.params, name: other}, best.params, f"trial {best.number} + {name}={other}"))
    return out


def get_choices(study: optuna.Study) -> dict[str, Sequence[Any]]:
    """Each categorical parameter's choices, as the study's trials recorded them."""
    choices: dict[str, Sequence[Any]] = {}
    for t in study.get_trials(deepcopy=False):
        for name, dist in t.distributions.items():
            if isinstance(dist, optuna.distributions.CategoricalDistribution):
                choices.setdefault(name, dist.choices)
    return choices


def enqueue_neighbour(study: optuna.Study, space: SearchSpace, rows: list[TrialRow], config_hash: Callable[[RuntimeConfig], str]) -> str | None:
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
