"""Kill a process and every process it started, whatever group or session they moved to.

[Note: killing a process tree]
A rank, a torchrun agent or a benchmark's part may have started processes of its own, and not
all of them stay in its process group: torchrun starts each worker in a session of its own, so
``os.killpg`` on the agent's group leaves its workers running. :func:`kill_tree` kills

- the process itself (not a ``Popen`` already reaped: its pid may since be another process's);
- every member of the process group and of the session it leads: a pid is not given to a new
  process while a group or a session carries it, so these are its own even after it exited (a
  reaped ``Popen``'s too, unless a new process has its pid: the group is then that one's, and
  left alone; the caller's own group and session never are killed as such);
- every process under any of those, found by the parent ids in ``/proc`` (Linux; elsewhere the
  first two only).

The tree is frozen before it is killed: each process found gets ``SIGSTOP`` and ``/proc`` is read
again until no new one turns up, so none can start a child, or die and leave its children to
init, between the reading and the kill; then each gets ``SIGKILL``. A process is known by its pid
and its start time, so a pid that a process exiting meanwhile left to an unrelated one is never
signalled; a process that is gone (``ProcessLookupError``) or not this user's (``PermissionError``)
is passed over, and the call never raises for either. With ``grace_s`` the tree is first asked
to exit (``SIGTERM``) and given that long; what it was stays known, so a child whose parent
exited in the grace is killed all the same. Out of reach: a process that left the tree's group
and session and whose parent exited before the call, nobody's descendant any more (its parent
is now init, or a child subreaper).

The call then waits, at most ``wait_s``, until none of them runs (a zombie does not: it holds no
memory, a GPU's included; a process killed in an uninterruptible wait, a device's teardown, may
end after the call returns), reaping those that became this process's children (orphans given
to it as a child subreaper). A ``Popen`` is reaped through its own ``wait`` (``reap``), so its
``returncode`` is the kill's; a process given by pid never is: its parent, or the ``Popen`` that
holds it, does that.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

__all__ = ["is_running", "kill_tree", "pid_alive"]

_MAX_ROUNDS = 50  # readings of /proc while freezing; a tree that forks faster than this is killed as found
_POLL_S = 0.01
_HAVE_PROC = Path("/proc/self/stat").exists()


class _Stat(NamedTuple):
    state: str
    ppid: int
    pgrp: int
    sid: int
    start: int  # clock ticks since boot: a pid and its start time name one process


def _read_stat(pid: int) -> _Stat | None:
    """``/proc/PID/stat``'s fields, or None where that process is gone (or ``/proc`` is not there)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
        return _Stat(fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))
    except (OSError, ValueError, IndexError):
        return None


def _read_all() -> dict[int, _Stat]:
    """Every process this host's ``/proc`` shows now (empty where there is none)."""
    table = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if name.isdigit():
                stat = _read_stat(int(name))
                if stat is not None:
                    table[int(name)] = stat
    return table


def is_running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited: unlike
    :func:`pid_alive`, a zombie is not (it holds no memory)."""
    stat = _read_stat(pid)
    if stat is not None:
        return stat.state not in ("Z", "X")
    return False if _HAVE_PROC else pid_alive(pid)


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host (a zombie included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _send(pid: int, start: int | None, sig: int) -> None:
    """``sig`` to ``pid``, unless it is gone, not this user's, or (``start`` known) another process now."""
    if start is not None:
        stat = _read_stat(pid)
        if stat is None or stat.start != start:
            return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _send_group(group: int | None, sig: int) -> None:
    if group is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, sig)


def _find_tree(root: int | None, group: int | None, known: dict[int, int]) -> dict[int, int]:
    """pid -> start time of every process of the tree now: ``root``, the members of the group and
    session ``group`` names, the ``known`` processes still alive, and every process under them."""
    table = _read_all()
    seeds = {pid for pid, start in known.items() if pid in table and table[pid].start == start}
    if root is not None and root in table:
        seeds.add(root)
    if group is not None:
        seeds |= {pid for pid, stat in table.items() if group in (stat.pgrp, stat.sid)}
    children: dict[int, list[int]] = {}
    for pid, stat in table.items():
        children.setdefault(stat.ppid, []).append(pid)
    found, todo = set(seeds), list(seeds)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    found.discard(os.getpid())
    return {pid: table[pid].start for pid in found}


