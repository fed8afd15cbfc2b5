"""Prints the trials TPE and random sampling need to come within 2% of a measured grid's best, same budget.

    .venv/bin/python studies/sampler_efficiency.py [--model tiny] [--world 2] [--budget 30] [--seeds 20]

1. Enumerates a space small enough to measure completely (72 points) (prefetch patterns, which blocks
   skip gradient sync, keep-unsharded, async unshard; FSDP mesh) and measures every point
   once with real trials on the persistent rank pool (unprofiled steps only).
2. Replays searches over that measured landscape: each sampler proposes points, the
   objective is the point's measured step time, and we count the trials until one lands
   within 2% of the grid's best. ``--seeds`` searches per sampler.
Replaying keeps the comparison fair (both samplers see exactly the same numbers) and cheap.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optuna  # noqa: E402

from autotune.search import SearchSpace  # noqa: E402
from autotune.trials import (  # noqa: E402
    RankPool,  # noqa: E402
    TrialSpec,
    run_trial,
)
from profiles import load_model_profile  # noqa: E402

GRID = {
    "forward_prefetch": ["implicit", "depth1", "depth2"],
    "backward_prefetch": ["implicit", "depth1"],
    "nosync_blocks": ["none", "all", "every_2nd"],
    "keep_unsharded": [False, True],
    "unshard_async": ["off", "on"],
}
FIXED = {
    "mesh": "fsdp",
    "reshard_after_forward": "true",
    "reduce_scatter_buffers": 1,
    "nosync_level_fsdp": "last",
    "defer_concat": True,
}


def measure_grid(model: str, world_size: int, num_microbatches: int, num_passes: int) -> dict[tuple, float]:
    """Median step ms per grid point; ``num_passes`` full sweeps, medians over passes (de-noises the landscape)."""
    profile = load_model_profile(model)
    space = SearchSpace(
        block_names=tuple(profile.unit_names[:-1]), world_size=world_size, num_microbatches=num_microbatches
    )
    samples: dict[tuple, list[float]] = {}
    points = list(itertools.product(*GRID.values()))
    with RankPool(world_size) as pool, tempfile.TemporaryDirectory() as tmp:
        for sweep in range(num_passes):
            for i, point in enumerate(points):
                params = {**FIXED, **dict(zip(GRID, point))}
                spec = TrialSpec(
                    model=model,
                    config=space.build_config(params),
                    world_size=world_size,
                    out_dir=Path(tmp) / f"p{i}",
                    num_warmup=1,
                    num_measured=3,
                    profile=False,
                )
                result = run_trial(spec, pool=pool)
                if result.step_ms is None:
                    raise SystemExit(f"point {params} failed: {result.status}: {result.reason}")
                samples.setdefault(point, []).append(result.step_ms)
                print(f"\rpass {sweep + 1}/{num_passes}: measured {i + 1}/{len(points)}", end="", file=sys.stderr)
    print(file=sys.stderr)
    return {point: statistics.median(values) for point, values in samples.items()}


def trials_to_target(
    sampler: optuna.samplers.BaseSampler, table: dict[tuple, float], target: float, budget: int
) -> int | None:
    study = optuna.create_study(sampler=sampler)
    for n in range(1, budget + 1):
        trial = study.ask()
        point = tuple(trial.suggest_categorical(k, v) for k, v in GRID.items())
        value = table[point]
        study.tell(trial, value)
        if value <= target:
            return n
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--budget", type=int, default=30)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument(
        "--passes", type=int, default=2, help="full sweeps of the grid; each point's value is the median over sweeps"
    )
    parser.add_argument("--save", type=Path, default=None, help="write the measured grid (JSON) here")
    parser.add_argument("--load", type=Path, default=None, help="replay a grid saved by --save instead of measuring")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if args.load:
        table = {tuple(row["point"]): row["step_ms"] for row in json.loads(args.load.read_text())}
    else:
        table = measure_grid(args.model, args.world, args.microbatches, args.passes)
    if args.save:
        args.save.write_text(json.dumps([{"point": list(k), "step_ms": v} for k, v in table.items()]))
    best = min(table.values())
    samplers = {
        "tpe": lambda seed: optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=5),
        "random": lambda seed: optuna.samplers.RandomSampler(seed=seed),
    }
    print(f"grid: {len(table)} points, best {best:.1f} ms, median {statistics.median(table.values()):.1f} ms")
    for tolerance in (0.02, 0.05):
        target = best * (1 + tolerance)
        num_good = sum(v <= target for v in table.values())
        print(
            f"target: within {tolerance:.0%} of best ({num_good} points qualify); budget {args.budget}, {args.seeds} seeds; misses count as budget+1"
        )
        for name, make in samplers.items():
            counts = [trials_to_target(make(seed), table, target, args.budget) for seed in range(args.seeds)]
            hits = [c for c in counts if c is not None]
            padded = [c if c is not None else args.budget + 1 for c in counts]
            print(
                f"  {name:8s} hit rate {len(hits) / len(counts):4.0%}  median trials {statistics.median(padded):5.1f}  per seed: {' '.join(str(c) if c else '-' for c in counts)}"
            )


if __name__ == "__main__":
    main()
