"""Prints what a step pays for following a step of another config on the same ranks (the switch cost).

    .venv/bin/python studies/switch_cost.py [--model wide] [--candidate reshard|keep] [--runs 8]
        [--run-length 4] [--gap switch|twin|sleep] [--cluster cpu-emulated-ib]

One launch of 2 ranks builds the defaults (R) and a candidate (C) side by side, as a paired
trial does, then runs them in alternating runs of ``--run-length`` steps (R C R C ...: every
run but the first follows a run of the other side). Two controls, each config in a launch of
its own: ``--gap twin`` alternates a config with a second model of the same config, and
``--gap sleep`` runs a config alone with an idle pause as long as a run between its runs. A
cost that appears under ``sleep`` comes from idleness (sockets, threads, CPU frequency), one
under ``twin`` from a second model being there, one under ``switch`` only from the other
config's state. Prints, per side and per position in a run (1 = the first step of a run),
the median step time, training-thread CPU time and page faults with their interquartile
ranges, and the pair ratios a one-step ABBA measurement would see. ``--model wide`` is
``benchmarks/models/wide.toml`` (dim 512, 2 blocks, batch 1, seq 256). See [Note: switch
cost] in ``autotune/trials/paired.py``.

``--estimators PAIRS`` measures the two sides with the paired measurement itself, on the same
two models in one launch: per round (``--runs``), a window of PAIRS one-step ABBA pairs (the
measurement before settle steps) and a window with settle steps, in alternating order; it
prints the median pair ratio at odd and even positions, the gap between them, each method's
estimate (median of pairs; median of ABBA blocks) with its interquartile range, and the steps
each method ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.trials import build_training  # noqa: E402
from benchmarks._common import run_rank0  # noqa: E402
from fsdp_runtime import config_to_dict, default_config  # noqa: E402
from profiles import load_model_profile  # noqa: E402

WIDE = ROOT / "benchmarks" / "models" / "wide.toml"


def get_candidate(blocks: list[str], kind: str, num_microbatches: int) -> dict:
    base = default_config(blocks, num_microbatches=num_microbatches)
    keep = kind == "keep"
    units = [
        dataclasses.replace(u, sync="last", reshard_after_backward=not keep) if u.name != "root" else u
        for u in base.units
    ]
    return config_to_dict(dataclasses.replace(base, units=units))


def rank_main(
    rank: int,
    world_size: int,
    *,
    model: str,
    configs: dict,
    runs: int,
    run_length: int,
    warmup: int,
    gap: str,
    cluster: str | None = None,
) -> list[dict]:
    """Runs of ``run_length`` steps, sides alternating (``gap="sleep"``: one model, each run
    after the first preceded by an idle wait as long as a run); every step's record."""
    import torch
    import torch.distributed as dist

    from autotune.trials import LinkEmulator
    from autotune.trials.program import timed_step
    from autotune.trials.rank_memory import tune_heap
    from profiles import load_cluster_profile

    tune_heap(torch.device("cpu"))
    names = list(configs)
    sides = {name: build_training(rank, world_size, model=model, config=configs[name]) for name in names}
    steps = dict.fromkeys(names, 0)
    emulators = {n: LinkEmulator.from_cluster(load_cluster_profile(cluster)) if cluster else None for n in names}
    for name in names:
        for _ in range(warmup):
            timed_step(sides[name], steps[name], sides[name].device, emulators[name])
            steps[name] += 1
    records: list[dict] = []
    for r in range(runs):
        name = names[r % len(names)]
        if gap == "sleep" and r > 0:
            time.sleep(sum(rec["ms"] for rec in records[-run_length:]) / 1e3)
            dist.barrier()
        for position in range(1, run_length + 1):
            timing = timed_step(sides[name], steps[name], sides[name].device, emulators[name])
            steps[name] += 1
            records.append(
                {
                    "run": r,
                    "side": name,
                    "position": position,
                    "ms": timing.ms,
                    "cpu_ms": timing.cpu_ms,
                    "faults": timing.page_faults,
                }
            )
    return records


def estimators_main(
    rank: int, world_size: int, *, model: str, configs: dict, pairs: int, rounds: int, warmup: int, cluster: str | None
) -> list[dict]:
    """The paired measurement itself on the same two models: per round, ``pairs`` ABBA pairs of
    one-step sides (``settle=False``, the measurement before settle steps: [Note: switch cost]) and ``pairs`` pairs with
    settle steps, the two in alternating order; each window's pair times."""
    import torch

    from autotune.trials import LinkEmulator
    from autotune.trials.paired import Side, run_pairs, step_side
    from autotune.trials.program import timed_step
    from autotune.trials.rank_memory import tune_heap
    from profiles import load_cluster_profile

    device = torch.device("cpu")
    tune_heap(device)
    sides = {
        name: Side(
            training=build_training(rank, world_size, model=model, config=configs[name]),
            emulator=LinkEmulator.from_cluster(load_cluster_profile(cluster)) if cluster else None,
        )
        for name in ("candidate", "reference")
    }
    for side in sides.values():
        for _ in range(warmup):
            step_side(side, device, timed_step)
    windows = []
    for r in range(rounds):
        for settle in (False, True) if r % 2 == 0 else (True, False):
            for side in sides.values():
                side.clear()
            last = "reference"  # run_pairs starts with the reference; a settle step first puts it there
            step_side(sides["reference"], device, timed_step, settle=True)
            run_pairs(
                sides,
                num_pairs=pairs,
                device=device,
                timed_step=timed_step,
                prune_if_ratio_above=None,
                last=last,
                settle=settle,
            )
            windows.append(
                {
                    "settle": settle,
                    "candidate_ms": list(sides["candidate"].step_ms),
                    "reference_ms": list(sides["reference"].step_ms),
                    "candidate_settle_ms": list(sides["candidate"].settle_ms),
                    "reference_settle_ms": list(sides["reference"].settle_ms),
                }
            )
    return windows


