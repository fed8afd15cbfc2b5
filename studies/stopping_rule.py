"""Prints the sequential stopping rule's error rates and cost, by Monte Carlo ([Note: sequential measurement]).

    .venv/bin/python studies/stopping_rule.py [--trials 5000] [--seed 0]   (the Note quotes --trials 20000)

Each simulated trial draws pair ratios ``true * exp(N(0, sigma))`` (sigma: the pairs' log-ratio
spread; 2-5% in paired trials on a 2-core CPU box, docs/benchmarks.md) and runs the search's rule
(``SearchSettings`` defaults: at most 6 pairs, precision 5%, faster below 1.0, pruned above 1.0
from the second block) through :func:`autotune.trials.sequential.decide`, as ``run_pairs`` does
after every block. Printed per (sigma, true ratio): how often the trial ended ``faster``,
``slower`` (pruned), ``settled`` or at ``max_blocks``, and the mean pairs it ran. A second
table adds a burst: one block's two candidate steps slowed by 1.5x (a load spike on adjacent
steps), for the false-prune rate under it. Then both again with the machine's noise pooled from
earlier trials ([Note: pooled noise]), as a search passes it once it has measured two paired
trials: each simulated trial gets a pooled spread estimated from ``--noise-df`` degrees of
freedom of the same sigma (``sigma * sqrt(chi2(df) / df)``, so the estimate's own error is in
the rates) and may be pruned on a third pair confirming a slow first block. Pure Python; no ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
from collections import Counter

from autotune.search.settings import SearchSettings
from autotune.trials.sequential import StoppingRule, confirms_slower, decide

REASONS = ("faster", "slower", "settled", "unlikely", "max_blocks")


def simulate(
    rule: StoppingRule, true: float, sigma: float, rng: random.Random, burst_block: int | None, burst: float = 1.5
) -> tuple[str, int]:
    if rule.noise_df:  # the pooled spread as a search would have estimated it
        chi2 = sum(rng.gauss(0.0, 1.0) ** 2 for _ in range(rule.noise_df))
        rule = dataclasses.replace(rule, noise_sd=sigma * math.sqrt(chi2 / rule.noise_df))
    ratios: list[float] = []
    for i in range(2 * rule.max_blocks):
        ratio = true * math.exp(rng.gauss(0.0, sigma))
        if burst_block is not None and i // 2 == burst_block:
            ratio *= burst
        ratios.append(ratio)
        if len(ratios) % 2 == 0:
            reason = decide(rule, ratios)
            if reason is not None:
                return reason, len(ratios)
        elif confirms_slower(rule, ratios):  # as run_pairs: a third pair confirming a slow first block
            return "slower", len(ratios)
    return "max_blocks", len(ratios)


def table(rule: StoppingRule, trials: int, seed: int, burst_block: int | None, burst: float = 1.5) -> None:
    rng = random.Random(seed)
    print(f"{'sigma':>6} {'true':>5} " + " ".join(f"{r:>10}" for r in REASONS) + f" {'pairs':>6}")
    for sigma in (0.02, 0.05, 0.09):
        for true in (0.5, 0.9, 0.95, 1.0, 1.05, 1.1, 1.3):
            counts: Counter[str] = Counter()
            pairs = 0
            for _ in range(trials):
                reason, n = simulate(rule, true, sigma, rng, burst_block, burst)
                counts[reason] += 1
                pairs += n
            shares = " ".join(f"{100 * counts[r] / trials:>9.1f}%" for r in REASONS)
            print(f"{sigma:>6.2f} {true:>5.2f} {shares} {pairs / trials:>6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise-df", type=int, default=24, help="pooled degrees of freedom (8 trials of 4 pairs: 24)")
    args = parser.parse_args()
    s = SearchSettings()
    rule = StoppingRule(
        max_blocks=(s.num_measured + 1) // 2, precision=s.precision, faster_below=1.0, prune_above=s.prune_ratio
    )
    print(f"rule: {rule}\n")
    print("pair log-ratios ~ N(log true, sigma); share of trials by how they stopped, mean pairs run")
    table(rule, args.trials, args.seed, None)
    print("\nthe same with a 1.5x burst on the first block's candidate steps")
    table(rule, args.trials, args.seed, 0)
    pooled = dataclasses.replace(rule, noise_sd=0.0, noise_df=args.noise_df)
    print(
        f"\nthe box's noise pooled over {args.noise_df} degrees of freedom (a slow first block pruned on a confirming pair)"
    )
    table(pooled, args.trials, args.seed, None)
    print("\nthe same with a 1.5x burst on the first block's candidate steps")
    table(pooled, args.trials, args.seed, 0)
    futile = dataclasses.replace(pooled, futile_above=rule.faster_below)
    print("\nthe same pooled rule, stopping trials unlikely to end below the best ([Note: futility])")
    table(futile, args.trials, args.seed, None)
    print("\nthe same with a 1.5x burst on the first block's candidate steps")
    table(futile, args.trials, args.seed, 0)
    print("\nthe same with a 1.15x burst on the first block's candidate steps")
    table(futile, args.trials, args.seed, 0, burst=1.15)


if __name__ == "__main__":
    main()
