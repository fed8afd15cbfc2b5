"""How long a search's trial may run before its ranks are killed: long enough on a slow box, short enough for a hang.

[Note: trial timeouts]
A trial's time limit exists to kill a hung collective, not a slow box. A fixed limit did both:
on a 2-core box with one core kept busy, the defaults' step grew from 6.4 to 11.1 s and two of a
search's three calibration trials hit the fixed 180 s limit although nothing was stuck.
So, unless ``--trial-timeout`` fixes one, a trial's limit follows what this box measured:

- every finished run of the search (the unrecorded warm-up first, a defaults run) gives its wall
  seconds per step it ran (every warm-up step of every model it built included) and per model
  it built: the steps priced at their recorded median, what is left of the wall (start-up,
  connecting the ranks, the builds) is charged to its builds (``num_builds``, at least one), an
  upper bound of a build's cost; the per-step rate keeps one build's share (the wall less the
  other builds' cost, over the steps), as a one-build run's rate always did;
- the rate a limit is priced at, and the build cost likewise, is the larger of the first run's
  (the defaults, the slowest config of most searches) and the median of the last ``RECENT``
  runs' (so a box that slows down after the start raises the limits of the trials that follow);
- a trial's limit is ``FACTOR`` times (that rate times the steps the trial may run at most, plus
  the build cost, never below ``BUILD_FLOOR_S``, times each model it builds beyond the first),
  and never below ``FLOOR_S``: a candidate twice as slow as the defaults on a box that got twice
  as slow still fits, and a hang is killed within minutes. Its steps: warm-up of each model it
  builds, every pair with its settle step, the profiled window; its builds (:func:`count_builds`):
  one for a model switched in place or paired with itself, two for a reference of its own, and
  for models built in turn ([Note: models built in turn] in :mod:`autotune.trials.in_turn`)
  ``n + 2`` for ``n`` pairs, one more before a profiled window, each warmed up: a builds-in-turn
  trial of a big model pays seconds to minutes of builds its steps alone would not price.
  Whether a trial builds in turn the search tells from its configs as given
  (:func:`autotune.search.context.builds_in_turn`: on CUDA or with ``AUTOTUNE_PAIRED_MODELS=turn``,
  where they differ in structure); the ranks decide on the configs resolved against the model,
  so the search may count builds in turn that do not happen: a longer limit, never a shorter one;
- before anything ran on this box (the warm-up itself) the limit is ``FIRST_S``: a cold
  start builds the model and connects the ranks for the first time.

A failed run (timeout, crash) gives no rate: a hang must not teach the next limit to wait longer.
"""

from __future__ import annotations

import os
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from autotune.trials import PAIRED_MODELS_ENV, get_default_backend
from fsdp_runtime import RuntimeConfig, get_structural_differences

FACTOR = 5.0
"""Limit / expected wall time: covers a config slower than the one observed and a box slowing down."""
FLOOR_S = 120.0
"""No trial's limit is shorter: start-up and a model build take tens of seconds on their own."""
FIRST_S = 900.0
"""The limit before anything ran on this box."""
RECENT = 3
"""Runs whose median rate follows the box's load."""


BUILD_FLOOR_S = 5.0
"""No build beyond a trial's first is priced below this (before ``FACTOR``): a first run's build
of a tiny model on a warm pool costs next to nothing, a big model's rebuilt in turn does not."""


def count_builds(*, num_pairs: int, paired: bool, self_paired: bool, in_turn: bool, profiled: int) -> int:
    """The most models a trial builds: one (unpaired, paired with itself, or switched in place),
    two (a reference of its own; one where it is kept warm, which the search cannot know), or with
    models built in turn ``num_pairs + 2``, one more to profile the candidate after the reference."""
    if not paired or self_paired:
        return 1
    if not in_turn:
        return 2
    return num_pairs + 2 + (1 if profiled else 0)


def count_steps(
    *, num_warmup: int, num_pairs: int, paired: bool, self_paired: bool, profiled: int, in_turn: bool = False
) -> int:
    """The most steps a trial runs: each side's warm-up (each model's, built in turn), each pair's
    two steps and, between two models, its settle step ([Note: switch cost]), and the profiled
    window (+1 warm-up step of the schedule)."""
    sides = 1 if (self_paired or not paired) else 2
    if in_turn and paired and not self_paired:
        sides = count_builds(num_pairs=num_pairs, paired=True, self_paired=False, in_turn=True, profiled=profiled)
    per_pair = 2 if self_paired else (3 if paired else 1)
    return sides * num_warmup + per_pair * num_pairs + (profiled + 1 if profiled else 0)


