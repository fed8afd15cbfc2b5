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
- *one transfer at a time per group*: a collective on a group starts when the previous
  one on that group is modelled to end (a link carries one collective at a time, as the
  process group executes them in order); its end is ``max(issue, previous end) + modelled``.
- *hold without a core*: an async collective (FSDP2's unshard with ``async_op=True``)
  returns a :class:`_HeldWork` whose ``wait()`` first waits for the real work and then
  sleeps until the modelled end; a synchronous one sleeps right after it returns.
  ``time.sleep`` releases the GIL and occupies no core, like a NIC that is busy while
  the host computes. If the real collective took longer than the model, nothing is added:
  the emulated time is ``max(real, modelled)``. In traces the hold is a
  ``linkemu::hold_<kind>`` span on the thread that waits (inside ``FSDP::all_gather_copy_out``
  for an async all-gather): communication time the gloo spans alone do not show.

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
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.distributed as dist
from torch.profiler import record_function

from profiles import ClusterProfile, LinkClass

# torch.distributed function name -> (collective kind, name of the argument holding the full buffer)
_HOOKED = {
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "all_reduce": ("all_reduce", "tensor"),
}


@dataclass(kw_only=True)
class KindStats:
    """What the emulator did for one collective kind on one rank."""

    count: int = 0
    num_bytes: int = 0
    modeled_s: float = 0.0
    """Sum of the link model's seconds (latency + bytes / bandwidth)."""
    held_s: float = 0.0
    """Seconds actually slept beyond the real collective's completion."""
    count_by_link: dict[str, int] = field(default_factory=dict)
    """How many of them ran on each link class (``intra_node``, ``inter_node``)."""


def get_link_name(group_ranks: list[int], ranks_per_node: int) -> str:
    """``intra_node`` when all ranks of a group share a node, else ``inter_node``."""
    nodes = {r // ranks_per_node for r in group_ranks}
    return "intra_node" if len(nodes) <= 1 else "inter_node"


@dataclass
class _GroupClock:
    busy_until: float = 0.0


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
    stats: dict[str, KindStats] = field(default_factory=dict)
    _originals: dict[str, Callable[..., Any]] = field(default_factory=dict, init=False, repr=False)
    _clocks: dict[int, _GroupClock] = field(default_factory=dict, init=False, repr=False)
    _link_of_group: dict[int, tuple[str, LinkClass | None]] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _local: threading.local = field(default_factory=threading.local, init=False, repr=False)

    @classmethod
    def from_cluster(cls, cluster: ClusterProfile) -> "LinkEmulator | None":
        """An emulator for the cluster's links, or ``None`` when no link is emulated."""
        if not any(link.emulated for link in cluster.links.values()):
            return None
        return cls(links=dict(cluster.links), ranks_per_node=cluster.ranks_per_node)

    # -- installation ---------------------------------------------------------------

    def __enter__(self) -> "LinkEmulator":
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

    def uninstall(self) -> None:
        for name, original in self._originals.items():
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
            buffer, group = call.get(arg_name), call.get("group")
            link_name, link = self._get_link(group)
            if buffer is None or link is None:
                return original(*args, **kwargs)
            issued = time.monotonic()
            self._local.active = True
            try:
                work = original(*args, **kwargs)
            finally:
                self._local.active = False
            num_bytes = buffer.numel() * buffer.element_size()
            release = self._schedule(kind, group, link_name, link, num_bytes, issued)
            if call.get("async_op", False) and isinstance(work, dist.Work):
                return _HeldWork(work, release)
            release()
            return work

        hooked.__wrapped__ = original  # type: ignore[attr-defined]
        return hooked

    def _get_link(self, group: Any) -> tuple[str, LinkClass | None]:
        """The group's link class name, and its model (None when that class is not emulated)."""
        group = group if group is not None else dist.group.WORLD
        key = id(group)
        if key not in self._link_of_group:
            name = get_link_name(dist.get_process_group_ranks(group), self.ranks_per_node)
            link = self.links.get(name)
            self._link_of_group[key] = (name, link if link is not None and link.emulated else None)
        return self._link_of_group[key]

    def _schedule(self, kind: str, group: Any, link_name: str, link: LinkClass, num_bytes: int, issued: float) -> Callable[[], None]:
        modeled = link.get_seconds(num_bytes)
        with self._lock:
            clock = self._clocks.setdefault(id(group if group is not None else dist.group.WORLD), _GroupClock())
            end = max(issued, clock.busy_until) + modeled
            clock.busy_until = end
            stats = self.stats.setdefault(kind, KindStats())
            stats.count += 1
            stats.num_bytes += num_bytes
            stats.modeled_s += modeled
            stats.count_by_link[link_name] = stats.count_by_link.get(link_name, 0) + 1

        def release() -> None:
            remaining = end - time.monotonic()
            if remaining > 0:
                with record_function(f"linkemu::hold_{kind}"):
                    time.sleep(remaining)
                with self._lock:
                    stats.held_s += remaining

        return release
