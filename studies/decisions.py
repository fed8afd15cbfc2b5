"""Prints the error rate and power of every decision that emits, prunes or adopts a config, each driven through its real rule, by Monte Carlo.

    .venv/bin/python studies/decisions.py [--trials 4000] [--seed 0] [--sigma 0.09] [--quick] [--before]

The decisions, each as the search or the tuner runs it:

- **emit**: the verdict window ([Note: emitted on an interval] in ``autotune/search/verdict.py``;
  the recipe round's window is the same code against torchtitan's recipe): the verdict's stopping
  rule (``get_verdict_rule``: every pair unless clearly slower or settled from its second block
  on, never stopped as faster, no futility) over ``get_verdict_pairs`` pairs of the search's
  defaults, then its call, :func:`fsdp_runtime.tuning.sequential.is_faster`;
- **prune** (and **lose**, the same rule where the finalist is the faster: a better config
  pruned): a finalist of the final round against a leader measured before it
  (``autotune/search/confirm.py``): the finalist's rule prunes above, and stops as futile below,
  the leader's mean ratio over its own window as no single burst there can have lowered it, with
  the leader's pairs behind that figure (``limit_pairs``: the two-sample comparison), two blocks
  before either may settle or be pruned (``get_finalist_rule``); ``--before``: one block could
  settle, and the leader's plain mean was taken as exact;
- **adopt**: one move of the in-job tuner's walk (:class:`fsdp_runtime.tuning.walk.TuningWalk`'s
  rule and its candidate-first schedule, 6 pairs), adopted where ``is_faster`` says so.
  ``studies/injob_walk.py`` measures the whole walk (about 20 moves and its final window).

Every step of each schedule (settle steps included) gets a log time from
``studies/stopping_rule.py``'s noise: an AR(1) series whose lag-1 autocorrelation is fitted to the
recorded per-step series in ``tests/data``, scaled so the pair log-ratios spread ``--sigma`` (the
box's 9%), the pooled noise of 24 degrees of freedom with its estimation error drawn. A burst
is a 1.5x slowdown of two adjacent steps at a uniformly drawn position. The orders: the candidate
first (a warm reference, in place or kept) and the reference first (a model of its own).

Printed per decision, order and burst model: the false rate (a tie emitted or adopted; a
finalist as fast as the leader pruned) and the power (a true 2%, 5% and 10% speedup emitted or
adopted; a finalist that much slower than the leader pruned), each with its binomial 95% interval
(Wilson), over ``--trials`` trials per case. ``--before``: the rules as they were before every
emitting call needed two blocks (``is_faster`` on the interval of any number of pairs, the
verdict free to settle after one block) and finalists were pruned on the leader's point estimate. ``--quick``: 600 trials, bursts only, emit and adopt
only, the figures a test reads. Pure Python; no ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "studies"))

from injob_walk import wilson  # noqa: E402
from stopping_rule import BURST, fit_rho, recorded_series, step_noise  # noqa: E402

from autotune.search.confirm import get_finalist_rule  # noqa: E402
from autotune.search.settings import SearchSettings  # noqa: E402
from fsdp_runtime.tuning.pair_schedule import CANDIDATE, REFERENCE, get_burst_windows, get_pair_schedule  # noqa: E402
from fsdp_runtime.tuning.sequential import StoppingRule, get_rule_interval, is_faster, look  # noqa: E402

SPEEDUPS = (1.0, 0.98, 0.95, 0.90)
"""True candidate/baseline ratios: a tie, then 2%, 5% and 10% faster."""
ORDERS = {"candidate first": CANDIDATE, "reference first": REFERENCE}
WALK_PAIRS = 6


def run_window(rule: StoppingRule, first: str, true: float, rng: random.Random, noise: tuple[float, float], burst: bool) -> tuple[str, list[float]]:  # fmt: skip
    """One measurement window under ``rule``: why it stopped and its pair ratios."""
    sigma, rho = noise
    chi2 = sum(rng.gauss(0.0, 1.0) ** 2 for _ in range(rule.noise_df))
    rule = dataclasses.replace(rule, noise_sd=sigma * math.sqrt(chi2 / rule.noise_df))
    schedule = get_pair_schedule(2 * rule.max_blocks, first=first)
    windows, steps = get_burst_windows(schedule), step_noise(rng, sigma, rho)
    at = rng.randrange(len(schedule) - 1) if burst else None
    ms: dict[str, list[float]] = {CANDIDATE: [], REFERENCE: []}
    for t, step in enumerate(schedule):
        log_ms = next(steps) + (math.log(true) if step.side == CANDIDATE else 0.0)
        if at is not None and at <= t <= at + 1:
            log_ms += math.log(BURST)
        if step.kind == "measured":
            ms[step.side].append(math.exp(log_ms))
        if step.ends_pair:
            ratios = [c / r for c, r in zip(ms[CANDIDATE], ms[REFERENCE])]
            stopped = look(rule, ratios, windows, 2 * rule.max_blocks)
            if stopped is not None:
                return stopped, ratios
    return "max_blocks", ratios


def called_faster(rule: StoppingRule, stopped: str, ratios: list[float], before: bool) -> bool:
    """The window's call: :func:`is_faster`, or (``before``) the interval of any number of pairs."""
    interval = get_rule_interval(rule, ratios)
    if before:  # the call on the interval alone, as it was
        return stopped == "faster" or (
            stopped in ("max_blocks", "settled") and interval is not None and interval.high < 1.0
        )
    return is_faster(stopped, interval, pair_ratios=ratios)


