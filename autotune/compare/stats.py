"""The order of a comparison's runs, and a speedup's interval over its rounds.

[Note: compare rounds]
Every config runs alone, once per round, on fresh ranks (what a training job does), so a
comparison is exposed to what pairing cancels in a search: the box's drift between runs and
any advantage of running first or last in a round. The order therefore rotates and reverses
(:func:`get_round_order`): round ``r`` (from 0) takes the configs rotated left by ``r // 2``,
reversed when ``r`` is odd. Three configs A B C run

    round 1: A B C    round 2: C B A    round 3: B C A
    round 4: A C B    round 5: C A B    round 6: B A C

Two consecutive rounds (forward, then reversed) put every config at positions that sum to
``n - 1``, so a drift linear in time weighs on each config alike within every such pair, and
``2 n`` rounds put each config at each position twice. Two configs run ABBA: A B, B A, B A, A B.
``--until-ci`` looks at the intervals after even rounds only, whole pairs.

[Note: compare interval]
Rounds are the independent unit: within a round every config ran under about the same load, so
each round gives one ratio per config, the first config's run median over this config's
(a speedup: above 1, this config is faster). The speedup quoted is the median of the round
ratios; its interval is the 90% Student-t interval of the mean log ratio over the rounds
(``t(0.95, n - 1) * sd / sqrt(n)`` either side, back in ratio space), so it is wide with few
rounds (with 2 rounds, t is 6.31) and narrows as rounds are added. An interval that includes
1.0 means the config is no faster than the first, within noise.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from autotune.trials import get_interval

INTERVAL_METHOD = "90% Student-t interval of the mean log ratio over rounds"
"""How a speedup's interval is made, as the record and the terminal state it ([Note: compare interval])."""


def get_round_order(round_index: int, num_configs: int) -> list[int]:
    """The configs' indices in the order round ``round_index`` (from 0) runs them ([Note: compare rounds])."""
    shift = round_index // 2
    forward = [(shift + i) % num_configs for i in range(num_configs)]
    return forward if round_index % 2 == 0 else forward[::-1]


@dataclass(frozen=True)
class SpeedupInterval:
    """A speedup over the first config from its round ratios ([Note: compare interval])."""

    median: float
    low: float
    high: float
    num_rounds: int

    @property
    def half_width(self) -> float:
        """Relative half-width of the interval: (high - low) / 2 over its centre (the geometric mean)."""
        return (self.high - self.low) / 2 / math.sqrt(self.low * self.high)

    @property
    def verdict(self) -> str:
        """``faster`` (interval above 1), ``slower`` (below 1) or ``within noise`` (it includes 1)."""
        if self.low > 1.0:
            return "faster"
        if self.high < 1.0:
            return "slower"
        return "within noise"


def get_speedup_interval(ratios: list[float]) -> SpeedupInterval | None:
    """The speedup of the round ratios ``ratios`` (first / this config) with its interval; None under
    two rounds. The interval is the trials' own (:func:`autotune.trials.get_interval`)."""
    interval = get_interval(ratios)
    if interval is None:
        return None
    return SpeedupInterval(
        median=statistics.median(ratios), low=interval.low, high=interval.high, num_rounds=interval.n
    )


def is_settled(intervals: list[SpeedupInterval | None], round_number: int, until_ci_pct: float | None) -> bool:
    """Whether ``--until-ci`` stops after round ``round_number`` (from 1): an even round, and every
    interval's half-width within ``until_ci_pct`` percent ([Note: compare rounds])."""
    if until_ci_pct is None or round_number % 2 or not intervals:
        return False
    return all(i is not None and 100 * i.half_width <= until_ci_pct for i in intervals)
