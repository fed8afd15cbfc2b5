"""Runs the in-job tuner inside a torchtitan 0.3.0 llama3 job on every visible GPU; prints what it chose and what it cost.

    PYTHONPATH=. python benchmarks/gpu_in_job.py --dry-run      # anywhere: everything up to the first CUDA call
    PYTHONPATH=. python benchmarks/gpu_in_job.py --out DIR      # on a GPU box: about two minutes on one H100/H200

torchtitan 0.3.0 and the wheels a GPU box lacks come as for ``benchmarks/gpu_torchtitan.py`` (its
``--torchtitan DIR``; a torch that cannot import 0.3.0, 2.11 among them, is refused in one line).

1. *the job*: ``torchtitan:llama3/FLAVOR`` (``--flavor``, default 1B) trained at ``--seq-len`` x
   ``--batch-size`` per rank, one rank per GPU (NCCL), sharded by torchtitan's own
   ``apply_fsdp_to_decoder`` (bf16 parameters, fp32 reduction, its units and reshard rules), AdamW,
   torchtitan's loss on its model's output.
2. *two runs of ``--steps`` steps* from the same weights and batches, in alternating order over
   ``--rounds``: ``untuned``, and ``tuned``, where the model is adopted (``fsdp_runtime.adopt_fsdp``
   with torchtitan's recipe, ``get_torchtitan_config``) and ``fsdp_runtime.tuning.InJobTuner``
   wraps every optimizer step (a ``--max-steps`` window): the two lines docs/in-job.md adds to
   torchtitan's trainer.
3. *the answer*: per run the wall time of all steps (each the slowest rank's) and the median step
   over the last quarter; the tuner's decisions, the step it settled at and its config
   (``tuned.toml`` under ``--out``); tuned over untuned in total time and in the settled step; the
   largest relative difference between the two runs' losses (NCCL's sums need not be bitwise
   alike from run to run); ``results.json``.

``--dry-run`` makes no CUDA call: on one gloo rank it builds 0.3.0's model on the meta device,
shards it with torchtitan's own ``apply_fsdp_to_decoder`` over a CPU mesh, adopts it with
torchtitan's recipe (the units, mesh and precision checked against torchtitan's sharding), lists
the moves the tuner would try on CUDA and its first plans, and prints the answer's lines from an
empty record.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpu_torchtitan import (  # noqa: E402
    DEFAULT_DIR,
    FAMILY,
    FLAVORS,
    check_imports,
    run_030_script,
    use_torchtitan,
    write_model_file,
)


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
    """Rank program: the job's ``num_steps`` steps (tuned where ``tuner``): per step the slowest
    rank's time and this rank's loss; the tuner's decisions and the step it settled at."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autotune.trials.training import make_microbatch
    from profiles import load_model_source

    source = load_model_source(model)
    module = source.build(device="cuda", seed=0)
    shard_as_torchtitan(module, init_device_mesh("cuda", (world_size,)))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    tuned = adopt_for_tuner(module, device_type="cuda", out=out, tuner=tuner) if tuner is not None else None
    steps_ms, losses, settled = [], [], None
    for s in range(num_steps):
        batch = make_microbatch(source, seed=0, step=s, microbatch=0, dp_rank=rank).cuda()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with tuned.step() if tuned else contextlib.nullcontext():
            loss = module.compute_autotune_loss(batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
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


def gpu_run(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import torch

    from autotune.trials import RankPool

    nproc = args.nproc or torch.cuda.device_count()
    model = str(write_model_file(args.flavor, args, out))
    tuner = {"max_steps": args.max_steps}
    runs = []
    with RankPool(nproc, backend="nccl") as pool:
        for r in range(args.rounds):
            results = {}
            for name in ("untuned", "tuned") if r % 2 == 0 else ("tuned", "untuned"):
                job = {"model": model, "num_steps": args.steps, "tuner": tuner if name == "tuned" else None}
                run = pool.run("gpu_in_job:run_job", job | {"out": str(out / "tuned.toml")}, timeout_s=540)
                if not run.ok:
                    sys.exit(f"round {r + 1}, {name}: {run.status}: {run.reason}")
                results[name] = run.results[0]
                print(f"round {r + 1} {name}: done", flush=True)
            runs.append(dict(sorted(results.items(), reverse=True)))
    answer = summarize(runs)
    print("\n".join(answer), flush=True)
    device = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "nproc": nproc}
    return device | {"model": model, "runs": runs, "answer": answer}


def dry_run(args: argparse.Namespace, out: Path) -> None:
    """Everything up to the first CUDA call, on one in-process gloo rank and the meta device."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_runtime.tuning import get_moves
    from profiles import load_model_source

    for line in check_imports():
        print(line)
    source = load_model_source(str(write_model_file(args.flavor, args, out)))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = source.build(device="meta")
        shard_as_torchtitan(model, init_device_mesh("cpu", (1,)))
        tuned = adopt_for_tuner(model, device_type="cuda", out=None, tuner={"max_steps": args.max_steps})
        config = tuned.applied.config
        mp = config.mixed_precision
        print(
            f"model: {source.name}, {source.get_num_params() / 1e9:.3f}B params, seq_len {args.seq_len} x batch {args.batch_size}"
        )
        print(f"adopted: {len(config.units)} units of torchtitan's sharding, {mp.param_dtype}/{mp.reduce_dtype}")
        moves = get_moves(config, device_type="cuda")
        print(f"moves on cuda: {len(moves)}: {', '.join(m.name for m in moves)}")
        print(f"window: {args.max_steps} steps of {args.steps}; first plan: {tuned.walk.plan()[1] or 'the seed'}")
    finally:
        dist.destroy_process_group()
    print("\n".join(summarize([])))
    print("dry run: no step ran")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="no CUDA call: the model sharded on meta and adopted")
    parser.add_argument("--out", type=Path, default=None, help="tuned.toml and results.json (default: a temp dir)")
    parser.add_argument("--torchtitan", type=Path, default=DEFAULT_DIR, help="a directory holding torchtitan 0.3.0")
    parser.add_argument("--nproc", type=int, default=None, help="GPUs (default: every GPU)")
    parser.add_argument("--flavor", choices=FLAVORS, default="1B")
    parser.add_argument("--steps", type=int, default=120, help="steps per run")
    parser.add_argument("--max-steps", type=int, default=80, help="the tuner's window")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of both runs, alternating their order")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=1)
    args = parser.parse_args()
    print(f"torchtitan {use_torchtitan(args.torchtitan)}, {FAMILY}/{args.flavor}")
    run_030_script("gpu_in_job", args, dry_run, gpu_run)


if __name__ == "__main__":
    main()
