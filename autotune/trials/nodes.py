"""A rank pool whose ranks the user's launcher starts on every node: the search across nodes.

    autotune search --model llama8b --nproc 32 --workers 0.0.0.0:29401 ...          # the driver, on one node
    torchrun --nnodes 4 --nproc-per-node 8 ... -m autotune.trials.worker --pool HEAD:29401   # every node

[Note: node pool]
The local :class:`~autotune.trials.pool.RankPool` and :class:`NodePool` are one design with two
ways of starting ranks. In both, a driver process owns a ``TCPStore``; the ranks form one world,
keep it (CUDA context, NCCL communicators, kept meshes) and serve jobs from that store in order
(:func:`autotune.trials.rank.serve_jobs`: ``job/{n}`` in, ``result/{n}/{rank}`` out); the driver
runs the whole search (the study, the paired trials, the stopping rule, the final and recipe
rounds, the emitted config, every trial dir) through the same ``pool.run`` and
:func:`~autotune.trials.trial.run_trial`. What differs is who starts and stops the ranks:

- *local*: the driver spawns them and kills their process trees after a failure, then spawns
  fresh ones for the next trial;
- *nodes*: torchrun (or srun running torchrun) starts them on every node
  (``autotune.trials.worker``), and restarts them: the driver cannot kill a process on another
  node, so after a failure it *aborts the world*. It adds
  :data:`~autotune.trials.worker.ABORT_BEATS` to every rank's beat counter, every rank's heartbeat
  sees its count jump within a second and exits, and each torchrun agent, seeing its workers
  gone, starts new ones (``--max-restarts``). The failed trial is recorded with its reason, as
  locally, and the next runs on the next world.

*Admission.* Each started worker takes a ticket from the driver's store and posts its rank
(torchrun's ``RANK``), host, node and pid. Once every rank has a worker newer than the last
world's, the driver admits the newest of each into world ``g + 1``, and they form their process
group on the driver's store under ``pg/{g+1}``. Not on torchrun's own store: its workers find
each other there under the agent's restart count, and an agent restarted for a peer's failure
(a membership change) does not count that restart, so after a rank is killed the two sides
would look for each other under different keys; measured, every restart then failed until the
restarts were spent. A world whose ranks do not all register within :data:`_FORM_S` (a worker
died before) is aborted and the next admitted.

*Failures* reach the driver in four ways: a rank's own report (``gen/{g}/failed/{rank}``: its
exception's text, written before it exits), a new worker's ticket for a rank of the running
world (torchrun restarted it: the old one died without a word, killed or out of host memory),
the silence of its heartbeat (``beat/{rank}`` stops counting for ``lost_after_s``: its node or
its agent lost), or the job's time limit (a hang). The driver lives outside the world, not in its rank 0: a world is re-formed by
restarting every worker, which would end a driver inside one with every failed trial. A world
that does not form within ``join_timeout_s`` is one line naming the address and what joined.

*Polling.* A job's wait costs the store a few requests a second whatever the world's size. Each
rank counts its result in (``add`` on ``done/{n}``); the one whose count reaches the world size
rings the job's doorbell (``add`` on ``wake/{n}``; a failure report, or a rank's word that it will
not run the job, rings it at once). The driver waits for it with one blocking ``wait`` per job, on
a client of its own, and once a :data:`_CHECK_S` reads the ticket counter (an ``add``) and every
beat counter (a ``multi_get``); it reads results and reports once the doorbell rang (a count made
twice across a reconnect rings early: it then checks each period). A heartbeat is one ``add`` a
second, the abort riding on its answer. Measured (``benchmarks/store_polling.py``): the driver 3
requests a second at 64 and at 256 ranks; the 50 ms poll of every rank it replaced, 2036 and 5090.

*Hiccups.* A worker's heartbeat and job loop make their connection again after a drop ([Note: store
hiccups] in :mod:`autotune.trials.reconnect`); one that had to ends its world between jobs, setting
``dropped/{rank}`` first: the driver runs that job again on the next world (:data:`_RERUNS` times).

*What travels.* The driver's store listens on the address ``--workers`` names only ([Note: store
binding] in :mod:`autotune.trials.stores`); every job, result, ticket, admission, placement and
failure report on it is a message signed with the search's secret ([Note: signed messages] in
:mod:`autotune.trials.wire`; :func:`get_pool_secret`), each world's under its own prefix, so a
message of an earlier world cannot be replayed into a later one.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed import DistError, PrefixStore, TCPStore

from autotune.trials.launch import RankRun, classify_failure, is_peer_loss
from autotune.trials.stores import listen_store
from autotune.trials.wire import SECRET_ENV, WireError, load_secret, new_secret, open_sealed, seal
from autotune.trials.worker import ABORT_BEATS, parse_address
from fsdp_runtime.errors import AutotuneError

__all__ = ["SECRET_FILE", "NodePool", "NodePoolError", "get_pool_secret"]

_JOIN_POLL_S = 0.2  # how often the driver looks for tickets and registrations while a world forms
_CHECK_S = 1.0  # while a job runs: the doorbell's wait between two checks of tickets and heartbeats
_RERUNS = 3  # how many times a job a dropped connection kept from running runs again, each on a new world
_FORM_S = 60.0  # how long admitted workers have to form their process group
_REPORT_GRACE_S = 3.0  # after a rank's report, how long the others' reports and new workers' tickets may take


SECRET_FILE = "pool-secret"
"""Where in the search's ``--out`` the driver writes the secret it made (no ``$AUTOTUNE_POOL_SECRET``)."""