def count_steps_run(metrics: Any) -> int:
    """The steps a finished trial ran (rank 0's record; every rank runs the same steps)."""
    if not metrics.ranks:
        return 0
    r = metrics.ranks[0]
    paired = bool(metrics.reference_step_ms_per_step)
    self_paired = paired and not r.settle_step_ms and not r.reference_settle_step_ms
    sides = 1 if (self_paired or not paired) else 2
    if r.num_models == 1 and (r.num_builds or 0) > 1:  # built in turn: each build warmed up
        sides = r.num_builds
    ran = len(r.step_ms) + len(r.reference_step_ms) + len(r.settle_step_ms) + len(r.reference_settle_step_ms)
    return sides * metrics.num_warmup + ran + (len(r.profiled_step_ms) + 1 if r.profiled_step_ms else 0)


def get_build_s(metrics: Any, wall_s: float, steps: int) -> float:
    """Seconds per model a finished trial built: its wall less its steps priced at their recorded
    median (slowest rank), over its builds (at least one: start-up is charged to builds too)."""
    r = metrics.ranks[0]
    recorded = [*metrics.step_ms_per_step, *metrics.reference_step_ms_per_step, *r.settle_step_ms]
    recorded += [*r.reference_settle_step_ms, *r.profiled_step_ms]
    step_s = statistics.median(recorded) / 1e3 if recorded else 0.0
    return max(0.0, wall_s - step_s * steps) / max(1, metrics.num_builds or 1)


@dataclass
class TrialTimeouts:
    """The time limits of a search's trials ([Note: trial timeouts])."""

    fixed_s: float | None = None
    """``--trial-timeout``: every trial gets this limit, whatever the box measured."""
    first_rate_s: float | None = None
    """Wall seconds per step of the first run that finished on this box (the defaults), one build's share included."""
    first_build_s: float | None = None
    """Seconds per build of that run (:func:`get_build_s`)."""
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    recent_builds: deque = field(default_factory=lambda: deque(maxlen=RECENT))

    def observe(self, result: Any) -> None:
        """Learn this box's rate from a finished trial (``TrialResult``); failures teach nothing."""
        if result.status not in ("ok", "pruned") or result.metrics is None or result.wall_s <= 0:
            return
        steps = count_steps_run(result.metrics)
        if steps <= 0:
            return
        build_s = get_build_s(result.metrics, result.wall_s, steps)
        extra = max(0, (result.metrics.num_builds or 1) - 1)
        rate = (result.wall_s - extra * build_s) / steps  # one build's share stays in the rate
        if self.first_rate_s is None:
            self.first_rate_s, self.first_build_s = rate, build_s
        self.recent.append(rate)
        self.recent_builds.append(build_s)

    @property
    def rate_s(self) -> float | None:
        """Seconds per step a limit is priced at: the first run's or the recent median, the larger."""
        if self.first_rate_s is None:
            return None
        return max(self.first_rate_s, statistics.median(self.recent))

    @property
    def build_s(self) -> float:
        """Seconds per build beyond a trial's first: the first run's or the recent median, the larger, at least ``BUILD_FLOOR_S``."""
        if self.first_build_s is None:
            return BUILD_FLOOR_S
        return max(BUILD_FLOOR_S, self.first_build_s, statistics.median(self.recent_builds))

    def get(self, num_steps: int, num_builds: int = 1) -> float:
        """The limit of a trial that runs at most ``num_steps`` steps and builds ``num_builds`` models."""
        if self.fixed_s is not None:
            return self.fixed_s
        rate = self.rate_s
        if rate is None:
            return FIRST_S
        return max(FLOOR_S, FACTOR * (rate * num_steps + self.build_s * max(0, num_builds - 1)))

    def describe(self) -> str:
        if self.fixed_s is not None:
            return f"fixed at {self.fixed_s:.0f} s (--trial-timeout)"
        rate = self.rate_s
        if rate is None:
            return f"{FIRST_S:.0f} s until a run finished on this box"
        return (
            f"{FACTOR:g}x (this box's {rate:.2f} s per step times a trial's steps + {self.build_s:.1f} s"
            f" per model it builds beyond the first), at least {FLOOR_S:.0f} s"
        )


def may_build_in_turn() -> bool:
    """Trials may build their two models in turn: on CUDA, or where ``AUTOTUNE_PAIRED_MODELS``
    asks for it ([Note: models built in turn] in :mod:`autotune.trials.in_turn`)."""
    asked = os.environ.get(PAIRED_MODELS_ENV)
    return asked == "turn" or (asked is None and get_default_backend() == "nccl")


def builds_in_turn(config: RuntimeConfig, reference: RuntimeConfig) -> bool:
    """A trial of ``config`` against ``reference`` may build its models in turn: they may, and the
    two differ in structure. Compared as given (the ranks compare them resolved against the
    model), so units that would resolve alike count as different: a longer limit, never a shorter one."""
    return reference != config and may_build_in_turn() and bool(get_structural_differences(config, reference))
