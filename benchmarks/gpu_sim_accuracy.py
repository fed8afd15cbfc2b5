"""Prints how well a device profile calibrated on one GPU trial predicts other configs' steps on that GPU.

On one GPU: measure FSDP2's defaults (bf16 params, fp32 reduce), calibrate a device profile on that
trial alone ([Note: GPU calibration] in ``autotune/sim/gpu_calibrate.py``), then measure other
configs across activation checkpointing (none, selective, full), grouping, reshard after forward,
1/2/4 microbatches and two sequence lengths, and compare each measured step (median of unprofiled
steps) with the simulator's prediction. The cases are split ([Note: fit and held-out sets] in
``autotune/sim/fitted.py``): *held out*, a config no fitted constant of the simulator was read off
(nor another measurement of it), and the *fit set*: the calibration trial, and the configs whose
recorded H200 trials set ``host_path``'s constants (full and selective checkpointing at the
default shape). The accuracy figure is the held-out cases' median absolute error; the fit set's
is printed apart. Writes ``results.json`` (``held_out`` and ``fit_set`` apart) and the profile
into ``--out``.

    python benchmarks/gpu_sim_accuracy.py                      # on a GPU box (~5 min on one H100/H200)
    python benchmarks/gpu_sim_accuracy.py --dry-run            # anywhere: the configs and the datasheet's predictions
    python benchmarks/gpu_sim_accuracy.py --cases 0,7          # the calibration and one held-out case (~1 min)

``--cases`` runs some of the ten cases (their indexes in :func:`get_cases`, or ``all``, the
default; the calibration, 0, always, first): the GPU suite's slice runs two, a lease of its own
all ten. The trial dirs are
numbered in the order the chosen cases run (``case_00`` is the calibration either way).

``--dry-run`` runs no trial: it builds every config, checks it against the model, calibrates on a
recorded calibration trial (``--recorded``: this script's own ``case_00`` from one H200) and
prints what that profile and the datasheet predict for every case: the whole path after the
trials, so the script is tested on a CPU box before a GPU minute is spent on it. Where the
calibration trial is an H200's and the model and sequence length are the defaults, it compares
the predictions with the recorded run's measured steps (``autotune.sim.fit_split.GPU_RECORDED``,
``tests/data/gpu_traces/README.md``) and writes the same tables and ``results.json`` as a run on
the GPU. On the GPU the table of measurements is written (``results.json``) before the
calibration runs, and again with the predictions; a calibration that fails leaves the
measurements and its error there.
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
from autotune.sim.fit_split import FITTED, get_config_key, get_gsa_measured_ms, is_held_out  # noqa: E402
from autotune.sim.fitted import GPU_STEP, GSA_CASE  # noqa: E402
from autotune.sim.gpu_calibrate import get_cluster_for  # noqa: E402
from fsdp_runtime import MixedPrecisionConfig  # noqa: E402
from profiles import load_cluster_profile  # noqa: E402
from profiles.sources import load_model_source  # noqa: E402

BF16 = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")
GSA_RUN_NOTE = "one H200 SXM, torch 2.11.0+cu130, 2026-11-27; tests/data/gpu_traces/README.md"
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


def get_case_keys(model: str, seq_len: int) -> list[str]:
    """Each case's config as :func:`autotune.sim.fit_split.get_config_key` compares it with the recorded trials."""
    return [
        get_config_key(model if isinstance(model, str) else str(model), o.get("seq_len", seq_len), m, p)
        for _, o, m, p in get_cases(model, seq_len)
    ]


def get_split(labels: list[str], keys: list[str]) -> list[str]:
    """``held out`` or ``fit set`` per case ([Note: fit and held-out sets]): the calibration trial (the
    first) is in the fit set, and so is every case of a config a fitted constant was read off."""
    return [
        "held out" if i > 0 and is_held_out(f"{GSA_CASE}{label}", GPU_STEP, key) else "fit set"
        for i, (label, key) in enumerate(zip(labels, keys))
    ]


def parse_cases(text: str) -> list[int] | None:
    """``--cases``: comma-separated indexes, or ``all`` (None)."""
    return None if text.strip() == "all" else [int(part) for part in text.split(",") if part.strip()]


