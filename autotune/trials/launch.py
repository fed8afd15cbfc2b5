"""Run a function on N real ranks, with a hard wall-clock limit that kills the whole tree.

[Note: launching ranks]
Measured pitfalls (2-core CPU box, gloo, torch 2.13.0+cpu): picking a free port and binding it later races,
and with the port taken one rank hung for minutes despite a process-group timeout.
So the parent owns the rendezvous: it creates a ``TCPStore`` on port 0 (the OS picks a
port that is already bound) and passes the port to the ranks. Each rank is a fresh
``python -m autotune.trials.rank once`` process in its own session (process group), so on timeout
or crash the parent kills every rank's entire process tree with ``SIGKILL``; nothing
survives. fork is avoided (children of a parent that used OpenMP hung), and each rank
sets ``torch.set_num_threads(cores // world)`` itself (spawned ranks do not inherit
torchrun's ``OMP_NUM_THREADS=1``).

A failure is data: :func:`run_ranks` never raises for what a rank did; it returns a
:class:`RankRun` whose ``status`` says ``ok``, ``timeout``, ``crash``, ``oom`` or
``invalid_config`` with a one-line ``reason`` and the last lines of each rank's stderr.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from autotune.trials.killing import kill_tree, pid_alive
from autotune.trials.stores import LOOPBACK, listen_store
from autotune.trials.wire import decode, encode

Status = Literal["ok", "timeout", "crash", "oom", "invalid_config"]

EXIT_USER_ERROR = 3
"""Exit code of a rank whose target raised a user-facing ``AutotuneError`` (e.g. a bad config)."""
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
    pids: list[int] = field(default_factory=list)
    """Process ids of the ranks (each the leader of its own process group), for leak checks."""
    placement: list[dict[str, Any]] = field(default_factory=list)
    """Each rank's host and node where a launcher placed them ([Note: node pool]); empty: this host."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def read_tail(path: Path, num_lines: int = 20) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-num_lines:])


def read_oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has killed since boot (``/proc/vmstat``,
    Linux >= 4.13), or None where that counter does not exist."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


_PEER_LOSS_SIGNS = ("Connection reset by peer", "Connection closed by peer", "remote process exited")
"""How a rank's stderr says a peer went away (gloo, NCCL): not the cause when another rank failed of its own."""
_OOM_SIGNS = ("out of memory", "memoryerror", "not enough memory")
"""How a rank's own stderr says it ran out of memory (CUDA, Python, torch's CPU allocator)."""


_CUDA_OOM = re.compile(
    r"Tried to allocate (?P<asked>[\d.]+) (?P<asked_unit>[KMG]iB).*?"
    r"this process has (?P<used>[\d.]+) (?P<used_unit>[KMG]iB) memory in use",
    re.DOTALL,
)
_UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_OOM_FIGURES = re.compile(r"out of memory at (?P<used>\d+) B in use, (?P<asked>\d+) B more asked")


def describe_oom(tail: str) -> str:
    """What a rank's CUDA out-of-memory error says it held and asked for, as ``out of memory at N B in
    use, M B more asked`` (:func:`parse_oom` reads it back from a trial's reason), or ``out of memory``."""
    match = _CUDA_OOM.search(tail)
    if match is None:
        return "out of memory"
    used = float(match["used"]) * _UNITS[match["used_unit"]]
    asked = float(match["asked"]) * _UNITS[match["asked_unit"]]
    return f"out of memory at {int(used)} B in use, {int(asked)} B more asked"


def parse_oom(reason: str) -> tuple[int, int] | None:
    """``(bytes in use, bytes more asked)`` from a reason :func:`describe_oom` wrote, else None."""
    match = _OOM_FIGURES.search(reason)
    return (int(match["used"]), int(match["asked"])) if match else None


