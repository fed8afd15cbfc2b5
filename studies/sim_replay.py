"""Prints recorded ``benchmarks/sim_accuracy.py`` runs re-calibrated and re-predicted by this checkout (no trial runs).

    .venv/bin/python studies/sim_replay.py RUN_DIR [RUN_DIR ...]

A run dir is ``sim_accuracy.py --out``'s: ``results.json`` and, per workload and setting, the
calibration trial dirs (``cal_*``) and the measured configs' dirs (``config_NNN``). Each setting is
calibrated again from its recorded calibration trials and every measured config predicted again;
the measured ratios are the recorded ones. So a change to the calibration or the simulator is
judged on the same measurements before and after, without the run-to-run noise of new trials.
Prints per setting the recorded and the replayed ratio median absolute error, p90, Spearman,
the mean error of replicated (HSDP Nx1) and sharded configs, the noise floor
(``sim_accuracy.get_noise_floor``) and the compute scale. ``--hook-quantile 0.5`` replays with
hooks priced at their median call (the calibration before the lower quartile).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.search.predictions import get_spearman  # noqa: E402
from autotune.sim import Hardware, Simulator, get_model_work, trace_costs  # noqa: E402
from benchmarks.sim_accuracy import (  # noqa: E402
    CALIBRATION_DIRS,
    SETTINGS,
    WORKLOADS,
    _median_abs,
    _p90_abs,
    calibrate_recorded,
    get_noise_floor,
)
from fsdp_runtime import load_config  # noqa: E402
from profiles import load_cluster_profile  # noqa: E402
from profiles.sources import load_model_source  # noqa: E402


def _figures(rows: list[dict], predicted: list[float]) -> dict:
    errors = [p / r["measured_ratio"] - 1 for p, r in zip(predicted, rows)]
    by_mesh: dict[str, list[float]] = {}
    for e, r in zip(errors, rows):
        by_mesh.setdefault("hsdp" if "hsdp" in r["params"]["mesh"] else "fsdp", []).append(e)
    return {
        "median": _median_abs(errors),
        "p90": _p90_abs(errors),
        "rho": get_spearman(predicted, [r["measured_ratio"] for r in rows]),
        **{f"mean_{mesh}": statistics.fmean(v) for mesh, v in sorted(by_mesh.items())},
    }


def _change(before: dict, after: dict, key: str) -> str:
    return f"{100 * before.get(key, float('nan')):+5.1f} -> {100 * after.get(key, float('nan')):+5.1f}%"


def replay_setting(run: Path, result: dict) -> dict:
    """One recorded setting: (recorded figures, replayed figures, replayed compute scale)."""
    workload, setting = result["workload"], result["setting"]
    directory = run / f"{workload}_{setting}"
    world, cluster = SETTINGS[setting]
    work = get_model_work(load_model_source(WORKLOADS[workload]), "float32")
    paths = [directory / name for name in CALIBRATION_DIRS if (directory / name / "metrics.json").exists()]
    profile = calibrate_recorded(paths, work, fit_sync=(directory / "cal_nosync").exists())
    simulator = Simulator(
        work, Hardware(load_cluster_profile(cluster or "cpu-gloo"), num_ranks=world, measured=profile)
    )
    default_s = simulator.simulate(load_config(directory / "cal_defaults" / "config.toml")).step_s
    rows, predicted = [], []
    for i, row in enumerate(result["rows"]):
        if row["status"] != "ok" or not row["measured_ratio"] or not row["measured_ms"]:
            continue
        config = load_config(directory / f"config_{i:03d}" / "config.toml")
        rows.append(row)
        predicted.append(simulator.simulate(config).step_s / default_s)
    return {
        "name": f"{run.name}/{workload}/{setting}",
        "recorded": _figures(rows, [r["predicted_ratio"] for r in rows]),
        "replayed": _figures(rows, predicted),
        "scale": (result["calibration"]["compute_scale"], profile.compute_scale),
        "floor": get_noise_floor(rows).get("noise_floor"),
        "notes": profile.notes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", help="sim_accuracy.py --out dirs")
    parser.add_argument("--notes", action="store_true", help="print each replayed calibration's notes")
    parser.add_argument(
        "--hook-quantile",
        type=float,
        default=None,
        help="price FSDP2's hooks at this quantile of their calls (default: the calibration's own, trace_costs.HOOK_QUANTILE)",
    )
    args = parser.parse_args()
    if args.hook_quantile is not None:
        trace_costs.HOOK_QUANTILE = args.hook_quantile
    print(
        "setting                     ratio med|err| recorded -> replayed   p90           rho          mean hsdp        mean fsdp        floor  compute scale"
    )
    for run in args.runs:
        for result in json.loads((run / "results.json").read_text())["results"]:
            r = replay_setting(run, result)
            a, b = r["recorded"], r["replayed"]

            print(
                f"{r['name']:<27} {100 * a['median']:5.1f} -> {100 * b['median']:5.1f}%             "
                f"{100 * a['p90']:4.1f} -> {100 * b['p90']:4.1f}%  {a['rho']:.2f} -> {b['rho']:.2f}  "
                f"{_change(a, b, 'mean_hsdp')}  {_change(a, b, 'mean_fsdp')}  {100 * (r['floor'] or 0):4.1f}%  {r['scale'][0]:.2f} -> {r['scale'][1]:.2f}"
            )
            if args.notes:
                print("   " + "; ".join(r["notes"]))


if __name__ == "__main__":
    main()
