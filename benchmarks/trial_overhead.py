"""Per-trial overhead: fresh ranks per trial (run_ranks) versus a persistent RankPool.

    .venv/bin/python benchmarks/trial_overhead.py [--model tiny] [--world 2] [--pairs 3]

Each trial runs ``--steps`` timed steps and no warm-up or profiling, so every step is
measured; its overhead is the trial's wall time minus the sum of its steps (the slowest
rank's time per step): process start-up, process-group set-up, model build and
``fully_shard``, exit and result collection. Fresh (A) and pooled (B) trials alternate,
``--pairs`` times, after one untimed pooled trial that starts the pool (its start-up is
printed separately). Prints the median overhead and wall time of each and their ratio.
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


def _overhead_s(result: TrialResult) -> float:
    if result.status != "ok":
        raise SystemExit(f"trial failed: {result.status}: {result.reason}")
    return result.wall_s - sum(result.metrics["step_ms_per_step"]) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
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