def is_peer_loss(tail: str) -> bool:
    """Whether a rank's stderr says only that a peer went away (:data:`_PEER_LOSS_SIGNS`)."""
    return any(sign in tail for sign in _PEER_LOSS_SIGNS)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _describe_exit(rank: int, code: int, tail: str, oom_kills: int | None) -> tuple[Status, str]:
    """Status and reason of one rank that exited on its own with a non-zero ``code``."""
    last = next((ln.strip() for ln in reversed(tail.splitlines()) if ln.strip()), "")
    lowered = tail.lower()
    if any(sign in lowered for sign in _OOM_SIGNS):
        return "oom", f"rank {rank} ran {describe_oom(tail)}: {last[:300]}"
    if code < 0:
        name = _signal_name(code)
        if code == -signal.SIGKILL and oom_kills:
            return (
                "oom",
                f"rank {rank} was killed by the kernel's OOM killer ({name}; {oom_kills} OOM kill(s) during the trial)",
            )
        known = " (the kernel reported no OOM kill)" if code == -signal.SIGKILL and oom_kills == 0 else ""
        return "crash", f"rank {rank} was killed by {name} from outside the trial{known}"
    return "crash", f"rank {rank} exited with {code}: {last[:300]}"


def classify_failure(
    returncodes: list[int | None],
    tails: list[str],
    *,
    timed_out: bool,
    timeout_s: float,
    exit_order: list[int] | None = None,
    oom_kills: int | None = None,
) -> tuple[Status, str]:
    """Status and one-line reason of a failed run.

    ``returncodes`` holds ``None`` for ranks the parent killed (they did not fail on their
    own). ``exit_order`` lists the ranks in the order they exited: the first rank to fail is
    the cause, its peers usually only report the broken connection; a rank that reports only
    that (:data:`_PEER_LOSS_SIGNS`) is passed over for one that failed of its own, even one that
    exited after it. ``oom_kills`` is how
    many OOM kills the kernel counted while the run lasted (None: unknown): a rank killed
    by SIGKILL is "out of memory" only when the kernel says so, or when the rank itself
    reported running out of memory.
    """
    if timed_out:
        return "timeout", f"no result after {timeout_s:.0f}s (deadlock or too slow); all ranks killed"
    order = [r for r in (exit_order or []) if 0 <= r < len(returncodes)]
    order += [r for r in range(len(returncodes)) if r not in order]
    for rank in order:
        if returncodes[rank] == EXIT_USER_ERROR:
            tail = tails[rank]
            last = tail.strip().splitlines()[-1] if tail.strip() else "invalid config"
            return "invalid_config", f"rank {rank}: {last}"
    failed = [r for r in order if returncodes[r] not in (0, None)]
    # a peer's broken connection is a consequence; it can exit before the rank that broke it
    causes = [r for r in failed if not is_peer_loss(tails[r])] or failed
    if causes:
        return _describe_exit(causes[0], returncodes[causes[0]], tails[causes[0]], oom_kills)
    return "crash", "a rank exited without a result"


def count_since(before: int | None) -> int | None:
    """OOM kills since ``before`` (a :func:`read_oom_kills` value), or None when unknown."""
    after = read_oom_kills()
    return None if before is None or after is None else after - before


