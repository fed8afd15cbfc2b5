"""Prints the sequential stopping rule's error rates and cost per pair order, by Monte Carlo ([Note: sequential measurement]).

    .venv/bin/python studies/stopping_rule.py [--trials 4000] [--seed 0] [--sigma 0.09] [--rho R]

Each simulated trial runs the schedule ``run_pairs`` runs (:func:`get_order_schedule`, the
search's 4 pairs, for each order the search uses: the candidate first where the reference is
switched in place or kept warm, the reference first on a model of its own, models built in turn
with their warm-up steps), step by step: every step, settle and warm-up steps included, gets a
log time from an AR(1) series whose lag-1 autocorrelation is the one of the recorded per-step
series in the repository (``tests/data/gpu_traces/*/metrics.json``, five H200 trials, and the
two ranks of ``tests/data/artifacts/metrics_v11.json``, a ``tiny`` CPU trial: each series'
sample autocorrelation of its log step times, bias-corrected by ``+1/n`` and averaged; override
with ``--rho``), scaled so that the pair log-ratios spread ``--sigma`` (the box's 9%). The
candidate's steps are ``true`` times slower. After every pair the rule looks as ``run_pairs``
does (:func:`fsdp_runtime.tuning.sequential.look`, with the schedule's burst windows), with the
box's noise pooled over 24 degrees of freedom (its estimation error drawn) and futility on, as
in a search's trials once it has measured two paired trials. A burst is a 1.5x slowdown of two
adjacent steps of the schedule: at a uniformly drawn position ("anywhere"), or at each position
in turn (the worst is printed). Printed per order: P(a tie is pruned), P(a tie stops
``faster``: the best, the bar of later trials), P(a real 5% / 10% speedup is lost by the rule:
pruned or stopped ``unlikely``), P(it is missed: lost, or its median block ratio, the trial's
figure, not below the best), mean steps run by a tie and by a
config twice as fast (settle and warm-up steps included). ``--unguarded``: the rule as it was before its decisions read the
schedule (a slow first block confirmed by any third pair above by one pooled spread, no burst
windows). Pure Python; no ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import random
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autotune.search.settings import SearchSettings  # noqa: E402
from fsdp_runtime.tuning.pair_schedule import ScheduledStep, Window, get_burst_windows, get_order_schedule  # noqa: E402
from fsdp_runtime.tuning.sequential import StoppingRule, decide, get_interval, look  # noqa: E402

ORDERS = {"candidate first (in place, kept)": "kept", "reference first (own model)": "own", "in turn": "in_turn"}
RECORDED = ("tests/data/gpu_traces/*/metrics.json", "tests/data/artifacts/metrics_v11.json")
BURST = 1.5


def recorded_series() -> list[list[float]]:
    """Per-step slowest-rank times of the recorded trials (each rank's own where it has them)."""
    series = []
    for pattern in RECORDED:
        for path in sorted(glob.glob(str(ROOT / pattern))):
            data = json.loads(Path(path).read_text())
            ranks = [r["step_ms"] for r in data.get("ranks", []) if len(r.get("step_ms", [])) >= 4]
            series += ranks if "artifacts" in path else [data["step_ms_per_step"]]
    return series


def fit_rho(series: list[list[float]]) -> float:
    """The lag-1 autocorrelation of log step times, per series bias-corrected (+1/n), averaged."""
    rhos = []
    for steps in series:
        logs = [math.log(x) for x in steps]
        mean = statistics.fmean(logs)
        dev = [x - mean for x in logs]
        rhos.append(sum(a * b for a, b in zip(dev, dev[1:])) / sum(d * d for d in dev) + 1 / len(dev))
    return statistics.fmean(rhos)


def step_noise(rng: random.Random, sigma: float, rho: float) -> Iterator[float]:
    """Consecutive steps' log-time noise, drawn as needed: an AR(1) series of lag-1 autocorrelation
    ``rho``, scaled so that the log-ratio of two steps two apart (a pair's, a settle step between)
    spreads ``sigma``."""
    step_sd = sigma / math.sqrt(2 * (1 - rho * rho))
    e = rng.gauss(0.0, step_sd)
    while True:
        yield e
        e = rho * e + math.sqrt(1 - rho * rho) * rng.gauss(0.0, step_sd)


def _unguarded_look(rule: StoppingRule, ratios: list[float], windows: list[Window], num_pairs: int) -> str | None:
    """The rule before its decisions read the schedule: blocks decide, a third pair above the
    limit by one pooled spread confirms a slow first block."""
    n = len(ratios)
    if n % 2 == 0 or n == num_pairs:
        return decide(rule, ratios, windows=[])
    if rule.prune_above is None or rule.noise_sd is None or n != 3:
        return None
    limit, pool = rule.prune_above, (rule.noise_sd, rule.noise_df)
    looked, now = get_interval(ratios[:-1], *pool), get_interval(ratios, *pool)
    slow = looked.low > limit and ratios[-1] > limit * math.exp(rule.noise_sd) and now.low > limit
    return "slower" if slow else None


def simulate(rule: StoppingRule, schedule: list[ScheduledStep], true: float, noise: tuple[float, float], rng: random.Random, burst_at: int | None, guarded: bool) -> tuple[str, int, float]:  # fmt: skip
    """One trial: why it stopped, the steps it ran, its median block ratio."""
    sigma, rho = noise
    chi2 = sum(rng.gauss(0.0, 1.0) ** 2 for _ in range(rule.noise_df))
    rule = dataclasses.replace(rule, noise_sd=sigma * math.sqrt(chi2 / rule.noise_df))
    windows = get_burst_windows(schedule) if guarded else []
    num_pairs, decider = 1 + schedule[-1].pair, look if guarded else _unguarded_look
    steps, ms = step_noise(rng, sigma, rho), {"candidate": [], "reference": []}
    reason = "max_blocks"
    for t, step in enumerate(schedule):
        log_ms = next(steps) + (math.log(true) if step.side == "candidate" else 0.0)
        if burst_at is not None and burst_at <= t <= burst_at + 1:
            log_ms += math.log(BURST)
        if step.kind == "measured":
            ms[step.side].append(math.exp(log_ms))
        if step.ends_pair:
            ratios = [c / r for c, r in zip(ms["candidate"], ms["reference"])]
            stopped = decider(rule, ratios, windows, num_pairs)
            if stopped is not None:
                reason = stopped
                break
    c, r = ms["candidate"], ms["reference"]
    blocks = [sum(c[k : k + 2]) / sum(r[k : k + 2]) for k in range(0, len(r), 2)]
    return reason, t + 1, statistics.median(blocks)


def rates(rule: StoppingRule, schedule: list[ScheduledStep], true: float, args: argparse.Namespace, burst: str | int | None) -> dict[str, float]:  # fmt: skip
    """Shares of ``args.trials`` trials: pruned, faster, lost (pruned or ``unlikely``), missed (lost,
    or its median block ratio not below the best), and mean steps."""
    rng = random.Random(args.seed)
    counts = {"pruned": 0, "faster": 0, "lost": 0, "missed": 0, "steps": 0}
    for _ in range(args.trials):
        at = rng.randrange(len(schedule) - 1) if burst == "anywhere" else burst
        reason, steps, ratio = simulate(rule, schedule, true, (args.sigma, args.rho), rng, at, not args.unguarded)
        counts["pruned"] += reason == "slower"
        counts["faster"] += reason == "faster"
        counts["lost"] += reason in ("slower", "unlikely")
        counts["missed"] += reason in ("slower", "unlikely") or ratio >= 1.0
        counts["steps"] += steps
    return {k: v / args.trials for k, v in counts.items()}


def worst(rule: StoppingRule, schedule: list[ScheduledStep], args: argparse.Namespace) -> tuple[float, str, float, str]:  # fmt: skip
    """A tie's highest prune and faster rates over the burst's positions, and where."""
    by_position = [rates(rule, schedule, 1.0, args, t) for t in range(len(schedule) - 1)]
    labels = [f"{a.label}+{b.label}" for a, b in zip(schedule, schedule[1:])]
    prune = max(range(len(by_position)), key=lambda t: by_position[t]["pruned"])
    faster = max(range(len(by_position)), key=lambda t: by_position[t]["faster"])
    return by_position[prune]["pruned"], labels[prune], by_position[faster]["faster"], labels[faster]


def report(rule: StoppingRule, args: argparse.Namespace) -> None:
    settings = SearchSettings()
    head = ("tie pruned", "tie faster", "lost 5%", "lost 10%", "miss 5%", "miss 10%", "steps", "steps 2x")
    print(f"{'order':<34} {'burst':<9} " + " ".join(f"{h:>10}" for h in head))
    for name, kind in ORDERS.items():
        schedule = get_order_schedule(kind, settings.num_measured, warmup=settings.num_warmup)
        for burst in (None, "anywhere"):
            tie = rates(rule, schedule, 1.0, args, burst)
            fast = [rates(rule, schedule, t, args, burst) for t in (0.95, 0.90)]
            clear = rates(rule, schedule, 0.5, args, burst)
            shares = [tie["pruned"], tie["faster"], *(f["lost"] for f in fast), *(f["missed"] for f in fast)]
            print(
                f"{name:<34} {burst or 'none':<9} "
                + " ".join(f"{100 * x:>9.1f}%" for x in shares)
                + f" {tie['steps']:>10.2f} {clear['steps']:>10.2f}"
            )
        prune, at_prune, faster, at_faster = worst(rule, schedule, args)
        print(f"{'':<34} {'worst':<9} {100 * prune:>9.1f}% {100 * faster:>9.1f}%   (pruned: {at_prune}; faster: {at_faster})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sigma", type=float, default=0.09, help="pair log-ratio spread (the box's: 9%%)")
    parser.add_argument("--rho", type=float, default=None, help="lag-1 autocorrelation (default: the recorded one)")
    parser.add_argument("--noise-df", type=int, default=24, help="pooled degrees of freedom (8 trials of 4 pairs: 24)")
    parser.add_argument("--unguarded", action="store_true", help="the rule before it read the schedule")
    args = parser.parse_args()
    series = recorded_series()
    fitted = fit_rho(series)
    args.rho = fitted if args.rho is None else args.rho
    print(f"recorded series: {len(series)} ({sum(map(len, series))} steps); lag-1 autocorrelation {fitted:+.3f}")
    s = SearchSettings()
    rule = StoppingRule(
        max_blocks=(s.num_measured + 1) // 2,
        precision=s.precision,
        faster_below=1.0,
        prune_above=s.prune_ratio,
        noise_sd=args.sigma,
        noise_df=args.noise_df,
        futile_above=1.0,
    )
    print(
        f"rule: {rule} (noise_sd drawn per trial)\nsigma {args.sigma}, rho {args.rho:+.3f}, {args.trials} trials per case"
    )
    report(rule, args)


if __name__ == "__main__":
    main()