def select_cases(given: list[int] | None, num_cases: int, parser: argparse.ArgumentParser) -> list[int]:
    """The indexes of the cases to run, in :func:`get_cases`' order, the calibration (0) first
    whether named or not: every other case is predicted from it."""
    if given is None:
        return list(range(num_cases))
    unknown = sorted(i for i in given if not 0 <= i < num_cases)
    if unknown:
        parser.error(f"--cases: no case {', '.join(map(str, unknown))}; the cases are 0-{num_cases - 1}")
    return sorted({0, *given})


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
    parser.add_argument(
        "--cases",
        type=parse_cases,
        default=None,
        help="which cases: their indexes in get_cases, comma-separated, or all (the default); 0, the calibration, always",
    )
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu_sim_accuracy_"))
    out.mkdir(parents=True, exist_ok=True)
    chosen = select_cases(args.cases, len(get_cases(args.model, args.seq_len)), parser)
    cases = [
        build_case(args.model, {"seq_len": args.seq_len, **o}, m, p)
        for i, (_, o, m, p) in enumerate(get_cases(args.model, args.seq_len))
        if i in chosen
    ]
    labels = [label for i, (label, *_) in enumerate(get_cases(args.model, args.seq_len)) if i in chosen]
    args.case_keys = [k for i, k in enumerate(get_case_keys(args.model, args.seq_len)) if i in chosen]
    split = get_split(labels, args.case_keys)
    if args.dry_run:
        _dry_run(cases, labels, split, args, out)
        return
    _gpu_run(cases, labels, split, args, out)


def _gpu_run(cases: list, labels: list[str], split: list[str], args: argparse.Namespace, out: Path) -> None:
    """Measure the calibration case, calibrate on it, then measure the other cases one at a time,
    each row (measured, predicted, error) written to results.json as it comes: a run stopped part
    way (a GPU suite's time slice) keeps every case it measured, judged."""
    first = _measure_case(0, cases, labels, args, out)
    measured: list[tuple | None] = [_measured(first)] + [None] * (len(cases) - 1)
    _write(_get_rows(cases, labels, split, measured, None), out, None)
    if not first.ok:
        sys.exit(f"the calibration trial failed: {first.status} {first.reason}; measurements in {out}")
    try:
        profile, lines = calibrate_trials([out / "case_00"], model=None, cluster=args.cluster)
    except Exception as e:  # a GPU minute is never lost to a crash: the table is written first
        _write(_get_rows(cases, labels, split, measured, None), out, f"calibration failed: {type(e).__name__}: {e}")
        sys.exit(f"calibration failed on {out / 'case_00'}: {type(e).__name__}: {e}; measurements in {out}")
    profile.write(out / "device.toml")
    print("\n".join([*lines, *(n for n in profile.notes if n.startswith("host path"))]), flush=True)
    hardware = _hardware(profile, args.cluster)
    judged = get_judged_by(out / "case_00", cases, labels, split, args.cluster)
    for i in range(1, len(cases)):
        measured[i] = _measured(_measure_case(i, cases, labels, args, out))
        _write(_get_rows(cases, labels, split, measured, hardware), out, None, judged)
    rows = _get_rows(cases, labels, split, measured, hardware)
    _report(rows, out, judged)
    _print_judged_by(rows, judged)


def _measured(result: Any) -> tuple:
    return (result.step_ms if result.ok else None, result.status, _host_path_ms(result))


