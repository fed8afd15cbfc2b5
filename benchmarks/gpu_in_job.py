"""Runs the in-job tuner inside a training job on every visible GPU; prints what it chose and what it cost.

    PYTHONPATH=. python benchmarks/gpu_in_job.py --dry-run      # anywhere: everything up to the first CUDA call
    PYTHONPATH=. python benchmarks/gpu_in_job.py --out DIR      # on a GPU box: about two minutes on one H100/H200

*Which job* (``--job``, default ``auto``; said in the first line and in ``results.json``'s ``job``
and ``job_reason``): ``torchtitan``, a torchtitan 0.3.0 llama3 job, where this torch imports 0.3.0
and 0.3.0 is there (``--torchtitan DIR``, and the wheels a GPU box lacks, as for
``benchmarks/gpu_torchtitan.py``); else ``llama``, the project's own llama (``--model``, default
``llama1b``: ``profiles``) built and sharded as a trial builds it (``autotune.trials.build_training``,
FSDP2's defaults), as ``benchmarks/in_job_tuner.py`` runs the tuner on CPU. torchtitan 0.3.0 needs
torch 2.12 or newer: on the GPU machines' torch 2.11 the job is ``llama``. ``--job torchtitan``
refuses, in one line, a torch or a directory without 0.3.0.

1. *the job*, trained at ``--seq-len`` x ``--batch-size`` per rank (default: torchtitan's 4096 x 1;
   the llama model's own, llama1b's 8192 x 1), one rank per GPU (NCCL), bf16 parameters, fp32
   reduction, one microbatch per step, AdamW. ``torchtitan``: ``torchtitan:llama3/FLAVOR``
   (``--flavor``, default 1B) sharded by torchtitan's own ``apply_fsdp_to_decoder`` (its units and
   reshard rules), torchtitan's loss on its model's output. ``llama``: one unit per block and the
   root, the project's loss.
2. *two runs of ``--steps`` steps* from the same weights and batches, in alternating order over
   ``--rounds``: ``untuned``, and ``tuned``, where ``fsdp_runtime.tuning.InJobTuner`` wraps every
   optimizer step (a ``--max-steps`` window); for ``torchtitan`` the model is first adopted
   (``fsdp_runtime.adopt_fsdp`` with torchtitan's recipe, ``get_torchtitan_config``): the two lines
   docs/in-job.md adds to torchtitan's trainer.
3. *the answer*: per run the wall time of all steps (each the slowest rank's) and the median step
   over the last quarter; the tuner's decisions, the step it settled at and its config
   (``tuned.toml`` under ``--out``); tuned over untuned in total time and in the settled step; the
   largest relative difference between the two runs' losses (NCCL's sums need not be bitwise
   alike from run to run); ``results.json``.

``--dry-run`` makes no CUDA call: on one gloo rank it builds the job's model on the meta device,
shards it over a CPU mesh (``torchtitan``: with torchtitan's own ``apply_fsdp_to_decoder``, then
adopted with torchtitan's recipe, the units, mesh and precision checked against torchtitan's
sharding; ``llama``: the job's config as the ranks receive it, checked to fit one GPU of 80 GiB
fully sharded), lists the moves the tuner would try on CUDA and its first plans, prints the
answer's lines from an empty record and writes ``results.json`` (``dry_run``, the job and why).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpu_torchtitan import (  # noqa: E402
    DEFAULT_DIR,
    FAMILY,
    FLAVORS,
    NEEDED,
    TORCHTITAN,
    use_torchtitan,
    write_model_file,
)

JOBS = ("auto", "torchtitan", "llama")
LLAMA = "llama1b"
"""The project's model the ``llama`` job trains by default (Llama 3.2 1B's shape, seq 8192, batch 1)."""
TORCHTITAN_SEQ_LEN = 4096
TORCHTITAN_ONLY = ("tyro", "spmd_types")
"""Of the modules ``gpu_torchtitan.NEEDED`` names, those only torchtitan 0.3.0 imports."""
DRY_RUN_GPU_GIB = 80.0
"""The dry run's one GPU (an H100's memory): the ``llama`` job's model is checked to fit it."""


def shard_as_torchtitan(model: Any, mesh: Any) -> None:
    """torchtitan 0.3.0's own FSDP2 sharding of a decoder: bf16 parameters, fp32 reduction, no PP."""
    import torch
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    apply_fsdp_to_decoder(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, pp_enabled=False)


