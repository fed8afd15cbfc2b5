"""Nodes stood in for on one host: torchrun agents on loopback whose workers join a search's
``--workers`` address ([Note: node pool] in :mod:`autotune.trials.nodes`), as the node tests
and ``benchmarks/node_search.py`` start them (gloo; ``--cluster cpu-emulated-2node`` holds the
link between the "nodes" to a slow network's speed).

torchrun starts each worker in a session of its own, so killing an agent's process group leaves
its workers running: :func:`kill_tree` (:mod:`autotune.trials.killing`, here for the callers that
start the agents) kills a process and everything under it.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from autotune.trials.killing import kill_tree

__all__ = ["get_agent_command", "get_free_port", "kill_tree"]

_GIVEN: set[int] = set()


def get_free_port() -> int:
    """A loopback port free now and not given before in this process: a driver binds its port only
    once its process has started, so the next free port asked for (a rendezvous') could be that one."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def get_agent_command(
    pool: str,
    *,
    rdzv: str,
    run_id: str,
    nnodes: int = 2,
    per_node: int = 1,
    max_restarts: int = 3,
    log_dir: Path | None = None,
    more: tuple[str, ...] = (),
) -> list[str]:
    """One of ``nnodes`` torchrun agents (c10d rendezvous at ``rdzv``) whose ``per_node`` workers
    join ``pool``; ``log_dir`` in place of torchrun's default (a new temp dir per agent, never
    removed); ``more``: torchrun options of the caller's."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(per_node),
    ]
    command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--rdzv-id", run_id]
    command += ["--max-restarts", str(max_restarts), *more]
    if log_dir is not None:
        command += ["--log-dir", str(log_dir)]
    return [*command, "-m", "autotune.trials.worker", "--pool", pool]
