"""Runs a default search on GPUs in one go and prints each trial's seconds, peaks and models held, and the numerics.

    PYTHONPATH=. python benchmarks/gpu_check.py --dry-run      # anywhere: the plan, no CUDA call
    PYTHONPATH=. python benchmarks/gpu_check.py --out DIR      # on a GPU box: at most ~8 min on one H100/H200

On the GPU box, with every GPU it sees (``--nproc``, default all), from a source checkout
(no install: the machine's own torch, plus optuna and traceinsight from carried wheels):

1. *numerics*, first (a minute; they say whether anything after them can be trusted;
   :mod:`autotune.trials.numerics`, its [Note: numerics checks]; fresh NCCL ranks,
   a 2-block model of Llama 3.1 8B's block shape and full vocabulary), each a structured
   result, written to ``results.json`` before the search starts:
   - *memorisation*: the same batch every step (rows alternating two tokens, so that the next
     token depends on the one before the current one), 48 AdamW steps at 1e-4, in fp32 and in
     bf16 params / fp32 reduce. Asserts, per run and rank, that the last loss is at most half the
     first, and at most half the batch's context-free floor (the least loss of any model that
     sees only the current token: a model whose blocks are skipped cannot pass); and that at
     every step ``|L_bf16 - L_fp32| <= 3 * 2**-8 * sqrt(r) * (L_fp32[s] + the fp32 curve's travel
     so far)``, with ``r = 3 * (10 * blocks + 2)`` bf16 roundings on a value's path (2**-8: bf16's
     8 significant bits; 3: three standard deviations of a sum of independent roundings);
   - *switch*: FSDP2's defaults switched in place after a step to no reshard after forward +
     prefetch one block ahead, against a fresh build of that, fp32, 4 steps, deterministic
     algorithms. Asserts losses bitwise equal on every rank and step, the per-step counts of
     all-gathers and reduce-scatters after the switch equal the fresh build's, and the two
     configs' counts differ (the defaults gather every block again in backward), so that a
     switch that did nothing fails. With one GPU it runs on 2 gloo ranks on the CPU (tiny Llama):
     FSDP2 issues no collectives on one rank;
2. *the model*: Llama 3.1 8B's block shape, full vocabulary, ``--seq-len`` tokens, with as many
   blocks as keep the simulator's predicted peak of one model (FSDP2's defaults, bf16 params,
   fp32 reduce, 2 microbatches) under ``--fill`` (0.6) of one GPU's memory: a job sized to its
   GPU, which a paired trial holding two models could not search;
3. *a default search* on it (``--trials``, the search's own defaults otherwise) through the
   API (typer is not on the GPU box), in one warm NCCL rank pool;
4. *one table*: per trial its status, ratio to the defaults, wall time, the time of its steps
   (measured, settle and profiled, both sides), the fixed cost (wall minus steps: start of the
   job, build, warm-up steps, profiler stop and export, result collection), the candidate's
   peak, the trial's peak with its reference, the allocator's reserved peak and the models it
   held; the defaults trial first. Also written as ``results.json``; every trial dir (traces
   included) stays under ``--out``.

``--dry-run`` makes no CUDA call: it checks the imports the GPU run needs, sizes the model for
``--gpu-gib`` of memory, builds the search's settings, plan and space and every config it
starts from, builds the numerics checks' configs, and prints the table of a recorded trial dir
(``--recorded``), so the script is known to run before a GPU minute is spent on it. ``--part``
runs the search only or the numerics only (default: both). ``results.json`` holds each numerics
check as ``numerics.<name>``: ``passed``, every criterion with its value and limit, the loss
curves; ``numerics_passed`` is all of them, and the script exits 1 after writing it when one failed.
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

from autotune.search import SearchSettings  # noqa: E402
from autotune.trials import TrialMetrics  # noqa: E402
from autotune.trials.numerics import (  # noqa: E402
    BF16,
    COMM_BUFFER_KNOBS,
    FP32,
    ONE_RANK,
    ONE_RANK_BUFFERS,
    MemoriseTask,
    check_comm_buffers,
    check_memorisation,
    check_switch,
    get_comm_buffer_configs,
    get_default_config,
    keep_and_prefetch,
)
from autotune.trials.numerics_criteria import GRAD_RTOL  # noqa: E402

BASE_MODEL = "llama8b"
NEEDED = {"optuna": "optuna", "hta": "traceinsight"}
"""Modules the GPU run imports beyond torch, and the wheel that brings each."""
NUMERICS_MODEL = {"name": BASE_MODEL, "num_layers": 2}
MEMORISE = MemoriseTask(lr=1e-4, num_steps=48)
"""For 4096 wide: on CPU a width of 64 memorised at 5e-3 and of 1024 at 3e-4 (lr x width ~0.3); more steps
than the CPU tests' 32, for room (a GPU step here takes milliseconds)."""
SWITCH = dataclasses.replace(MEMORISE, num_steps=4)
ONE_GPU_SWITCH_MODEL = {"name": "tiny", "num_layers": 2}
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
    from autotune.search import get_planned_target
    from autotune.search.run import make_space, prepare_search

    target = get_planned_target("h200-node", settings.world_size, memory_bytes=gpu_bytes)
    plan = prepare_search(settings, target=target)  # as run_search plans and checks it, for a GPU of gpu_bytes
    space = make_space(settings, plan)
    default = space.build_config(space.get_default_params())
    mp = plan.precision
    return [
        f"search: {settings.num_trials} trials of {plan.source.name} on {settings.world_size} GPU(s), {mp.param_dtype}/{mp.reduce_dtype}",
        *plan.describe()[1:],
        f"space: {len(space.get_default_params())} knobs; defaults: {len(default.units)} units",
        *space.notes,
    ]


