"""Prints how well a device profile calibrated on one GPU trial predicts other configs' steps on that GPU.

On one GPU: measure FSDP2's defaults (bf16 params, fp32 reduce), calibrate a device profile on that
trial alone ([Note: GPU calibration] in ``autotune/sim/gpu_calibrate.py``), then measure configs it
never saw, across activation checkpointing (none, selective, full), grouping, reshard after
forward, 1/2/4 microbatches and two sequence lengths, and compare each measured step (median of
unprofiled steps) with the simulator's prediction. Prints one row per config and the median
absolute error; writes ``results.json`` and the profile into ``--out``.

    python benchmarks/gpu_sim_accuracy.py                      # on a GPU box (~5 min on one H100/H200)
    python benchmarks/gpu_sim_accuracy.py --dry-run            # anywhere: the configs and the datasheet's predictions

``--dry-run`` runs no trial: it builds every config, checks it against the model, calibrates on a
recorded calibration trial (``--recorded``: this script's own ``case_00`` from one H200) and
prints what that profile and the datasheet predict for every case: the whole path after the
trials, so the script is tested on a CPU box before a GPU minute is spent on it. On the GPU the
table of measurements is written (``results.json``) before the calibration runs, and again with
the predictions; a calibration that fails leaves the measurements and its error there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from typing import Any  # noqa: E402

from autotune.search import SearchSpace, describe_params  # noqa: E402
from autotune.sim import Hardware, Simulator, calibrate_trials, get_model_work  # noqa: E402
from autotune.sim.gpu_calibrate import get_cluster_for  # noqa: E402
from fsdp_runtime import MixedPrecisionConfig  # noqa: E402
from profiles import load_cluster_profile  # noqa: E402
from profiles.sources import load_model_source  # noqa: E402

BF16 = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")
RECORDED = Path(__file__).resolve().parents[1] / "tests" / "data" / "gpu_traces" / "h200-llama1b-gsa-defaults"
"""This script's own calibration trial (``case_00``), as it wrote it on one H200 (2026-11-27)."""


