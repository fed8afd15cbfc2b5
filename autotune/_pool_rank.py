"""Entry point of one long-lived rank of a :class:`autotune.pool.RankPool` (``python -m autotune._pool_rank DIR RANK``).

The rank joins the parent's store, initialises the default process group once, then runs
jobs in order: it waits for key ``job/{n}``, calls the job's target as
``fn(rank, world_size, **kwargs)`` and stores the pickled result under ``result/{n}/{rank}``.
A job that raises ends the process (a peer may be blocked in a collective with it; the
parent kills and restarts the whole pool). The rank also exits when the parent is gone (its store socket closes).
"""

from __future__ import annotations

import gc
import itertools
import os
import pickle
import sys
from datetime import timedelta

from autotune._rank import call_target, init_rank

EXIT_JOB = b"exit"
_IDLE = timedelta(days=1)  # a blocking wait; the parent's death closes the socket and ends it


def _get_process_groups() -> list[object]:
    """Every live process group (the default one included).

    torch has no public listing; ``_world.pg_map`` is the registry ``new_group`` and
    ``init_device_mesh`` add to.
    """
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map)


def _destroy_groups_since(before: list[object]) -> None:
    """Destroy the groups a job created (its device mesh's): each holds gloo threads and
    sockets, and a search runs hundreds of jobs in one pool (measured without this: +3
    threads and +4 file descriptors per rank for every HSDP trial)."""
    import torch.distributed as dist

    for group in _get_process_groups():
        if group not in before:
            dist.destroy_process_group(group)


def main(tmpdir: str, rank_str: str) -> int:
    rank = int(rank_str)
    spec, store = init_rank(tmpdir, rank)
    import torch.distributed as dist

    world_size = spec["world_size"]
    # The pool's keys live apart from the process group's own store keys.
    jobs = dist.PrefixStore("pool/", store)
    for n in itertools.count():
        key = f"job/{n}"
        while True:
            try:
                jobs.wait([key], _IDLE)
                break
            except dist.DistStoreError as e:
                if "timeout" not in str(e).lower():
                    os._exit(0)  # the store went away: the parent is gone
            except dist.DistError:
                os._exit(0)  # connection closed: the parent is gone
        job = jobs.get(key)
        if job == EXIT_JOB:
            # No collective is in flight between jobs, and the parent kills the session
            # right after: skip process-group teardown and interpreter exit (seconds).
            sys.stderr.flush()
            os._exit(0)
        job = pickle.loads(job)
        groups_before = _get_process_groups()
        result = call_target(job["target"], rank, world_size, job["kwargs"])
        _destroy_groups_since(groups_before)
        jobs.set(f"result/{n}/{rank}", pickle.dumps(result))
        gc.collect()
    return 0  # unreachable: the loop ends in os._exit


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