def get_judged_by(trial_dir: Path, cases: list, labels: list[str], split: list[str], cluster: str | None) -> dict:
    """Which held-out cases judge each of ``host_path``'s fitted constants: those whose prediction moves
    by more than 0.2% when the constant is scaled by 1.1 and the profile recalibrated on ``trial_dir``
    (a constant no held-out case moves is not judged by this run)."""
    from autotune.sim import calibrate_device, load_kernel_costs, read_gpu_trial
    from autotune.sim import host_path as hp
    from profiles.sources import load_model_source as load_source

    trial = read_gpu_trial(trial_dir)
    work = get_model_work(load_source(trial.model), trial.config.mixed_precision.param_dtype or "float32")
    costs = [load_kernel_costs(trial, work)]
    held = [(label, case) for label, case, part in zip(labels, cases, split) if part == "held out"]

    def predict() -> list[float]:
        hardware = _hardware(calibrate_device([(trial, work)], kernel_costs=costs), cluster)
        return [Simulator(w, hardware).simulate(config).step_s for _, (_, w, config, _) in held]

    base, judged = predict(), {}
    for name, table, keys in (
        ("host_path.LAUNCH_US", hp.LAUNCH_US, tuple(hp.LAUNCH_US)),
        ("host_path.PROFILER_FACTOR", None, ()),
        *((f"host_path.DEFAULT_RATIOS[{k}]", hp.DEFAULT_RATIOS, (k,)) for k in hp.DEFAULT_RATIOS),
    ):
        saved = (dict(hp.LAUNCH_US), dict(hp.DEFAULT_RATIOS), hp.PROFILER_FACTOR)
        try:
            if table is None:
                hp.PROFILER_FACTOR *= 1.1
            for key in keys:
                table[key] *= 1.1
            moved = predict()
        finally:
            hp.LAUNCH_US.update(saved[0]), hp.DEFAULT_RATIOS.update(saved[1])
            hp.PROFILER_FACTOR = saved[2]
        judged[name] = {label: m / b - 1 for (label, _), m, b in zip(held, moved, base) if abs(m / b - 1) > 0.002}
    return judged


def _print_judged_by(rows: list[dict], judged: dict) -> None:
    errors = {r["case"]: _error(r) for r in rows}
    print("\nheld-out cases that judge each fitted constant (prediction moved by scaling it 1.1x; the case's error):")
    for name, moved in judged.items():
        cases = ", ".join(
            f"{case} ({100 * shift:+.1f}%; error {'-' if errors.get(case) is None else f'{100 * errors[case]:+.1f}%'})"
            for case, shift in moved.items()
        )
        print(f"  {name}: {cases or 'none: not judged by a held-out case'}")


def _host_path_ms(result: Any) -> dict[str, float] | None:
    """The host's path per block pass the trial timed ([Note: host path probe]): what bounds a host-bound step."""
    return result.metrics.host_path_ms if result.metrics is not None else None


def _hardware(profile: Any, cluster: str | None) -> Hardware:
    return Hardware(load_cluster_profile(get_cluster_for(profile.device, cluster)), num_ranks=1, device=profile)


def _dry_run(cases: list, labels: list[str], split: list[str], args: argparse.Namespace, out: Path) -> None:
    """The path after the trials, on a recorded calibration trial: calibrate, then predict every case, and
    compare with the recorded run's measured steps where they are this GPU's and these cases'."""
    profile, lines = calibrate_trials([args.recorded], model=None, cluster=args.cluster)
    print("\n".join([*lines, *(n for n in profile.notes if n.startswith("host path"))]))
    measured = _hardware(profile, args.cluster)
    datasheet = Hardware(load_cluster_profile(get_cluster_for(profile.device, args.cluster)), num_ranks=1)
    for label, (_, work, config, described) in zip(labels, cases):
        predicted = Simulator(work, measured).simulate(config).step_s
        step = Simulator(work, datasheet).simulate(config).step_s
        print(f"{label:<48} profile {1e3 * predicted:8.1f} ms  datasheet {1e3 * step:8.1f} ms  {described}")
    recorded = get_gsa_measured_ms() if "H200" in profile.device else {}
    keys = args.case_keys
    if any(key in recorded for key in keys):
        print(f"\nmeasured: the recorded gpu_sim_accuracy.py run ({GSA_RUN_NOTE})")
        rows = _get_rows(cases, labels, split, [(recorded.get(k), "recorded", None) for k in keys], measured)
        judged = get_judged_by(args.recorded, cases, labels, split, args.cluster)
        _report(rows, out, judged)
        _print_judged_by(rows, judged)
    print(f"dry run: calibrated on {args.recorded}; no trial ran")


