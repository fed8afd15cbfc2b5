"""One rank of a search across nodes, started by torchrun (or srun) on every node.

    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:29400 \\
        --max-restarts 3 -m autotune.trials.worker --pool HEAD:29401

torchrun's rendezvous gives each rank its ``RANK`` and ``WORLD_SIZE``; the rank then joins the
driver's store at ``--pool`` (the ``autotune search --workers HEAD:29401`` process), is admitted
to a world (a *generation*) there, forms its process group on that store, and serves the
driver's jobs as a local pool's ranks do (:func:`autotune.trials.rank.serve_jobs`): [Note: node
pool] in :mod:`autotune.trials.nodes`. After each job's result it rings the job's doorbell
(:func:`ring`), so the driver blocks on one key instead of polling every rank.

A heartbeat thread per rank counts up under the generation every second: one ``add``, whose
answer also carries the driver's abort (the driver adds :data:`ABORT_BEATS` to every count of a
world it ends), so a hang or a lost peer ends the world on every node within a second and
torchrun's elastic restart (``--max-restarts``) starts the workers of the next one. A rank
costs the driver's store one request a second for its heartbeat (two before the abort rode on
the count), and five per job for its job loop: the blocking ``wait``, the job's ``get``, the
result's ``set`` and the ``check`` that it landed, the count (``benchmarks/store_polling.py``).

The heartbeat and the job loop reach the driver through clients that make their connection
again after a network hiccup ([Note: store hiccups] in :mod:`autotune.trials.reconnect`): a
worker that had to reconnect ends its world (exit :data:`EXIT_ABORTED`) between jobs, its
process group being formed on a connection that is gone, and torchrun starts the next world.
When the driver stays unreachable for ``--driver-gone-s`` (:data:`DRIVER_GONE_S`; the search
ended, or was killed), every rank exits 0 and torchrun ends: nothing is left running on the
nodes waiting for a driver that will not come back.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

EXIT_ABORTED = 75
"""A worker's exit code when its world ended under it: the driver aborted it (a failed or hung
trial), or the worker's connection to the driver dropped and had to be made again."""
HEARTBEAT_S = 1.0
ABORT_BEATS = 1 << 40
"""What the driver adds to every beat counter of a world it aborts: a heartbeat whose count
reaches it exits (a count of one a second never does)."""
DRIVER_GONE_S = 20.0
"""How long a worker keeps trying to reach a driver it lost before it takes it for gone and
exits 0 (``--driver-gone-s``): as long as the driver waits for a silent heartbeat
(``NodePool(lost_after_s=20)``) before it fails that rank's job."""
_boards: list[Path] = []
"""This host's arrival board once the rank serves, removed by whichever thread ends the rank."""


def _end(code: int) -> None:
    """End the rank at once, without unwinding (its threads may be in a collective or a store
    wait), and with it this host's arrival board: every rank on the host tries, the first removes it."""
    for board in _boards:
        shutil.rmtree(board, ignore_errors=True)
    sys.stderr.flush()
    os._exit(code)


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port), or a one-line ``ValueError`` naming it."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--pool {address!r}: expected HOST:PORT (the driver's address, e.g. head-node:29401)")
    return host, int(port)


def get_placement(rank: int) -> dict[str, Any]:
    """Where this rank runs: its host, node (torchrun's ``GROUP_RANK``), local rank and pid."""
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        "pid": os.getpid(),
    }


def ring(jobs: Any, n: int, world_size: int) -> None:
    """Count this rank's result of job ``n`` in; the rank whose count reaches ``world_size`` rings
    the job's doorbell (``wake/{n}``), on which the driver blocks ([Note: node pool])."""
    if jobs.add(f"done/{n}", 1) >= world_size:
        jobs.add(f"wake/{n}", 1)


