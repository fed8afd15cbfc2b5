"""Runs a default search on GPUs in one go and prints each trial's seconds, peaks and models held, and the numerics.

    PYTHONPATH=. python benchmarks/gpu_check.py --dry-run      # anywhere: the plan, no CUDA call
    PYTHONPATH=. python benchmarks/gpu_check.py --out DIR      # on a GPU box: at most ~8 min on one H100/H200

On the GPU box, with every GPU it sees (``--nproc``, default all), from a source checkout
(no install: the machine's own torch, plus optuna and traceinsight from carried wheels):

1. *the model*: Llama 3.1 8B's block shape, full vocabulary, ``--seq-len`` tokens, with as many
   blocks as keep the simulator's predicted peak of one model (FSDP2's defaults, bf16 params,
   fp32 reduce, 2 microbatches) under ``--fill`` (0.6) of one GPU's memory: a job sized to its
   GPU, which a paired trial holding two models could not search;
2. *a default search* on it (``--trials``, the search's own defaults otherwise) through the
   API (typer is not on the GPU box), in one warm NCCL rank pool;
3. *numerics*: the defaults in bf16 against fp32 on a 2-block model (losses of 4 steps,
   within 2%: bf16 keeps 8 bits of mantissa, 0.4% per rounding), and one model switched in
   place to no reshard after forward + prefetch one block ahead against a fresh build of that
   config (bf16, 4 steps; bitwise on CPU, within 0.1% here: GPU kernels may pick other
   algorithms for other memory layouts);
4. *one table*: per trial its status, ratio to the defaults, wall time, the time of its steps
   (measured, settle and profiled, both sides), the fixed cost (wall minus steps: start of the
   job, build, warm-up steps, profiler stop and export, result collection), the candidate's
   peak, the trial's peak with its reference, the allocator's reserved peak and the models it
   held; the defaults trial first. Also written as ``results.json``; every trial dir (traces
   included) stays under ``--out``.

``--dry-run`` makes no CUDA call: it checks the imports the GPU run needs, sizes the model for
``--gpu-gib`` of memory, builds the search's settings, plan and space and every config it
starts from, builds the numerics trials' specs, and prints the table of a recorded trial dir
(``--recorded``), so the script is known to run before a GPU minute is spent on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import with_keep_and_prefetch  # noqa: E402

from autotune.search import SearchSettings  # noqa: E402
from autotune.trials import TrialMetrics, TrialSpec  # noqa: E402
from fsdp_runtime import MixedPrecisionConfig, config_to_dict  # noqa: E402

BF16 = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")
FP32 = MixedPrecisionConfig()
BASE_MODEL = "llama8b"
NEEDED = {"optuna": "optuna", "hta": "traceinsight"}
"""Modules the GPU run imports beyond torch, and the wheel that brings each."""
BF16_RTOL, SWITCH_RTOL = 2e-2, 1e-3
DEFAULT_RECORDED = ROOT / "tests" / "data" / "gpu_traces" / "h200-l8b4-defaults"


def check_imports() -> list[str]:
    """The wheels to carry to the GPU box: one line each for a module this Python lacks."""
    return [
        f"missing {module}: carry the {wheel} wheel"
        for module, wheel in NEEDED.items()
        if not importlib.util.find_spec(module)
    ]


def size_model(*, gpu_bytes: int, fill: float, nproc: int, seq_len: int, cluster: str) -> tuple[dict, float]:
    """The 8B-shaped model with the most blocks whose predicted peak (one model, the defaults) is
    under ``fill`` of ``gpu_bytes``; and that peak."""
    from autotune.search import SearchSpace
    from autotune.sim import Hardware, Simulator, get_model_work
    from profiles import load_cluster_profile
    from profiles.sources import load_model_source

    hardware = Hardware(load_cluster_profile(cluster), num_ranks=nproc)
    best: tuple[dict, float] | None = None
    for blocks in range(1, 33):
        model = {"name": BASE_MODEL, "num_layers": blocks, "seq_len": seq_len}
        work = get_model_work(load_model_source(model), "bfloat16")
        space = SearchSpace(
            block_names=work.block_names, world_size=nproc, num_microbatches=2, device_type="cuda", mixed_precision=BF16
        )
        peak = Simulator(work, hardware).simulate(space.build_config(space.get_default_params())).peak_memory_bytes
        if peak > fill * gpu_bytes:
            break
        best = (model, peak)
    if best is None:
        raise SystemExit(
            f"one block of {BASE_MODEL} at seq {seq_len} does not fit {fill:.0%} of {gpu_bytes / 2**30:.0f} GiB"
        )
    return best


def write_model_toml(model: dict, out: Path) -> Path:
    """The sized model as a profile TOML (a path, as users pass ``--model``; the search keeps it as given)."""
    from fsdp_runtime import dumps_toml
    from profiles.sources import load_model_source

    profile = load_model_source(model)
    name = f"{BASE_MODEL}-{model['num_layers']}blocks"
    data = {
        "name": name,
        "description": f"{BASE_MODEL}'s shape, {model['num_layers']} blocks (gpu_check.py)",
        "seq_len": profile.seq_len,
        "batch_size": profile.batch_size,
        "shape": dataclasses.asdict(profile.shape),
    }
    path = out / f"{name}.toml"
    path.write_text(dumps_toml(data), encoding="utf-8")
    return path


def search_settings(model: dict, args: argparse.Namespace, out: Path) -> SearchSettings:
    return SearchSettings(
        model=str(write_model_toml(model, out)),
        world_size=args.nproc,
        num_trials=args.trials,
        num_microbatches=2,
        out_dir=out / "search",
        param_dtype="bfloat16",
        reduce_dtype="float32",
    )


def plan_search(settings: SearchSettings, gpu_bytes: int) -> list[str]:
    """What the search will run, checked as ``run_search`` checks it before its first CUDA call."""
    from autotune.search.preflight import preflight
    from autotune.search.run import get_search_precision, make_space
    from autotune.search.study import make_plan
    from autotune.trials import check_fits_gpu
    from profiles.sources import load_model_source

    profile = load_model_source(settings.model)
    mp = get_search_precision(settings, "cuda")
    check_fits_gpu(profile, settings.world_size, mp, device_type="cuda", total_memory=gpu_bytes)
    plan = make_plan(settings, profile, "cuda")
    preflight(settings)
    space = make_space(settings, plan, "cuda", mixed_precision=mp)
    default = space.build_config(space.get_default_params())
    return [
        f"search: {settings.num_trials} trials of {profile.name} on {settings.world_size} GPU(s), {mp.param_dtype}/{mp.reduce_dtype}",
        f"space: {len(space.get_default_params())} knobs; defaults: {len(default.units)} units",
        *space.notes,
    ]


def numerics_specs(args: argparse.Namespace, out: Path) -> dict[str, TrialSpec]:
    """The trials of the numerics check: fp32 and bf16 defaults, unpaired, 4 steps each, on 2 blocks."""
    from autotune.trials import load_trial_config

    model = {"name": BASE_MODEL, "num_layers": 2, "seq_len": args.seq_len // 2}
    base = load_trial_config(None, model)
    specs = {}
    for name, mp in (("fp32", FP32), ("bf16", BF16)):
        specs[name] = TrialSpec(
            model=model,
            config=dataclasses.replace(base, mixed_precision=mp),
            world_size=args.nproc,
            out_dir=out / "numerics" / name,
            num_warmup=0,
            num_measured=4,
            profile=False,
            timeout_s=600,
            backend="nccl",
        )
    return specs


def switch_check(rank: int, world_size: int, *, model: dict, build: dict, switched: dict) -> dict:
    """Rank program: 4 steps of a fresh build of ``switched``, then of a build of ``build``
    switched in place to it before its first step; both runs' losses."""
    from autotune.trials import build_training
    from autotune.trials.program import _get_device

    device = _get_device("nccl", rank)
    fresh = build_training(rank, world_size, model=model, config=switched, device=device)
    fresh_losses = [fresh.step(s) for s in range(4)]
    del fresh
    one = build_training(rank, world_size, model=model, config=build, device=device)
    one.use_config(switched)
    return {"fresh": fresh_losses, "switched": [one.step(s) for s in range(4)]}


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def run_numerics(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from autotune.trials import run_ranks, run_trial

    specs = numerics_specs(args, out)
    results = {name: run_trial(spec) for name, spec in specs.items()}
    losses = {name: r.metrics.ranks[0].losses if r.ok else [] for name, r in results.items()}
    bf16 = max_rel_diff(losses["bf16"], losses["fp32"]) if all(losses.values()) else None
    bf16_config = specs["bf16"].config
    switch = run_ranks(
        "gpu_check:switch_check",
        world_size=args.nproc,
        kwargs={
            "model": specs["bf16"].model,
            "build": config_to_dict(bf16_config),
            "switched": config_to_dict(with_keep_and_prefetch(bf16_config)),
        },
        timeout_s=600,
        backend="nccl",
    )
    switched = max_rel_diff(switch.results[0]["switched"], switch.results[0]["fresh"]) if switch.ok else None
    return {
        "bf16_vs_fp32": {"max_rel_diff": bf16, "rtol": BF16_RTOL, "ok": bf16 is not None and bf16 <= BF16_RTOL},
        "switched_vs_fresh": {
            "max_rel_diff": switched,
            "rtol": SWITCH_RTOL,
            "ok": switched is not None and switched <= SWITCH_RTOL,
            "failure": None if switch.ok else f"{switch.status}: {switch.reason}",
        },
        "losses": {**losses, **({"switch": switch.results[0]} if switch.ok else {})},
    }


def get_trial_row(trial_dir: Path) -> dict[str, Any]:
    """One table row from a trial dir's ``metrics.json`` (any version: older ones read with nulls)."""
    metrics = TrialMetrics.read(trial_dir / "metrics.json")
    steps_ms = 0.0
    if metrics.ranks:
        r = metrics.ranks[0]
        timed = r.step_ms + r.reference_step_ms + r.settle_step_ms + r.reference_settle_step_ms
        steps_ms = sum(timed) + sum(max(own) for own in zip(*(x.profiled_step_ms for x in metrics.ranks)))
    return {
        "trial": trial_dir.name,
        "status": metrics.status,
        "ratio": metrics.paired.get("ratio"),
        "wall_s": metrics.wall_s,
        "steps_s": steps_ms / 1e3,
        "fixed_s": metrics.wall_s - steps_ms / 1e3,
        "step_ms": metrics.step_ms,
        "peak_gib": _gib(metrics.process_peak_bytes),
        "trial_peak_gib": _gib(metrics.trial_peak_bytes),
        "reserved_gib": _gib(metrics.reserved_peak_bytes),
        "models": metrics.num_models,
    }


def _gib(n: int | None) -> float | None:
    return None if n is None else n / 2**30


COLUMNS = (
    "trial",
    "status",
    "ratio",
    "wall_s",
    "steps_s",
    "fixed_s",
    "step_ms",
    "peak_gib",
    "trial_peak_gib",
    "reserved_gib",
    "models",
)


def format_table(rows: list[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        if value is None:
            return "-"
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    lines = ["  ".join(f"{c:>14}" for c in COLUMNS)]
    lines += ["  ".join(f"{cell(row[c]):>14}" for c in COLUMNS) for row in rows]
    return "\n".join(lines)


def get_search_rows(search_dir: Path) -> list[dict[str, Any]]:
    """Every trial dir of the search, the defaults trial (the first) first; the warm-up run last."""
    dirs = sorted(p.parent for p in search_dir.rglob("metrics.json"))
    return [get_trial_row(d) for d in sorted(dirs, key=lambda d: (d.name == "warmup", str(d)))]


def gpu_run(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import torch

    from autotune.search import run_search

    args.nproc = args.nproc or torch.cuda.device_count()
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    model, predicted = size_model(
        gpu_bytes=gpu_bytes, fill=args.fill, nproc=args.nproc, seq_len=args.seq_len, cluster=args.cluster
    )
    settings = search_settings(model, args, out)
    print("\n".join(plan_search(settings, gpu_bytes)), flush=True)
    started = time.monotonic()
    summary = run_search(settings)
    search_s = time.monotonic() - started
    rows = get_search_rows(settings.out_dir)
    print(format_table(rows), flush=True)
    numerics = run_numerics(args, out)
    return {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "nproc": args.nproc,
        "model": model,
        "predicted_peak_gib": predicted / 2**30,
        "gpu_gib": gpu_bytes / 2**30,
        "search_s": search_s,
        "best": {"trial": summary.best.number, "ratio": summary.best.ratio} if summary.best else None,
        "best_config": str(summary.best_config_path) if summary.best_config_path else None,
        "trials": rows,
        "numerics": {k: v for k, v in numerics.items() if k != "losses"},
        "losses": numerics["losses"],
    }


def dry_run(args: argparse.Namespace, out: Path) -> None:
    for line in check_imports():
        print(line)
    nproc = args.nproc or 1
    gpu_bytes = int(args.gpu_gib * 2**30)
    model, predicted = size_model(
        gpu_bytes=gpu_bytes, fill=args.fill, nproc=nproc, seq_len=args.seq_len, cluster=args.cluster
    )
    print(
        f"model: {model} (predicted peak {predicted / 2**30:.1f} GiB of {args.gpu_gib:.0f} GiB, fill {args.fill:.0%})"
    )
    args.nproc = nproc
    # The one device query before the first trial (the search's plan reads the GPU's memory): stood in for.
    stand_in = types.SimpleNamespace(total_memory=gpu_bytes, name=f"dry run: {args.gpu_gib:.0f} GiB")
    with mock.patch("torch.cuda.get_device_properties", lambda device=0: stand_in):
        print("\n".join(plan_search(search_settings(model, args, out), gpu_bytes)))
    for name, spec in numerics_specs(args, out).items():
        print(f"numerics {name}: {spec.model}, {spec.config.mixed_precision}, {spec.num_measured} steps")
    if args.recorded is not None and (args.recorded / "metrics.json").exists():
        print(f"the table of a recorded trial dir ({args.recorded}):")
        print(format_table([get_trial_row(args.recorded)]))
    print("dry run: no trial ran")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="no CUDA call: the plan and a recorded trial's row")
    parser.add_argument(
        "--out", type=Path, default=None, help="where trial dirs and results.json go (default: a temp dir)"
    )
    parser.add_argument("--nproc", type=int, default=None, help="GPUs (default: every GPU; 1 in a dry run)")
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--fill", type=float, default=0.6, help="the model's predicted peak, as a share of one GPU")
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="dry run: one GPU's memory (an H100's by default)")
    parser.add_argument("--cluster", default="h100-node", help="cluster profile the model is sized with")
    parser.add_argument("--recorded", type=Path, default=DEFAULT_RECORDED, help="dry run: a trial dir to tabulate")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        dry_run(args, out)
        return
    results = gpu_run(args, out)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(results["numerics"], indent=2))
    print(f"written: {out / 'results.json'}")


if __name__ == "__main__":
    main()
