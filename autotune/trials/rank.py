"""Entry point of one local rank: ``python -m autotune.trials.rank once|pool DIR RANK``.

Both launchers start ranks through this module (see [Note: launching ranks] in
:mod:`autotune.trials.launch` and [Note: rank pool] in :mod:`autotune.trials.pool`):

- ``once`` (:func:`~autotune.trials.launch.run_ranks`): join the parent's store and the
  default group, call the target once, write ``result_RANK.json``, exit.
- ``pool`` (:class:`~autotune.trials.pool.RankPool`): initialise the default group once,
  then run jobs in order: wait for key ``job/{n}``, call its target as
  ``fn(rank, world_size, **kwargs)``, store the result under ``result/{n}/{rank}``: both signed
  messages ([Note: signed messages] in :mod:`autotune.trials.wire`), the target one the rank
  allows (:func:`~autotune.trials.wire.check_target`). A job that raises ends the process (a peer may be blocked in a
  collective with it; the parent kills and restarts the whole pool). The rank also exits
  when the parent is gone (its store socket closes).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import itertools
import json
import os
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

EXIT_JOB = b"exit"
_IDLE = timedelta(days=1)  # a blocking wait; the parent's death closes the socket and ends it


def read_spec(tmpdir: str | Path) -> dict[str, Any]:
    """The launcher's spec (``TMPDIR/spec.json``, written by :func:`~autotune.trials.launch.spawn_ranks`)."""
    from autotune.trials.wire import decode

    return decode(json.loads((Path(tmpdir) / "spec.json").read_text()))


def init_rank(tmpdir: str, rank: int) -> tuple[dict, Any]:
    """Read the launcher's spec, set this rank's threads, join the parent's store and the default group."""
    spec = read_spec(tmpdir)
    os.environ.setdefault("OMP_NUM_THREADS", str(spec["num_threads"]))
    import torch
    import torch.distributed as dist

    from autotune.trials.linkemu import BOARD_ENV

    board = Path(tmpdir) / "linkemu"  # the launch's ranks share it: [Note: link emulation]
    board.mkdir(exist_ok=True)
    os.environ[BOARD_ENV] = str(board)

    torch.set_num_threads(spec["num_threads"])
    world_size = spec["world_size"]
    timeout = timedelta(seconds=spec["pg_timeout_s"])
    if spec["backend"] == "nccl":  # one GPU per local rank, before NCCL binds its communicators to one
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    store = dist.TCPStore("127.0.0.1", spec["store_port"], world_size + 1, is_master=False, timeout=timeout)
    dist.init_process_group(spec["backend"], store=store, rank=rank, world_size=world_size, timeout=timeout)
    return spec, store


def call_target(
    target: str, rank: int, world_size: int, kwargs: dict, on_fail: Callable[[int, str], None] | None = None
) -> Any:
    """``module:function(rank, world_size, **kwargs)``; on failure print the reason and exit at once.

    A user error (:class:`AutotuneError`) prints one line and exits with ``EXIT_USER_ERROR``;
    anything else prints the traceback and exits 1. ``on_fail(code, text)`` is told first (a
    worker on another node reports its reason through the driver's store). Interpreter teardown
    is skipped: a peer may be blocked in a collective with us.
    """
    from autotune.trials.launch import EXIT_USER_ERROR
    from fsdp_runtime.errors import AutotuneError

    module_name, fn_name = target.split(":")
    try:
        return getattr(importlib.import_module(module_name), fn_name)(rank, world_size, **kwargs)
    except AutotuneError as e:
        code, text = EXIT_USER_ERROR, f"{type(e).__name__}: {e}"
    except BaseException:
        code, text = 1, traceback.format_exc()
    print(text, file=sys.stderr, flush=True)
    if on_fail is not None:
        with contextlib.suppress(Exception):
            on_fail(code, text)
    os._exit(code)


def _run_once(tmpdir: str, rank: int) -> None:
    spec, _ = init_rank(tmpdir, rank)
    import torch.distributed as dist

    from autotune.trials.wire import encode
    from fsdp_runtime.files import write_atomic

    result = call_target(spec["target"], rank, spec["world_size"], spec["kwargs"])
    write_atomic(Path(tmpdir) / f"result_{rank}.json", json.dumps(encode(result)).encode())
    dist.destroy_process_group()


def _get_process_groups() -> list[object]:
    """Every live process group (the default one included).

    torch has no public listing; ``_world.pg_map`` is the registry ``new_group`` and
    ``init_device_mesh`` add to.
    """
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map)


def _release_job_groups(before: list[object]) -> None:
    """Destroy the groups a job created, but the kept meshes' ([Note: reused meshes] in
    :mod:`autotune.trials.meshes`): each holds gloo threads and sockets (or NCCL
    communicators), and a search runs hundreds of jobs in one pool (measured without this:
    +3 threads and +4 file descriptors per rank for every HSDP trial)."""
    import torch.distributed as dist

    from autotune.trials.meshes import get_kept_groups

    kept = get_kept_groups()
    for group in _get_process_groups():
        if group not in before and group not in kept:
            dist.destroy_process_group(group)
    _clear_sharding_caches()


POOL_TORCH = "2.11 to 2.15"
"""The torch releases whose private names below the pool was run with (CI's torch matrix)."""


