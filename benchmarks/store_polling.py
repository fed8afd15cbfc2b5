"""Prints the store requests a second that the search across nodes costs while jobs run, 64 and 256 ranks, before and after the doorbell.

    .venv/bin/python benchmarks/store_polling.py                       # 64 and 256 ranks, 3 jobs of 5 s each
    .venv/bin/python benchmarks/store_polling.py --quick               # 4 ranks, 1 job of 0.5 s: the path, not the figures

No training, no torchrun: the driver is a real :class:`~autotune.trials.nodes.NodePool` on
loopback, and its ranks are fake workers, threads in a few processes (``--procs``), each rank
with its own store clients doing what ``autotune/trials/worker.py`` does between and during
jobs: it takes a ticket, is admitted, posts its placement, beats, and serves jobs (a job here
sleeps ``--job-s`` and returns the pid). Two codes, each on fresh workers and a fresh driver:

- ``before``: the driver's wait as it was (a copy below, :class:`PollingPool`: every 50 ms a
  ``check`` of the results, one of every rank's report, the ticket counter, and an ``add`` of
  every rank's beat counter; the results read one ``get`` each); a worker's heartbeat an ``add``
  and a ``check`` of the abort key each second, its job loop ``wait``, ``get``, ``set``;
- ``after``: ``NodePool`` as it is (the doorbell, one ``multi_get`` of the beats a second, the
  results in one ``multi_get``); a worker's heartbeat one ``add`` a second, its job loop on
  :class:`~autotune.trials.reconnect.ReconnectingStore` (a ``set`` followed by its ``check``)
  ringing with :func:`~autotune.trials.worker.ring`.

Requests are counted on the client side, by wrapping every store client the driver and the
workers use (a ``check``, ``multi_get`` or ``wait`` of many keys is one request), from the first
job's start to the last job's end, after one warm-up job. Printed per ranks and code: the
driver's requests a second, the workers' (all ranks, and per rank), their total, and how long
after its ranks finished a job the driver had it (the median job's wall time minus
``--job-s``). Load (``os.getloadavg``) before and after each run. Every process is killed at the
end of its run (a hard limit: ``--limit-s``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.distributed import TCPStore  # noqa: E402

from autotune.trials.loopback import get_free_port  # noqa: E402
from autotune.trials.nodes import NodePool  # noqa: E402
from autotune.trials.reconnect import ReconnectingStore  # noqa: E402
from autotune.trials.wire import decode, new_secret, open_sealed, seal  # noqa: E402
from autotune.trials.worker import ABORT_BEATS, HEARTBEAT_S, ring  # noqa: E402

OLD_POLL_S = 0.05
"""The driver's poll period before the doorbell."""


class Counted:
    """A store client (``TCPStore`` or ``PrefixStore``) whose requests are counted."""

    def __init__(self, store: Any) -> None:
        self.store, self.count = store, 0

    def __getattr__(self, name: str) -> Any:  # get, set, add, check, wait, multi_get
        method = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            self.count += 1
            return method(*args)

        return counted


class PollingPool(NodePool):
    """The driver's wait before the doorbell (autotune/trials/nodes.py at b5c7eef), for ``before``."""

    def _wait(self, n: int, prefix: str, deadline: float) -> dict[str, Any] | None:
        keys = [f"result/{n}/{r}" for r in range(self.world_size)]
        while True:
            if self._jobs.check(keys):
                return None
            reported = [r for r in range(self.world_size) if self._keys.check([f"{prefix}failed/{r}"])]
            if reported:
                return {"reported": reported, "replaced": sorted(self._newest)}
            self._scan_tickets()
            if self._newest:
                return {"replaced": sorted(self._newest)}
            now, lost = time.monotonic(), []
            for rank, (count, since) in self._beats.items():
                latest = self._keys.add(f"{prefix}beat/{rank}", 0)
                if latest != count:
                    self._beats[rank] = (latest, now)
                elif now - since > self.lost_after_s:
                    lost.append(rank)
            if lost:
                return {"lost": lost}
            if time.monotonic() > deadline:
                return {"timed_out": True}
            time.sleep(OLD_POLL_S)

    def _open_results(self, prefix: str, n: int) -> list[Any]:
        return [
            open_sealed(self._secret, f"{prefix}result/{n}/{r}", self._jobs.get(f"result/{n}/{r}"), sender=f"rank {r}")
            for r in range(self.world_size)
        ]


