"""How long a search's trial may run before its ranks are killed: long enough on a slow box, short enough for a hang.

[Note: trial timeouts]
A trial's time limit exists to kill a hung collective, not a slow box. A fixed limit did both:
on a 2-core box with one core kept busy, the defaults' step grew from 6.4 to 11.1 s and two of a
search's three calibration trials hit the fixed 180 s limit although nothing was stuck.
So, unless ``--trial-timeout`` fixes one, a trial's limit follows what this box measured:

- every finished run of the search (the unrecorded warm-up first, a defaults run) gives its wall
  seconds per step it ran (build and start-up included, so the rate is an upper bound);
- the rate a limit is priced at is the larger of the first run's (the defaults, the slowest
  config of most searches) and the median of the last ``RECENT`` runs' (so a box that slows down
  after the start raises the limits of the trials that follow);
- a trial's limit is ``FACTOR`` times that rate times the steps the trial may run at most
  (warm-up of each side, every pair with its settle step, the profiled window), and never
  below ``FLOOR_S``: a candidate twice as slow as the defaults on a box that got twice as slow
  still fits, and a hang is killed within minutes;
- before anything ran on this box (the warm-up itself) the limit is ``FIRST_S``: a cold
  start builds the model and connects the ranks for the first time.

A failed run (timeout, crash) gives no rate: a hang must not teach the next limit to wait longer.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

FACTOR = 5.0
"""Limit / expected wall time: covers a config slower than the one observed and a box slowing down."""
FLOOR_S = 120.0
"""No trial's limit is shorter: start-up and a model build take tens of seconds on their own."""
FIRST_S = 900.0
"""The limit before anything ran on this box."""
RECENT = 3
"""Runs whose median rate follows the box's load."""


def count_steps(*, num_warmup: int, num_pairs: int, paired: bool, self_paired: bool, profiled: int) -> int:
    """The most steps a trial runs: each side's warm-up, each pair's two steps and, between two
    models, its settle step ([Note: switch cost]), and the profiled window (+1 warm-up step of the schedule)."""
    sides = 1 if (self_paired or not paired) else 2
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
    ran = len(r.step_ms) + len(r.reference_step_ms) + len(r.settle_step_ms) + len(r.reference_settle_step_ms)
    return sides * metrics.num_warmup + ran + (len(r.profiled_step_ms) + 1 if r.profiled_step_ms else 0)


@dataclass
class TrialTimeouts:
    """The time limits of a search's trials ([Note: trial timeouts])."""

    fixed_s: float | None = None
    """``--trial-timeout``: every trial gets this limit, whatever the box measured."""
    first_rate_s: float | None = None
    """Wall seconds per step of the first run that finished on this box (the defaults)."""
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))

    def observe(self, result: Any) -> None:
        """Learn this box's rate from a finished trial (``TrialResult``); failures teach nothing."""
        if result.status not in ("ok", "pruned") or result.metrics is None or result.wall_s <= 0:
            return
        steps = count_steps_run(result.metrics)
        if steps <= 0:
            return
        rate = result.wall_s / steps
        if self.first_rate_s is None:
            self.first_rate_s = rate
        self.recent.append(rate)

    @property
    def rate_s(self) -> float | None:
        """Seconds per step a limit is priced at: the first run's or the recent median, the larger."""
        if self.first_rate_s is None:
            return None
        return max(self.first_rate_s, statistics.median(self.recent))

    def get(self, num_steps: int) -> float:
        """The limit of a trial that runs at most ``num_steps`` steps."""
        if self.fixed_s is not None:
            return self.fixed_s
        rate = self.rate_s
        if rate is None:
            return FIRST_S
        return max(FLOOR_S, FACTOR * rate * num_steps)

    def describe(self) -> str:
        if self.fixed_s is not None:
            return f"fixed at {self.fixed_s:.0f} s (--trial-timeout)"
        rate = self.rate_s
        if rate is None:
            return f"{FIRST_S:.0f} s until a run finished on this box"
        return f"{FACTOR:g}x this box's {rate:.2f} s per step times a trial's steps, at least {FLOOR_S:.0f} s"
