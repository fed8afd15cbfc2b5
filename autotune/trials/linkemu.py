"""Link emulation: hold each collective's completion to the speed of a modelled link.

[Note: link emulation]
On a CPU box, loopback gloo competes with compute for the same cores, so overlap knobs
mostly hurt there; on a real cluster the links *wait* rather than compute (DESIGN.md,
"Link emulation"). While a :class:`LinkEmulator` is installed, every collective FSDP2
issues still moves its real data through the real process group (numerics are bitwise
unchanged: the emulator never touches a tensor), but its completion is held until the
time the link model says the transfer would end:

    modelled seconds = latency + bytes / bandwidth      (profiles.LinkClass.get_seconds)

- *bytes* is the collective's full buffer, as nccl-tests define algorithm bandwidth
  (the unit of the cluster profiles' ``bandwidth_gbps``): the all-gather output, the
  reduce-scatter input, the all-reduce tensor.
- *link class*: ``intra_node`` when every rank of the collective's group lies on one node
  (``rank // ranks_per_node`` equal), ``inter_node`` otherwise. So under HSDP with
  ``ranks_per_node = 2`` at world 4, the shard groups {0,1}, {2,3} are intra-node and the
  replicate groups {0,2}, {1,3} cross nodes.
- *the transfer starts when the last rank has issued it*: as on a real link, where a ring
  or tree collective cannot move data before every rank of the group has joined, and then
  all ranks leave it together. Each rank posts the time it issues each collective to an
  :class:`ArrivalBoard` (shared memory in the launch's temp dir, one small file per process
  group, slots indexed by the collective's sequence number on that group); once the real
  gloo work has completed, every rank of the group has issued it, so the board holds every
  issue time. Holding each rank to its *own* issue time + modelled instead lets a rank that
  arrived early leave early and compute while its peers still sleep, with the cores less
  contended, which a real cluster never does (docs/benchmarks.md, "Simulator accuracy", has
  what that did to ``sim_accuracy``'s 4-rank rows). Where no board is shared (ranks on other
  hosts under torchrun, or a board slot not written), the ranks this process can see stand
  in: at worst its own issue time.
- *one transfer at a time per group*: a collective on a group starts when the previous
  one on that group is modelled to end (a link carries one collective at a time, as the
  process group executes them in order); its end is
  ``max(last rank's issue, previous end) + modelled``.
- *hold without a core*: an async collective (FSDP2's unshard with ``async_op=True``)
  returns a :class:`_HeldWork` whose ``wait()`` first waits for the real work and then
  sleeps until the modelled end; a synchronous one sleeps right after it returns.
  ``time.sleep`` releases the GIL and occupies no core, like a NIC that is busy while
  the host computes. If the real collective took longer than the model, nothing is added:
  the emulated time is ``max(real, start + modelled)``. In traces the hold is a
  ``linkemu::hold_<kind>`` span on the thread that waits (inside ``FSDP::all_gather_copy_out``
  for an async all-gather): communication time the gloo spans alone do not show.

Pipeline stages' activations and gradients (``torch.distributed.pipelining``) are P2P
sends: each direction ``src -> dst`` is a link of its own (``intra_node`` or ``inter_node``
by the same rule), *bytes* the tensor, and both the send and the matching receive end at
``max(send issued, receive issued, previous transfer's end) + modelled`` (the board slots
are ``p2p.<src>.<dst>``, numbered per direction: sends between two ranks arrive in order).
The schedules issue them through their module's ``_batch_p2p`` (a private function, hooked
where this torch has it: with ``dist.isend`` replaced instead, ``P2POp`` would refuse the
hook as an unknown op); without it, P2P is not emulated and ``summary()`` has no ``p2p``.

The hooks replace the ``torch.distributed`` functions FSDP2 calls by attribute lookup
at call time (``all_gather_single``, ``reduce_scatter_single``, ``all_reduce`` and their
``*_into_tensor``/``*_tensor`` aliases); a thread-local guard keeps an alias that calls
another from being counted twice. Install only around the training steps (the trial's
barriers and its pruning vote are not training traffic) and always uninstall: ranks in a
:class:`~autotune.pool.RankPool` outlive a trial.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.profiler import record_function

from autotune.trials.arrivals import BOARD_ENV, ArrivalBoard
from profiles import ClusterProfile, LinkClass

__all__ = [
    "BOARD_ENV",
    "ArrivalBoard",
    "KindStats",
    "LinkEmulationError",
    "LinkEmulator",
    "check_emulation_backend",
    "get_emulated_cluster",
    "get_link_name",
]


class LinkEmulationError(ValueError):
    """Link emulation asked for over real links (NCCL)."""


def get_emulated_cluster(cluster: str | None, backend: str) -> str | None:
    """The cluster profile whose links a search's trials emulate: ``cluster`` over gloo, never over
    NCCL, where ``--cluster`` only describes the topology (ranks per node, which mesh groups stay in a
    node) and prices the simulator: sleeping after each real NCCL call returns would measure sleeps."""
    return cluster if cluster is not None and backend == "gloo" else None


def check_emulation_backend(cluster: str | None, backend: str) -> None:
    """Refuse, in one line, a trial asked to emulate ``cluster``'s links over ``backend`` other than gloo."""
    if cluster is not None and backend != "gloo":
        raise LinkEmulationError(
            f"link emulation ({cluster}) is a CPU tool for gloo ranks; over {backend} the links are real: "
            "drop --cluster from the trial (a search passes it as the topology only)"
        )