def adopt_for_tuner(model: Any, *, device_type: str, out: str | None, tuner: dict[str, Any]) -> Any:
    """docs/in-job.md's tuner line for torchtitan: the model adopted with torchtitan's recipe."""
    from fsdp_runtime import adopt_fsdp, get_torchtitan_config
    from fsdp_runtime.tuning import InJobTuner

    return InJobTuner(adopt_fsdp(model, get_torchtitan_config(model)), device_type=device_type, out=out, **tuner)


def run_job(
    rank: int, world_size: int, *, model: str, num_steps: int, tuner: dict[str, Any] | None, out: str | None
) -> dict[str, Any]:
    """Rank program of the ``torchtitan`` job: its ``num_steps`` steps (tuned where ``tuner``)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from autotune.trials.training import make_microbatch
    from profiles import load_model_source

    source = load_model_source(model)
    module = source.build(device="cuda", seed=0)
    shard_as_torchtitan(module, init_device_mesh("cuda", (world_size,)))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    tuned = adopt_for_tuner(module, device_type="cuda", out=out, tuner=tuner) if tuner is not None else None

    def step(s: int) -> float:
        batch = make_microbatch(source, seed=0, step=s, microbatch=0, dp_rank=rank).cuda()
        loss = module.compute_autotune_loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss)

    return time_steps(step, tuned, num_steps)


def run_llama_job(
    rank: int,
    world_size: int,
    *,
    model: dict[str, Any],
    config: dict[str, Any],
    num_steps: int,
    tuner: dict[str, Any] | None,
    out: str | None,
) -> dict[str, Any]:
    """Rank program of the ``llama`` job: the project's model built and sharded as a trial builds
    it, its ``num_steps`` steps (tuned where ``tuner``), as ``benchmarks/in_job_tuner.py`` on CUDA."""
    from autotune.trials import build_training
    from fsdp_runtime.tuning import InJobTuner

    training = build_training(rank, world_size, model=model, config=config, device="cuda")
    tuned = InJobTuner(training.applied, device_type="cuda", out=out, **tuner) if tuner is not None else None
    return time_steps(training.step, tuned, num_steps)


def time_steps(step: Any, tuned: Any, num_steps: int) -> dict[str, Any]:
    """``step(s)`` (returns this rank's loss) ``num_steps`` times, inside the tuner's step where
    ``tuned``: per step the slowest rank's time and this rank's loss; the tuner's decisions and the
    step it settled at."""
    import torch
    import torch.distributed as dist

    steps_ms, losses, settled = [], [], None
    for s in range(num_steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with tuned.step() if tuned else contextlib.nullcontext():
            loss = step(s)
        torch.cuda.synchronize()
        elapsed = torch.tensor([(time.perf_counter() - start) * 1e3], device="cuda")
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        steps_ms.append(float(elapsed))
        losses.append(float(loss))
        if tuned is not None and settled is None and tuned.finished:
            settled = s + 1
    decisions = [d.describe() for d in tuned.decisions] if tuned else []
    return {"steps_ms": steps_ms, "losses": losses, "settled": settled, "decisions": decisions}


def summarize(runs: list[dict[str, dict[str, Any]]]) -> list[str]:
    """The answer's lines: per round each run, the tuner's decisions, and the ratios over rounds."""
    lines = []
    for r, results in enumerate(runs):
        for name, run in results.items():
            steps = run["steps_ms"]
            run["total_s"] = sum(steps) / 1e3
            run["settled_ms"] = statistics.median(steps[-max(1, len(steps) // 4) :])
            extra = f", settled at step {run['settled']}" if name == "tuned" else ""
            lines.append(
                f"round {r + 1} {name:<8} {run['total_s']:7.1f} s, last-quarter step {run['settled_ms']:7.1f} ms{extra}"
            )
        lines += [f"   {d}" for d in results.get("tuned", {}).get("decisions", [])]
    if not runs:
        return ["tuned / untuned: not measured (no run)"]
    for label, key in (("total time", "total_s"), ("settled step", "settled_ms")):
        ratios = [r["tuned"][key] / r["untuned"][key] for r in runs]
        lines.append(
            f"tuned / untuned {label}: median {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
        )
    drift = max(
        abs(a - b) / max(abs(b), 1e-12) for r in runs for a, b in zip(r["tuned"]["losses"], r["untuned"]["losses"])
    )
    lines.append(f"largest relative loss difference, tuned vs untuned: {drift:.2e}")
    return lines


def choose_job(args: argparse.Namespace) -> tuple[str, str]:
    """``torchtitan`` where this torch imports torchtitan 0.3.0 and 0.3.0 is there (``--torchtitan``
    put first on the paths), else ``llama``; and why, in one line. ``--job`` forces one: a forced
    ``torchtitan`` that cannot run exits in one line."""
    import torch

    from profiles.factory import ModelSourceError
    from profiles.torchtitan import check_torch_for_030

    if args.job == "llama":
        return "llama", f"--job llama: the project's {args.model}"
    try:
        check_torch_for_030()  # before any of 0.3.0 is imported (the GPU machines' 2.11 cannot)
        version = use_torchtitan(args.torchtitan)
    except ModelSourceError as e:
        reason = str(e)
    except SystemExit as e:  # use_torchtitan's one line: 0.3.0 is not there
        reason = str(e.code)
    else:
        return "torchtitan", f"torchtitan {version} imports with torch {torch.__version__}"
    if args.job == "torchtitan":
        sys.exit(f"gpu_in_job.py: {reason}")
    return "llama", f"torchtitan 0.3.0 cannot be imported here ({reason}); the project's {args.model} instead"


def get_llama_job(args: argparse.Namespace) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The ``llama`` job's model source, its model spec and config as the ranks receive them (FSDP2's
    defaults, one unit per block and the root, bf16/fp32, one microbatch: torchtitan's loop)."""
    from fsdp_runtime import MixedPrecisionConfig, config_to_dict, default_config
    from profiles import load_model_source

    spec: dict[str, Any] = {"name": args.model}
    spec |= {"seq_len": args.seq_len} if args.seq_len else {}
    spec |= {"batch_size": args.batch_size} if args.batch_size else {}
    source = load_model_source(spec)
    mp = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")
    config = default_config(list(source.block_names), num_microbatches=1, mixed_precision=mp)
    return source, spec, config_to_dict(config)


def get_rank_job(args: argparse.Namespace, out: Path, job: str) -> tuple[Any, str, dict[str, Any]]:
    """The job's model source, the rank program the pool runs (``module:function``) and the
    arguments every run of it shares."""
    from profiles import load_model_source

    if job == "torchtitan":
        model = str(write_model_file(args.flavor, args, out))
        return load_model_source(model), "gpu_in_job:run_job", {"model": model}
    source, spec, config = get_llama_job(args)
    return source, "gpu_in_job:run_llama_job", {"model": spec, "config": config}


def check_imports(job: str) -> list[str]:
    """The wheels to carry to the GPU box for ``job``: one line each for a module this Python lacks."""
    import importlib.util

    return [
        f"missing {module}: carry the {wheel} wheel"
        for module, wheel in NEEDED.items()
        if (job == "torchtitan" or module not in TORCHTITAN_ONLY) and not importlib.util.find_spec(module)
    ]


def gpu_run(args: argparse.Namespace, out: Path, job: str) -> dict[str, Any]:
    import torch

    from autotune.trials import RankPool, check_fits_gpu
    from fsdp_runtime import config_from_dict

    nproc = args.nproc or torch.cuda.device_count()
    tuner = {"max_steps": args.max_steps}
    source, target, base = get_rank_job(args, out, job)
    if job == "llama":
        check_fits_gpu(source, nproc, config_from_dict(base["config"]).mixed_precision, device_type="cuda")
    model = base["model"]
    runs = []
    with RankPool(nproc, backend="nccl", allow=("gpu_in_job",)) as pool:
        for r in range(args.rounds):
            results = {}
            for name in ("untuned", "tuned") if r % 2 == 0 else ("tuned", "untuned"):
                run_args = base | {"num_steps": args.steps, "tuner": tuner if name == "tuned" else None}
                run = pool.run(target, run_args | {"out": str(out / "tuned.toml")}, timeout_s=540)
                if not run.ok:
                    sys.exit(f"round {r + 1}, {name}: {run.status}: {run.reason}")
                results[name] = run.results[0]
                print(f"round {r + 1} {name}: done", flush=True)
            runs.append(dict(sorted(results.items(), reverse=True)))
    answer = summarize(runs)
    print("\n".join(answer), flush=True)
    device = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "nproc": nproc}
    return device | {"model": model, "runs": runs, "answer": answer}


