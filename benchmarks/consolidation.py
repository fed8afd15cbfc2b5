"""Prints full-state consolidation's time and memory (RSS rise) per method: all_gather vs broadcast vs DCP.

    .venv/bin/python benchmarks/consolidation.py [--worlds 2 4] [--repeats 3] [--json out.json]

For each model size and world size, one launch of ranks (FSDP, 1-D mesh) trains one step
so that AdamW's state exists, then consolidates the full model + optimizer state onto
rank 0 (CPU) with each method, ``--repeats`` times in rotating order, then once more per
method to measure memory (``consolidation_rise_bytes``, the rise of peak RSS over RSS just
before the call; see ``autotune.search.consolidation.consolidation_timing`` for how).
Prints per method: rank 0's median seconds (min-max), the speedup of the median over
broadcast's, rank 0's RSS rise and how much of it is not the consolidated state itself,
and the largest RSS rise of any other rank.

Models: ``small`` (dim 256, 4 blocks, 4.3M params) and ``small`` at dim 1024 / FFN 3072
(55M params), with 16-token sequences to keep the one training step short (sequence length
does not change the state's size).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.trials import run_ranks  # noqa: E402
from fsdp_runtime.consolidate import DEFAULT_BUCKET_BYTES  # noqa: E402

MODELS: dict[str, str | dict[str, Any]] = {
    "small (4.3M)": "small",
    "dim1024 (55M)": {"name": "small", "dim": 1024, "ffn_hidden_dim": 3072, "seq_len": 16, "batch_size": 1},
}
_MIB = 2**20


def get_cases(bucket_mibs: list[int]) -> dict[str, dict[str, Any]]:
    """Case name -> consolidate_state arguments: broadcast, dcp, and all_gather per bucket size."""
    cases: dict[str, dict[str, Any]] = {"broadcast": {"method": "broadcast"}, "dcp": {"method": "dcp"}}
    for mib in bucket_mibs:
        cases[f"all_gather {mib} MiB"] = {"method": "all_gather", "bucket_bytes": mib * _MIB}
    return cases


def run_case(
    model: str | dict[str, Any],
    world_size: int,
    *,
    cases: dict[str, dict[str, Any]],
    num_repeats: int,
    timeout_s: float,
) -> list[dict[str, Any]] | None:
    """One launch: every case, ``num_repeats`` times, then once for memory; each rank's
    result, or None (reported on stderr) if the launch failed."""
    run = run_ranks(
        "autotune.search.consolidation:consolidation_timing",
        world_size=world_size,
        kwargs={
            "model": model,
            "config": {"schema_version": 1},
            "cases": cases,
            "num_repeats": num_repeats,
            "measure_memory": True,
        },
        timeout_s=timeout_s,
    )
    if not run.ok:
        print(
            f"FAILED world {world_size}: {run.status}: {run.reason}\n" + "\n".join(run.stderr_tails),
            file=sys.stderr,
            flush=True,
        )
        return None
    return run.results


def summarize(per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per case from the ranks' results (times and memory as described above)."""
    rank0 = per_rank[0]
    base = statistics.median(rank0["seconds"]["broadcast"])
    rows = []
    for case, seconds in rank0["seconds"].items():
        median = statistics.median(seconds)
        rise0 = rank0["consolidation_rise_bytes"].get(case)
        others = [r["consolidation_rise_bytes"].get(case) for r in per_rank[1:]]
        rows.append(
            {
                "case": case,
                "median_s": median,
                "min_s": min(seconds),
                "max_s": max(seconds),
                "speedup_vs_broadcast": base / median,
                "rank0_rise_mib": None if rise0 is None else rise0 / _MIB,
                "rank0_overhead_mib": None if rise0 is None else (rise0 - rank0["state_bytes"]) / _MIB,
                "other_ranks_rise_mib": None if None in others or not others else max(others) / _MIB,
                "state_mib": rank0["state_bytes"] / _MIB,
                "num_params": rank0["num_params"],
            }
        )
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def render(rows: list[dict[str, Any]]) -> str:
    header = "| model | world | case | median s (min-max) | speedup vs broadcast | rank 0 RSS rise MiB (beyond state) | other ranks RSS rise MiB |"
    lines = [header, "|---" * (header.count("|") - 1) + "|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['world']} | {r['case']} | {r['median_s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f}) "
            f"| {r['speedup_vs_broadcast']:.2f}x | {_fmt(r['rank0_rise_mib'], '.0f')} ({_fmt(r['rank0_overhead_mib'], '+.0f')}) "
            f"| {_fmt(r['other_ranks_rise_mib'], '.0f')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--bucket-mib",
        type=int,
        nargs="+",
        default=[DEFAULT_BUCKET_BYTES // _MIB, 256],
        help="all_gather bucket sizes to compare",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        for world_size in args.worlds:
            per_rank = run_case(
                MODELS[name],
                world_size,
                cases=get_cases(args.bucket_mib),
                num_repeats=args.repeats,
                timeout_s=args.timeout,
            )
            for row in summarize(per_rank) if per_rank else []:
                rows.append({"model": name, "world": world_size, **row})
            print(f"done: {name}, world {world_size}", file=sys.stderr, flush=True)
    print(render(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
