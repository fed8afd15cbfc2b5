"""Prints how long a search takes and what it emits, quiet and with one core kept busy.

    .venv/bin/python benchmarks/search_time.py --out runs/search_time            # wide, 8 trials, --presearch sim
    .venv/bin/python benchmarks/search_time.py --runs quiet --model small --microbatches 2 --trials 16 \\
        --presearch none --cluster none                                            # the README's main command

For each run (``--runs quiet,busy``: in that order; ``busy`` keeps one core spinning in another
process for the whole search) it runs ``search_and_report`` with the given settings and prints:
the wall time of the whole search, of its trials and of its final round; the emitted speedup
over the defaults with its interquartile range (the final round's blocks); how many trials were
measured, failed and timed out; any shortfall the search reported; and per trial its status, the
steps it ran (warm-up, pairs, settle and profiled steps, from rank 0's record), its wall time,
why its pairs stopped and what it was paired with. Nothing here is timed by a test: the numbers
are the measurement. Load (``os.getloadavg``) is printed before and after each run.

The script only reads the run dir's JSON files and sets ``SearchSettings`` fields that predate the
pipeline-stage search (``--pp``), so a checkout of an older commit runs it as it is (copy it there)
for a before/after comparison.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.pipeline import search_and_report  # noqa: E402
from autotune.search import SearchSettings  # noqa: E402

WIDE = str(Path(__file__).resolve().parent / "models" / "wide.toml")


def _busy() -> None:
    while True:
        pass


def _steps(metrics: dict) -> int:
    """Steps a trial ran (rank 0): the candidate's warm-up steps (metrics v11 ``candidate_warmup``:
    one fewer where its first measured step leads the pairs), the warm-up steps of every model it built (``num_builds``: a
    reference kept warm from an earlier trial is not built, nor warmed up: [Note: a warm
    reference]; before metrics v8, every model it held), one warm-up step of a reference switched
    in place before metrics v10 started the pairs with the candidate, the measured, settle and
    profiled steps (the profiler's warm-up step too)."""
    if not metrics.get("ranks"):
        return 0
    r = metrics["ranks"][0]
    warmup = metrics.get("num_warmup", 0)
    builds = metrics.get("num_builds")
    models = metrics.get("num_models") or 1
    paired = bool(r.get("settle_step_ms") or r.get("reference_settle_step_ms"))
    if r.get("candidate_warmup") is not None:  # metrics v11: the candidate's own count, then a built reference's
        warm = r["candidate_warmup"] + (warmup if paired and models > 1 and (builds or 0) >= 2 else 0)
    elif not paired or models > 1:  # unpaired or paired with itself: one model; else two
        warm = warmup * (builds if builds is not None else models if paired else 1)
    else:  # switched in place
        warm = warmup + (0 if r.get("pairs_first") == "candidate" else 1)
    measured = len(r["step_ms"]) + len(r.get("reference_step_ms", []))
    settle = len(r.get("settle_step_ms", [])) + len(r.get("reference_settle_step_ms", []))
    profiled = len(r.get("profiled_step_ms", [])) + (1 if r.get("profiled_step_ms") else 0)
    return warm + measured + settle + profiled


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _wall(paths: list[Path]) -> tuple[float, int]:
    metrics = [_read(p) for p in paths]
    return sum(m.get("wall_s", 0.0) for m in metrics), sum(_steps(m) for m in metrics)


def _report(out: Path, wall_s: float) -> dict:
    search = _read(out / "search.json")
    results = _read(out / "results.json").get("trials", [])
    conf = search.get("confirmation") or {}
    trial_metrics = sorted(out.glob("trials/trial_*/**/metrics.json"))
    trials_s, trial_steps = _wall(trial_metrics)
    final_s, final_steps = _wall(sorted(out.glob("final/*/metrics.json")))
    anchors_s, anchor_steps = _wall(sorted(out.glob("anchors/*/metrics.json")))
    print(
        f"  wall {wall_s:.0f} s: trials {trials_s:.0f} s ({trial_steps} steps), final round {final_s:.0f} s "
        f"({final_steps} steps), anchors {anchors_s:.0f} s ({anchor_steps} steps)"
    )
    speedup = conf.get("speedup_median")
    if speedup is not None:
        iqr = (conf.get("speedup_q25"), conf.get("speedup_q75"))
        print(
            f"  emitted {conf.get('emitted')} (trial {conf.get('winner')}): {speedup:.3f}x, IQR {iqr[0]:.3f}-{iqr[1]:.3f} "
            f"({100 * (iqr[1] - iqr[0]) / speedup:.1f}% of the median)"
        )
    states = [r["state"] for r in results]
    timeouts = sum(r.get("status") == "timeout" for r in results)
    print(
        f"  {len(results)} trials: {states.count('COMPLETE')} complete, {states.count('PRUNED')} pruned, "
        f"{states.count('FAIL')} failed ({timeouts} timeouts), {states.count('WAITING')} never ran"
    )
    for line in search.get("shortfall", []):
        print(f"  shortfall: {line}")
    print(f"  {'trial':>5} {'state':>8} {'steps':>5} {'wall s':>6} {'ratio':>6}  stopped, paired with")
    for row in results:
        metrics = _read(out / row["trial_dir"] / "metrics.json") if row.get("trial_dir") else {}
        against = f"trial {row['reference_trial']}" if row.get("reference_trial") is not None else "defaults"
        ratio = f"{row['ratio']:.3f}" if row.get("ratio") is not None else "-"
        print(
            f"  {row['number']:>5} {row['state']:>8} {_steps(metrics):>5} {metrics.get('wall_s', 0):>6.0f} {ratio:>6}  "
            f"{row.get('stopped') or '-'}, {against}"
            + (f" ({row.get('calibration')})" if row.get("calibration") else "")
        )
    return {"wall_s": wall_s, "speedup": speedup, "trial_steps": trial_steps, "final_steps": final_steps}


def _run(name: str, args: argparse.Namespace) -> dict:
    out = args.out / name
    shutil.rmtree(out, ignore_errors=True)
    busy = multiprocessing.Process(target=_busy, daemon=True) if name == "busy" else None
    if busy:
        busy.start()
    print(f"{name}: load before {os.getloadavg()}", flush=True)
    settings = SearchSettings(
        model=args.model,
        world_size=2,
        num_trials=args.trials,
        num_microbatches=args.microbatches,
        out_dir=out,
        seed=args.seed,
        cluster=None if args.cluster == "none" else args.cluster,
        presearch=None if args.presearch == "none" else args.presearch,
    )
    start = time.monotonic()
    try:
        search_and_report(settings)
    finally:
        wall_s = time.monotonic() - start
        if busy:
            busy.terminate()
    print(f"{name}: load after {os.getloadavg()}", flush=True)
    return _report(out, wall_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=WIDE)
    parser.add_argument("--cluster", default="cpu-emulated-ib", help="a cluster profile, or none")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--presearch", default="sim", help="sim or none")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", default="quiet,busy", help="quiet, busy or both, in order")
    parser.add_argument("--out", type=Path, default=Path("runs/search_time"))
    args = parser.parse_args()
    results = {name: _run(name, args) for name in args.runs.split(",")}
    speedups = [r["speedup"] for r in results.values() if r["speedup"]]
    if len(speedups) == 2:
        print(f"\nquiet vs busy emitted speedups differ by {100 * (max(speedups) / min(speedups) - 1):.1f}% (aim 5%)")
    print("wall s: " + ", ".join(f"{n} {r['wall_s']:.0f}" for n, r in results.items()))
    if speedups:
        print(f"median emitted speedup {statistics.median(speedups):.3f}x")


if __name__ == "__main__":
    main()
