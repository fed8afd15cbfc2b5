"""Prints what tuning inside the job costs and what it finds: the same training run with the in-job tuner and without it.

    .venv/bin/python benchmarks/in_job_tuner.py                    # wide1024, 200 steps, 4 microbatches, cpu-emulated-ib
    .venv/bin/python benchmarks/in_job_tuner.py --search-config runs/search/best.toml   # and the search's config
    .venv/bin/python benchmarks/in_job_tuner.py --quick            # tiny, 30 steps: the path, not the numbers

Each round runs, in alternating order, the job from FSDP2's defaults untuned (``untuned``), the
same job with the in-job tuner around every optimizer step (``tuned``: ``fsdp_runtime.tuning``,
its defaults but ``--max-steps``), and with ``--search-config`` the job on that config untuned
(``search``). A run is one job on a rank pool: the ranks build the model from one seed, train
``--steps`` steps on the same batches, and time every step (the slowest rank's). Per run it
prints the wall time of all steps, the median step over the last quarter (the tuner has settled
there) and, for the tuned run, the steps it spent tuning and the moves it adopted. Then the
ratios, per round and as medians with their spread over rounds: tuned over untuned in total wall
time (what tuning cost or saved over the whole run), the settled step over the untuned step, and
the settled step over the search's config's step. Load (``os.getloadavg``) before and after each
run. A ``wide1024`` step is about 6 s here under ``cpu-emulated-ib``: a default round takes about
20 minutes a run. A search on this box runs ``wide1024`` as a scale proxy; to compare with its
config, run the job on that proxy (``--model PROXY.toml``, the proxy's shape as a model TOML):
docs/benchmarks.md, "Tuning inside the job".
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.trials import RankPool, build_training  # noqa: E402
from fsdp_runtime import config_to_dict, default_config, load_config  # noqa: E402
from profiles import load_cluster_profile, load_model_source  # noqa: E402

WIDE1024 = str(Path(__file__).resolve().parent / "models" / "wide1024.toml")


def run_job(
    rank: int,
    world_size: int,
    *,
    model: str,
    config: dict[str, Any],
    num_steps: int,
    cluster: str | None,
    tuner: dict[str, Any] | None,
) -> dict[str, Any]:
    """Rank program: train ``num_steps`` steps (with the in-job tuner where ``tuner``); every step's
    time (the slowest rank's), and the tuner's decisions and the step it settled at."""
    import torch
    import torch.distributed as dist

    from autotune.trials.linkemu import LinkEmulator
    from fsdp_runtime.tuning import InJobTuner

    training = build_training(rank, world_size, model=model, config=config)
    emulator = LinkEmulator.from_cluster(load_cluster_profile(cluster)) if cluster else None
    tuned = InJobTuner(training.applied, device_type="cpu", **tuner) if tuner is not None else None
    steps_ms, settled = [], None
    with emulator or contextlib.nullcontext():
        for s in range(num_steps):
            start = time.perf_counter()
            with tuned.step() if tuned else contextlib.nullcontext():
                training.step(s)
            elapsed = torch.tensor([(time.perf_counter() - start) * 1e3])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            steps_ms.append(float(elapsed))
            if tuned is not None and settled is None and tuned.finished:
                settled = s + 1
    decisions = [d.describe() for d in tuned.decisions] if tuned else []
    adopted = [d.name for d in tuned.decisions if d.outcome == "adopted"] if tuned else []
    return {"steps_ms": steps_ms, "settled": settled, "decisions": decisions, "adopted": adopted}


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """A run's total wall time of its steps and median step over its last quarter."""
    steps = run["steps_ms"]
    return {"total_s": sum(steps) / 1e3, "settled_ms": statistics.median(steps[-max(1, len(steps) // 4) :])}


def print_ratios(rounds: list[dict[str, dict[str, Any]]]) -> None:
    """Per round and over rounds (median, min-max): tuned / untuned total, settled steps against the others."""
    pairs = [("tuned total / untuned total", "tuned", "untuned", "total_s")]
    pairs += [("tuned settled step / untuned step", "tuned", "untuned", "settled_ms")]
    if "search" in rounds[0]:
        pairs.append(("tuned settled step / search config's step", "tuned", "search", "settled_ms"))
    for label, a, b, key in pairs:
        ratios = [r[a][key] / r[b][key] for r in rounds]
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
        print(
            f"{label:<45} median {statistics.median(ratios):.3f} ({spread}) per round: {[round(x, 3) for x in ratios]}"
        )


def get_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=WIDE1024)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--cluster", default="cpu-emulated-ib", help="link emulation; 'none' for the real links")
    parser.add_argument("--max-steps", type=int, default=100, help="the tuner's window")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every run, alternating their order")
    parser.add_argument("--search-config", type=Path, help="also run the job on this config (a search's best.toml)")
    parser.add_argument("--quick", action="store_true", help="tiny, 30 steps, a 20-step window, real links")
    args = parser.parse_args()
    if args.quick:
        args.model, args.steps, args.microbatches, args.cluster, args.max_steps = "tiny", 30, 2, "none", 20
    args.cluster = None if args.cluster == "none" else args.cluster
    return args


def main() -> None:
    args = get_args()
    source = load_model_source(args.model)
    configs = {"untuned": default_config(source.block_names, num_microbatches=args.microbatches)}
    configs["tuned"] = configs["untuned"]
    if args.search_config:
        configs["search"] = load_config(args.search_config)
    timeout_s = 120 + args.steps * (30 if args.cluster else 10)
    rounds = []
    with RankPool(2, allow=("in_job_tuner",)) as pool:
        for r in range(args.rounds):
            names = list(configs) if r % 2 == 0 else list(configs)[::-1]
            results = {}
            for name in names:
                load = os.getloadavg()[0]
                job = {"model": args.model, "config": config_to_dict(configs[name]), "num_steps": args.steps}
                job |= {"cluster": args.cluster, "tuner": {"max_steps": args.max_steps} if name == "tuned" else None}
                run = pool.run("in_job_tuner:run_job", job, timeout_s=timeout_s)
                if not run.ok:
                    sys.exit(f"round {r + 1}, {name}: {run.status}: {run.reason}")
                results[name] = run.results[0] | summarize(run.results[0])
                line = f"round {r + 1} {name:<8} {results[name]['total_s']:8.1f} s, last-quarter step {results[name]['settled_ms']:8.1f} ms"
                if name == "tuned":
                    line += f", settled at step {results[name]['settled']}: {' + '.join(results[name]['adopted']) or 'the defaults'}"
                print(f"{line} (load {load:.1f} -> {os.getloadavg()[0]:.1f})", flush=True)
            for decision in results["tuned"]["decisions"]:
                print(f"   {decision}")
            rounds.append(results)
    print_ratios(rounds)


if __name__ == "__main__":
    main()