# -- the fake workers ------------------------------------------------------------------


def fake_job(rank: int, world_size: int, *, seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def _client(port: int) -> Counted:
    return Counted(TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120)))


class Plain:
    """``PrefixStore`` keys over a counted client, no reconnecting: what a worker's clients were before."""

    def __init__(self, store: Counted, prefix: str = "") -> None:
        self.store, self.prefix = store, prefix

    def under(self, prefix: str) -> Plain:
        return Plain(self.store, f"{self.prefix}{prefix}/")

    def get(self, key: str) -> bytes:
        return self.store.get(self.prefix + key)

    def set(self, key: str, value: bytes) -> None:
        self.store.set(self.prefix + key, value)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self.prefix + key, amount)

    def check(self, keys: list[str]) -> bool:
        return self.store.check([self.prefix + k for k in keys])

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self.store.wait([self.prefix + k for k in keys], timeout)


def _join(client: Counted, rank: int, world_size: int, secret: bytes) -> int:
    """A worker's join (worker.py's ``join``, without the process group): its world."""
    pool = Plain(client).under("nodepool/")
    ticket = pool.add("tickets", 1)
    info = {"rank": rank, "host": socket.gethostname(), "node": 0, "local_rank": rank, "local_world_size": world_size}
    info |= {"pid": os.getpid(), "world_size": world_size, "backend": "gloo"}
    pool.set(f"ticket/{ticket}", seal(secret, f"nodepool/ticket/{ticket}", info))
    pool.wait([f"admitted/{ticket}"], timedelta(seconds=120))
    return int(open_sealed(secret, f"nodepool/admitted/{ticket}", pool.get(f"admitted/{ticket}"), sender="driver"))


def _connect(client: Counted, port: int, code: str) -> Any:
    """A worker's client under ``nodepool/``: ``before`` plain, ``after`` the reconnecting one it now uses."""
    if code == "before":
        return Plain(client).under("nodepool/")
    return ReconnectingStore("127.0.0.1", port, timeout_s=120, gone_after_s=60, store=client).under("nodepool/")


def _beat(beats: Any, prefix: str, rank: int, code: str, stop: threading.Event) -> None:
    """A worker's heartbeat: ``before`` an ``add`` and a ``check`` of the abort key a second, ``after`` one ``add``."""
    while not stop.is_set():
        if beats.add(f"{prefix}beat/{rank}", 1) >= ABORT_BEATS:
            return
        if code == "before" and beats.check([f"{prefix}abort"]):
            return
        time.sleep(HEARTBEAT_S)


def _serve(port: int, rank: int, world_size: int, secret: bytes, code: str, counts: list[Counted]) -> None:
    """One fake rank: join, beat on a client of its own, serve jobs until told to exit."""
    client, heart = _client(port), _client(port)
    counts += [client, heart]
    generation = _join(client, rank, world_size, secret)
    prefix, stop = f"gen/{generation}/", threading.Event()
    pool, beats = _connect(client, port, code), _connect(heart, port, code)
    jobs = pool.under(prefix)
    threading.Thread(target=_beat, args=(beats, prefix, rank, code, stop), daemon=True).start()
    placement = {"rank": rank, "host": socket.gethostname(), "node": 0, "local_rank": rank, "pid": os.getpid()}
    pool.set(f"{prefix}rank/{rank}", seal(secret, f"nodepool/{prefix}rank/{rank}", placement))
    for n in range(10**9):
        jobs.wait([f"job/{n}"], timedelta(days=1))
        data = jobs.get(f"job/{n}")
        if data == b"exit":
            stop.set()
            return
        job = decode(json.loads(data)["body"])  # not opened: a process's ranks share one replay guard
        result = fake_job(rank, world_size, **job["kwargs"])
        jobs.set(f"result/{n}/{rank}", seal(secret, f"{prefix}result/{n}/{rank}", result))
        if code == "after":
            ring(jobs, n, world_size)


