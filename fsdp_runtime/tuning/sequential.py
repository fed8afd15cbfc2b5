"""When a paired trial has measured enough: a sequential stopping rule on its ABBA blocks.

[Note: sequential measurement]
A trial used to run a fixed number of pairs, and the search re-ran it with twice the pairs
when it was pruned or spread too wide; the final round then ran a fixed number of pairs per
finalist and a second window for each contested one. Most of those steps decided nothing:
a config twice as fast as its reference is known to be faster after one block (a search on a
2-core box with one core kept busy re-measured three finalists for 6 pairs each in its final round,
then again, although the winner's lead was clear early). So a paired trial
(:func:`autotune.trials.paired.run_pairs`) now looks at its ratios after every ABBA block of two
pairs and stops as soon as the question it was asked is answered:

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
  ``min_blocks_to_prune`` blocks on (2; with the box's noise pooled, a confirming third pair
  may prune: below): one burst of load on a block's two adjacent candidate steps must not
  prune a config, and a burst inflates the spread of two blocks instead of shifting both.
  Before that block such an interval is not called settled either (a burst can be as tight as
  a real difference): the next block decides.
- *Burst windows.* Faster and slower are called only where no single burst over two adjacent
  steps of the schedule that ran can have made the call ([Note: burst windows], below).
- *Settled.* An interval whose relative half-width is at most ``precision`` stops the trial
  whatever the thresholds (except as just said): more blocks would only resolve differences
  below the precision.
- *Tie.* Otherwise the trial measures another block, up to ``max_blocks``; at the maximum it
  stops with what it has (the search flags a ratio that still spreads wider than
  ``max_ratio_spread`` as ``noisy``).

*The box's noise* ([Note: pooled noise]). Two or four pairs estimate their own spread badly
(t(0.95, 1) = 6.3), yet the spread is mostly the box's, not the config's: on this box the pair
log-ratios of a search's trials spread 7-11% whatever the config, and the difference between a
trial's first and second block (153 trials of ten recorded searches) averaged 0.000 with a
spread of 8.8%, what independent pairs of that spread give; but 2 of the 153 differed by more
than 1.35x (bursts, about 1%). So where the search has measured paired trials before, the
rule takes the spread pooled over their pairs (``noise_sd``, ``noise_df`` degrees of freedom:
each trial's log-ratios about its own mean, the last ``NOISE_WINDOW`` trials) together with
the trial's own pairs, a pooled-variance t interval: after one block it is ~3x narrower than
the trial's own, so faster and settled are called after one block far more often (where the
burst windows let it: [Note: burst windows]). A first block whose pooled interval lies wholly
above ``prune_above`` (held back: ``min_blocks_to_prune``), or wholly below ``faster_below``
where its burst windows refused the call, may be *confirmed* by one more pair (3 steps, not the
second block's 6): the trial stops there as slower or faster if that pair alone lies beyond the
limit by one pooled spread (a burst over the whole first block does not reach it), the three
pairs' interval still lies beyond the limit and, each burst window's pairs left out in turn, so do
the pairs it did not reach; otherwise the second block decides. Two guards more: from the second block on, where the trial's own pairs spread wider
than the pooled figure (a config noisier than the box, or a burst in one block), its own
interval decides, as without a pool; and a pool of fewer than ``MIN_NOISE_DF`` degrees of
freedom is not used.

Every rank decides on the same numbers (each step's slowest-rank time is all-reduced before
it is recorded), so every rank stops after the same block without a vote.

*Error rates*: ``studies/stopping_rule.py`` drives this rule through the real pair schedule under
recorded noise, with bursts and autocorrelation; its figures for the rule as it runs are in
[Note: burst windows] below and docs/search.md.

A wrong "faster" makes a config within the noise of the best the best too early (the next
trials are compared with it, and the final round re-measures the finalists against the
defaults); a wrong "slower" loses a config within the noise of the best. Settled and pruned
stops both end the trial; they differ in its status only.

[Note: burst windows]
The burst guard above was written for the reference leading every even pair (ref, cand | cand,
ref), where a block's two candidate steps stand together and the third pair's do not. Since a
warm reference (switched in place or kept) lets the candidate lead, the steps run ``c0 r_s r0 r1
c_s c1 c2 r_s r2 ...`` ([Note: pair schedule] in :mod:`fsdp_runtime.tuning.pair_schedule`): ``c1 c2``
join the first block's second pair to the pair that confirmed it, so one burst over two
adjacent steps made a tie look slow after one block and then "confirmed" it, and ``r0 r1``
fill the first block's reference steps, so one burst made a tie "faster" after one block: a
false best whose ratio then bars every later trial (``prune_above``, futility). With the pool,
even one slowed reference step in the first block made a tie faster (a 1.5x step shifts the
mean of two pairs by 0.2 in log, the pooled half-width is 0.11).

So ``run_pairs`` hands the rule its schedule's *burst windows*
(:func:`~fsdp_runtime.tuning.pair_schedule.get_burst_windows`: for every two adjacent steps, the
pairs whose candidate step, and those whose reference step, a burst over both would slow), and
a call stands only where no one window can have made it: for every window that slows the side
the call leans on (the candidate's for slower, the reference's for faster), the pairs it did
not reach must still lie beyond the limit, their mean taken with the rule's spread of all the
pairs (a burst in them widens it) and a t quantile for its degrees of freedom. Where a window
reaches every pair so far (``r0 r1`` in a first block led by the candidate), the call waits for
a pair it does not reach: the confirming third pair, or the second block. A call so refused is
not called settled either. Without a pool, or with no windows (``windows=[]``), the rule is the
one above; a pure call without a schedule takes the reference-first one.

*Error rates*: ``studies/stopping_rule.py`` draws every step of the schedule (settle and warm-up
steps included) from an autocorrelated series fitted to recorded trials (``tests/data``), with a
1.5x burst over two adjacent steps placed anywhere and at its worst place; docs/search.md ("When
a trial stops") has its figures, before and after the windows.

[Note: futility]
Most of a search's trials are neither clearly faster than the best so far nor clearly slower:
on the README's main command the best configs lie within 5-10% of each other, and with this
box's pair spread (log-ratios 11% over 972 pairs of twelve searches, 7-17% in a search's recent
trials) four pairs cannot tell them apart, so 10 of 16 trials ran to ``max_blocks``. A trial that stands 6% above the best after its first block
will almost never end below it, yet it ran its second block (6 steps, ~4.5 s). So before its
last block a trial stops as ``unlikely`` when the chance that its mean log ratio after the last
block lies below ``futile_above`` (the best so far; in the final round, the leader's ratio) is
under 10%, given its pairs so far: the pairs to come are drawn around the mean so far, whose
own error is counted too (a predictive probability, not the conditional power at the point
estimate, which would stop more often than its nominal rate), so the final mean is taken as
``N(mean, sd^2 (N - n) / (N n))`` after ``n`` of ``N`` pairs, with the rule's spread (pooled,
or the trial's own where wider) and a t quantile for its degrees of freedom. After the first
block (two of at most four pairs) at 9%, that is a mean 6% or more above the best.

Only with the box's noise pooled (two pairs say nothing reliable of their own spread), never
where the burst guard holds a slow first block for the next block to decide (an interval wholly
above ``prune_above`` before ``min_blocks_to_prune``: a 1.5x burst is not lost to futility
either), never where nothing is pruned (the defaults trial, the presearch's calibration trials:
their figure or their traces are the point), and not in the round against torchtitan's recipe,
where a config near the recipe must be measured to the end to say which of the two to emit. An ``unlikely`` trial is
not pruned: it keeps its ratio, the sampler and the choice of finalists see it, and it skips its
profiled window as any trial that did not beat the best.

*Error rates*: ``studies/stopping_rule.py`` (futility on, as the search runs it); what a tie, a
slower and a faster config lose to it is in docs/search.md ("When a trial stops").
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from fsdp_runtime.tuning.pair_schedule import Window, get_burst_windows, get_pair_schedule

T_95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753)
"""Student t's 95th percentile for 1..15 degrees of freedom (a 90% two-sided interval)."""
_Z_95 = 1.6448536269514722
T_90 = (3.078, 1.886, 1.638, 1.533, 1.476, 1.440, 1.415, 1.397, 1.383, 1.372, 1.363, 1.356, 1.350, 1.345, 1.341)
"""Student t's 90th percentile for 1..15 degrees of freedom: a trial whose chance of ending below
its ``futile_above`` is under 10% stops ([Note: futility])."""
_Z_90 = 1.2815515655446004
NOISE_WINDOW = 8
"""Paired trials whose pairs the box's noise is pooled from ([Note: pooled noise]): the recent
ones, so a box that got busier is seen within a few trials."""
MIN_NOISE_DF = 6
"""Degrees of freedom under which a pooled noise is not used (two trials of four pairs)."""


