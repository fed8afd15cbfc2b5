"""Prints the speedup a search claims for its emitted config beside the speedup that config realizes alone.

    .venv/bin/python benchmarks/realized_speedup.py --out runs/realized_speedup     # 5 x (small, wide1024)
    .venv/bin/python benchmarks/realized_speedup.py --runs 2 --models small --trials 10
    .venv/bin/python benchmarks/realized_speedup.py --quick --out runs/realized_quick  # tiny, end to end, ~1-2 min
    .venv/bin/python benchmarks/realized_speedup.py --summarize runs/realized_speedup  # reprint, no run
    .venv/bin/python benchmarks/realized_speedup.py --runs 20 --models small --out runs/cov --resume  # go on

A search measures its configs paired with FSDP2's defaults on the same ranks; a user runs the
emitted config alone. This runs ``--runs`` searches of each workload, alternating them (small,
wide1024, small, ...), and after each runs ``autotune compare`` on the emitted ``best.toml``
against ``defaults`` with the search's model, world size, microbatches, cluster and precision
(``until_ci_pct``: rounds until the interval is within +-``--until-ci``%, at most ``--max-rounds``).
Workloads: ``small`` is ``./dev autotune search`` as it stands (10 trials, 2 microbatches, real
links); ``wide1024`` (``benchmarks/models/wide1024.toml``) is ``search_time.py``'s
communication-heavy command (8 trials, 4 microbatches, ``--presearch sim``, ``cpu-emulated-ib``).

Per search it prints the workload, the search's wall time, what was emitted (``best``,
``defaults``, ``recipe``), the CLAIMED speedup over the defaults (``search.json``'s
``confirmation.speedup_median``, with ``speedup_low``-``speedup_high``, its 90% interval, where
the search records one), the REALIZED speedup (compare's, with its 90% interval) and realized /
claimed; the load (``os.getloadavg``) before and after the search and the compare. A search that
emitted the defaults or torchtitan's recipe claims nothing over the defaults: it is counted, not
compared (a recipe's realized speedup is still measured and printed). At the end, per workload
and over all: the median and the worst realized / claimed with their spread, those counts, and
whether the aim holds (median within 3% of 1, none below 0.95). ``OUT/results.json`` is written
after every search and compare, so an interrupted run keeps what it measured, and ``--resume``
goes on from its last finished row; ``--summarize`` pools several runs' results.

The compare runs on the model the search measured: for a search on a scale proxy (``wide1024``
is one on a 2-core box, its step over the search's budget) that is the proxy, written as a
profile beside the run (``proxy.toml``), since the claim is the proxy's. Time on a 2-core box: a
``small`` search about 3 minutes and its compare about 4; a ``wide1024`` search about 4-5 minutes
and its compare about 4 (``COMPARES``): the default command takes about 80 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.compare import CompareSettings, run_compare  # noqa: E402
from autotune.pipeline import search_and_report  # noqa: E402
from autotune.search import SearchSettings  # noqa: E402
from fsdp_runtime.errors import AutotuneError  # noqa: E402
from fsdp_runtime.files import write_json_atomic  # noqa: E402

WIDE1024 = str(Path(__file__).resolve().parent / "models" / "wide1024.toml")
WORKLOADS = {
    "small": {"model": "small", "num_trials": 10, "num_microbatches": 2},
    "wide1024": {
        "model": WIDE1024,
        "num_trials": 8,
        "num_microbatches": 4,
        "cluster": "cpu-emulated-ib",
        "presearch": "sim",
    },
    "tiny": {"model": "tiny", "num_trials": 2, "num_microbatches": 2, "num_confirm_pairs": 1, "num_measured": 2},
}
"""Workload name -> the ``SearchSettings`` fields its searches set (the rest: the defaults)."""
COMPARES = {
    "small": {"num_rounds": 8},
    "wide1024": {"num_rounds": 6, "num_warmup": 2, "num_measured": 6},
    "tiny": {"num_rounds": 2},
}
"""Workload name -> the ``CompareSettings`` its compares set by default: rounds (at most, with
``until_ci_pct``) and steps per run: its search runs on a scale proxy here (a ~1.4 s step), and
so do its compares."""
AIM_MEDIAN_PCT, AIM_WORST = 3.0, 0.95


def get_claim(search: dict) -> dict:
    """What a search emitted (``best``, ``defaults``, ``recipe``; ``search`` under a memory budget)
    and, where it claims one over the defaults, the speedup it claims with its interval."""
    conf = search.get("confirmation") or {}
    emitted = conf.get("emitted", "best")
    if (search.get("recipe") or {}).get("emitted") == "recipe":
        emitted = "recipe"  # the confirmation's figures are the search config's, not the recipe's
    if emitted not in ("best", "search") or conf.get("speedup_median") is None:
        return {"emitted": emitted, "claimed": None, "claimed_low": None, "claimed_high": None}
    return {
        "emitted": emitted,
        "claimed": conf["speedup_median"],
        "claimed_low": conf.get("speedup_low"),
        "claimed_high": conf.get("speedup_high"),
    }


def run_search(settings: SearchSettings) -> dict:
    load = os.getloadavg()
    start = time.monotonic()
    search_and_report(settings)
    wall_s = time.monotonic() - start
    search = json.loads((settings.out_dir / "search.json").read_text())
    return {"search_wall_s": wall_s, "load_before": load, "load_after_search": os.getloadavg(), **get_claim(search)}


def get_measured_model(settings: SearchSettings, out: Path) -> str:
    """The model the search's trials ran: the requested one, or for a scale proxy (``wide1024`` is
    one on a 2-core box: its step is over the search's budget) the proxy, written as a profile of
    its own (``OUT/.../proxy.toml``): the claim is the proxy's, so it is checked on the proxy."""
    proxy = json.loads((settings.out_dir / "search.json").read_text())["proxy"]
    if not proxy.get("is_proxy"):
        return settings.model
    profile = tomllib.loads(Path(settings.model).read_text())
    overrides = dict(proxy["overrides"])
    top = {k: overrides.pop(k) for k in ("seq_len", "batch_size") if k in overrides}
    lines = [f'name = "{profile["name"]}-proxy"', f'description = "{proxy["name"]}"']
    lines += [f"{k} = {v}" for k, v in (profile | top).items() if k not in ("name", "description", "shape")]
    lines += ["[shape]", *(f"{k} = {v}" for k, v in (profile["shape"] | overrides).items())]
    path = out / "proxy.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def run_realized(settings: SearchSettings, workload: str, args: argparse.Namespace, out: Path) -> dict:
    """The emitted ``best.toml`` alone against ``defaults``, on the model the search measured
    (:func:`get_measured_model`), with the world, microbatches, cluster and precision it ran."""
    model = get_measured_model(settings, out)
    compare = CompareSettings(
        model=model,
        configs=["defaults", str(settings.out_dir / "best.toml")],
        world_size=settings.world_size,
        **(COMPARES[workload] | ({"num_rounds": args.max_rounds} if args.max_rounds else {})),
        until_ci_pct=args.until_ci,
        num_microbatches=settings.num_microbatches,  # compare refuses a best.toml that disagrees
        cluster=settings.cluster,
        seed=settings.seed,
        param_dtype=settings.param_dtype,
        reduce_dtype=settings.reduce_dtype,
        timeout_s=args.run_timeout,
        out_dir=out / "compare",
    )
    record, _ = run_compare(compare)
    figures = record.configs[1]
    return {
        "compared_on": Path(model).name,
        "realized": figures.speedup,
        "realized_low": figures.speedup_low,
        "realized_high": figures.speedup_high,
        "compare_rounds": record.num_rounds,
        "compare_wall_s": record.wall_s,
        "load_after_compare": os.getloadavg(),
    }


