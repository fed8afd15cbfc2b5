"""Prints a trial's fixed cost: fresh ranks vs the rank pool; ``--paired``: a reference on its own model vs in place.

Fresh ranks versus a persistent RankPool, and (``--paired``) a paired trial's reference on its own
model versus the candidate's model switched in place.

    .venv/bin/python benchmarks/trial_overhead.py [--model tiny] [--world 2] [--pairs 3]
    .venv/bin/python benchmarks/trial_overhead.py --paired [--model small] [--warmup 2]

Default mode: each trial runs ``--steps`` timed steps and no warm-up or profiling, so every
step is measured; its overhead is the trial's wall time minus the sum of its steps (the slowest
rank's time per step): process start-up, process-group set-up, model build and
``fully_shard``, exit and result collection. Fresh (A) and pooled (B) trials alternate,
``--pairs`` times, after one untimed pooled trial that starts the pool (its start-up is
printed separately). Prints the median overhead and wall time of each and their ratio.

``--paired``: search-like trials, pooled, of a config that differs from the defaults only in
knobs switched in place (no reshard after forward, prefetch one block ahead), paired with the
defaults for ``--steps`` pairs after ``--warmup`` warm-up steps. A: the reference on a model of
its own (``AUTOTUNE_PAIRED_MODELS=two``, what every paired trial did before [Note: one model
for both sides]); B: one model for both sides. Each has its own pool (the variable is read by
the ranks), started by one untimed trial; A and B alternate. Overhead is the wall time minus
every measured and settle step (both sides): builds, warm-up steps, result collection.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from autotune.trials import (  # noqa: E402
    RankPool,  # noqa: E402
    TrialResult,
    TrialSpec,
    load_trial_config,
    run_trial,
)
from autotune.trials.numerics import keep_and_prefetch  # noqa: E402
from autotune.trials.sides import PAIRED_MODELS_ENV  # noqa: E402


def _overhead_s(result: TrialResult) -> float:
    if result.status != "ok":
        raise SystemExit(f"trial failed: {result.status}: {result.reason}")
    return result.wall_s - sum(result.metrics["step_ms_per_step"]) / 1e3


def _paired_overhead_s(result: TrialResult) -> float:
    if result.status != "ok":
        raise SystemExit(f"trial failed: {result.status}: {result.reason}")
    rank = result.metrics.ranks[0]
    steps = rank.step_ms + rank.reference_step_ms + rank.settle_step_ms + rank.reference_settle_step_ms
    return result.wall_s - sum(steps) / 1e3


def _pool(world: int, paired_models: str | None) -> RankPool:
    """A pool whose ranks read ``AUTOTUNE_PAIRED_MODELS`` as given (the environment at their start)."""
    if paired_models is None:
        os.environ.pop(PAIRED_MODELS_ENV, None)
    else:
        os.environ[PAIRED_MODELS_ENV] = paired_models
    pool = RankPool(world, backend="gloo")
    pool._start()  # now, under this environment
    os.environ.pop(PAIRED_MODELS_ENV, None)
    return pool


def paired(args: argparse.Namespace) -> None:
    with (
        tempfile.TemporaryDirectory(prefix="trial-overhead-") as tmp,
        _pool(args.world, "two") as two,
        _pool(args.world, None) as one,
    ):

        def spec(name: str) -> TrialSpec:
            return TrialSpec(
                model=args.model,
                config=keep_and_prefetch(load_trial_config(None, args.model)),
                reference=load_trial_config(None, args.model),
                world_size=args.world,
                out_dir=Path(tmp) / name,
                num_warmup=args.warmup,
                num_measured=args.steps,
                profile=False,
                backend="gloo",
                timeout_s=900,
            )

        for name, pool in (("two-start", two), ("one-start", one)):
            _paired_overhead_s(run_trial(spec(name), pool=pool))
        rows = {"two": [], "one": []}
        for i in range(args.pairs):
            for name, pool in (("two", two), ("one", one)):
                result = run_trial(spec(f"{name}{i}"), pool=pool)
                rows[name].append((_paired_overhead_s(result), result.wall_s, result.metrics.paired.get("ratio")))
            print(
                f"pair {i}: two models overhead {rows['two'][-1][0]:.2f} s (wall {rows['two'][-1][1]:.2f}), "
                f"one model {rows['one'][-1][0]:.2f} s (wall {rows['one'][-1][1]:.2f})"
            )
    print(
        f"{args.model}, world {args.world}, {args.warmup} warm-up steps, {args.steps} pairs/trial, {args.pairs} pairs, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    for k, what in ((0, "overhead"), (1, "wall")):
        a, b = (statistics.median(x[k] for x in rows[n]) for n in ("two", "one"))
        spread = [x[k] / y[k] for x, y in zip(rows["two"], rows["one"])]
        print(
            f"median {what} per trial: two models {a:.2f} s, one model {b:.2f} s, two/one {a / b:.2f}x "
            f"(per pair {min(spread):.2f}-{max(spread):.2f})"
        )
    ratios = [f"{x[2] or 0:.3f}/{y[2] or 0:.3f}" for x, y in zip(rows["two"], rows["one"])]
    print(f"paired ratio per trial (two/one models): {', '.join(ratios)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--paired", action="store_true", help="one model for both sides vs two (see above)")
    parser.add_argument("--warmup", type=int, default=2, help="--paired: warm-up steps per trial")
    args = parser.parse_args()
    if args.paired:
        paired(args)
        return
    with tempfile.TemporaryDirectory(prefix="trial-overhead-") as tmp, RankPool(args.world, backend="gloo") as pool:

        def spec(name: str) -> TrialSpec:
            return TrialSpec(
                model=args.model,
                config=load_trial_config(None, args.model),
                world_size=args.world,
                out_dir=Path(tmp) / name,
                num_warmup=0,
                num_measured=args.steps,
                profile=False,
                backend="gloo",
                timeout_s=300,
            )

        start = run_trial(spec("pool-start"), pool=pool)
        print(f"pool start (first pooled trial): wall {start.wall_s:.2f} s, overhead {_overhead_s(start):.2f} s")
        fresh, pooled = [], []
        for i in range(args.pairs):
            a = run_trial(spec(f"fresh{i}"))
            b = run_trial(spec(f"pool{i}"), pool=pool)
            fresh.append((_overhead_s(a), a.wall_s))
            pooled.append((_overhead_s(b), b.wall_s))
            print(
                f"pair {i}: fresh overhead {fresh[-1][0]:.2f} s (wall {a.wall_s:.2f}), pool overhead {pooled[-1][0]:.2f} s (wall {b.wall_s:.2f})"
            )
    fo, fw = (statistics.median(x[k] for x in fresh) for k in (0, 1))
    po, pw = (statistics.median(x[k] for x in pooled) for k in (0, 1))
    print(
        f"{args.model}, world {args.world}, {args.steps} steps/trial, {args.pairs} pairs, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(f"median overhead per trial: fresh {fo:.2f} s, pool {po:.2f} s, fresh/pool {fo / po:.1f}x")
    print(f"median wall per trial:     fresh {fw:.2f} s, pool {pw:.2f} s, fresh/pool {fw / pw:.1f}x")


if __name__ == "__main__":
    main()
