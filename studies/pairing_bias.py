"""Prints a config's ratio to the defaults as each runs alone and as a paired trial measures it.

Does a paired trial measure a config's ratio to the defaults as each config runs alone?

    .venv/bin/python studies/pairing_bias.py [--workload wide] [--rounds 6] [--pairs 3] [--steps 6]

``benchmarks/sim_accuracy.py`` and the search take a config's speed from paired trials ([Note: paired
measurement] in ``autotune/trials/paired.py``): the config and the defaults alternate on the same
ranks. What a user runs is the config alone. This benchmark measures the same candidates both
ways, on one rank pool, in rounds: per round and candidate, an unpaired trial of the defaults, an
unpaired trial of the candidate (the order flips every round, so drift cancels over rounds) and
a paired trial of the candidate against the defaults. It prints per candidate the *alone* ratio
(candidate's median step over the adjacent defaults trial's), the *paired* ratio (the trial's
block ratio), their medians over rounds with the interquartile range, the gap between them, and
the defaults' own median step alone and as a paired trial's reference.

Candidates (``sim_accuracy``'s ladder): ``rep`` (HSDP Nx1, a mesh change: the reference gets a
model of its own), ``rep_nosync`` (HSDP Nx1 with no gradient sync before the last microbatch),
``nosync`` (FSDP, no gradient sync: switched in place on one model).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.search import SearchSpace, describe_params  # noqa: E402
from autotune.sim import get_model_work  # noqa: E402
from autotune.trials import RankPool, run_trial  # noqa: E402
from benchmarks.sim_accuracy import NUM_MICROBATCHES, SETTINGS, WORKLOADS, _spec, get_ladder  # noqa: E402
from profiles.sources import load_model_source  # noqa: E402

CANDIDATES = {"rep": 1, "rep_nosync": 5, "nosync": 2}
"""Name -> index into ``sim_accuracy.get_ladder``."""


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


def _alone(model, config, world, out, cluster, steps, pool) -> float:
    result = run_trial(
        _spec(model, config, world, out, cluster=cluster, steps=steps, warmup=2, profile=False), pool=pool
    )
    assert result.ok, f"{out}: {result.status} {result.reason}"
    return result.step_ms


def run_round(i: int, args: argparse.Namespace, space: SearchSpace, model, pool, out: Path) -> dict:
    """One round: per candidate, the defaults and the candidate alone (order flipping by round), then paired."""
    world, cluster = SETTINGS[args.setting]
    ladder = get_ladder(space)
    defaults = space.build_config(ladder[0])
    row: dict = {"load": os.getloadavg()[0]}
    for name in args.candidates.split(","):
        config = space.build_config(ladder[CANDIDATES[name]])
        sides = [("defaults", defaults), (name, config)]
        alone = {}
        for side, cfg in sides if i % 2 == 0 else sides[::-1]:
            alone[side] = _alone(model, cfg, world, out / f"r{i}_{name}_{side}", cluster, args.steps, pool)
        result = run_trial(
            _spec(
                model,
                config,
                world,
                out / f"r{i}_{name}_paired",
                cluster=cluster,
                steps=args.pairs,
                warmup=2,
                profile=False,
                reference=defaults,
            ),
            pool=pool,
        )
        assert result.ok, f"paired {name}: {result.status} {result.reason}"
        m = result.metrics
        row[name] = {
            "alone_ratio": alone[name] / alone["defaults"],
            "paired_ratio": m.paired["ratio"],
            "defaults_alone_ms": alone["defaults"],
            "candidate_alone_ms": alone[name],
            "defaults_paired_ms": statistics.median(m.reference_step_ms_per_step),
            "candidate_paired_ms": m.step_ms,
        }
        print(
            f"  round {i} {name:>10}: alone {row[name]['alone_ratio']:.3f} ({alone[name]:.0f} / {alone['defaults']:.0f} ms)"
            f"  paired {row[name]['paired_ratio']:.3f} ({m.step_ms:.0f} / {row[name]['defaults_paired_ms']:.0f} ms)"
            f"  load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    return row


def summarize(rows: list[dict], names: list[str]) -> None:
    print(
        "\ncandidate    alone ratio (IQR)        paired ratio (IQR)       paired/alone  defaults alone / as reference ms"
    )
    for name in names:
        alone = [r[name]["alone_ratio"] for r in rows]
        paired = [r[name]["paired_ratio"] for r in rows]
        gaps = [p / a for p, a in zip(paired, alone)]
        a, p, g = _quartiles(alone), _quartiles(paired), _quartiles(gaps)
        d_alone = statistics.median(r[name]["defaults_alone_ms"] for r in rows)
        d_ref = statistics.median(r[name]["defaults_paired_ms"] for r in rows)
        print(
            f"{name:>10}   {a[1]:.3f} ({a[0]:.3f}-{a[2]:.3f})   {p[1]:.3f} ({p[0]:.3f}-{p[2]:.3f})"
            f"   {g[1]:.3f} ({g[0]:.3f}-{g[2]:.3f})   {d_alone:.0f} / {d_ref:.0f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="wide", choices=sorted(WORKLOADS))
    parser.add_argument("--setting", default="raw", choices=sorted(SETTINGS))
    parser.add_argument("--candidates", default=",".join(CANDIDATES))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--pairs", type=int, default=3, help="pairs per paired trial (sim_accuracy's default)")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per unpaired trial")
    parser.add_argument("--microbatches", type=int, default=NUM_MICROBATCHES)
    parser.add_argument("--out", type=Path, default=Path("runs/pairing_bias"))
    args = parser.parse_args()
    world, _ = SETTINGS[args.setting]
    model = WORKLOADS[args.workload]
    work = get_model_work(load_model_source(model), "float32")
    space = SearchSpace(
        block_names=work.block_names, world_size=world, num_microbatches=args.microbatches, device_type="cpu"
    )
    names = args.candidates.split(",")
    for name in names:
        print(f"{name}: {describe_params(get_ladder(space)[CANDIDATES[name]])}")
    started, rows = time.monotonic(), []
    with RankPool(world) as pool:
        _alone(model, space.build_config(space.get_default_params()), world, args.out / "warmup", None, 3, pool)
        for i in range(args.rounds):
            rows.append(run_round(i, args, space, model, pool, args.out))
    summarize(rows, names)
    print(f"\n{time.monotonic() - started:.0f} s; load {' / '.join(f'{x:.1f}' for x in os.getloadavg())}")
    (args.out / "results.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}))


if __name__ == "__main__":
    main()