def _t_above_table(z: float, df: int) -> float:
    """Student t's quantile at the normal quantile ``z`` for ``df`` degrees of freedom, by the
    Cornish-Fisher expansion in 1/df (Abramowitz and Stegun, Handbook of Mathematical Functions,
    26.7.5): within 1e-4 of the exact value from df 16 on, and the normal quantile as df grows."""
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


def t_95(df: int) -> float:
    """Student t's 95th percentile for ``df`` degrees of freedom (the table to 15, then :func:`_t_above_table`)."""
    return T_95[df - 1] if df <= len(T_95) else _t_above_table(_Z_95, df)


def t_90(df: int) -> float:
    """Student t's 90th percentile for ``df`` degrees of freedom (the table to 15, then :func:`_t_above_table`)."""
    return T_90[df - 1] if df <= len(T_90) else _t_above_table(_Z_90, df)


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
    noise_sd: float | None = None
    """The box's pair log-ratio spread pooled over earlier trials ([Note: pooled noise]); None:
    the trial's own pairs only (the keys are absent from rules written before it)."""
    noise_df: int = 0
    """Its degrees of freedom."""
    futile_above: float | None = None
    """A trial unlikely to end below this stops before its last block (``unlikely``: [Note:
    futility]); None: never (the keys are absent from rules written before it)."""
    limit_pairs: int = 0
    """The pairs behind ``prune_above`` and ``futile_above`` where they are another trial's mean
    (the final round's leader): its own error, at the rule's spread, widens the slower and the
    futile calls, a two-sample comparison; 0: limits taken as exact."""

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


