"""One call of :func:`autotune.trials.kill_tree` kills a process tree whatever session its
processes moved to ([Note: killing a process tree] in autotune/trials/killing.py), and never
raises for a process that is gone. Every process here ends on its own within a minute, and is
killed with its tree on teardown."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autotune.trials import kill_tree

pytestmark = pytest.mark.multirank

LIMIT_S = 60
# The root starts a child in its own process group and one in a session of its own (as torchrun
# starts its workers), whose child is a grandchild in that session; it prints their pids.
TREE = f"""
import json, subprocess, sys, time
same = subprocess.Popen(['sleep', '{LIMIT_S}'])
inner = "import subprocess, time; subprocess.Popen(['sleep', '{LIMIT_S}']); time.sleep({LIMIT_S})"
apart = subprocess.Popen([sys.executable, '-c', inner], start_new_session=True)
print(json.dumps([same.pid, apart.pid]), flush=True)
time.sleep({LIMIT_S})
"""


def is_running(pid: int) -> bool:
    """Whether ``pid`` has not exited (a zombie has), read from ``/proc``."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def get_children(pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return children


@pytest.fixture
def tree():
    """The root (a ``Popen`` in a session of its own) and the pids of its three descendants."""
    root = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True, start_new_session=True)
    descendants: list[int] = []
    try:
        descendants += json.loads(root.stdout.readline())
        deadline = time.monotonic() + LIMIT_S / 2
        while len(descendants) < 3 and time.monotonic() < deadline:
            descendants += get_children(descendants[1])
            time.sleep(0.01)
        yield root, descendants
    finally:
        kill_tree(root)
        for pid in descendants:  # orphans, where a test killed the root alone
            if is_running(pid):
                kill_tree(pid)
        root.stdout.close()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="descendants are found in /proc (Linux)")
def test_one_call_kills_the_tree_in_its_group_and_in_a_session_of_its_own(tree):
    root, descendants = tree
    assert len(descendants) == 3 and all(map(is_running, descendants))
    found = kill_tree(root)
    assert set(descendants) | {root.pid} <= set(found)
    assert root.returncode == -signal.SIGKILL  # reaped by its Popen: the kill's code, not a guess
    assert [pid for pid in [root.pid, *descendants] if is_running(pid)] == []


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="descendants are found in /proc (Linux)")
def test_a_reaped_process_s_group_and_what_ran_under_it_are_still_killed(tree):
    """A rank that exited on its own and was reaped (its pid free again) leaves its children."""
    root, descendants = tree
    root.send_signal(signal.SIGKILL)
    root.wait()
    assert all(map(is_running, descendants))  # orphans now: none is under the root any more
    kill_tree(root)
    assert [pid for pid in descendants[:1] if is_running(pid)] == []  # the one in the root's group


def test_a_process_that_is_gone_is_passed_over_and_left_to_its_popen_to_reap():
    done = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    while is_running(done.pid):  # exited, not reaped: a zombie, whose pid no other process can have
        time.sleep(0.01)
    assert kill_tree(done.pid, wait_s=1) in ([], [done.pid])
    assert done.wait(timeout=LIMIT_S) == 0  # not reaped behind its Popen's back, nor its code changed
    assert kill_tree(done, wait_s=1) == [] and done.returncode == 0
