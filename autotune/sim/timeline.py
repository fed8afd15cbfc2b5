"""The simulator's clock: streams, links and the host thread, plus a per-rank memory ledger.

Ops are issued in program order, as the host thread issues them. An op starts when its
stream is free, its dependencies (events it waits on) have ended, its link is free (one
collective at a time per link: concurrent collectives on one link share its bandwidth,
which FIFO order approximates), and the host has issued it. On a GPU the host runs ahead
and never waits (``host_blocks = False``), but a block's kernels cannot run before the host
launched them: an op with a host launch path ends no earlier than that path; on a CPU the "compute stream" *is* the host
thread, so every op on it, a synchronous collective included, holds the host until it ends.

Exposed communication: when a compute-stream op waits for a collective, the wait (the part
of the collective that compute could not hide) is charged to that collective's unit;
several collectives waited on at once are charged in the order they end. A collective run
*on* the compute stream (a blocking one, on CPU) is exposed whole.

An event is a tuple ``(end, unit, blocker)``: ``unit >= 0`` marks a collective of that unit
(``-1`` anything else) and ``blocker`` is the collective it queued behind on its stream or
link, if any: waiting for a queued collective is waiting for its queue too, and that part of
the wait is charged to the units ahead in the queue. This module is the simulator's inner loop: it is kept to plain tuples,
lists and floats on purpose.
"""

from __future__ import annotations

COMPUTE = "compute"
Event = tuple  # (end: float, unit: int, blocker: Event | None)
_NO_EVENT: Event = (0.0, -1, None)

MEMORY_CATEGORIES = (
    "unsharded_params",
    "all_gather_buffers",
    "post_forward_shards",
    "unsharded_grads",
    "accumulated_grads",
    "reduce_scatter_buffers",
    "partial_reduce_outputs",
    "sharded_grads",
)
(UNSHARDED, AG_BUFFERS, POST_FORWARD, GRADS, ACCUMULATED, RS_BUFFERS, PARTIAL, SHARDED_GRADS) = range(
    len(MEMORY_CATEGORIES)
)


class Timeline:
    __slots__ = ("streams", "links", "link_last", "host", "host_blocks", "exposed", "comm", "compute_busy")

    def __init__(self, num_units: int, *, host_blocks: bool = False) -> None:
        self.streams: dict[str, float] = {COMPUTE: 0.0}
        self.links: dict[str, float] = {}
        self.link_last: dict[str, Event] = {}
        """The last collective on each stream and link."""
        self.host = 0.0
        self.host_blocks = host_blocks
        self.exposed = [0.0] * num_units
        self.comm = [0.0] * num_units
        self.compute_busy = 0.0

    def copy(self) -> Timeline:
        other = Timeline.__new__(Timeline)
        other.streams, other.links, other.host, other.host_blocks = (
            dict(self.streams),
            dict(self.links),
            self.host,
            self.host_blocks,
        )
        other.link_last = dict(self.link_last)
        other.exposed, other.comm, other.compute_busy = list(self.exposed), list(self.comm), self.compute_busy
        return other

    def compute(self, seconds: float, deps: tuple[Event, ...] = (), host: float = 0.0) -> None:
        """A compute-stream op after ``deps``, launched by ``host`` seconds of the host's time
        (GPU): it ends no earlier than its launch does, and the host goes on from there."""
        streams = self.streams
        issued = self.host
        start = streams[COMPUTE]
        if issued > start:
            start = issued
        if (
            deps and (deps[0][0] if len(deps) == 1 else max([dep[0] for dep in deps])) > start
        ):  # a wait: charge it (blockers end earlier)
            if len(deps) > 1 or deps[0][2] is not None:
                deps = _with_blockers(deps)
            exposed = self.exposed
            for end, unit, _ in deps:
                if end > start:
                    if unit >= 0:
                        exposed[unit] += end - start
                    start = end
        end = start + seconds
        if host:
            self.host = issued + host
            if self.host > end:  # host-bound: the device waits for the launches
                end = self.host
        streams[COMPUTE] = end
        self.compute_busy += seconds
        if self.host_blocks:
            self.host = end

    def collective(self, stream: str, seconds: float, link: str, unit: int, after: float = 0.0) -> Event:
        """A collective of ``unit`` on ``stream`` over ``link``, starting no earlier than ``after``."""
        streams, links = self.streams, self.links
        free = streams.get(stream, 0.0)
        ready = after if after > self.host else self.host
        start = max(free, ready, links.get(link, 0.0))
        end = start + seconds
        streams[stream] = links[link] = end
        last = self.link_last
        blocker = None
        if start > ready:  # queued behind the previous collective on its stream or link
            on_stream, on_link = last.get(stream, _NO_EVENT), last.get(link, _NO_EVENT)
            blocker = on_stream if on_stream[0] >= on_link[0] else on_link
        event = (end, unit, blocker)
        last[stream] = last[link] = event
        self.comm[unit] += seconds
        if stream == COMPUTE:  # blocking: compute waits for all of it, link contention included
            self.exposed[unit] += end - max(free, self.host)
            if self.host_blocks:
                self.host = end
        return event

    @property
    def end(self) -> float:
        return max(self.host, *self.streams.values())


def _with_blockers(deps: tuple[Event, ...]) -> list[Event]:
    """``deps`` and the collectives they queued behind, in the order they end."""
    found = {id(dep): dep for dep in deps}
    stack = list(deps)
    while stack:
        blocker = stack.pop()[2]
        if blocker is not None and id(blocker) not in found:
            found[id(blocker)] = blocker
            stack.append(blocker)
    return sorted(found.values(), key=lambda e: (e[0], e[1]))


class MemoryLedger:
    """Bytes live on one rank by category (``MEMORY_CATEGORIES``); ``checkpoint`` records the peak."""

    __slots__ = ("static", "live", "peak", "peak_live", "peak_activations", "phase", "phase_peaks")

    def __init__(self, static: float) -> None:
        self.static = static
        self.live = [0.0] * len(MEMORY_CATEGORIES)
        self.peak = 0.0
        self.peak_live: list[float] = []
        self.peak_activations = 0.0
        self.phase = "forward"
        """What runs now (``forward``, ``backward``, ``optimizer``): peaks are also kept per phase."""
        self.phase_peaks: dict[str, float] = {}

    def copy(self) -> MemoryLedger:
        other = MemoryLedger(self.static)
        other.live, other.peak, other.peak_live, other.peak_activations = (
            list(self.live),
            self.peak,
            self.peak_live,
            self.peak_activations,
        )
        other.phase, other.phase_peaks = self.phase, dict(self.phase_peaks)
        return other

    def checkpoint(self, activations: float) -> None:
        total = self.static + activations + sum(self.live)
        if total > self.phase_peaks.get(self.phase, 0.0):
            self.phase_peaks[self.phase] = total
        if total > self.peak:
            self.peak, self.peak_live, self.peak_activations = total, list(self.live), activations

    def get_peak_breakdown(self) -> dict[str, float]:
        breakdown = {name: value for name, value in zip(MEMORY_CATEGORIES, self.peak_live) if value > 0}
        return {"sharded_params_and_optimizer": self.static, "activations": self.peak_activations, **breakdown}