def dry_run(args: argparse.Namespace, out: Path, job: str) -> dict[str, Any]:
    """Everything up to the first CUDA call, on one in-process gloo rank and the meta device."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_runtime.tuning import get_moves

    for line in check_imports(job):
        print(line)
    source, target, base = get_rank_job(args, out, job)
    module_name, function = target.split(":")
    if not callable(getattr(importlib.import_module(module_name), function, None)):  # as a rank resolves it
        sys.exit(f"gpu_in_job.py: the rank program {target} is not there")
    print(f"ranks run: {target} on {source.name}")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        tuner = {"max_steps": args.max_steps}
        if job == "torchtitan":
            module = source.build(device="meta")
            shard_as_torchtitan(module, mesh)
            tuned = adopt_for_tuner(module, device_type="cuda", out=None, tuner=tuner)
            how = "torchtitan's sharding"
        else:
            tuned = adopt_llama(source, base["config"], mesh, tuner=tuner)
            how = "a trial's build, FSDP2's defaults"
        config = tuned.applied.config
        mp = config.mixed_precision
        print(
            f"model: {source.name}, {source.get_num_params() / 1e9:.3f}B params, "
            f"seq_len {source.seq_len} x batch {source.batch_size}"
        )
        print(f"adopted: {len(config.units)} units of {how}, {mp.param_dtype}/{mp.reduce_dtype}")
        moves = get_moves(config, device_type="cuda")
        print(f"moves on cuda: {len(moves)}: {', '.join(m.name for m in moves)}")
        print(f"window: {args.max_steps} steps of {args.steps}; first plan: {tuned.walk.plan()[1] or 'the seed'}")
    finally:
        dist.destroy_process_group()
    print("\n".join(summarize([])))
    print("dry run: no step ran")
    return {"model": base["model"], "units": len(config.units), "moves": [m.name for m in moves]}


def adopt_llama(source: Any, job_config: dict[str, Any], mesh: Any, *, tuner: dict[str, Any]) -> Any:
    """The ``llama`` job's model on meta, sharded with the config the ranks receive over ``mesh``,
    checked to fit one GPU fully sharded, and the tuner over it (on CUDA's moves)."""
    from autotune.trials import check_fits_gpu
    from fsdp_runtime import apply_fsdp, config_from_dict
    from fsdp_runtime.tuning import InJobTuner

    config = config_from_dict(job_config)  # as build_training reads the job's config
    check_fits_gpu(source, 1, config.mixed_precision, device_type="cuda", total_memory=int(DRY_RUN_GPU_GIB * 2**30))
    applied = apply_fsdp(source.build(device="meta"), config, mesh=mesh)
    return InJobTuner(applied, device_type="cuda", out=None, **tuner)


def write_results(out: Path, results: dict[str, Any]) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="no CUDA call: the model sharded on meta and adopted")
    parser.add_argument("--out", type=Path, default=None, help="tuned.toml and results.json (default: a temp dir)")
    parser.add_argument("--job", choices=JOBS, default="auto", help="auto: torchtitan where 0.3.0 imports, else llama")
    parser.add_argument("--torchtitan", type=Path, default=DEFAULT_DIR, help="a directory holding torchtitan 0.3.0")
    parser.add_argument("--model", default=LLAMA, help="the llama job's model (a profile name or model TOML)")
    parser.add_argument("--nproc", type=int, default=None, help="GPUs (default: every GPU)")
    parser.add_argument("--flavor", choices=FLAVORS, default="1B", help="the torchtitan job's llama3 flavor")
    parser.add_argument("--steps", type=int, default=120, help="steps per run")
    parser.add_argument("--max-steps", type=int, default=80, help="the tuner's window")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of both runs, alternating their order")
    parser.add_argument(
        "--seq-len", type=int, default=None, help=f"default: torchtitan's {TORCHTITAN_SEQ_LEN}, the llama model's own"
    )
    parser.add_argument("--batch-size", type=int, default=None, help="default: 1, the llama model's own")
    args = parser.parse_args()
    job, why = choose_job(args)
    if job == "torchtitan":
        args.seq_len, args.batch_size = args.seq_len or TORCHTITAN_SEQ_LEN, args.batch_size or 1
        print(f"torchtitan {TORCHTITAN}, {FAMILY}/{args.flavor}")
    else:
        print(f"the project's {args.model}")
    print(f"job: {job} ({why})", flush=True)
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu_in_job_"))
    out.mkdir(parents=True, exist_ok=True)
    record = {"job": job, "job_reason": why, "dry_run": args.dry_run}
    write_results(out, record)  # first: a run stopped part way (a GPU suite's slice) still says which job it was
    results = dry_run(args, out, job) if args.dry_run else gpu_run(args, out, job)
    write_results(out, record | results)
    print(f"written: {out / 'results.json'}")


if __name__ == "__main__":
    main()