def _print_estimators(windows: list[dict]) -> None:
    from autotune.trials.paired import get_block_ratios, get_ratios

    print(f"{'measurement':34} {'pairs 1,3,5..':>14} {'pairs 2,4,6..':>14} {'gap':>7} {'estimate (IQR)':>26} steps")
    for settle in (False, True):
        mine = [w for w in windows if w["settle"] == settle]
        ratios = [get_ratios(w["candidate_ms"], w["reference_ms"]) for w in mine]
        odd = [x for r in ratios for x in r[0::2]]
        even = [x for r in ratios for x in r[1::2]]
        if settle:
            units = [b for w in mine for b in get_block_ratios(w["candidate_ms"], w["reference_ms"])]
            name = "settle steps, median of blocks"
        else:
            units = [x for r in ratios for x in r]
            name = "one-step pairs, median of pairs"
        steps = sum(len(w["candidate_ms"]) + len(w["reference_ms"]) + len(w["candidate_settle_ms"]) for w in mine)
        steps += sum(len(w["reference_settle_ms"]) for w in mine)
        gap = statistics.median(odd) / statistics.median(even) - 1
        q = statistics.quantiles(units, n=4, method="inclusive")
        estimate = f"{statistics.median(units):.3f} ({q[0]:.3f}-{q[2]:.3f})"
        print(
            f"{name:34} {statistics.median(odd):>14.3f} {statistics.median(even):>14.3f} {100 * gap:>+6.1f}% "
            f"{estimate:>26} {steps}"
        )


def _fmt(values: list[float], digits: int = 1) -> str:
    if not values:
        return "-"
    if len(values) < 2:
        return f"{values[0]:.{digits}f}"
    q = statistics.quantiles(values, n=4, method="inclusive")
    return f"{statistics.median(values):.{digits}f} ({q[0]:.{digits}f}-{q[2]:.{digits}f})"


def _launch(model: str, configs: dict, args: argparse.Namespace, estimators: bool = False) -> list[dict]:
    """One launch of 2 ranks: ``configs`` in alternating runs (rank 0's step records), or with
    ``estimators`` both measurements (rank 0's windows)."""
    common = {"model": model, "configs": configs, "warmup": args.warmup, "cluster": args.cluster}
    if estimators:
        kwargs = {"pairs": args.estimators, "rounds": args.runs}
        return run_rank0("switch_cost:estimators_main", world_size=2, kwargs={**common, **kwargs})
    kwargs = {"runs": args.runs, "run_length": args.run_length, "gap": args.gap}
    return run_rank0("switch_cost:rank_main", world_size=2, kwargs={**common, **kwargs})


def _print(records: list[dict], args: argparse.Namespace) -> None:
    print(f"model {args.model}, candidate {args.candidate}, gap {args.gap}, cluster {args.cluster}, rank 0's steps")
    print(f"{'side':10} {'pos':>3} {'n':>3} {'ms':>24} {'cpu ms':>24} {'page faults':>26}")
    medians = {}
    for side in ("reference", "candidate"):
        for position in sorted({r["position"] for r in records}):
            sel = [r for r in records if r["side"] == side and r["position"] == position]
            medians[side, position] = statistics.median(r["ms"] for r in sel)
            print(
                f"{side:10} {position:>3} {len(sel):>3} {_fmt([r['ms'] for r in sel]):>24} "
                f"{_fmt([r['cpu_ms'] for r in sel]):>24} {_fmt([r['faults'] for r in sel], 0):>26}"
            )
    if ("candidate", 2) in medians:
        print(
            "one-step ABBA would see: candidate switched / reference settled "
            f"{medians['candidate', 1] / medians['reference', 2]:.3f}, "
            f"candidate settled / reference switched {medians['candidate', 2] / medians['reference', 1]:.3f}, "
            f"both settled {medians['candidate', 2] / medians['reference', 2]:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="wide")
    parser.add_argument("--candidate", choices=["reshard", "keep"], default="reshard")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--run-length", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--gap", choices=["switch", "sleep", "twin"], default="switch")
    parser.add_argument("--cluster", default=None, help="emulate this cluster's links (e.g. cpu-emulated-ib)")
    parser.add_argument(
        "--estimators",
        type=int,
        default=0,
        metavar="PAIRS",
        help="instead: the paired measurement with and without settle steps, PAIRS pairs a window, --runs rounds",
    )
    args = parser.parse_args()
    model = str(WIDE) if args.model == "wide" else args.model
    blocks = load_model_profile(model).unit_names[:-1]
    configs = {
        "reference": config_to_dict(default_config(blocks, num_microbatches=args.microbatches)),
        "candidate": get_candidate(blocks, args.candidate, args.microbatches),
    }
    if args.estimators:
        windows = _launch(model, configs, args, estimators=True)
        print(f"model {args.model}, candidate {args.candidate}, cluster {args.cluster}, {args.runs} rounds")
        _print_estimators(windows)
        return
    if args.gap == "switch":
        records = _launch(model, configs, args)
    else:  # each config alone (sleep) or against a twin of itself, in a launch of its own
        records = []
        for name, config in configs.items():
            runs = _launch(model, {name: config, **({"twin": config} if args.gap == "twin" else {})}, args)
            records += [r for r in runs if r["side"] == name]
    _print(records, args)


if __name__ == "__main__":
    main()
