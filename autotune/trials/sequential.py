"""When a paired trial has measured enough: a sequential stopping rule on its ABBA blocks.

[Note: sequential measurement]
A trial used to run a fixed number of pairs, and the search re-ran it with twice the pairs
when it was pruned or spread too wide; the final round then ran a fixed number of pairs per
finalist and a second window for each contested one. Most of those steps decided nothing:
a config twice as fast as its reference is known to be faster after one block (issue 39's
final round re-measured three finalists for 6 pairs each, then again, although the winner's
lead was clear early). So a paired trial (:func:`autotune.trials.paired.run_pairs`) now looks
at its ratios after every ABBA block of two pairs and stops as soon as the question it was
asked is answered:

- *The interval.* From the pair ratios so far (an even number at every look, so each ABBA
  order is half of them and the mean holds no order effect; what order effect the settle steps
  left widens the spread, so the interval is wider, not biased) the rule takes a 90% two-sided
  Student-t interval of the mean log ratio, ``exp(mean +- t(0.95, n-1) * sd / sqrt(n))``: the
  log makes "2x slower" and "2x faster" symmetric, and t rather than a normal quantile because
  n is 2 to 8 pairs. (Blocks as the samples would be one per two pairs: t(0.95, 1) = 6.3 after
  two blocks, where four pairs give t(0.95, 3) = 2.35.) The trial's figure stays the median
  block ratio ([Note: paired measurement]).
- *Faster.* An interval wholly below ``faster_below`` (1.0 where the reference is the search's
  best so far: "is this config faster than the best?") stops the trial: clearly faster.
- *Slower.* An interval wholly above ``prune_above`` (the search's ``prune_ratio``, 1.0 by
  default: clearly slower than the best) prunes the trial, but only from
  ``min_blocks_to_prune`` blocks on (2): one burst of load on a block's two adjacent candidate
  steps (ref, cand, cand, ref) must not prune a config, and a burst inflates the spread of two
  blocks instead of shifting both. Before that block such an interval is not called settled
  either (a burst can be as tight as a real difference): the next block decides.
- *Settled.* An interval whose relative half-width is at most ``precision`` stops the trial
  whatever the thresholds (except as just said): more blocks would only resolve differences
  below the precision.
- *Tie.* Otherwise the trial measures another block, up to ``max_blocks``; at the maximum it
  stops with what it has (the search flags a ratio that still spreads wider than
  ``max_ratio_spread`` as ``noisy``).

Every rank decides on the same numbers (each step's slowest-rank time is all-reduced before
it is recorded), so every rank stops after the same block without a vote.

*Error rates*, from ``benchmarks/stopping_rule.py`` (a Monte Carlo of the search's rule: at
most 4 pairs, precision 5%, faster below the best, pruned above it; pair log-ratios drawn around
the true ratio (to the best) with spread sigma; 20,000 trials per case). Optional stopping (a
look after every block) makes the real rates larger than the nominal 5% per side; these are
the real ones:

- sigma 5% (a noisy trial here): a true tie with the best ends ``faster`` in 8.3% and pruned
  in 3.2% of trials (41% settled, 48% at the maximum; 3.6 pairs on average); a config 10%
  slower than the best is pruned in 71% and called faster in none; 10% faster is called faster
  in 94% and pruned in none; 2x faster stops after one block (2 pairs) every time;
- sigma 2% (a quiet box): a tie settles in 92% (6.6% faster, 1.5% pruned; 3.2 pairs on
  average); a 5% difference is called the wrong way round in none;
- a 1.5x burst on the first block's two candidate steps: a tie at sigma 5% is pruned in 2.8%
  (3.2% without the burst), a config 10% faster in none.

A wrong "faster" makes a config within the noise of the best the best too early (the next
trials are compared with it, and the final round re-measures the finalists against the
defaults); a wrong "slower" loses a config within the noise of the best. Settled and pruned
stops both end the trial; they differ in its status only.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

T_95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753)
"""Student t's 95th percentile for 1..15 degrees of freedom (a 90% two-sided interval)."""
_T_95_LARGE = 1.645


def t_95(df: int) -> float:
    return T_95[df - 1] if df <= len(T_95) else _T_95_LARGE


@dataclass(frozen=True)
class StoppingRule:
    """When a paired trial stops measuring ([Note: sequential measurement])."""

    max_blocks: int
    """ABBA blocks (two pairs each) measured at most."""
    min_blocks: int = 1
    """Blocks measured before any decision."""
    precision: float = 0.05
    """Relative half-width of the 90% interval at which a ratio counts as settled."""
    faster_below: float | None = None
    """An interval wholly below this stops the trial: clearly faster (1.0 where the reference is
    the search's best so far); None: never stopped for that."""
    prune_above: float | None = None
    """An interval wholly above this prunes the trial: clearly slower; None: never pruned (the
    presearch's calibration trials must reach their profiled window)."""
    min_blocks_to_prune: int = 2

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StoppingRule:
        return cls(**data)


@dataclass(frozen=True)
class Interval:
    """A ratio's estimate and 90% interval from ``n`` samples (block or pair ratios)."""

    center: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        """Relative half-width: (high - low) / 2 / center."""
        return (self.high - self.low) / 2 / self.center


def get_interval(samples: list[float]) -> Interval | None:
    """The 90% Student-t interval of the samples' mean log ratio, back in ratio space; None under two samples."""
    logs = [math.log(x) for x in samples if x > 0]
    if len(logs) < 2:
        return None
    mean, sd = statistics.fmean(logs), statistics.stdev(logs)
    half = t_95(len(logs) - 1) * sd / math.sqrt(len(logs))
    return Interval(center=math.exp(mean), low=math.exp(mean - half), high=math.exp(mean + half), n=len(logs))


def decide(rule: StoppingRule, pair_ratios: list[float]) -> str | None:
    """After a block: why the trial stops (``faster``, ``slower``, ``settled``, ``max_blocks``), or None to go on.

    ``pair_ratios`` are the trial's candidate/reference ratios so far, pair by pair."""
    num_blocks = (len(pair_ratios) + 1) // 2
    if num_blocks < rule.min_blocks:
        return None
    interval = get_interval(pair_ratios)
    if interval is not None:
        if rule.faster_below is not None and interval.high < rule.faster_below:
            return "faster"
        if rule.prune_above is not None and interval.low > rule.prune_above:
            # clearly slower: pruned from min_blocks_to_prune on, and not called settled before (one burst of load
            # can fill a block); the next block decides
            return "slower" if num_blocks >= rule.min_blocks_to_prune else None
        if interval.half_width <= rule.precision:
            return "settled"
    return "max_blocks" if num_blocks >= rule.max_blocks else None