def _log_spread(samples: list[float], noise_sd: float | None, noise_df: int) -> tuple[float, float, int, int] | None:
    """The samples' mean log ratio, its spread (pooled with ``noise_sd`` over ``noise_df`` degrees
    of freedom where given), the spread's degrees of freedom and the number of samples; None under
    two samples (one with a pool)."""
    logs = [math.log(x) for x in samples if x > 0]
    pooled = noise_sd is not None and noise_df >= 1
    if len(logs) < (1 if pooled else 2):
        return None
    mean = statistics.fmean(logs)
    squares, df = sum((x - mean) ** 2 for x in logs), len(logs) - 1
    if pooled:
        squares, df = squares + noise_df * noise_sd**2, df + noise_df
    return mean, math.sqrt(squares / df), df, len(logs)


def get_interval(samples: list[float], noise_sd: float | None = None, noise_df: int = 0) -> Interval | None:
    """The 90% Student-t interval of the samples' mean log ratio, back in ratio space; None under
    two samples. With ``noise_sd`` (``noise_df`` >= 1) the samples' variance is pooled with it
    ([Note: pooled noise]), and one sample is enough."""
    spread = _log_spread(samples, noise_sd, noise_df)
    if spread is None:
        return None
    mean, sd, df, n = spread
    half = t_95(df) * sd / math.sqrt(n)
    return Interval(center=math.exp(mean), low=math.exp(mean - half), high=math.exp(mean + half), n=n)


def _get_rule_noise(rule: StoppingRule, pair_ratios: list[float]) -> tuple[float | None, int]:
    """The box's noise the rule pools the trial's pairs with, unless the trial's own pairs (from
    two blocks on) spread wider: then none, their own decides ([Note: pooled noise])."""
    if rule.noise_sd is None or rule.noise_df < MIN_NOISE_DF:
        return None, 0
    if len(pair_ratios) >= 4 and _log_sd(pair_ratios) > rule.noise_sd:
        return None, 0
    return rule.noise_sd, rule.noise_df


def get_rule_interval(rule: StoppingRule, pair_ratios: list[float]) -> Interval | None:
    """The trial's interval with the noise the rule takes (:func:`_get_rule_noise`)."""
    return get_interval(pair_ratios, *_get_rule_noise(rule, pair_ratios))


