"""Rank programs that misbehave on purpose, and a process-leak check, for the trial and pool tests.

Ranks import this module by name (``_trial_programs:...``): pytest puts this folder on
``sys.path`` and the launchers pass ``sys.path`` on to the ranks.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist

CRASH_MESSAGE = "injected failure on rank 1"


def crash_on_rank1(rank: int, world_size: int, **kwargs) -> dict:
    """Rank 1 raises at once; rank 0 enters a collective that rank 1 never joins."""
    if rank == 1:
        raise RuntimeError(CRASH_MESSAGE)
    dist.all_reduce(torch.ones(1))
    return {}


def deadlock(rank: int, world_size: int, **kwargs) -> dict:
    """Mismatched collectives: rank 0 all-reduces while rank 1 waits on a child process that sleeps.

    The child (a grandchild of the launcher) proves that the whole process tree is killed.
    """
    if rank == 1:
        subprocess.run(["sleep", "300"], check=False)
    dist.all_reduce(torch.ones(1))
    return {}


def sleep_then_pid(rank: int, world_size: int, *, seconds: float = 1.0, **kwargs) -> int:
    import os

    time.sleep(seconds)
    return os.getpid()


def get_rank_pid(rank: int, world_size: int, **kwargs) -> int:
    import os

    return os.getpid()


def count_process_groups(rank: int, world_size: int, **kwargs) -> int:
    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map)


def get_kept_group_names(rank: int, world_size: int, **kwargs) -> list[str]:
    """The process groups of the meshes this rank keeps between jobs ([Note: reused meshes])."""
    from autotune.trials.meshes import get_kept_groups

    return sorted(group.group_name for group in get_kept_groups())


def get_survivors(pids: list[int]) -> list[int]:
    """Live processes that are one of ``pids`` or in their process groups (each rank leads its own)."""
    assert pids, "no pids to check: the launcher did not report its ranks"
    survivors = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        pid, state, pgrp = int(stat.parent.name), fields[0], int(fields[2])
        if state != "Z" and (pid in pids or pgrp in pids):
            survivors.append(pid)
    return survivors


STAGE_DEATH_MESSAGE = "injected: pipeline stage 1 died in its third forward"


def stage_dies_mid_step(rank: int, world_size: int, *, spec: dict) -> dict:
    """The real trial rank program, but the ranks holding pipeline stage 1 raise inside that
    stage's third microbatch forward (the first training step, mid-schedule): their peers wait
    in a receive or a collective that never completes."""
    from autotune.trials.program import run_trial_rank
    from fsdp_runtime.pipeline import TunedStage

    original = TunedStage.forward_one_chunk
    calls = {"n": 0}

    def forward_one_chunk(self, *args, **kwargs):
        if self.stage_index == 1:
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError(STAGE_DEATH_MESSAGE)
        return original(self, *args, **kwargs)

    TunedStage.forward_one_chunk = forward_one_chunk
    return run_trial_rank(rank, world_size, spec=spec)


def forget_kept_on_rank1(rank: int, world_size: int, *, spec: dict) -> dict:
    """The real trial, but rank 1 forgets the kept warm reference first, as a rank restarted alone
    would have ([Note: a warm reference]): the ranks must agree to build, not hang."""
    from autotune.trials import kept
    from autotune.trials.program import run_trial_rank

    if rank == 1:
        kept.drop()
    return run_trial_rank(rank, world_size, spec=spec)


def with_paired_models(rank: int, world_size: int, *, spec: dict, paired_models: str | None) -> dict:
    """The real trial with ``AUTOTUNE_PAIRED_MODELS`` set to ``paired_models`` (None: unset) for it
    alone, as a rank started so would see it: a pooled rank keeps the environment it started with."""
    import os

    from autotune.trials.program import run_trial_rank
    from autotune.trials.sides import PAIRED_MODELS_ENV

    before = os.environ.pop(PAIRED_MODELS_ENV, None)
    if paired_models is not None:
        os.environ[PAIRED_MODELS_ENV] = paired_models
    try:
        return run_trial_rank(rank, world_size, spec=spec)
    finally:
        os.environ.pop(PAIRED_MODELS_ENV, None)
        if before is not None:
            os.environ[PAIRED_MODELS_ENV] = before


def with_sharded_builds(rank: int, world_size: int, *, spec: dict) -> dict:
    """The real trial with every Llama built sharded, as on CUDA ([Note: sharded build]), and
    structural pairs built in turn (``AUTOTUNE_PAIRED_MODELS=turn``), for this trial alone; the
    rank's shard cache ([Note: shard cache]) is whatever the process's earlier jobs left."""
    import os

    from autotune.trials import training
    from autotune.trials.program import run_trial_rank
    from autotune.trials.sides import PAIRED_MODELS_ENV
    from profiles import ModelProfile

    original, before = training._builds_sharded, os.environ.get(PAIRED_MODELS_ENV)
    training._builds_sharded = lambda source, device, sharded: isinstance(source, ModelProfile)
    os.environ[PAIRED_MODELS_ENV] = "turn"
    try:
        return run_trial_rank(rank, world_size, spec=spec)
    finally:
        training._builds_sharded = original
        os.environ.pop(PAIRED_MODELS_ENV, None)
        if before is not None:
            os.environ[PAIRED_MODELS_ENV] = before


def release_shard_cache(rank: int, world_size: int) -> int:
    """Rank program: empty this rank's shard cache ([Note: shard cache]); returns the entries it held."""
    from profiles.chunked_init import SHARD_CACHE

    held = len(SHARD_CACHE)
    SHARD_CACHE.release()
    return held


def touch(rank: int, world_size: int, path: str) -> None:
    """Create ``path``: what a forged job would do, were it run (tests/autotune/trials/test_wire.py)."""
    Path(path).touch()