def _measure_case(i: int, cases: list, labels: list[str], args: argparse.Namespace, out: Path) -> Any:
    from autotune.trials import TrialSpec, run_trial

    spec, _, config, _ = cases[i]
    started = time.monotonic()
    result = run_trial(
        TrialSpec(
            model=spec,
            config=config,
            world_size=1,
            out_dir=out / f"case_{i:02d}",
            num_warmup=2,
            num_measured=args.steps,
            profile=i == 0,
            timeout_s=600.0,
        )
    )
    step = result.step_ms or float("nan")
    print(f"{labels[i]:<48} {result.status} {step:8.1f} ms ({time.monotonic() - started:.0f} s)", flush=True)
    return result


def _get_rows(
    cases: list, labels: list[str], split: list[str], measured: list[tuple | None], hardware: Hardware | None
) -> list[dict]:
    """One row per case: measured (``(ms or None, status, host path ms)`` per case), its split, and
    predicted where a profile's ``hardware`` is given."""
    rows = []
    for label, (_, work, config, described), part, taken in zip(labels, cases, split, measured):
        ms, status, host = taken if taken is not None else (None, "not measured (yet)", None)
        predicted = 1e3 * Simulator(work, hardware).simulate(config).step_s if hardware is not None else None
        rows.append(
            {
                "case": label,
                "config": described,
                "split": part,
                "measured_ms": ms,
                "predicted_ms": predicted,
                "status": status,
                "host_path_ms": host,
            }
        )
    return rows


def _host(timed: dict[str, float] | None) -> str:
    return f"{timed['block_forward']:.2f} / {timed['block_backward']:.2f}" if timed else "-"


def _error(row: dict) -> float | None:
    if not row["measured_ms"] or row["predicted_ms"] is None:
        return None
    return row["predicted_ms"] / row["measured_ms"] - 1


def summarize(rows: list[dict], part: str) -> dict:
    """The error over the rows of one split (``held out`` or ``fit set``): cases, median and max |error|."""
    errors = {r["case"]: _error(r) for r in rows if r["split"] == part and _error(r) is not None}
    values = [abs(e) for e in errors.values()]
    return {
        "cases": sorted(errors),
        "median_abs_error": statistics.median(values) if values else None,
        "max_abs_error": max(values) if values else None,
    }


def _write(rows: list[dict], out: Path, error: str | None, judged: dict | None = None) -> None:
    held, fit = summarize(rows, "held out"), summarize(rows, "fit set")
    data = {
        "rows": rows,
        "held_out": held,
        "fit_set": fit,
        "median_abs_error": held["median_abs_error"],  # the accuracy figure: held-out cases only
        "held_out_median_abs_error": held["median_abs_error"],
        "fit_set_median_abs_error": fit["median_abs_error"],
        "fitted_constants": [{"name": f.name, "fit_on": list(f.fit_on), "figure": f.figure} for f in FITTED],
        "judged_by": judged,
        "error": error,
    }
    (out / "results.json").write_text(json.dumps(data, indent=1))


def _report(rows: list[dict], out: Path, judged: dict | None = None) -> None:
    for part, title in (
        ("held out", "held out: configs no fitted constant was read off (the accuracy figure)"),
        (
            "fit set",
            "fit set (set constants): the calibration trial, and configs whose trials set host_path's constants",
        ),
    ):
        print(
            f"\n{title}\n| case | config | measured ms | predicted ms | error | host ms per block (fwd/bwd) |\n"
            "|---|---|---|---|---|---|"
        )
        for row in (r for r in rows if r["split"] == part):
            error = _error(row)
            print(
                f"| {row['case']} | {row['config']} | {row['measured_ms'] or float('nan'):.1f} | {row['predicted_ms']:.1f} | "
                f"{'' if error is None else f'{100 * error:+.1f}%'} | {_host(row['host_path_ms'])} |"
            )
    for part in ("held out", "fit set"):
        summary = summarize(rows, part)
        median, worst = summary["median_abs_error"], summary["max_abs_error"]
        print(
            f"{part}: median absolute error over {len(summary['cases'])} configs "
            f"{'-' if median is None else f'{100 * median:.1f}%'} (max {'-' if worst is None else f'{100 * worst:.1f}%'})"
        )
    _write(rows, out, None, judged)
    print(f"details in {out}")


if __name__ == "__main__":
    main()