class NodePoolError(AutotuneError):
    """No world formed: the workers did not join, or torchrun's restarts are spent."""


def _listen(bells: Any, key: str, deadline: float, bell: threading.Event) -> None:
    """Set ``bell`` once the doorbell ``key`` rings: one blocking ``wait`` per job, not one per check
    period (each that times out logs two warnings of torch's, measured on torch 2.13.0)."""
    try:
        bells.wait([key], timedelta(seconds=max(deadline - time.monotonic(), 0.0) + 2 * _CHECK_S))
        bell.set()
    except DistError:  # the time limit passed: the wait's own loop has ended it
        pass


def get_pool_secret(out_dir: str | os.PathLike, say: Any = None) -> bytes:
    """The search's secret ([Note: signed messages]): ``$AUTOTUNE_POOL_SECRET`` where it is set, else
    the one in ``OUT/pool-secret`` (a resumed search's), else a new one written there (mode 0600)
    for the launcher to hand to the workers (``--secret-file``)."""
    if os.environ.get(SECRET_ENV):
        return load_secret()
    path = Path(out_dir) / SECRET_FILE
    if path.exists():
        return load_secret(path)
    secret, say = new_secret(), say or (lambda line: print(line, file=sys.stderr, flush=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as f:
        f.write(secret.hex() + "\n")
    say(f"the workers' secret is in {path}: pass it to every worker (--secret-file, or ${SECRET_ENV})")
    return secret


class NodePool:
    """``world_size`` ranks started by a launcher on every node and joined to this driver's store
    at ``address`` ([Note: node pool]); runs jobs as :class:`~autotune.trials.pool.RankPool` does."""

    remote = True

    def __init__(
        self,
        world_size: int,
        *,
        address: str,
        secret: bytes,
        backend: str = "gloo",
        join_timeout_s: float = 900.0,
        lost_after_s: float = 20.0,
        ranks_per_node: int | None = None,
        say: Any = None,
    ) -> None:
        host, port = parse_address(address)
        self.world_size, self.backend, self.address = world_size, backend, address
        self.join_timeout_s, self.lost_after_s = join_timeout_s, lost_after_s
        self.ranks_per_node = ranks_per_node
        """Each node's ranks as the search's cluster profile has them (None: not checked)."""
        self._say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self._secret = secret
        self._store = listen_store(host, port, timeout_s=30)
        self._keys = PrefixStore("nodepool/", self._store)
        # The doorbells' own client: a blocking wait holds its client until it returns.
        self._bell_keys, self._bells = PrefixStore("nodepool/", TCPStore(host, self._store.port, is_master=False)), None
        self.generation = 0
        """The world the next job runs on (0: none joined yet)."""
        self.placement: list[dict[str, Any]] = []
        """Each rank's host, node, local rank and pid in the current world."""
        self.num_starts = 0
        self._live = False
        self._next_job = 0
        self._jobs: Any = None
        self._scanned = 0  # tickets read so far
        self._floor = 0  # tickets up to here belong to earlier worlds' workers
        self._newest: dict[int, tuple[int, dict[str, Any]]] = {}  # per rank, its newest worker's ticket
        self._beats: dict[int, tuple[int, float]] = {}

    def __enter__(self) -> NodePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return [p["pid"] for p in self.placement]

    @property
    def nodes(self) -> list[str]:
        """The current world's nodes, in rank order of their first rank: ``host`` (``node N``)."""
        seen: dict[int, str] = {}
        for p in self.placement:
            seen.setdefault(p["node"], f"{p['host']} (node {p['node']})")
        return list(seen.values())

    def run(self, target: str, kwargs: dict[str, Any] | None = None, *, timeout_s: float = 120.0) -> RankRun:
        """Run ``target`` on every rank of the current world (waiting for one to form first); a job a
        rank did not run, its connection to this store dropped, runs again ([Note: node pool], "Hiccups")."""
        for attempt in range(_RERUNS + 1):
            start = time.monotonic()
            if not self._live:
                self._join()
            n, prefix = self._next_job, f"gen/{self.generation}/"
            self._next_job += 1
            job = {"target": target, "kwargs": kwargs or {}}
            self._jobs.set(f"job/{n}", seal(self._secret, f"{prefix}job/{n}", job))
            failure = self._wait(n, prefix, start + timeout_s)
            if failure is None:
                try:
                    results = self._open_results(prefix, n)
                except WireError as e:
                    failure = {"refused": str(e)}
            if failure is None:
                return RankRun(
                    status="ok",
                    results=results,
                    returncodes=[None] * self.world_size,
                    wall_s=time.monotonic() - start,
                    pids=self.pids,
                    placement=self.placement,
                )
            self._abort(prefix)
            if "dropped" not in failure or attempt == _RERUNS:
                return self._failed_run(failure, prefix, timeout_s, time.monotonic() - start)
            self._say(
                f"world {self.generation}: {self._describe_dropped(failure)}; the job runs again on the next world"
            )

    def close(self) -> None:
        """Tell the current world's ranks to exit (torchrun then ends, its workers done)."""
        if self._live:
            self._jobs.set(f"job/{self._next_job}", b"exit")
            self._live = False

    # -- internals ------------------------------------------------------------------

    def _join(self) -> None:
        """Admit the newest worker of every rank into the next world and wait for it to form; a
        world that does not form within :data:`_FORM_S` is aborted and the next one admitted."""
        deadline = time.monotonic() + self.join_timeout_s
        self._say(f"waiting for {self.world_size} ranks at {self.address}: start the workers on every node")
        admitted: dict[int, int] | None = None
        while True:
            self._scan_tickets()
            now = time.monotonic()
            if admitted is None and sorted(self._newest) == list(range(self.world_size)):
                self.generation += 1
                admitted, admitted_at = {r: t for r, (t, _) in self._newest.items()}, now
                for ticket in admitted.values():
                    self._set(f"admitted/{ticket}", self.generation)
                self._newest = {}
            if admitted is not None:
                prefix = f"gen/{self.generation}/"
                if self._keys.check([f"{prefix}rank/{r}" for r in range(self.world_size)]):  # all of them
                    break
                if now - admitted_at > _FORM_S:  # a worker died before forming it: the next world
                    self._abort_world(prefix)
                    self._floor, admitted = max(admitted.values()), None
            if now > deadline:
                raise NodePoolError(
                    f"no world of {self.world_size} ranks formed at {self.address} within {self.join_timeout_s:.0f} s "
                    f"({len(self._newest)} rank(s) waiting, {self.generation} world(s) admitted so far); check that torchrun "
                    f"runs `-m autotune.trials.worker --pool {self.address}` on every node with --nnodes x "
                    f"--nproc-per-node = {self.world_size}, and that its --max-restarts are not spent"
                )
            time.sleep(_JOIN_POLL_S)
        self._start_world(prefix, max(admitted.values()))

    def _scan_tickets(self) -> None:
        """Read the tickets workers took since the last scan; keep the newest per rank above the floor."""
        count = self._keys.add("tickets", 0)
        while self._scanned < count and self._keys.check([f"ticket/{self._scanned + 1}"]):
            self._scanned += 1
            try:
                info = self._open(f"ticket/{self._scanned}", f"the worker that took ticket {self._scanned}")
            except WireError as e:  # not one of this search's workers: passed over, said
                self._say(str(e))
                continue
            if info["world_size"] != self.world_size:
                raise NodePoolError(
                    f"a worker on {info['host']} is in a world of {info['world_size']} ranks (torchrun's --nnodes x "
                    f"--nproc-per-node), the search runs {self.world_size} (--nproc)"
                )
            if info.get("backend", self.backend) != self.backend:
                raise NodePoolError(
                    f"the worker on {info['host']} runs {info['backend']}, this search's trials {self.backend}: run the "
                    "search on one of the nodes (it takes the backend from the devices it sees)"
                )
            per_node = info.get("local_world_size", self.ranks_per_node)
            if self.ranks_per_node is not None and per_node != self.ranks_per_node:
                raise NodePoolError(
                    f"the workers on {info['host']} run {per_node} ranks to a node (torchrun's --nproc-per-node), the "
                    f"search's --cluster profile {self.ranks_per_node} (ranks_per_node): its meshes would be named, "
                    f"and its links emulated, by nodes the world does not have; pass a --cluster whose "
                    f"ranks_per_node is {per_node}"
                )
            if self._scanned <= self._floor:
                continue
            older = self._newest.get(info["rank"])
            if older is not None:  # that worker was replaced: it may go
                self._set(f"admitted/{older[0]}", 0)
            self._newest[info["rank"]] = (self._scanned, info)

    def _start_world(self, prefix: str, last_ticket: int) -> None:
        self._floor, self._next_job, self._live = last_ticket, 0, True
        # the ranks' job loop reads a store nested in the generation's prefix (a PrefixStore joins with "/")
        self._jobs = PrefixStore(prefix, self._keys)
        self._bells = PrefixStore(prefix, self._bell_keys)
        self.placement = [
            self._open(f"{prefix}rank/{r}", f"rank {r} of world {self.generation}") for r in range(self.world_size)
        ]
        for r in range(self.world_size):  # every beat counter there for one multi_get, the first beat or not
            self._keys.add(f"{prefix}beat/{r}", 0)
        self._beats = {r: (0, time.monotonic()) for r in range(self.world_size)}
        self.num_starts += 1
        self._say(
            f"world {self.generation}: {self.world_size} ranks on {len(self.nodes)} node(s): {', '.join(self.nodes)}"
        )

    def _wait(self, n: int, prefix: str, deadline: float) -> dict[str, Any] | None:
        """None once every result of job ``n`` is in; else what ended the wait (a dropped
        connection, a report, a new worker, a lost rank, the clock). Waits for the job's doorbell,
        and checks tickets and heartbeats once per :data:`_CHECK_S` ([Note: node pool], "Polling")."""
        keys, bell = [f"result/{n}/{r}" for r in range(self.world_size)], threading.Event()
        threading.Thread(target=_listen, args=(self._bells, f"wake/{n}", deadline, bell), daemon=True).start()
        rung = False
        try:
            while True:
                period = min(_CHECK_S, max(deadline - time.monotonic(), 0.01))
                if rung:  # rung before every result was in (a count made twice across a reconnect)
                    time.sleep(period)
                else:
                    rung = bell.wait(period)
                if rung and self._jobs.check(keys):
                    return None
                failure = self._read_reports(prefix) if rung else None
                if failure is not None:
                    return failure
                self._scan_tickets()
                if self._newest:  # torchrun started a new worker for a rank of this world: its old one is gone
                    return {"replaced": sorted(self._newest)}
                lost = self._find_lost(prefix)
                if lost:
                    return {"lost": lost}
                if time.monotonic() > deadline:
                    return {"timed_out": True}
        finally:
            if not bell.is_set():  # the listener let go
                self._jobs.add(f"wake/{n}", 1)

    def _read_reports(self, prefix: str) -> dict[str, Any] | None:
        """What the ranks told once the doorbell rang: that they will not run the job (their
        connection dropped: it runs again), or why it failed (the cause's report may follow)."""
        try:
            dropped = {r: self._open(f"{prefix}dropped/{r}", f"rank {r}") for r in self._find_keys(prefix, "dropped")}
        except WireError as e:
            return {"refused": str(e)}
        if dropped:
            return {"dropped": dropped}
        if not self._find_keys(prefix, "failed"):
            return None
        time.sleep(_REPORT_GRACE_S)  # the cause's own report, or its new worker's ticket, may follow
        self._scan_tickets()
        return {"reported": self._find_keys(prefix, "failed"), "replaced": sorted(self._newest)}

    def _find_keys(self, prefix: str, name: str) -> list[int]:
        """The ranks whose ``{prefix}{name}/{rank}`` is set (one request each: only once the doorbell rang)."""
        return [r for r in range(self.world_size) if self._keys.check([f"{prefix}{name}/{r}"])]

    def _find_lost(self, prefix: str) -> list[int]:
        """Ranks whose heartbeat has not counted up for ``lost_after_s`` (every count in one request)."""
        now, lost = time.monotonic(), []
        counts = self._keys.multi_get([f"{prefix}beat/{r}" for r in range(self.world_size)])
        for rank, latest in enumerate(int(count) for count in counts):
            count, since = self._beats[rank]
            if latest != count:
                self._beats[rank] = (latest, now)
            elif now - since > self.lost_after_s:
                lost.append(rank)
        return lost

    def _set(self, key: str, value: Any) -> None:
        """``value`` signed under ``key`` ([Note: signed messages])."""
        self._keys.set(key, seal(self._secret, f"nodepool/{key}", value))

    def _open(self, key: str, sender: str) -> Any:
        """The signed value of ``key`` ([Note: signed messages]); :class:`WireError` where refused."""
        return open_sealed(self._secret, f"nodepool/{key}", self._keys.get(key), sender=sender)

    def _open_results(self, prefix: str, n: int) -> list[Any]:
        """Every rank's result of job ``n``, set under the world's jobs (their scope: ``prefix``), in one request."""
        data = self._jobs.multi_get([f"result/{n}/{r}" for r in range(self.world_size)])
        key, sender = f"{prefix}result/{n}/", lambda r: f"rank {r} on {self._host(r)}"
        return [open_sealed(self._secret, f"{key}{r}", d, sender=sender(r)) for r, d in enumerate(data)]

    def _host(self, rank: int) -> str:
        return self.placement[rank]["host"] if rank < len(self.placement) else "an unknown host"

    def _abort(self, prefix: str) -> None:
        self._abort_world(prefix)
        self._live = False

    def _abort_world(self, prefix: str) -> None:
        """End the world under ``prefix`` on every node: each rank's next heartbeat finds its count
        past :data:`~autotune.trials.worker.ABORT_BEATS` and exits (one request per rank, once)."""
        for r in range(self.world_size):
            self._keys.add(f"{prefix}beat/{r}", ABORT_BEATS)

    def _describe_dropped(self, failure: dict[str, Any]) -> str:
        ranks = sorted(failure["dropped"].items())
        where = ", ".join(f"rank {r} on {self._host(r)} ({info['down_s']:.1f} s)" for r, info in ranks)
        return f"the connection of {where} to the driver dropped and was made again, which their process group's cannot"

    def _describe_silent(self, failure: dict[str, Any], reported: list[int], peers_only: bool) -> str:
        """Why a job failed where the rank that caused it said nothing. A restarted worker cannot
        name the rank it replaces (torchrun may renumber the ranks of a new world); a peer's
        lost connection, or a silent heartbeat, can."""
        if failure.get("lost"):
            where = ", ".join(f"rank {r} on {self.placement[r]['host']}" for r in failure["lost"])
            return f"{where} stopped answering for {self.lost_after_s:.0f} s (killed, out of host memory, or its node lost)"
        if peers_only:
            silent = [r for r in range(self.world_size) if r not in reported]
            where = ", ".join(f"rank {r} on {self.placement[r]['host']}" for r in silent)
            return f"{where} died without a word, its peers' connections to it lost (killed, out of host memory, or its node lost)"
        return "a rank died without a word and torchrun restarted the workers (killed, or out of host memory)"

    def _failed_run(self, failure: dict[str, Any], prefix: str, timeout_s: float, wall_s: float) -> RankRun:
        codes: list[int | None] = [None] * self.world_size
        tails = [""] * self.world_size
        for rank in failure.get("reported", []):
            try:
                report = self._open(f"{prefix}failed/{rank}", f"rank {rank} on {self._host(rank)}")
            except WireError as e:
                report = {"code": 1, "tail": str(e)}
            codes[rank], tails[rank] = report["code"], report["tail"]
        reported = failure.get("reported", [])
        peers_only = bool(reported) and all(is_peer_loss(tails[r]) for r in reported)  # the cause said nothing
        if failure.get("lost") or (failure.get("replaced") and not reported) or peers_only:
            status, reason = "crash", self._describe_silent(failure, reported, peers_only)
        else:
            status, reason = classify_failure(
                codes, tails, timed_out=bool(failure.get("timed_out")), timeout_s=timeout_s, exit_order=reported
            )
        if failure.get("refused"):
            status, reason = "crash", failure["refused"]
        if failure.get("dropped"):
            status, reason = "crash", f"{self._describe_dropped(failure)}, in {_RERUNS + 1} worlds in a row"
        if failure.get("timed_out"):
            reason = f"no result after {timeout_s:.0f}s (deadlock or too slow); the world was aborted on every node"
        return RankRun(
            status=status,
            reason=reason,
            returncodes=codes,
            stderr_tails=tails,
            wall_s=wall_s,
            pids=self.pids,
            placement=self.placement,
        )