def failed_run(
    codes: list[int | None],
    tails: list[str],
    timed_out: bool,
    exit_order: list[int],
    *,
    timeout_s: float,
    oom_before: int | None,
    wall_s: float,
    pids: list[int],
) -> RankRun:
    """The :class:`RankRun` of ranks that failed: status and reason by :func:`classify_failure` from
    how the wait for them ended (``timed_out``, ``exit_order``), with the OOM kills counted since
    ``oom_before`` (a :func:`read_oom_kills` value)."""
    status, reason = classify_failure(
        codes, tails, timed_out=timed_out, timeout_s=timeout_s, exit_order=exit_order, oom_kills=count_since(oom_before)
    )
    return RankRun(status=status, reason=reason, returncodes=codes, stderr_tails=tails, wall_s=wall_s, pids=pids)


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
    if num_threads is None:
        num_threads = max(1, (os.cpu_count() or 1) // world_size)
    start = time.monotonic()
    oom_before = read_oom_kills()
    store = listen_store(LOOPBACK, 0, world_size=world_size + 1, timeout_s=300)
    remove_stale_temp_dirs()
    with tempfile.TemporaryDirectory(prefix=f"{TEMP_PREFIX}ranks-{os.getpid()}-", dir=workdir) as tmp:
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
        procs = spawn_ranks("once", tmpdir, spec, env=env)
        try:
            timed_out, exit_order = _wait_all(procs, start + timeout_s)
        finally:  # Ctrl-C included: no rank outlives the call
            for proc in procs:
                kill_tree(proc)  # reaped, its returncode set
        # Ranks we killed report None: their SIGKILL is ours, not the OOM killer's.
        codes = [p.returncode if r in exit_order else None for r, p in enumerate(procs)]
        tails = [read_tail(tmpdir / f"stderr_{r}.txt") for r in range(world_size)]
        wall = time.monotonic() - start
        pids = [p.pid for p in procs]
        if not timed_out and all(c == 0 for c in codes):
            results = [decode(json.loads((tmpdir / f"result_{r}.json").read_bytes())) for r in range(world_size)]
            return RankRun(status="ok", results=results, returncodes=codes, stderr_tails=tails, wall_s=wall, pids=pids)
        return failed_run(
            codes, tails, timed_out, exit_order, timeout_s=timeout_s, oom_before=oom_before, wall_s=wall, pids=pids
        )


TEMP_PREFIX = "autotune-"
_TEMP_DIR = re.compile(r"^autotune-(?:ranks|pool)-(\d+)-")


def remove_stale_temp_dirs(root: str | Path | None = None) -> list[Path]:
    """Remove rank temp dirs (stderr files, specs, results) left by a launcher process that
    no longer exists (one killed with SIGKILL cannot clean up after itself)."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(f"{TEMP_PREFIX}*"):
        match = _TEMP_DIR.match(path.name)
        if match and path.is_dir() and not pid_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def spawn_ranks(
    mode: Literal["once", "pool"], tmpdir: Path, spec: dict[str, Any], *, env: dict[str, str] | None = None
) -> list[subprocess.Popen]:
    """Start ``python -m autotune.trials.rank MODE TMPDIR RANK`` per rank, each in its own session,
    stderr to ``TMPDIR/stderr_RANK.txt``.

    ``spec`` (JSON in ``TMPDIR/spec.json``, a directory only this user can read: it may hold the
    pool's secret) must hold ``world_size``; the rank reads it with
    :func:`autotune.trials.rank.init_rank`.
    """
    tmpdir.chmod(0o700)
    (tmpdir / "spec.json").write_text(json.dumps(encode(spec)))
    child_env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs = []
    for rank in range(spec["world_size"]):
        with open(tmpdir / f"stderr_{rank}.txt", "wb") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "autotune.trials.rank", mode, str(tmpdir), str(rank)],
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    env=child_env,
                    start_new_session=True,
                )
            )
    return procs


def _wait_all(procs: list[subprocess.Popen], deadline: float) -> tuple[bool, list[int]]:
    """Wait for every rank; once one fails, give the rest a short grace.

    Returns (timed out, the ranks that exited on their own in exit order).
    """
    failed_at: float | None = None
    exit_order: list[int] = []
    while True:
        codes = [p.poll() for p in procs]
        exit_order += [r for r, c in enumerate(codes) if c is not None and r not in exit_order]
        if len(exit_order) == len(procs):
            return False, exit_order
        now = time.monotonic()
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if failed_at is not None and now - failed_at > _GRACE_S:
            return False, exit_order
        if now > deadline:
            return True, exit_order
        time.sleep(0.02)