def get_cases(model: str, seq_len: int) -> list[tuple[str, dict, int, dict]]:
    """(label, model overrides, microbatches, space params) per case; the first is the calibration trial."""
    short = {"seq_len": seq_len // 2}
    return [
        ("defaults (calibration)", {}, 2, {}),
        ("full checkpointing", {}, 2, {"ac_units": "all", "ac_kind": "full"}),
        ("selective checkpointing", {}, 2, {"ac_units": "all", "ac_kind": "selective"}),
        ("2 blocks per unit", {}, 2, {"blocks_per_unit": 2}),
        ("no reshard after forward", {}, 2, {"reshard_after_forward": "false"}),
        ("1 microbatch", {}, 1, {}),
        ("4 microbatches", {}, 4, {}),
        (f"seq {seq_len // 2}", short, 2, {}),
        (f"seq {seq_len // 2}, selective, 4 microbatches", short, 4, {"ac_units": "all", "ac_kind": "selective"}),
        (
            "4 blocks per unit, no reshard after forward",
            {},
            2,
            {"blocks_per_unit": 4, "reshard_after_forward": "false"},
        ),
    ]


def _space(block_names: tuple[str, ...], microbatches: int) -> SearchSpace:
    return SearchSpace(
        block_names=block_names,
        world_size=1,
        num_microbatches=microbatches,
        device_type="cuda",
        mixed_precision=BF16,
        grouping=True,
        checkpointing=True,
    )


def build_case(model: str, overrides: dict, microbatches: int, params: dict):
    """The case's model (name or overrides dict), its work and its config."""
    spec = {"name": model, **overrides} if overrides else model
    work = get_model_work(load_model_source(spec), "bfloat16")
    space = _space(work.block_names, microbatches)
    config = space.build_config({**space.get_default_params(), **params})
    return spec, work, config, describe_params({**space.get_default_params(), **params})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama1b", help="a profile name or model TOML (fits one GPU with AdamW)")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=6, help="measured (unprofiled) steps per trial")
    parser.add_argument("--cluster", default=None, help="cluster profile of this GPU (default: by its name)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--dry-run", action="store_true", help="run no trial: calibrate on --recorded and predict every case"
    )
    parser.add_argument("--recorded", type=Path, default=RECORDED, help="--dry-run: the calibration trial dir to use")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu_sim_accuracy_"))
    out.mkdir(parents=True, exist_ok=True)
    cases = [
        build_case(args.model, {"seq_len": args.seq_len, **o}, m, p)
        for _, o, m, p in get_cases(args.model, args.seq_len)
    ]
    labels = [label for label, *_ in get_cases(args.model, args.seq_len)]
    if args.dry_run:
        _dry_run(cases, labels, args)
        return
    dirs = _measure(cases, labels, args, out)
    rows = _get_rows(cases, labels, [result for _, result in dirs], None)
    _write(rows, out, None)  # the measurements are kept whatever the calibration does
    if not dirs[0][1].ok:
        sys.exit(f"the calibration trial failed: {dirs[0][1].status} {dirs[0][1].reason}; measurements in {out}")
    try:
        profile, lines = calibrate_trials([dirs[0][0]], model=None, cluster=args.cluster)
    except Exception as e:  # a GPU minute is never lost to a crash: the table is written first
        _write(rows, out, f"calibration failed: {type(e).__name__}: {e}")
        sys.exit(f"calibration failed on {dirs[0][0]}: {type(e).__name__}: {e}; measurements in {out / 'results.json'}")
    profile.write(out / "device.toml")
    print("\n".join([*lines, *(n for n in profile.notes if n.startswith("host path"))]), flush=True)
    _report(_get_rows(cases, labels, [result for _, result in dirs], _hardware(profile, args.cluster)), out)


def _hardware(profile: Any, cluster: str | None) -> Hardware:
    return Hardware(load_cluster_profile(get_cluster_for(profile.device, cluster)), num_ranks=1, device=profile)


def _dry_run(cases: list, labels: list[str], args: argparse.Namespace) -> None:
    """The path after the trials, on a recorded calibration trial: calibrate, then predict every case."""
    profile, lines = calibrate_trials([args.recorded], model=None, cluster=args.cluster)
    print("\n".join([*lines, *(n for n in profile.notes if n.startswith("host path"))]))
    measured = _hardware(profile, args.cluster)
    datasheet = Hardware(load_cluster_profile(get_cluster_for(profile.device, args.cluster)), num_ranks=1)
    for label, (_, work, config, described) in zip(labels, cases):
        predicted = Simulator(work, measured).simulate(config).step_s
        step = Simulator(work, datasheet).simulate(config).step_s
        print(f"{label:<48} profile {1e3 * predicted:8.1f} ms  datasheet {1e3 * step:8.1f} ms  {described}")
    print(f"dry run: calibrated on {args.recorded}; no trial ran")


def _measure(cases: list, labels: list[str], args: argparse.Namespace, out: Path) -> list[tuple[Path, Any]]:
    from autotune.trials import TrialSpec, run_trial

    dirs = []
    for i, (spec, _, config, _) in enumerate(cases):
        trial_dir = out / f"case_{i:02d}"
        started = time.monotonic()
        result = run_trial(
            TrialSpec(
                model=spec,
                config=config,
                world_size=1,
                out_dir=trial_dir,
                num_warmup=2,
                num_measured=args.steps,
                profile=i == 0,
                timeout_s=600.0,
            )
        )
        print(
            f"{labels[i]:<48} {result.status} {result.step_ms or float('nan'):8.1f} ms ({time.monotonic() - started:.0f} s)",
            flush=True,
        )
        dirs.append((trial_dir, result))
    return dirs


def _get_rows(cases: list, labels: list[str], results: list[Any], hardware: Hardware | None) -> list[dict]:
    """One row per case: measured, and predicted where a profile's ``hardware`` is given."""
    rows = []
    for label, (_, work, config, described), result in zip(labels, cases, results):
        predicted = 1e3 * Simulator(work, hardware).simulate(config).step_s if hardware is not None else None
        rows.append(
            {
                "case": label,
                "config": described,
                "measured_ms": result.step_ms if result.ok else None,
                "predicted_ms": predicted,
                "status": result.status,
                # the host's path per block pass the trial timed ([Note: host path probe]): what bounds a host-bound step
                "host_path_ms": result.metrics.host_path_ms if result.metrics is not None else None,
            }
        )
    return rows


def _host(timed: dict[str, float] | None) -> str:
    return f"{timed['block_forward']:.2f} / {timed['block_backward']:.2f}" if timed else "-"


def _write(rows: list[dict], out: Path, error: str | None) -> None:
    errors = [
        abs(r["predicted_ms"] / r["measured_ms"] - 1)
        for r in rows[1:]
        if r["measured_ms"] and r["predicted_ms"] is not None
    ]
    median = statistics.median(errors) if errors else None
    data = {"rows": rows, "median_abs_error": median, "error": error}
    (out / "results.json").write_text(json.dumps(data, indent=1))


def _report(rows: list[dict], out: Path) -> None:
    print(
        "\n| case | config | measured ms | predicted ms | error | host ms per block (fwd/bwd) |\n|---|---|---|---|---|---|"
    )
    errors = []
    for row in rows:
        error = row["predicted_ms"] / row["measured_ms"] - 1 if row["measured_ms"] else None
        if error is not None and row is not rows[0]:
            errors.append(abs(error))
        print(
            f"| {row['case']} | {row['config']} | {row['measured_ms'] or float('nan'):.1f} | {row['predicted_ms']:.1f} | "
            f"{'' if error is None else f'{100 * error:+.1f}%'} | {_host(row['host_path_ms'])} |"
        )
    median = statistics.median(errors) if errors else None
    print(
        f"\nmedian absolute error over {len(errors)} configs the profile never saw: {'-' if median is None else f'{100 * median:.1f}%'}"
    )
    _write(rows, out, None)
    print(f"details in {out}")


if __name__ == "__main__":
    main()