def run_one(index: int, workload: str, args: argparse.Namespace, save: Callable[[dict], None]) -> dict:
    """One search of ``workload`` and, unless it emitted the defaults, its emitted config compared;
    ``save`` gets the row once the search is done (a compare cut short keeps the claim)."""
    out = args.out / f"{index:02d}-{workload}"
    shutil.rmtree(out, ignore_errors=True)
    fields = WORKLOADS[workload] | ({"num_trials": args.trials} if args.trials else {})
    settings = SearchSettings(**fields, out_dir=out / "search", seed=args.seed + index)
    row: dict = {"run": index, "workload": workload, "model": settings.model, "dir": str(out)}
    print(f"{index:>2} {workload}: searching, {settings.num_trials} trials (load {os.getloadavg()[0]:.1f})", flush=True)
    try:
        row |= run_search(settings)
        save(row)
        if row["emitted"] != "defaults":
            row |= run_realized(settings, workload, args, out)
    except AutotuneError as e:
        row["error"] = str(e)
    if (ratio := get_ratio(row)) is not None:
        row["ratio"] = ratio
    return row


def get_ratio(row: dict) -> float | None:
    """Realized / claimed, for a search that claims a speedup over the defaults and was compared."""
    if row.get("emitted") not in ("best", "search") or not row.get("claimed") or not row.get("realized"):
        return None
    return row["realized"] / row["claimed"]


def write_results(out: Path, rows: list[dict], args: argparse.Namespace) -> None:
    """``OUT/results.json``, replaced whole (a reader never sees half a file)."""
    body = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rows": rows}
    write_json_atomic(out / "results.json", body)