def numerics_plan(nproc: int) -> list[str]:
    """What the numerics checks will run on ``nproc`` GPUs, one line each; builds their configs (no CUDA call)."""
    switch_model, ranks = (
        (NUMERICS_MODEL, f"{nproc} NCCL ranks") if nproc >= 2 else (ONE_GPU_SWITCH_MODEL, "2 gloo ranks")
    )
    fp32 = get_default_config(switch_model, FP32)
    keep_and_prefetch(fp32)
    m = MEMORISE
    return [
        f"numerics memorisation: {NUMERICS_MODEL} on {nproc} NCCL rank(s), fp32 then {BF16.param_dtype}/"
        f"{BF16.reduce_dtype}, {m.num_steps} steps at lr {m.lr:g} on {m.rows}x{m.length} tokens per rank",
        f"numerics switch: {switch_model} on {ranks}, fp32, {SWITCH.num_steps} steps: {len(fp32.units)} units"
        " switched in place after a step to no reshard after forward + prefetch one block ahead, vs a fresh build",
        get_comm_buffers_plan(nproc),
    ]


def get_comm_buffers_plan(nproc: int) -> str:
    """The CUDA-only communication-buffer knobs' check: what it runs, or why not (one GPU, or a torch without them)."""
    knobs = [k for k in get_comm_buffer_configs(NUMERICS_MODEL) if k != "defaults"]
    left = [k for k in COMM_BUFFER_KNOBS if k not in knobs]
    lacking = f"; not {', '.join(left)}: this torch lacks the method" if left else ""
    if nproc < 2:
        return f"numerics comm_buffers: not run on 1 GPU ({ONE_RANK_BUFFERS})"
    return (
        f"numerics comm_buffers: {NUMERICS_MODEL} on {nproc} NCCL ranks, fp32, {MEMORISE.num_steps} steps: FSDP2's "
        f"defaults vs {', '.join(knobs) or 'none'} (sum-only reductions: first gradient within {GRAD_RTOL:g}){lacking}"
    )


def run_numerics(nproc: int) -> dict[str, Any]:
    """Both numerics checks on fresh ranks, NCCL on ``nproc`` GPUs (the switch on 2 gloo ranks with
    one GPU: FSDP2 issues no collectives on one rank); each one's structured result."""
    memorisation = check_memorisation(NUMERICS_MODEL, world_size=nproc, backend="nccl", task=MEMORISE, timeout_s=600)
    if nproc >= 2:
        switch = check_switch(NUMERICS_MODEL, world_size=nproc, backend="nccl", task=SWITCH, timeout_s=600)
        where = f"{nproc} NCCL ranks"
    else:
        switch = check_switch(ONE_GPU_SWITCH_MODEL, world_size=2, task=SWITCH, timeout_s=600)
        where = f"2 gloo ranks on CPU, {ONE_GPU_SWITCH_MODEL} (one GPU: {ONE_RANK})"
    checks = [(memorisation, f"{nproc} NCCL ranks"), (switch, where)]
    if nproc >= 2:  # one rank issues no collectives: get_comm_buffers_plan says so
        buffers = check_comm_buffers(NUMERICS_MODEL, world_size=nproc, task=MEMORISE, timeout_s=600)
        checks.append((buffers, f"{nproc} NCCL ranks"))
    results = {}
    for check, ranks in checks:
        print(check.describe(), flush=True)
        results[check.name] = {**check.to_dict(), "ranks": ranks}
    return results


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
    """The parts ``--part`` asks for, on every GPU ``--nproc`` names; what results.json holds.

    The numerics first (a minute; they decide whether anything after them can be trusted), then
    the search; results.json is written after each, so a run stopped in the search (a GPU
    suite's time slice) keeps the numerics, and the search's trial dirs stay under ``--out``."""
    import torch

    args.nproc = args.nproc or torch.cuda.device_count()
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "nproc": args.nproc,
        "part": args.part,
    }
    if args.part in ("all", "numerics"):
        results["numerics"] = run_numerics(args.nproc)
        results["numerics_passed"] = all(check["passed"] for check in results["numerics"].values())
        write_results(results, out)
    if args.part in ("all", "search"):
        results.update(search_run(args, out))
        write_results(results, out)
    return results


def write_results(results: dict[str, Any], out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


def search_run(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import torch

    from autotune.search import run_search

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
    return {
        "model": model,
        "predicted_peak_gib": predicted / 2**30,
        "gpu_gib": gpu_bytes / 2**30,
        "search_s": search_s,
        "best": {"trial": summary.best.number, "ratio": summary.best.ratio} if summary.best else None,
        "best_config": str(summary.best_config_path) if summary.best_config_path else None,
        "trials": rows,
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
    print("\n".join(numerics_plan(nproc)))
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
    parser.add_argument(
        "--part", choices=("all", "search", "numerics"), default="all", help="the search, the numerics, or both"
    )
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        dry_run(args, out)
        return
    results = gpu_run(args, out)
    print(f"written: {out / 'results.json'}")
    if results.get("numerics_passed") is False:
        failed = [name for name, check in results["numerics"].items() if not check["passed"]]
        sys.exit(f"numerics check failed: {', '.join(failed)} (criteria and figures in results.json)")


if __name__ == "__main__":
    main()