def _holds_without_bursts(rule: StoppingRule, pair_ratios: list[float], windows: list[Window], slower: bool) -> bool:
    """A call (``slower``, else faster) that no single two-step burst can have made ([Note: burst
    windows]): for every window of the schedule that slows the steps of the side the call leans
    on (the candidate's for slower, the reference's for faster), the pairs it did not reach still
    lie wholly beyond the limit, their mean taken with the rule's spread of every pair (and, for
    slower, the limit's own error where it is another trial's mean: ``limit_pairs``)."""
    logs = [math.log(x) for x in pair_ratios]
    _, sd, df, _ = _log_spread(pair_ratios, *_get_rule_noise(rule, pair_ratios))
    limit = math.log(rule.prune_above if slower else rule.faster_below)
    other = 1 / rule.limit_pairs if slower and rule.limit_pairs else 0.0
    for window in windows:
        reached = window[0 if slower else 1] & set(range(len(logs)))
        if not reached:
            continue
        rest = [x for i, x in enumerate(logs) if i not in reached]
        if not rest:
            return False
        mean, half = statistics.fmean(rest), t_95(df) * sd * math.sqrt(1 / len(rest) + other)
        if (mean - half <= limit) if slower else (mean + half >= limit):
            return False
    return True


def _get_windows(pair_ratios: list[float], windows: list[Window] | None) -> list[Window]:
    """The burst windows ``run_pairs`` hands over; None: those of the reference leading (a pure decision)."""
    return get_burst_windows(get_pair_schedule(len(pair_ratios))) if windows is None else windows


def confirms(rule: StoppingRule, pair_ratios: list[float], windows: list[Window] | None = None) -> str | None:
    """After the pair that follows the first block: ``slower`` or ``faster`` where it confirms what
    that block's look held back ([Note: burst windows]), else None. Only with the pool in use;
    the look before held its interval wholly beyond a limit (above ``prune_above`` before
    ``min_blocks_to_prune``, or beyond either where its burst windows refused the call), and
    the confirming pair alone lies beyond it by one pooled spread (a burst over the whole first
    block does not reach it), and the pairs so far, each window's pairs left out in turn, still
    lie beyond it."""
    if rule.noise_sd is None or rule.noise_df < MIN_NOISE_DF or len(pair_ratios) != 3:
        return None
    windows = _get_windows(pair_ratios, windows)
    looked = get_rule_interval(rule, pair_ratios[:-1])
    now = get_rule_interval(rule, pair_ratios)
    # The confirming pair on its own lies beyond the limit by one pooled spread: a burst longer than
    # two steps (over a whole first block) reaches the first block's pairs but not this one.
    alone = pair_ratios[-1]
    if rule.prune_above is not None and looked.low > rule.prune_above and now.low > rule.prune_above:
        if alone > rule.prune_above * math.exp(rule.noise_sd):
            return "slower" if _holds_without_bursts(rule, pair_ratios, windows, slower=True) else None
        return None
    if rule.faster_below is not None and looked.high < rule.faster_below and now.high < rule.faster_below:
        if alone < rule.faster_below * math.exp(-rule.noise_sd):
            return "faster" if _holds_without_bursts(rule, pair_ratios, windows, slower=False) else None
    return None


def confirms_slower(rule: StoppingRule, pair_ratios: list[float], windows: list[Window] | None = None) -> bool:
    """After an odd pair: it confirms that the first block was clearly slower, so the trial is
    pruned there (:func:`confirms`)."""
    return confirms(rule, pair_ratios, windows) == "slower"


def look(rule: StoppingRule, pair_ratios: list[float], windows: list[Window] | None, num_pairs: int) -> str | None:
    """What ``run_pairs`` asks after every pair (``num_pairs``: the most it runs): the rule's
    decision after a block or the last pair (:func:`decide`), a confirmation after the pair that
    follows the first block (:func:`confirms`); None: go on."""
    n = len(pair_ratios)
    if n % 2 == 0 or n == num_pairs:
        return decide(rule, pair_ratios, windows)
    return confirms(rule, pair_ratios, windows)


def _log_sd(samples: list[float]) -> float:
    return statistics.stdev(math.log(x) for x in samples if x > 0)


def is_unlikely(rule: StoppingRule, pair_ratios: list[float]) -> bool:
    """Before the last block: the trial's mean ratio after its last block would lie below
    ``futile_above`` with a chance under 10% ([Note: futility]); only with the box's
    noise pooled (two pairs alone say too little of their spread)."""
    most, n = 2 * rule.max_blocks, len(pair_ratios)
    if rule.futile_above is None or rule.noise_sd is None or rule.noise_df < MIN_NOISE_DF or not 0 < n < most:
        return False
    mean, sd, df, n = _log_spread(pair_ratios, *_get_rule_noise(rule, pair_ratios))
    # the final mean's spread given the pairs so far: the pairs to come plus the error of the mean so far
    spread = sd * math.sqrt((most - n) / (most * n) + (1 / rule.limit_pairs if rule.limit_pairs else 0))
    return spread > 0 and (mean - math.log(rule.futile_above)) / spread > t_90(df)