def get_rules(noise_df: int, sigma: float, before: bool = False) -> dict[str, StoppingRule]:
    """The verdict's and the walk's rules as the search and the tuner build them (the search's
    defaults; ``autotune.search.verdict.get_verdict_rule``, ``TuningWalk._rule``); ``before``: the
    verdict free to settle after one block, as it was."""
    s = SearchSettings()
    verdict_pairs = max(4, 2 * s.num_confirm_pairs)
    blocks = (verdict_pairs + 1) // 2
    verdict = StoppingRule(
        max_blocks=blocks, min_blocks=2, precision=s.precision, prune_above=1.0, noise_sd=sigma, noise_df=noise_df
    )
    walk = StoppingRule(
        max_blocks=(WALK_PAIRS + 1) // 2,
        precision=0.05,
        faster_below=1.0,
        prune_above=1.0,
        noise_sd=sigma,
        noise_df=noise_df,
        futile_above=1.0,
    )
    return {"emit": dataclasses.replace(verdict, min_blocks=1) if before else verdict, "adopt": walk}


def rate_calls(rule: StoppingRule, first: str, true: float, args: argparse.Namespace, burst: bool) -> int:
    """How many of ``args.trials`` windows of ``rule`` call the candidate faster."""
    rng, k = random.Random(args.seed), 0
    for _ in range(args.trials):
        stopped, ratios = run_window(rule, first, true, rng, (args.sigma, args.rho), burst)
        k += called_faster(rule, stopped, ratios, args.before)
    return k


def rate_prunes(gap: float, first: str, args: argparse.Namespace, burst: bool) -> int:
    """How many finalists ``gap`` times the leader's ratio (true leader 0.8) are pruned against it."""
    s = SearchSettings()
    pairs = 2 * s.num_confirm_pairs
    base = StoppingRule(max_blocks=(pairs + 1) // 2, precision=s.precision, noise_sd=args.sigma, noise_df=args.noise_df)
    rng, k = random.Random(args.seed), 0
    for _ in range(args.trials):
        leading = base if args.before else get_finalist_rule(base, None)  # the first finalist: no leader yet
        _, leader = run_window(leading, first, 0.8, rng, (args.sigma, args.rho), burst)
        if args.before:  # one block may settle, the leader's plain mean taken as exact
            mean = math.exp(statistics.fmean(math.log(r) for r in leader))
            rule = dataclasses.replace(base, prune_above=mean, futile_above=mean)
        else:
            rule = get_finalist_rule(base, {"pair_ratios": leader, "first": first})
        stopped, _ = run_window(rule, first, 0.8 * gap, rng, (args.sigma, args.rho), burst)
        k += stopped == "slower"
    return k


def share(k: int, n: int) -> str:
    low, high = wilson(k, n)
    return f"{100 * k / n:5.1f}% ({100 * low:4.1f}-{100 * high:4.1f})"


def measure(args: argparse.Namespace) -> dict[tuple[str, str, str], list[int | None]]:
    """Per (decision, order, burst model): counts for the tie (or as fast) case, then 2, 5, 10%
    (``lose``: no tie, then finalists that much faster than the leader, pruned)."""
    rules, table = get_rules(args.noise_df, args.sigma, args.before), {}
    for order, first in ORDERS.items():
        for burst in (False, True) if not args.quick else (True,):
            model = "burst" if burst else "none"
            for decision in ("emit", "adopt"):
                rule = rules[decision]
                table[decision, order, model] = [rate_calls(rule, first, t, args, burst) for t in SPEEDUPS]
            if not args.quick:
                gaps = [1.0 / t for t in SPEEDUPS]  # as fast, then 2%, 5%, 10% slower than the leader
                table["prune", order, model] = [rate_prunes(g, first, args, burst) for g in gaps]
                # the harm a prune can do: a finalist 2%, 5%, 10% faster than the leader pruned (lost)
                table["lose", order, model] = [None, *(rate_prunes(g, first, args, burst) for g in SPEEDUPS[1:])]
    return table


def main(argv: list[str] | None = None) -> dict[tuple[str, str, str], list[int | None]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sigma", type=float, default=0.09, help="pair log-ratio spread (the box's: 9%%)")
    parser.add_argument("--rho", type=float, default=None, help="lag-1 autocorrelation (default: the recorded one)")
    parser.add_argument("--noise-df", type=int, default=24, help="pooled degrees of freedom")
    parser.add_argument("--before", action="store_true", help="the rules before the burst guard on every call")
    parser.add_argument("--quick", action="store_true", help="600 trials, bursts only, no prune")
    args = parser.parse_args(argv)
    if args.quick:
        args.trials = 600
    args.rho = fit_rho(recorded_series()) if args.rho is None else args.rho
    print(f"sigma {args.sigma}, rho {args.rho:+.3f}, {args.trials} trials per case{', before' if args.before else ''}")
    table = measure(args)
    head = ("false (tie)", "power 2%", "power 5%", "power 10%")
    print(f"{'decision':<8} {'order':<16} {'burst':<6} " + " ".join(f"{h:>20}" for h in head))
    for (decision, order, model), counts in table.items():
        cells = (f"{'-' if k is None else share(k, args.trials):>20}" for k in counts)
        print(f"{decision:<8} {order:<16} {model:<6} " + " ".join(cells))
    if not args.quick:
        print("lose: a finalist 2%, 5% or 10% FASTER than the leader pruned (the columns' speedups, the leader's way)")
    return table


if __name__ == "__main__":
    main()
