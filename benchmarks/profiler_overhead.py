"""Step time with versus without torch.profiler, alternating in one run of ranks.

    .venv/bin/python benchmarks/profiler_overhead.py [--model small] [--world 2] [--pairs 4] [--block 3]

One launch of ranks and one model; after a warm-up step, blocks of ``--block`` steps run
unprofiled (A) and under ``torch.profiler`` (B, CPU activity, no shapes or stacks: what a
trial's profiled window records) in alternation, ``--pairs`` times. Steps are timed as in
a trial (barrier, then perf_counter; the slowest rank per step). Prints the median step
time of each and the median of the per-pair B/A ratios: why trials time unprofiled steps.
Both wall time (slowest rank) and CPU time (process time summed over ranks, which counts
the profiler's extra work even when other processes compete for the cores) are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.trials import run_ranks  # noqa: E402
from autotune.trials import load_trial_config  # noqa: E402
from fsdp_runtime import config_to_dict  # noqa: E402


def alternate(rank: int, world_size: int, *, model: str, config: dict, pairs: int, block: int) -> list[dict[str, list[float]]]:
    """Rank program: per pair, this rank's wall and CPU ms per step, unprofiled and profiled."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from autotune.trials import build_training
    from autotune.trials.program import timed_step

    device = torch.device("cpu")
    training = build_training(rank, world_size, model=model, config=config)
    step = 0
    timed_step(training, step, device)

    def run_block(times: dict[str, list[float]], mode: str) -> None:
        nonlocal step
        for _ in range(block):
            step += 1
            cpu = time.process_time()
            times[f"{mode}_wall"].append(timed_step(training, step, device)[0])
            times[f"{mode}_cpu"].append((time.process_time() - cpu) * 1e3)

    result = []
    for _ in range(pairs):
        times: dict[str, list[float]] = {k: [] for k in ("plain_wall", "plain_cpu", "profiled_wall", "profiled_cpu")}
        run_block(times, "plain")
        with profile(activities=[ProfilerActivity.CPU]):
            run_block(times, "profiled")
        result.append(times)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--block", type=int, default=3)
    args = parser.parse_args()
    config = config_to_dict(load_trial_config(None, args.model))
    run = run_ranks(
        "profiler_overhead:alternate", world_size=args.world, timeout_s=1800,
        kwargs={"model": args.model, "config": config, "pairs": args.pairs, "block": args.block},
    )
    if not run.ok:
        raise SystemExit(f"ranks failed: {run.status}: {run.reason}")
    print(f"{args.model}, world {args.world}, {args.pairs} pairs x {args.block} steps, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for clock in ("wall", "cpu"):
        ratios, plain_all, profiled_all = [], [], []
        for i in range(args.pairs):
            # Per step, the slowest rank (wall) or the ranks' summed CPU time (cpu).
            combine = max if clock == "wall" else sum
            plain = [combine(ms) for ms in zip(*(r[i][f"plain_{clock}"] for r in run.results))]
            profiled = [combine(ms) for ms in zip(*(r[i][f"profiled_{clock}"] for r in run.results))]
            plain_all += plain
            profiled_all += profiled
            ratios.append(statistics.median(profiled) / statistics.median(plain))
        print(
            f"{clock:>4} ms/step: unprofiled {statistics.median(plain_all):.1f}, profiled {statistics.median(profiled_all):.1f}; "
            f"profiled/unprofiled median {statistics.median(ratios):.3f} (pairs: {', '.join(f'{r:.3f}' for r in ratios)})"
        )


if __name__ == "__main__":
    main()