def read_rows(source: Path) -> list[dict]:
    """The rows of a results file, or of ``results.json`` in a run's directory."""
    path = source / "results.json" if source.is_dir() else source
    try:
        return json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"realized_speedup: cannot read the rows of {path}: {e}") from None


def get_resumed(out: Path, workloads: list[str]) -> list[dict]:
    """The finished rows of an earlier run into ``out``, for ``--resume``: those of the same
    workloads in the same turn (row i searched ``workloads[i % len]``), up to the first that did not
    finish (it is searched again, in its directory, from scratch)."""
    if not (out / "results.json").exists():
        return []
    rows = []
    for i, row in enumerate(read_rows(out)):
        if row.get("run") != i or row.get("workload") != workloads[i % len(workloads)]:
            raise SystemExit(f"realized_speedup: {out}/results.json row {i} is not run {i} of {','.join(workloads)}")
        if "error" not in row and row.get("emitted") != "defaults" and "realized" not in row:
            break  # its compare was cut short
        rows.append(row)
    return rows


def _fmt(value: float | None, low: float | None = None, high: float | None = None) -> str:
    if value is None:
        return "-"
    interval = f"{low:.3f}-{high:.3f}" if low is not None and high is not None else "interval unknown"
    return f"{value:.3f}x ({interval})"


def print_row(row: dict) -> None:
    head = f"{row['run']:>2} {row['workload']:<9}"
    if "emitted" not in row:
        print(f"{head} failed: {row.get('error')}", flush=True)
        return
    claimed = _fmt(row["claimed"], row["claimed_low"], row["claimed_high"])
    realized = _fmt(row.get("realized"), row.get("realized_low"), row.get("realized_high"))
    if row.get("compare_rounds"):
        realized += f" over {row['compare_rounds']} rounds on {row.get('compared_on', row['workload'])}"
    ratio = f"{row['ratio']:.3f}" if row.get("ratio") is not None else "-"
    line = f"{head} {row['search_wall_s']:>5.0f} s  emitted {row['emitted']:<8}  claimed {claimed}  realized {realized}"
    note = "  (no claim over the defaults: not counted)" if row["emitted"] in ("defaults", "recipe") else ""
    print(f"{line}  realized/claimed {ratio}{note}", flush=True)
    loads = [row.get(k) for k in ("load_before", "load_after_search", "load_after_compare")]
    print("   load before / after search / after compare: " + " / ".join(f"{x[0]:.1f}" if x else "-" for x in loads))
    if row.get("error"):
        print(f"   failed: {row['error']}")


def is_covered(row: dict) -> bool | None:
    """Whether the figure realized alone lies inside the claim's printed 90% interval (None: a claim
    not counted, or one without an interval): what that interval covers, measured."""
    if get_ratio(row) is None or row.get("claimed_low") is None or row.get("claimed_high") is None:
        return None
    return row["claimed_low"] <= row["realized"] <= row["claimed_high"]


def wilson(k: int, n: int, z: float = 1.645) -> tuple[float, float]:
    """The binomial interval of ``k`` in ``n`` (Wilson's score interval; ``z`` 1.645: 90%)."""
    p, d = k / n, 1 + z * z / n
    centre, half = (p + z * z / (2 * n)) / d, z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5 / d
    return max(0.0, centre - half), min(1.0, centre + half)


def get_coverage(group: list[dict]) -> dict:
    """How many counted claims with an interval held the figure realized alone, and that share's 90% interval."""
    covered = [c for r in group if (c := is_covered(r)) is not None]
    k, n = sum(covered), len(covered)
    low, high = wilson(k, n) if n else (None, None)
    return {
        "covered": k,
        "with_interval": n,
        "coverage": k / n if n else None,
        "coverage_low": low,
        "coverage_high": high,
    }


def get_summary(rows: list[dict]) -> dict[str, dict]:
    """Per workload and ``all``: realized / claimed over the searches that claim a speedup over the
    defaults (median, worst, spread, whether the aim holds), and how many emitted the defaults or
    the recipe, or failed."""
    groups = {w: [r for r in rows if r["workload"] == w] for w in dict.fromkeys(r["workload"] for r in rows)}
    summary = {}
    for name, group in {**groups, "all": rows}.items():
        ratios = [ratio for r in group if (ratio := get_ratio(r)) is not None]
        median = statistics.median(ratios) if ratios else None
        summary[name] = {
            "searches": len(group),
            "counted": len(ratios),
            "median": median,
            "worst": min(ratios, default=None),
            "best": max(ratios, default=None),
            "defaults": sum(r.get("emitted") == "defaults" for r in group),
            "recipe": sum(r.get("emitted") == "recipe" for r in group),
            "recipe_realized": [r["realized"] for r in group if r.get("emitted") == "recipe" and r.get("realized")],
            "recipe_slower": sum(r.get("emitted") == "recipe" and (r.get("realized_high") or 2.0) < 1.0 for r in group),
            "failed": sum("error" in r for r in group),
            "aim": None if median is None else abs(median - 1) <= AIM_MEDIAN_PCT / 100 and min(ratios) >= AIM_WORST,
            **get_coverage(group),
        }
    return summary