def fake_workers(port: int, ranks: list[int], world_size: int, secret: bytes, code: str, pipe: Any) -> None:
    """A process of fake ranks; answers ``count`` on ``pipe`` with its requests so far."""
    torch.set_num_threads(1)
    counts: list[Counted] = []
    for rank in ranks:
        threading.Thread(target=_serve, args=(port, rank, world_size, secret, code, counts), daemon=True).start()
    while (message := pipe.recv()) != "stop":
        pipe.send(sum(c.count for c in counts) if message == "count" else None)
    os._exit(0)  # its ranks' threads may be in a store call


# -- one run ---------------------------------------------------------------------------


def run(world_size: int, code: str, args: argparse.Namespace) -> dict[str, float]:
    """Fresh fake workers and a fresh driver of ``code``; the requests a second of each side."""
    port, secret = get_free_port(), new_secret()
    kind = PollingPool if code == "before" else NodePool
    pool = kind(world_size, address=f"127.0.0.1:{port}", secret=secret, join_timeout_s=args.limit_s, say=lambda _: None)
    context, procs, pipes = multiprocessing.get_context("spawn"), [], []
    for i in range(args.procs):
        here, there = context.Pipe()
        ranks = list(range(i, world_size, args.procs))
        procs.append(context.Process(target=fake_workers, args=(port, ranks, world_size, secret, code, there)))
        procs[-1].start()
        pipes.append(here)
    timer = threading.Timer(args.limit_s, _kill, (procs,))  # the run's hard limit
    timer.start()
    load = os.getloadavg()[0]
    try:
        warm = pool.run("store_polling:fake_job", {"seconds": 0.1}, timeout_s=args.limit_s)
        assert warm.ok, warm.reason
        pool._keys, pool._jobs, pool._bells = Counted(pool._keys), Counted(pool._jobs), Counted(pool._bells)
        before = _count_workers(pipes)
        start, walls = time.monotonic(), []
        for _ in range(args.jobs):
            done = pool.run("store_polling:fake_job", {"seconds": args.job_s}, timeout_s=args.limit_s)
            assert done.ok, done.reason
            walls.append(done.wall_s)
        window = time.monotonic() - start
        workers = _count_workers(pipes) - before
        driver = pool._keys.count + pool._jobs.count + pool._bells.count
    finally:
        pool.close()
        for pipe in pipes:
            pipe.send("stop")
        for proc in procs:
            proc.join(timeout=10)
            proc.kill()
        timer.cancel()
    return {
        "driver": driver / window,
        "workers": workers / window,
        "late_ms": (statistics.median(walls) - args.job_s) * 1e3,
        "load": f"{load:.1f}-{os.getloadavg()[0]:.1f}",
    }


def _kill(procs: list[Any]) -> None:
    """Past the hard limit: the fake workers and this process, at once."""
    for proc in procs:
        proc.kill()
    print("store_polling.py: a run outlived --limit-s", file=sys.stderr, flush=True)
    os._exit(3)


def _count_workers(pipes: list[Any]) -> int:
    for pipe in pipes:
        pipe.send("count")
    return sum(pipe.recv() for pipe in pipes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256], help="world sizes")
    parser.add_argument("--jobs", type=int, default=3, help="jobs measured per run, after one warm-up job")
    parser.add_argument("--job-s", type=float, default=5.0, help="how long each job sleeps on every rank")
    parser.add_argument("--procs", type=int, default=4, help="processes the fake ranks are spread over")
    parser.add_argument("--limit-s", type=float, default=300.0, help="a run's hard limit")
    parser.add_argument("--quick", action="store_true", help="4 ranks, 1 job of 0.5 s, 1 process")
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.jobs, args.job_s, args.procs, args.limit_s = [4], 1, 0.5, 1, 60.0
    print(f"torch {torch.__version__}, {os.cpu_count()} cores; {args.jobs} jobs of {args.job_s:g} s per run")
    print("| ranks | code | driver req/s | workers req/s | per rank | total req/s | job noticed after | load |")
    print("|---|---|---|---|---|---|---|---|")
    for world_size in args.ranks:
        for code in ("before", "after"):
            r = run(world_size, code, args)
            print(
                f"| {world_size} | {code} | {r['driver']:.0f} | {r['workers']:.0f} | {r['workers'] / world_size:.2f} "
                f"| {r['driver'] + r['workers']:.0f} | {r['late_ms']:.0f} ms | {r['load']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
