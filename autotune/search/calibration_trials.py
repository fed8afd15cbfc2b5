"""The presearch's calibration trials: points of the space the simulator is calibrated on.

[Note: calibration trials]
The defaults alone cannot price what the winning knobs change on this machine, so before
calibrating, the presearch measures up to three more configs of the space as ordinary trials
(``CALIBRATION_CHANGES``, each the defaults with a few knobs changed; paired with the
defaults like every trial, so each counts toward ``--trials`` and can win):
``unshard_async`` (asynchronous all-gathers: the CPU share of gloo's worker thread),
``replicated`` (HSDP Nx1: a shard group of one's plain copies) and ``eager_concat``
(FSDP1-style concat's own labels); the wait per collective is not fitted (see
[Note: calibration]). With 2 trials or fewer left for the simulator's picks they are skipped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autotune.search.space import SearchSpace

if TYPE_CHECKING:
    from autotune.search.context import SearchContext
    from autotune.search.results import TrialRow


CALIBRATION_CHANGES: dict[str, dict[str, Any]] = {
    "unshard_async": {"unshard_async": "on", "forward_prefetch": "depth1"},
    "replicated": {"mesh": "hsdp:{world}x1"},
    "eager_concat": {
        "nosync_blocks": "all",
        "nosync_level_fsdp": "last",
        "defer_concat": False,
        "keep_unsharded": False,
    },
}
"""The presearch's calibration trials: the defaults with these knobs changed (``{world}``: the
world size); ``reshard_after_forward`` names the question of whichever mesh."""
CALIBRATION_ATTR = "calibration"


class _AnswerTrial:
    """Answers the space's questions from ``wanted``, else the defaults' answer to the same
    question, else its first choice (FSDP2's default): a full point of the space."""

    def __init__(self, wanted: dict[str, Any], defaults: dict[str, Any]) -> None:
        self.wanted, self.defaults, self.params = wanted, defaults, {}

    def suggest_categorical(self, name: str, choices: Any) -> Any:
        choices = list(choices)
        generic = "reshard_after_forward" if name.startswith("reshard_after_forward") else name
        for source in (self.wanted, self.defaults):
            if generic in source and source[generic] in choices:
                self.params[name] = source[generic]
                return source[generic]
            if name in source and source[name] in choices:
                self.params[name] = source[name]
                return source[name]
        self.params[name] = choices[0]
        return choices[0]


def get_calibration_params(space: SearchSpace) -> dict[str, dict[str, Any]]:
    """``CALIBRATION_CHANGES`` as full points of ``space``, those it can express and that differ from the defaults."""
    defaults = space.get_default_params()
    default_config = space.build_config(defaults)
    points = {}
    for name, changes in CALIBRATION_CHANGES.items():
        wanted = {k: v.format(world=space.world_size) if isinstance(v, str) else v for k, v in changes.items()}
        trial = _AnswerTrial(wanted, defaults)
        config = space.suggest(trial)  # type: ignore[arg-type]
        if (
            all(trial.params.get(k) == v for k, v in wanted.items() if k != "reshard_after_forward")
            and config != default_config
        ):
            points[name] = trial.params
    return points


def run_calibration_trials(ctx: SearchContext) -> list[TrialRow]:
    """Measure the calibration points not measured yet (see [Note: presearch]); the finished rows of all of them."""
    from autotune.search.loop import count_measured, get_rows, run_one

    study, settings = ctx.study, ctx.settings
    points = get_calibration_params(ctx.space)
    if settings.num_trials - 1 - len(points) < 2:
        return []
    done = {r.calibration for r in get_rows(study) if r.calibration}
    for name, params in points.items():
        if name in done:
            continue
        study.enqueue_trial(
            {**params, "root_split": "none"} if ctx.space.can_split else params, user_attrs={CALIBRATION_ATTR: name}
        )
        ctx.reporter.on_trial_start(count_measured(get_rows(study)), settings.num_trials)
        row = run_one(ctx, None, against_defaults=True)
        ctx.reporter.on_trial_end(row, None)
    return [r for r in get_rows(study) if r.calibration and r.state == "COMPLETE" and r.trial_dir]