def print_summary(rows: list[dict]) -> None:
    print(f"\nrealized / claimed (aim: median within {AIM_MEDIAN_PCT:.0f}% of 1, none below {AIM_WORST})")
    print(f"{'workload':<9} {'searches':>8} {'counted':>7} {'median':>7} {'worst':>6} {'spread':>12}  not counted, aim")
    for name, s in get_summary(rows).items():
        spread = f"{s['worst']:.3f}-{s['best']:.3f}" if s["median"] is not None else "-"
        median, worst = (f"{s[k]:.3f}" if s[k] is not None else "-" for k in ("median", "worst"))
        figures = f"{median:>7} {worst:>6} {spread:>12}"
        aim = {None: "nothing to judge", True: "holds", False: "MISSED"}[s["aim"]]
        print(
            f"{name:<9} {s['searches']:>8} {s['counted']:>7} {figures}  "
            f"defaults {s['defaults']}, recipe {s['recipe']}, failed {s['failed']}; aim {aim}"
        )
    print("(a search that emitted the defaults or the recipe claims nothing over the defaults to check)")
    for name, s in get_summary(rows).items():  # what a user on FSDP2's defaults gets from an emitted recipe
        if s["recipe_realized"]:
            alone = ", ".join(f"{x:.3f}x" for x in s["recipe_realized"])
            print(
                f"{name:<9} emitted torchtitan's recipe {s['recipe']} times; alone against the defaults: {alone}"
                f" ({s['recipe_slower']} wholly slower at 90%)"
            )
    print("\nrealized alone inside the claim's printed 90% interval (it covers one window's noise, paired)")
    for name, s in get_summary(rows).items():
        if s["with_interval"]:
            share = f"{100 * s['coverage']:.0f}% (90% interval {100 * s['coverage_low']:.0f}-{100 * s['coverage_high']:.0f}%)"
            print(f"{name:<9} {s['covered']} of {s['with_interval']}: {share}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="searches of each workload")
    parser.add_argument("--models", default="small,wide1024", help=f"workloads, in turn: {', '.join(WORKLOADS)}")
    parser.add_argument("--trials", type=int, default=None, help="trials per search; default: the workload's")
    parser.add_argument("--until-ci", type=float, default=2.0, help="compare until its interval is within +-PCT%%")
    parser.add_argument("--max-rounds", type=int, default=None, help="the most compare rounds; default: the workload's")
    parser.add_argument("--run-timeout", type=float, default=300.0, help="seconds per compare run, start-up included")
    parser.add_argument("--seed", type=int, default=0, help="search i's seed is this + i")
    parser.add_argument("--out", type=Path, default=Path("runs/realized_speedup"))
    parser.add_argument("--quick", action="store_true", help="tiny, 2 trials, 1 run, 2 compare rounds")
    parser.add_argument(
        "--summarize",
        type=Path,
        nargs="+",
        metavar="OUT",
        help="print the rows and the summary of OUT/results.json (or of a results file), pooled over all given",
    )
    parser.add_argument(
        "--resume", action="store_true", help="keep the rows already in OUT/results.json and run the rest of --runs"
    )
    args = parser.parse_args()
    if args.summarize:
        rows = [row for source in args.summarize for row in read_rows(source)]
        for row in rows:
            print_row(row)
        print_summary(rows)
        return
    if args.quick:
        args.models, args.runs, args.trials = "tiny", 1, 2
    workloads = args.models.split(",")
    if unknown := set(workloads) - set(WORKLOADS):
        parser.error(f"unknown workload(s) {', '.join(sorted(unknown))} (use {', '.join(WORKLOADS)})")
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = get_resumed(args.out, workloads) if args.resume else []
    for row in rows:
        print_row(row)
    for i in range(len(rows), args.runs * len(workloads)):
        rows.append(
            run_one(i, workloads[i % len(workloads)], args, lambda row: write_results(args.out, [*rows, row], args))
        )
        write_results(args.out, rows, args)
        print_row(rows[-1])
    print_summary(rows)


if __name__ == "__main__":
    main()