# torch.distributed function name -> (collective kind, name of the argument holding the full buffer)
_HOOKED = {
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "all_reduce": ("all_reduce", "tensor"),
}


_P2P_HOOK = "pipelining._batch_p2p"


def _get_pipelining_schedules() -> Any:
    """torch's pipelining schedules module where it has the ``_batch_p2p`` the P2P hook wraps, else None."""
    try:
        from torch.distributed.pipelining import schedules
    except ImportError:
        return None
    return schedules if callable(getattr(schedules, "_batch_p2p", None)) else None


@dataclass(kw_only=True)
class KindStats:
    """What the emulator did for one collective kind on one rank."""

    count: int = 0
    num_bytes: int = 0
    modeled_s: float = 0.0
    """Sum of the link model's seconds (latency + bytes / bandwidth)."""
    held_s: float = 0.0
    """Seconds actually slept beyond the real collective's completion."""
    late_peer_s: float = 0.0
    """Sum over collectives of how long after this rank the last rank of the group issued it
    (what the transfer's start waited for; 0 without an arrival board)."""
    count_by_link: dict[str, int] = field(default_factory=dict)
    """How many of them ran on each link class (``intra_node``, ``inter_node``)."""


def get_link_name(group_ranks: list[int], ranks_per_node: int) -> str:
    """``intra_node`` when all ranks of a group share a node, else ``inter_node``."""
    nodes = {r // ranks_per_node for r in group_ranks}
    return "intra_node" if len(nodes) <= 1 else "inter_node"


_SEQUENCES: dict[str, int] = {}
"""Per process group name: how many hooked collectives this process has issued on it. One
count per process, not per emulator: a trial's two sides (candidate, reference) may share a
group, and every rank must number a group's collectives alike."""
_SEQUENCES_LOCK = threading.Lock()


@dataclass(eq=False)
class _Transfer:
    """One collective on one group's link; ``end`` is known once its predecessor's is."""

    seq: int
    issued: float
    modeled: float
    previous: _Transfer | None
    end: float | None = None
    late_s: float = 0.0


@dataclass(frozen=True)
class _GroupLink:
    name: str
    size: int
    rank: int
    link_name: str
    link: LinkClass | None


class _HeldWork(dist.Work):
    """A real collective's work handle whose ``wait()`` also waits for the modelled end."""

    def __init__(self, inner: dist.Work, release: Callable[[], None]) -> None:
        super().__init__()
        self._inner = inner
        self._release = release

    def wait(self, timeout: Any = None) -> bool:
        done = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        self._release()
        return done

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def get_future(self) -> Any:
        return self._inner.get_future()

    def result(self) -> Any:
        return self._inner.result()


@dataclass(kw_only=True)
class LinkEmulator:
    """Holds collectives to a cluster profile's link model; see [Note: link emulation].

    Use as a context manager around the training steps; ``stats`` accumulates over every
    installation of this emulator (per collective kind).
    """

    links: dict[str, LinkClass]
    ranks_per_node: int
    board: ArrivalBoard | None = None
    """Where the ranks post their issue times; None: each rank's own issue time starts a transfer."""
    stats: dict[str, KindStats] = field(default_factory=dict)
    _originals: dict[str, Callable[..., Any]] = field(default_factory=dict, init=False, repr=False)
    _last: dict[str, _Transfer] = field(default_factory=dict, init=False, repr=False)
    _groups: dict[Any, _GroupLink] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _local: threading.local = field(default_factory=threading.local, init=False, repr=False)

    @classmethod
    def from_cluster(cls, cluster: ClusterProfile) -> LinkEmulator | None:
        """An emulator for the cluster's links (sharing the launch's arrival board, when the
        rank entry point named one), or ``None`` when no link is emulated."""
        if not any(link.emulated for link in cluster.links.values()):
            return None
        root = os.environ.get(BOARD_ENV)
        board = ArrivalBoard(root) if root and Path(root).is_dir() else None
        return cls(links=dict(cluster.links), ranks_per_node=cluster.ranks_per_node, board=board)

    # -- installation ---------------------------------------------------------------

    def __enter__(self) -> LinkEmulator:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def install(self) -> None:
        if self._originals:
            return
        for name, (kind, arg_name) in _HOOKED.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(original, kind, arg_name))
        schedules = _get_pipelining_schedules()
        if schedules is not None:
            self._originals[_P2P_HOOK] = schedules._batch_p2p
            schedules._batch_p2p = self._wrap_p2p(schedules._batch_p2p)

    def uninstall(self) -> None:
        schedules = _get_pipelining_schedules()
        for name, original in self._originals.items():
            if name == _P2P_HOOK:
                schedules._batch_p2p = original
            else:
                setattr(dist, name, original)
        self._originals.clear()

    def summary(self) -> dict[str, dict[str, Any]]:
        """JSON-able per-kind totals (count, bytes, modelled and held seconds, count per link class)."""
        return {kind: dataclasses.asdict(s) for kind, s in sorted(self.stats.items())}

    # -- the hook -------------------------------------------------------------------

    def _wrap(self, original: Callable[..., Any], kind: str, arg_name: str) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def hooked(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "active", False):
                return original(*args, **kwargs)  # an alias calling another: count once
            call = signature.bind(*args, **kwargs).arguments
            buffer, group = call.get(arg_name), self._get_group(call.get("group"))
            if buffer is None or group.link is None:
                return original(*args, **kwargs)
            num_bytes = buffer.numel() * buffer.element_size()
            transfer = self._begin(kind, group, num_bytes)  # posted before the real issue
            self._local.active = True
            try:
                work = original(*args, **kwargs)
            finally:
                self._local.active = False
            release = self._get_release(kind, group, transfer)
            if call.get("async_op", False) and isinstance(work, dist.Work):
                return _HeldWork(work, release)
            release()
            return work

        hooked.__wrapped__ = original  # type: ignore[attr-defined]
        return hooked

    def _wrap_p2p(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``_batch_p2p(ops, desc)`` whose works end at the modelled end of each op's transfer."""

        def hooked(p2p_ops: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
            me = dist.get_rank()
            transfers = []
            for op in p2p_ops:
                sending = op.op is dist.isend
                src, dst = (me, op.peer) if sending else (op.peer, me)
                link = self._get_direction(src, dst, me)
                num_bytes = op.tensor.numel() * op.tensor.element_size()
                transfers.append((link, self._begin("p2p", link, num_bytes)) if link.link is not None else None)
            works = original(p2p_ops, *args, **kwargs)
            releases = [self._get_release("p2p", *t) if t is not None else None for t in transfers]
            if all(r is None for r in releases):
                return works
            if len(works) == len(p2p_ops):  # one work per op (gloo, and homogeneous batches)
                return [w if r is None else _HeldWork(w, r) for w, r in zip(works, releases, strict=True)]
            held = [r for r in releases if r is not None]  # coalesced (NCCL): each work waits for all
            return [_HeldWork(w, lambda: [r() for r in held]) for w in works]

        return hooked

    def _get_direction(self, src: int, dst: int, me: int) -> _GroupLink:
        key = ("p2p", src, dst)
        if key not in self._groups:
            link_name = get_link_name([src, dst], self.ranks_per_node)
            link = self.links.get(link_name)
            self._groups[key] = _GroupLink(
                name=f"p2p.{src}.{dst}",
                size=2,
                rank=0 if me == src else 1,
                link_name=link_name,
                link=link if link is not None and link.emulated else None,
            )
        return self._groups[key]

    def _get_group(self, group: Any) -> _GroupLink:
        """The group's name, size, this rank's place in it, its link class and model (None when not emulated)."""
        group = group if group is not None else dist.group.WORLD
        key = id(group)
        if key not in self._groups:
            ranks = dist.get_process_group_ranks(group)
            link_name = get_link_name(ranks, self.ranks_per_node)
            link = self.links.get(link_name)
            self._groups[key] = _GroupLink(
                name=group.group_name,
                size=len(ranks),
                rank=dist.get_rank(group),
                link_name=link_name,
                link=link if link is not None and link.emulated else None,
            )
        return self._groups[key]

    def _begin(self, kind: str, group: _GroupLink, num_bytes: int) -> _Transfer:
        assert group.link is not None
        modeled = group.link.get_seconds(num_bytes)
        with _SEQUENCES_LOCK:
            seq = _SEQUENCES.get(group.name, 0)
            _SEQUENCES[group.name] = seq + 1
        issued = time.monotonic()
        if self.board is not None:
            self.board.post(group.name, group.size, group.rank, seq, issued)
        with self._lock:
            transfer = _Transfer(seq=seq, issued=issued, modeled=modeled, previous=self._last.get(group.name))
            self._last[group.name] = transfer
            stats = self.stats.setdefault(kind, KindStats())
            stats.count += 1
            stats.num_bytes += num_bytes
            stats.modeled_s += modeled
            stats.count_by_link[group.link_name] = stats.count_by_link.get(group.link_name, 0) + 1
        return transfer

    def _get_end(self, group: _GroupLink, transfer: _Transfer) -> float:
        """``max(last rank's issue, previous end) + modelled``, for this transfer and any
        predecessor not yet computed. Called once the real collective has completed: every
        rank of the group then has issued it, and so every earlier one too."""
        pending = []
        while transfer is not None and transfer.end is None:
            pending.append(transfer)
            transfer = transfer.previous
        end = transfer.end if transfer is not None else 0.0
        for t in reversed(pending):
            arrival = self.board.get_last_arrival(group.name, group.size, t.seq) if self.board is not None else None
            start = t.issued if arrival is None else max(t.issued, arrival)
            t.late_s = start - t.issued
            t.end = end = max(start, end) + t.modeled
            t.previous = None  # the chain is only walked back to the last known end
        return end

    def _get_release(self, kind: str, group: _GroupLink, transfer: _Transfer) -> Callable[[], None]:
        def release() -> None:
            with self._lock:
                end = self._get_end(group, transfer)
                stats = self.stats[kind]
                stats.late_peer_s += transfer.late_s
            remaining = end - time.monotonic()
            if remaining > 0:
                with record_function(f"linkemu::hold_{kind}"):
                    time.sleep(remaining)
                with self._lock:
                    stats.held_s += remaining

        return release