class _Served:
    """What the job loop and the heartbeat share: the job in flight (or the next), and whether a
    connection to the driver had to be made again ([Note: store hiccups]). Whichever thread
    finds the rank between jobs after a drop tells the driver and ends the rank."""

    def __init__(self, secret: bytes, generation: int, rank: int, world_size: int) -> None:
        self._secret, self.generation, self.rank, self.world_size = secret, generation, rank, world_size
        self.prefix = f"gen/{generation}/"
        self._lock = threading.RLock()  # a call made under it may reconnect, and tell dropped()
        self.next_job, self.busy = 0, False
        self.down_s: float | None = None
        """How long the driver was unreachable, once a connection had to be made again."""

    def dropped(self, down_s: float) -> None:
        """A client's ``on_reconnect``: this world's process group is not to be trusted again."""
        with self._lock:
            self.down_s = max(self.down_s or 0.0, down_s)

    def start(self, pool: Any, n: int) -> None:
        """Job ``n`` is about to run here (``serve_jobs``' ``on_job``)."""
        with self._lock:
            self.next_job = n
            if self.down_s is not None:  # not run here: the driver runs it again on the next world
                self._leave(pool)
            self.busy = True

    def finish(self, pool: Any, n: int) -> None:
        """Job ``n``'s result is set (``serve_jobs``' ``on_result``): ring, and leave if a drop came."""
        ring(pool.under(self.prefix), n, self.world_size)
        with self._lock:
            self.next_job, self.busy = n + 1, False
            if self.down_s is not None:
                self._leave(pool)

    def leave_if_idle(self, pool: Any) -> None:
        """From the heartbeat: end the rank now where a drop came and no job runs."""
        with self._lock:
            if self.down_s is not None and not self.busy:
                self._leave(pool)

    def report(self, pool: Any, code: int, text: str) -> None:
        """The job in flight failed here (``on_fail``): its reason, and the doorbell. Where a drop
        came first (found by this very ``set``, the job loop's client being the process group's
        until a drop: a job's new group fails on it), the driver is told so too, and runs the job again."""
        with self._lock:
            report = {"code": code, "tail": text[-4000:]}
            pool.set(f"{self.prefix}failed/{self.rank}", self._seal(f"failed/{self.rank}", report))
            if self.down_s is not None:
                self._leave(pool)
            pool.under(self.prefix).add(f"wake/{self.next_job}", 1)

    def _leave(self, pool: Any) -> None:
        """Tell the driver this rank runs no job from ``next_job`` on (it runs that one again on
        the next world), ring that job's doorbell, and end the rank for torchrun to restart."""
        info = {"job": self.next_job, "down_s": self.down_s, "during_job": self.busy}
        pool.set(f"{self.prefix}dropped/{self.rank}", self._seal(f"dropped/{self.rank}", info))
        pool.under(self.prefix).add(f"wake/{self.next_job}", 1)
        print(
            f"rank {self.rank}: the connection to the driver dropped for {self.down_s:.1f} s; this world's "
            "process group cannot make its connection again: ending it for torchrun to form the next",
            file=sys.stderr,
            flush=True,
        )
        _end(EXIT_ABORTED)

    def _seal(self, key: str, value: Any) -> bytes:
        from autotune.trials.wire import seal

        return seal(self._secret, f"nodepool/{self.prefix}{key}", value)


def _connect(address: str, *, timeout_s: float, gone_after_s: float, served: _Served, store: Any = None) -> Any:
    """A client of the driver's store under ``nodepool/`` that makes its connection again after
    a drop, telling ``served``; a driver gone for ``gone_after_s`` ends the rank with exit 0."""
    from autotune.trials.reconnect import ReconnectingStore

    host, port = parse_address(address)
    client = ReconnectingStore(
        host,
        port,
        store=store,
        timeout_s=timeout_s,
        gone_after_s=gone_after_s,
        on_reconnect=served.dropped,
        on_gone=lambda: _end(0),  # not a failure: torchrun restarts no worker to wait for it
    )
    return client.under("nodepool/")


def join(
    address: str, backend: str, join_timeout_s: float, secret: bytes, driver_gone_s: float = DRIVER_GONE_S
) -> tuple[Any, int, int, _Served]:
    """Admitted to a world by the driver ([Note: node pool]): the driver's store (the client the
    process group was formed on), this rank, the world size and what the rank's threads share;
    the process group formed on the driver's store. What it posts and reads there is signed
    with the search's ``secret`` ([Note: signed messages] in :mod:`autotune.trials.wire`)."""
    import torch
    import torch.distributed as dist

    from autotune.trials.wire import open_sealed, seal

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = parse_address(address)
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=join_timeout_s))
    pool = dist.PrefixStore("nodepool/", store)
    ticket = pool.add("tickets", 1)
    info = get_placement(rank) | {"world_size": world_size, "backend": backend}
    pool.set(f"ticket/{ticket}", seal(secret, f"nodepool/ticket/{ticket}", info))
    pool.wait([f"admitted/{ticket}"], timedelta(seconds=join_timeout_s))
    key = f"nodepool/admitted/{ticket}"
    generation = int(open_sealed(secret, key, pool.get(f"admitted/{ticket}"), sender=f"the driver at {address}"))
    if generation == 0:  # superseded by a newer worker of this rank
        os._exit(EXIT_ABORTED)
    served = _Served(secret, generation, rank, world_size)
    beats = _connect(address, timeout_s=60, gone_after_s=driver_gone_s, served=served)
    threading.Thread(target=_beat, args=(beats, served), daemon=True).start()
    if backend == "nccl":  # one GPU per local rank, before NCCL binds its communicators to one
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    pg_store = dist.PrefixStore(f"pg/{generation}", store)
    dist.init_process_group(
        backend, store=pg_store, rank=rank, world_size=world_size, timeout=timedelta(seconds=join_timeout_s)
    )
    return store, rank, world_size, served


