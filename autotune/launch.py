"""Run a function on N real ranks, with a hard wall-clock limit that kills the whole tree.

[Note: launching ranks]
Measured pitfalls (shared/FINDINGS.md): picking a free port and binding it later races,
and with the port taken one rank hung for minutes despite a process-group timeout.
So the parent owns the rendezvous: it creates a ``TCPStore`` on port 0 (the OS picks a
port that is already bound) and passes the port to the ranks. Each rank is a fresh
``python -m autotune._rank`` process in its own session (process group), so on timeout
or crash the parent kills every rank's entire process tree with ``SIGKILL``; nothing
survives. fork is avoided (children of a parent that used OpenMP hung), and each rank
sets ``torch.set_num_threads(cores // world)`` itself (spawned ranks do not inherit
torchrun's ``OMP_NUM_THREADS=1``).

A failure is data: :func:`run_ranks` never raises for what a rank did; it returns a
:class:`RankRun` whose ``status`` says ``ok``, ``timeout``, ``crash``, ``oom`` or
``invalid_config`` with a one-line ``reason`` and the last lines of each rank's stderr.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Status = Literal["ok", "timeout", "crash", "oom", "invalid_config"]

# A rank that exits with this code raised a user-facing AutotuneError (e.g. a bad config).
EXIT_USER_ERROR = 3
_GRACE_S = 5.0  # how long the other ranks may run on after one rank failed


@dataclass(kw_only=True)
class RankRun:
    status: Status
    reason: str = ""
    results: list[Any] = field(default_factory=list)
    """Each rank's return value (rank order), when ``status == "ok"``."""
    returncodes: list[int | None] = field(default_factory=list)
    stderr_tails: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _tail(path: Path, num_lines: int = 20) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-num_lines:])


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _classify(returncodes: list[int | None], tails: list[str], timed_out: bool, timeout_s: float) -> tuple[Status, str]:
    if timed_out:
        return "timeout", f"no result after {timeout_s:.0f}s (deadlock or too slow); all ranks killed"
    for rank, (code, tail) in enumerate(zip(returncodes, tails)):
        if code == EXIT_USER_ERROR:
            last = tail.strip().splitlines()[-1] if tail.strip() else "invalid config"
            return "invalid_config", f"rank {rank}: {last}"
    for rank, (code, tail) in enumerate(zip(returncodes, tails)):
        if code not in (0, None):
            lowered = tail.lower()
            if code == -signal.SIGKILL or "out of memory" in lowered or "memoryerror" in lowered:
                return "oom", f"rank {rank} exited with {code} (out of memory)"
            last = next((ln for ln in reversed(tail.splitlines()) if ln.strip()), "")
            return "crash", f"rank {rank} exited with {code}: {last.strip()[:300]}"
    return "crash", "a rank exited without a result"


def run_ranks(
    target: str,
    *,
    world_size: int,
    kwargs: dict[str, Any] | None = None,
    timeout_s: float = 120.0,
    backend: str = "gloo",
    num_threads: int | None = None,
    env: dict[str, str] | None = None,
    workdir: str | Path | None = None,
) -> RankRun:
    """Call ``target`` (``"package.module:function"``) as ``fn(rank, world_size, **kwargs)`` on each rank.

    Returns within ``timeout_s`` (plus a few seconds of clean-up) whatever the ranks do.
    """
    from torch.distributed import TCPStore

    if num_threads is None:
        num_threads = max(1, (os.cpu_count() or 1) // world_size)
    start = time.monotonic()
    store = TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="autotune-ranks-", dir=workdir) as tmp:
        tmpdir = Path(tmp)
        spec = {
            "target": target,
            "kwargs": kwargs or {},
            "world_size": world_size,
            "store_port": store.port,
            "backend": backend,
            "num_threads": num_threads,
            "pg_timeout_s": max(10.0, timeout_s),
        }
        (tmpdir / "spec.pkl").write_bytes(pickle.dumps(spec))
        child_env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        procs = []
        for rank in range(world_size):
            with open(tmpdir / f"stderr_{rank}.txt", "wb") as err:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "autotune._rank", str(tmpdir), str(rank)],
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                        env=child_env,
                        start_new_session=True,
                    )
                )
        timed_out = _wait_all(procs, start + timeout_s)
        for proc in procs:
            _kill_tree(proc)
            proc.wait()
        codes = [p.returncode for p in procs]
        tails = [_tail(tmpdir / f"stderr_{r}.txt") for r in range(world_size)]
        wall = time.monotonic() - start
        if not timed_out and all(c == 0 for c in codes):
            results = [pickle.loads((tmpdir / f"result_{r}.pkl").read_bytes()) for r in range(world_size)]
            return RankRun(status="ok", results=results, returncodes=codes, stderr_tails=tails, wall_s=wall)
        status, reason = _classify(codes, tails, timed_out, timeout_s)
        return RankRun(status=status, reason=reason, returncodes=codes, stderr_tails=tails, wall_s=wall)


def _wait_all(procs: list[subprocess.Popen], deadline: float) -> bool:
    """Wait for every rank; once one fails, give the rest a short grace. True if timed out."""
    failed_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return False
        now = time.monotonic()
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if failed_at is not None and now - failed_at > _GRACE_S:
            return False
        if now > deadline:
            return True
        time.sleep(0.02)