def get_pool_torch_problem() -> str | None:
    """One line naming what of torch's private surface the pool needs and this torch lacks (None: all there).

    A warm pool releases a job's process groups (``distributed_c10d._world.pg_map``) and DTensor's
    sharding caches (``torch.distributed.tensor.debug._clear_sharding_prop_cache``) after every job;
    both are private, so a torch without them is refused before any rank starts, not after a trial."""
    import torch
    from torch.distributed import distributed_c10d
    from torch.distributed.tensor import debug

    missing = [
        name
        for name, there in (
            (
                "torch.distributed.distributed_c10d._world.pg_map",
                hasattr(getattr(distributed_c10d, "_world", None), "pg_map"),
            ),
            ("torch.distributed.tensor.debug._clear_sharding_prop_cache", hasattr(debug, "_clear_sharding_prop_cache")),
        )
        if not there
    ]
    if not missing:
        return None
    return (
        f"the rank pool needs {' and '.join(missing)}, which torch {torch.__version__} lacks "
        f"(torch {POOL_TORCH} have them)"
    )


def _clear_sharding_caches() -> None:
    """Forget DTensor sharding propagation results computed for the last job's meshes.

    DTensor caches sharding propagation by op schema, and a ``DeviceMesh`` hashes and
    compares by layout, not by its process groups. So the next job's mesh of the same
    layout hit the cache and got back output specs holding the *previous* job's mesh,
    whose groups were just destroyed: an HSDP job followed by HSDP consolidation failed
    with "Could not resolve the process group registered under the name 1". torch has
    no public hook for this; ``torch.distributed.tensor.debug`` has the one that clears
    both the Python and the C++ fast-path caches.
    """
    from torch.distributed.tensor import debug

    debug._clear_sharding_prop_cache()


def _wait_for_job(jobs: Any, key: str) -> bool:
    """True once ``key`` is set; False when the store went away (its parent, the pool, with it)."""
    import torch.distributed as dist

    while True:
        try:
            jobs.wait([key], _IDLE)
            return True
        except dist.DistStoreError as e:
            if "timeout" not in str(e).lower():
                return False
        except dist.DistError:  # connection closed
            return False


def serve_jobs(
    jobs: Any,
    rank: int,
    world_size: int,
    *,
    secret: bytes,
    scope: str,
    sender: str,
    on_fail: Callable[[int, str], None] | None = None,
    on_exit: Callable[[], None] | None = None,
    on_job: Callable[[int], None] | None = None,
    on_result: Callable[[int], None] | None = None,
) -> None:
    """Run the jobs set under ``jobs`` (a store) in order until told to exit: ``job/{n}`` in,
    ``result/{n}/{rank}`` out (both the local pool's ranks and the workers torchrun starts), each a
    message signed with ``secret`` for its key under ``scope`` (the world's prefix: a message of
    another world's is refused), a job's from ``sender`` ([Note: signed messages] in
    :mod:`autotune.trials.wire`). A job refused ends the rank as a failed one does, its one line
    told to ``on_fail``. ``on_exit`` runs when told to exit or the pool is gone, before the process
    ends without unwinding. ``on_job(n)`` is told before job ``n`` runs and ``on_result(n)`` after
    its result is set: a worker across nodes rings the driver's doorbell there, and ends its world
    between jobs after a dropped connection ([Note: store hiccups] in :mod:`autotune.trials.reconnect`);
    ``jobs`` is then a client that makes its connection again (the local pool's ranks keep the plain
    store: their parent's death ends them at once)."""
    from autotune.trials.wire import WireError, check_target, open_sealed, seal

    for n in itertools.count():
        gone = not _wait_for_job(jobs, f"job/{n}")
        job = None if gone else jobs.get(f"job/{n}")
        if gone or job == EXIT_JOB:
            if on_exit is not None:
                on_exit()
            # No collective is in flight between jobs, and the parent kills the session
            # right after: skip process-group teardown and interpreter exit (seconds).
            sys.stderr.flush()
            os._exit(0)
        if on_job is not None:
            on_job(n)
        try:
            job = open_sealed(secret, f"{scope}job/{n}", job, sender=sender)
            check_target(job["target"])
        except WireError as e:
            _refuse(f"rank {rank}: {e}", on_fail)
        groups_before = _get_process_groups()
        result = call_target(job["target"], rank, world_size, job["kwargs"], on_fail)
        _release_job_groups(groups_before)
        jobs.set(f"result/{n}/{rank}", seal(secret, f"{scope}result/{n}/{rank}", result))
        if on_result is not None:
            on_result(n)
        gc.collect()


def _refuse(line: str, on_fail: Callable[[int, str], None] | None) -> None:
    """End the rank over a refused job: its line on stderr and to ``on_fail``, nothing run."""
    print(f"WireError: {line}", file=sys.stderr, flush=True)
    if on_fail is not None:
        with contextlib.suppress(Exception):
            on_fail(1, f"WireError: {line}")
    os._exit(1)


def _run_pool(tmpdir: str, rank: int) -> None:
    spec, store = init_rank(tmpdir, rank)
    import torch.distributed as dist

    secret, sender = bytes.fromhex(spec["secret"]), "this host's pool (its parent process)"
    jobs = dist.PrefixStore("pool/", store)  # the pool's keys apart from the group's
    serve_jobs(jobs, rank, spec["world_size"], secret=secret, scope="pool/", sender=sender)


if __name__ == "__main__":
    mode, directory, rank_arg = sys.argv[1:4]
    (_run_pool if mode == "pool" else _run_once)(directory, int(rank_arg))
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: the result is written, and C++ static destructors racing
    # gloo's threads at exit occasionally aborted a finished rank.
    os._exit(0)