def _freeze(root: int | None, group: int | None, tree: dict[int, int]) -> None:
    """``SIGSTOP`` to the tree (``tree``: the processes known of it, added to as more are found),
    reading ``/proc`` again until no process of it is new."""
    _send_group(group, signal.SIGSTOP)
    stopped: dict[int, int] = {}
    for _ in range(_MAX_ROUNDS):
        found = _find_tree(root, group, tree)
        new = {pid: start for pid, start in found.items() if stopped.get(pid) != start}
        if not new:
            return
        for pid, start in new.items():
            _send(pid, start, signal.SIGSTOP)
        stopped |= new
        tree |= new


def _wait_gone(tree: dict[int, int], parents: dict[int, int], deadline: float) -> None:
    """Until ``deadline``, wait for every process of ``tree`` to stop running, reaping those that
    became this process's children (``parents``: each one's parent when first found)."""
    me, pending = os.getpid(), dict(tree)
    while pending:
        for pid, start in list(pending.items()):
            stat = _read_stat(pid)
            if stat is not None and stat.ppid == me and parents.get(pid, -1) != me:  # an orphan handed to us
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(pid, os.WNOHANG)
                stat = _read_stat(pid)
            if stat is None or stat.start != start or stat.state in ("Z", "X"):
                del pending[pid]
        if not pending or time.monotonic() >= deadline:
            return
        time.sleep(_POLL_S)


def _get_targets(popen: subprocess.Popen | None, pid: int) -> tuple[int | None, int | None]:
    """The process to kill by its pid (None: a reaped ``Popen``'s, which may be another's now) and the
    group and session to kill (None: the caller's own, or a reaped ``Popen``'s pid given to another)."""
    reaped = popen is not None and popen.returncode is not None
    root = None if reaped else pid
    ours = {os.getpgrp(), os.getsid(0)}  # the caller's own group and session are never killed as such
    group = None if pid in ours or (reaped and _read_stat(pid) is not None) else pid
    return root, group


def _terminate(popen: subprocess.Popen | None, tree: dict[int, int], group: int | None, deadline: float) -> None:
    """``SIGTERM`` to the tree, and until ``deadline`` for it to exit (a ``Popen`` reaped by its own ``wait``)."""
    _send_group(group, signal.SIGTERM)
    for pid, start in tree.items():
        _send(pid, start, signal.SIGTERM)
    if popen is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=max(0.0, deadline - time.monotonic()))
    _wait_gone(tree, {pid: os.getpid() for pid in tree}, deadline)  # none reaped here: the kill's wait does


def kill_tree(
    process: int | subprocess.Popen, *, reap: bool = True, grace_s: float = 0.0, wait_s: float = 5.0
) -> list[int]:
    """``SIGKILL`` ``process`` (a pid or a ``Popen``), its process group and session, and every
    process under them ([Note: killing a process tree]); never raises for a process that is gone or
    not this user's. ``grace_s``: ``SIGTERM`` first, and that long to exit. Waits at most ``wait_s``
    for them to end; ``reap``: a ``Popen``'s ``wait`` too. Returns the pids of the tree found."""
    popen = process if isinstance(process, subprocess.Popen) else None
    pid = process.pid if popen is not None else int(process)
    root, group = _get_targets(popen, pid)
    tree = _find_tree(root, group, {})
    parents = {each: stat.ppid for each in tree if (stat := _read_stat(each)) is not None}
    if grace_s > 0:
        _terminate(popen, tree, group, time.monotonic() + grace_s)
        root, group = _get_targets(popen, pid)
    try:
        _freeze(root, group, tree)
    finally:  # Ctrl-C while freezing included: nothing found is left stopped
        _send_group(group, signal.SIGKILL)
        for each, start in tree.items():
            _send(each, start, signal.SIGKILL)
        if root is not None and not _HAVE_PROC:
            _send(root, None, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    if popen is not None and reap:
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=wait_s)
    parents[pid] = os.getpid()  # the process given is never reaped here (its Popen's wait, or its parent)
    _wait_gone(tree, parents, deadline)
    return sorted(tree)
