"""Step time with versus without torch.profiler, alternating in one run of ranks.

    .venv/bin/python benchmarks/profiler_overhead.py [--model small] [--world 2] [--pairs 4] [--block 3]

One launch of ranks and one model; after a warm-up step, blocks of ``--block`` steps run
unprofiled (A) and under ``torch.profiler`` (B, CPU activity, no shapes or stacks: what a
trial's profiled window records) in alternation, ``--pairs`` times. Steps are timed as in
a trial (barrier, then perf_counter; the slowest rank per step). Prints the median step
time of each and the median of the per-pair B/A ratios: why trials time unprofiled steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.launch import run_ranks  # noqa: E402
from autotune.trial import load_trial_config  # noqa: E402
from fsdp_runtime import config_to_dict  # noqa: E402


def alternate(rank: int, world_size: int, *, model: str, config: dict, pairs: int, block: int) -> list[tuple[list[float], list[float]]]:
    """Rank program: per pair, (unprofiled step ms, profiled step ms) of this rank."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from autotune.train import build_training
    from autotune.trial_rank import _timed_step

    device = torch.device("cpu")
    training = build_training(rank, world_size, model=model, config=config)
    step = 0
    _timed_step(training, step, device, None)
    result = []
    for _ in range(pairs):
        plain, profiled = [], []
        for _ in range(block):
            step += 1
            plain.append(_timed_step(training, step, device, None)[0])
        with profile(activities=[ProfilerActivity.CPU]):
            for _ in range(block):
                step += 1
                profiled.append(_timed_step(training, step, device, None)[0])
        result.append((plain, profiled))
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
    ratios, plain_all, profiled_all = [], [], []
    for i in range(args.pairs):
        plain = [max(ms) for ms in zip(*(r[i][0] for r in run.results))]
        profiled = [max(ms) for ms in zip(*(r[i][1] for r in run.results))]
        plain_all += plain
        profiled_all += profiled
        ratios.append(statistics.median(profiled) / statistics.median(plain))
        print(f"pair {i}: unprofiled {statistics.median(plain):.1f} ms, profiled {statistics.median(profiled):.1f} ms, ratio {ratios[-1]:.3f}")
    print(f"{args.model}, world {args.world}, {args.pairs} pairs x {args.block} steps, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"median step: unprofiled {statistics.median(plain_all):.1f} ms, profiled {statistics.median(profiled_all):.1f} ms; "
          f"profiled/unprofiled {statistics.median(ratios):.3f} (pairs: {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
