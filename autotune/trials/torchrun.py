"""Several nodes run one trial under torchrun::

    autotune trial --model small --config cfg.toml --nproc 16 --out /nfs/runs/t0 --write-spec spec.json
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m autotune.trials.torchrun --spec spec.json

Every rank runs the spec's rank program; rank 0 gathers the results and writes the trial
dir through :func:`autotune.trials.trialdir.write_trial_dir` (the same writer as local
trials); each rank writes its own trace, so ``out_dir`` must be on a filesystem all nodes
share (or collect the ``trace_rank*.json.gz`` files afterwards).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch.distributed as dist

from autotune.trials.launch import EXIT_USER_ERROR
from autotune.trials.spec import TrialSpec
from autotune.trials.trial import load_rank_program
from autotune.trials.trialdir import check_trial_spec, prepare_trial_dir, write_trial_dir
from fsdp_runtime.errors import AutotuneError


def _run(spec: TrialSpec, spec_path: Path, rank: int, world_size: int) -> list[Any] | None:
    if world_size != spec.world_size:
        raise AutotuneError(
            f"{spec_path}: spec.world_size is {spec.world_size} but torchrun started {world_size} ranks (match --nnodes x --nproc-per-node)"
        )
    check_trial_spec(spec)  # on every rank: all fail together, nobody waits at the barrier
    if rank == 0:
        prepare_trial_dir(spec, check=False)
    dist.barrier()
    spec.out_dir.mkdir(parents=True, exist_ok=True)  # another node's view of the dir
    result = load_rank_program(spec.rank_program)(rank, world_size, spec=spec.to_dict())
    gathered: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    return gathered


def main(argv: list[str] | None = None) -> int:
    """``python -m autotune.trials.torchrun --spec spec.json`` under torchrun (env:// rendezvous)."""
    parser = argparse.ArgumentParser(
        prog="python -m autotune.trials.torchrun", description="Run one trial rank under torchrun."
    )
    parser.add_argument(
        "--spec", required=True, type=Path, help="TrialSpec JSON written by `autotune trial --write-spec`."
    )
    args = parser.parse_args(argv)
    spec = TrialSpec.read(args.spec)
    dist.init_process_group(spec.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    start = time.monotonic()
    try:
        gathered = _run(spec, args.spec, rank, world_size)
    except BaseException as e:
        traceback.print_exc()
        status = "invalid_config" if isinstance(e, AutotuneError) else "crash"
        if rank == 0:
            spec.out_dir.mkdir(parents=True, exist_ok=True)
            write_trial_dir(
                spec,
                status=status,
                reason=f"rank 0: {type(e).__name__}: {e}"[:300],
                rank_results=[],
                wall_s=time.monotonic() - start,
            )
        sys.stderr.flush()
        os._exit(EXIT_USER_ERROR if status == "invalid_config" else 1)
    if rank == 0:
        status = "pruned" if any(r["pruned"] for r in gathered) else "ok"
        write_trial_dir(spec, status=status, reason="", rank_results=gathered, wall_s=time.monotonic() - start)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: with gloo's worker threads and the profiler's state around,
    # C++ static destructors at exit aborted a finished rank now and then ("terminate called
    # without an active exception"), turning a good trial into a failed torchrun.
    os._exit(code)