def _beat(beats: Any, served: _Served) -> None:
    """Count up every second; exit at once when the driver aborts the generation (the count
    jumps past :data:`ABORT_BEATS`), or, between jobs, once a connection had to be made again.
    On a client of its own (the job loop's blocking wait holds the other); a driver unreachable
    for ``--driver-gone-s`` ends the rank with exit 0 there ([Note: store hiccups])."""
    key = f"{served.prefix}beat/{served.rank}"
    try:
        while True:
            if beats.add(key, 1) >= ABORT_BEATS:
                _end(EXIT_ABORTED)
            served.leave_if_idle(beats)
            time.sleep(HEARTBEAT_S)
    except Exception as e:  # not the connection's (that one is made again): the world cannot be watched
        print(f"rank {served.rank}: the heartbeat failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        _end(EXIT_ABORTED)


def get_board(address: str, generation: int | str) -> Path:
    """This host's arrival board for the world ``generation`` of the pool at ``address``."""
    return Path(tempfile.gettempdir()) / f"autotune-nodepool-{address.replace(':', '-')}-{generation}"


def serve(
    address: str, backend: str, join_timeout_s: float, secret: bytes, driver_gone_s: float = DRIVER_GONE_S
) -> None:
    from autotune.trials.linkemu import BOARD_ENV
    from autotune.trials.rank import serve_jobs
    from autotune.trials.wire import seal

    store, rank, world_size, served = join(address, backend, join_timeout_s, secret, driver_gone_s)
    prefix = served.prefix
    # One arrival board per host and generation ([Note: link emulation]): the ranks that share a host share it.
    board = get_board(address, served.generation)
    for stale in board.parent.glob(get_board(address, "*").name):  # an earlier world's: its ranks are gone
        if stale != board:
            shutil.rmtree(stale, ignore_errors=True)
    board.mkdir(exist_ok=True)
    _boards.append(board)
    os.environ[BOARD_ENV] = str(board)
    # The job loop's client: the one the process group was formed on until a drop, then a new one.
    pool = _connect(address, timeout_s=join_timeout_s, gone_after_s=driver_gone_s, served=served, store=store)
    pool.set(f"{prefix}rank/{rank}", seal(secret, f"nodepool/{prefix}rank/{rank}", get_placement(rank)))
    serve_jobs(
        pool.under(prefix),
        rank,
        world_size,
        secret=secret,
        scope=prefix,
        sender=f"the driver at {address}",
        on_fail=lambda code, text: served.report(pool, code, text),
        on_exit=lambda: _end(0),
        on_job=lambda n: served.start(pool, n),
        on_result=lambda n: served.finish(pool, n),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autotune.trials.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--pool", required=True, help="HOST:PORT of the driver (autotune search --workers HOST:PORT)")
    parser.add_argument("--backend", default=None, help="gloo or nccl (default: nccl where CUDA is, else gloo)")
    parser.add_argument("--join-timeout-s", type=float, default=900.0, help="how long to wait for the driver and peers")
    parser.add_argument(
        "--driver-gone-s",
        type=float,
        default=DRIVER_GONE_S,
        help=f"how long the driver may stay unreachable before the worker exits 0 (default {DRIVER_GONE_S:.0f})",
    )
    parser.add_argument(
        "--secret-file",
        default=None,
        help="the search's secret, hex (the driver's OUT/pool-secret); default: $AUTOTUNE_POOL_SECRET",
    )
    args = parser.parse_args(argv)
    from autotune.trials.wire import WireError, load_secret

    try:
        parse_address(args.pool)
        secret = load_secret(args.secret_file)
    except (ValueError, WireError) as e:
        print(f"autotune.trials.worker: {e}", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        print(
            "autotune.trials.worker: no RANK in the environment: start it with torchrun (or srun + torchrun)",
            file=sys.stderr,
        )
        return 2
    if args.backend is None:
        import torch

        args.backend = "nccl" if torch.cuda.is_available() else "gloo"
    serve(args.pool, args.backend, args.join_timeout_s, secret, args.driver_gone_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())


CHECK_BYTES = 8 * 2**20


def check_rank(rank: int, world_size: int) -> dict[str, Any]:
    """A dry run's job on every rank: where it runs, its device, and one timed all-reduce of
    :data:`CHECK_BYTES` over the whole world (the median of three, after one to warm up)."""
    import statistics

    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    buffer = torch.ones(CHECK_BYTES // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(4):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return get_placement(rank) | {"device": name, "all_reduce_ms": statistics.median(times[1:])}