def decide(rule: StoppingRule, pair_ratios: list[float], windows: list[Window] | None = None) -> str | None:
    """After a block: why the trial stops (``faster``, ``slower``, ``settled``, ``unlikely``, ``max_blocks``), or None to go on.

    ``pair_ratios`` are the trial's candidate/reference ratios so far, pair by pair; ``windows``
    the reach of a two-step burst in the schedule that ran them (:func:`get_burst_windows`; None:
    the reference leading; empty: no burst guard)."""
    num_blocks = (len(pair_ratios) + 1) // 2
    if num_blocks < rule.min_blocks:
        return None
    windows = _get_windows(pair_ratios, windows)
    at_most = "max_blocks" if num_blocks >= rule.max_blocks else None
    interval = get_rule_interval(rule, pair_ratios)
    if interval is not None:
        if rule.faster_below is not None and interval.high < rule.faster_below:
            # one burst on adjacent reference steps can make a tie look faster: the pairs it did not reach must agree
            return "faster" if _holds_without_bursts(rule, pair_ratios, windows, slower=False) else at_most
        if rule.prune_above is not None and _is_above(rule, pair_ratios, interval):
            # clearly slower: pruned from min_blocks_to_prune on, and not called settled before (one burst of load
            # can fill a block); the next block decides
            if num_blocks < rule.min_blocks_to_prune:
                return None
            return "slower" if _holds_without_bursts(rule, pair_ratios, windows, slower=True) else at_most
        if interval.half_width <= rule.precision:
            return "settled"
    if is_unlikely(rule, pair_ratios):
        return "unlikely"
    return at_most


def _is_above(rule: StoppingRule, pair_ratios: list[float], interval: Interval) -> bool:
    """The trial's interval wholly above ``prune_above``; with ``limit_pairs``, the two-sample
    interval of the trial's mean log ratio less the limit's (their errors added) wholly above 0."""
    if not rule.limit_pairs:
        return interval.low > rule.prune_above
    mean, sd, df, n = _log_spread(pair_ratios, *_get_rule_noise(rule, pair_ratios))
    return mean - t_95(df) * sd * math.sqrt(1 / n + 1 / rule.limit_pairs) > math.log(rule.prune_above)


MIN_CALL_PAIRS = 4
"""The fewest pairs whose interval alone may call a config faster (:func:`is_faster`): two blocks."""


def is_faster(stopped: str | None, interval: Interval | None, *, pair_ratios: list[float]) -> bool:
    """A measurement's last word that a config is faster than its baseline (the search's verdict
    window and recipe round, the in-job tuner): the rule stopped it as ``faster`` (its burst guard
    held), or it ran every pair (or settled) and their interval lies wholly below 1 over at least
    :data:`MIN_CALL_PAIRS` pairs. One block is never enough: where the candidate leads, one burst
    over the reference's two adjacent steps slows both its pairs alike, a tie with no spread and a
    settled interval ([Note: burst windows]). Holding the interval of every pair to the burst
    guard instead cost most of the power (``studies/decisions.py``: docs/search.md)."""
    if stopped == "faster":
        return True
    if stopped not in ("max_blocks", "settled", None) or interval is None or interval.high >= 1.0:
        return False
    return len(pair_ratios) >= MIN_CALL_PAIRS


@dataclass
class PairNoise:
    """The box's pair noise, pooled over a search's recent paired trials ([Note: pooled noise])."""

    trials: deque = field(default_factory=lambda: deque(maxlen=NOISE_WINDOW))
    """Per trial: (sum of squared log-ratio deviations from its mean, degrees of freedom)."""

    def observe(self, pair_ratios: list[float]) -> None:
        """Add a finished trial's pair ratios (fewer than two teach nothing)."""
        logs = [math.log(x) for x in pair_ratios if x > 0]
        if len(logs) >= 2:
            mean = statistics.fmean(logs)
            self.trials.append((sum((x - mean) ** 2 for x in logs), len(logs) - 1))

    def get(self) -> tuple[float, int] | None:
        """``(sd, df)`` pooled over the window, or None while it holds under ``MIN_NOISE_DF`` degrees of freedom."""
        df = sum(d for _, d in self.trials)
        if df < MIN_NOISE_DF:
            return None
        return math.sqrt(sum(q for q, _ in self.trials) / df), df
