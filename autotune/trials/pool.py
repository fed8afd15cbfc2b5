"""A persistent pool of local ranks: pay process start-up once, run many jobs.

    with RankPool(2) as pool:
        for cfg in configs:
            run_trial(TrialSpec(..., world_size=2), pool=pool)

[Note: rank pool]
A fresh 2-rank trial costs ~4-6 s before its first step (import torch, spawn re-import,
process-group set-up, exit; measured on a 2-core CPU box, torch 2.13.0+cpu); a search runs hundreds. The pool keeps
N ranks alive between jobs, launched like ranks of :func:`autotune.trials.launch.run_ranks` (never fork;
each rank ``python -m autotune.trials.rank pool`` in its own session; the parent owns the
``TCPStore`` on port 0). The ranks initialise the default process group once; every job
builds its own device mesh (1-D or HSDP 2-D) and FSDP state on top of it, so different
configs run back to back.

Jobs travel through the store, which listens on loopback only ([Note: store binding] in
:mod:`autotune.trials.stores`): the parent sets ``job/{n}`` (target and kwargs), each rank sets
``result/{n}/{rank}``, both signed messages under a secret made for each start of the ranks
([Note: signed messages] in :mod:`autotune.trials.wire`), never pickles. The parent waits for all results, watching the
processes and the clock. A job that fails ends its rank; any failure or timeout then
kills every rank's process tree (SIGKILL to each session) and marks the pool broken; the
next :meth:`RankPool.run` starts fresh ranks. A failure is returned as a
:class:`~autotune.trials.launch.RankRun` with the same statuses as ``run_ranks``, never raised.

On CUDA (``backend="nccl"``, the search's default there) the same pool keeps what a fresh
trial would pay for again: the CUDA context, the NCCL default group and its communicators,
and each mesh shape's groups ([Note: reused meshes] in :mod:`autotune.trials.meshes`). Each
trial empties the caching allocator and resets its peak counter first, and frees its models
and empties the cache at its end, so its peak is its own and the next trial starts from an
empty cache. A trial that dies (CUDA out of memory: status ``oom``; an NCCL error; a hang
past its limit) ends its rank or is killed; the pool is then restarted for the next trial,
and what earlier trials wrote stays as it was.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from autotune.trials.killing import kill_tree
from autotune.trials.launch import (
    TEMP_PREFIX,
    RankRun,
    failed_run,
    read_oom_kills,
    read_tail,
    remove_stale_temp_dirs,
    spawn_ranks,
)
from autotune.trials.rank import get_pool_torch_problem
from autotune.trials.stores import LOOPBACK, listen_store
from autotune.trials.wire import ALLOW_TARGETS_ENV, WireError, new_secret, open_sealed, seal
from fsdp_runtime.errors import AutotuneError

_FAIL_GRACE_S = 1.0  # after a rank dies, how long its peers may run on to report their own error
_CHECK_EVERY_S = 0.1  # how often the parent asks the store for a job's results (the ranks: every 5 ms)
_FIRST_CHECK_S = 0.005
_SHUTDOWN_S = 5.0


class RankPool:
    """``world_size`` long-lived ranks that run jobs ``fn(rank, world_size, **kwargs)``; see [Note: rank pool]."""

    remote = False

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        num_threads: int | None = None,
        pg_timeout_s: float = 600.0,
        allow: tuple[str, ...] = (),
    ) -> None:
        """``allow``: modules or ``module:function`` targets the ranks may run besides the project's
        own (:func:`~autotune.trials.wire.check_target`), added to ``$AUTOTUNE_ALLOW_TARGETS``."""
        problem = get_pool_torch_problem()
        if problem:
            raise AutotuneError(problem)
        self.world_size = world_size
        self.backend = backend
        self.num_threads = num_threads or max(1, (os.cpu_count() or 1) // world_size)
        self.pg_timeout_s = pg_timeout_s
        self.allow = allow
        self.num_starts = 0
        """How many times ranks were started (1 + restarts after failures)."""
        self._procs: list[subprocess.Popen] = []
        self._store: Any = None
        self._jobs: Any = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._next_job = 0
        self._secret = b""

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """Process ids of the live ranks (empty when none are running)."""
        return [p.pid for p in self._procs]

    def run(self, target: str, kwargs: dict[str, Any] | None = None, *, timeout_s: float = 120.0) -> RankRun:
        """Run ``target`` (``"module:function"``) on every rank; returns within ``timeout_s`` (start-up included)."""
        start = time.monotonic()
        oom_before = read_oom_kills()
        if not self._procs:
            self._start()
        n = self._next_job
        self._next_job += 1
        self._jobs.set(f"job/{n}", seal(self._secret, f"pool/job/{n}", {"target": target, "kwargs": kwargs or {}}))
        keys = [f"result/{n}/{r}" for r in range(self.world_size)]
        try:
            timed_out, exit_order = self._wait(keys, start + timeout_s)
        except BaseException:  # Ctrl-C mid-job: the ranks are busy, asking them to exit would only wait
            self._stop_all([])
            raise
        pids = self.pids
        if not timed_out and not exit_order:
            try:
                results = [self._open_result(n, r) for r in range(self.world_size)]
            except WireError as e:
                self._stop_all([])
                return RankRun(status="crash", reason=str(e), returncodes=[None] * self.world_size, pids=pids)
            for k in [f"job/{n}", *keys]:
                self._jobs.delete_key(k)
            return RankRun(
                status="ok",
                results=results,
                returncodes=[None] * self.world_size,
                wall_s=time.monotonic() - start,
                pids=pids,
            )
        codes, tails = self._stop_all(exit_order)
        wall = time.monotonic() - start
        return failed_run(
            codes, tails, timed_out, exit_order, timeout_s=timeout_s, oom_before=oom_before, wall_s=wall, pids=pids
        )

    def close(self) -> None:
        """Ask the ranks to exit, then kill whatever is left; the pool can be started again."""
        if self._procs:
            try:
                self._jobs.set(f"job/{self._next_job}", b"exit")
                deadline = time.monotonic() + _SHUTDOWN_S
                while any(p.poll() is None for p in self._procs) and time.monotonic() < deadline:
                    time.sleep(0.02)
            finally:
                self._stop_all([])
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # -- internals ------------------------------------------------------------------

    def _open_result(self, n: int, rank: int) -> Any:
        key = f"pool/result/{n}/{rank}"
        return open_sealed(
            self._secret, key, self._jobs.get(f"result/{n}/{rank}"), sender=f"rank {rank} of this host's pool"
        )

    def _start(self) -> None:
        from torch.distributed import PrefixStore

        if self._tmp is not None:
            self._tmp.cleanup()  # the previous ranks' stderr files
        remove_stale_temp_dirs()
        self._tmp = tempfile.TemporaryDirectory(prefix=f"{TEMP_PREFIX}pool-{os.getpid()}-")
        tmpdir = Path(self._tmp.name)
        self._store = listen_store(LOOPBACK, 0, world_size=self.world_size + 1, timeout_s=300)
        self._secret = new_secret()
        self._jobs = PrefixStore("pool/", self._store)
        self._next_job = 0
        spec = {
            "world_size": self.world_size,
            "store_port": self._store.port,
            "backend": self.backend,
            "num_threads": self.num_threads,
            "pg_timeout_s": self.pg_timeout_s,
            "secret": self._secret.hex(),
        }
        allowed = ",".join(filter(None, [os.environ.get(ALLOW_TARGETS_ENV, ""), *self.allow]))
        self._procs = spawn_ranks("pool", tmpdir, spec, env={ALLOW_TARGETS_ENV: allowed})
        self.num_starts += 1

    def _wait(self, keys: list[str], deadline: float) -> tuple[bool, list[int]]:
        """Wait for every result key. Returns (timed out, ranks that exited, in exit order).

        The ranks' processes are polled every 5 ms (a cheap ``waitpid``: the first rank to exit is
        the one whose error explains the failure), the store only every ``_CHECK_EVERY_S``: each
        ``check`` is a round trip through the store's server, and polled every 5 ms they took ~7%
        of a core from the ranks on a 2-core box (py-spy over the main command's search: 22 s in
        ``check`` of ~300 s)."""
        exit_order: list[int] = []
        failed_at: float | None = None
        next_check = time.monotonic() + _FIRST_CHECK_S
        while True:
            now = time.monotonic()
            if not exit_order and now >= next_check:
                if self._jobs.check(keys):
                    return False, []
                next_check = now + _CHECK_EVERY_S
            exit_order += [r for r, p in enumerate(self._procs) if p.poll() is not None and r not in exit_order]
            if exit_order and failed_at is None:
                failed_at = now
            if failed_at is not None and (now - failed_at > _FAIL_GRACE_S or len(exit_order) == self.world_size):
                return False, exit_order
            if now > deadline:
                return True, exit_order
            time.sleep(0.005)

    def _stop_all(self, exit_order: list[int]) -> tuple[list[int | None], list[str]]:
        """Kill every rank's process tree; returns their own exit codes (None if we killed them) and stderr tails."""
        for proc in self._procs:
            kill_tree(proc)  # reaped, its returncode set
        codes = [p.returncode if r in exit_order else None for r, p in enumerate(self._procs)]
        tails = (
            [read_tail(Path(self._tmp.name) / f"stderr_{r}.txt") for r in range(len(self._procs))] if self._tmp else []
        )
        self._procs = []
        self._store = None
        self._jobs = None
        return codes, tails
