"""What a rank pool is to the code that runs jobs on one: the members both pools have.

A search, a trial, a numerics check and a consolidation timing take a pool and use it through
:class:`Pool` alone; :class:`~autotune.trials.pool.RankPool` (ranks spawned on this host) and
:class:`~autotune.trials.nodes.NodePool` (ranks torchrun starts on every node) are its two
kinds, one design with two ways of starting ranks ([Note: node pool] in
:mod:`autotune.trials.nodes`). Neither derives from it: a class is a pool by having its members
(``isinstance(x, Pool)`` checks that they are there, not their types), so a test's stand-in is
one too.

What differs between the two, and shows here, is ``remote``: a node pool's ranks may run on other
hosts and share no filesystem with the driver, so what a rank writes for the driver travels in
its result ([Note: node-local files] in :mod:`autotune.trials.gather`); what the pool does after a
failure (kills the ranks and starts fresh ones, or aborts the world for torchrun to start it
again) shows only as ``num_starts`` going up by one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from typing import Self

    from autotune.trials.launch import RankRun

__all__ = ["Pool"]


@runtime_checkable
class Pool(Protocol):
    """``world_size`` long-lived ranks that run jobs ``fn(rank, world_size, **kwargs)`` one after another."""

    world_size: int
    backend: str
    """The process group's backend: ``gloo`` or ``nccl``."""
    remote: bool
    """Whether the ranks may run on other hosts, sharing no filesystem with this process."""
    num_starts: int
    """How many times ranks were started or a world formed (1 + one after each failure)."""

    @property
    def pids(self) -> list[int]:
        """Process ids of the current ranks (empty when none runs); on a remote pool, on their own hosts."""
        ...

    def run(self, target: str, kwargs: dict[str, Any] | None = None, *, timeout_s: float = 120.0) -> RankRun:
        """Run ``target`` (``"module:function"``) as ``fn(rank, world_size, **kwargs)`` on every rank,
        starting ranks (or waiting for a world to form) first where none runs; ``timeout_s``: the
        job's limit, the start counted in it. What a rank did is a
        :class:`~autotune.trials.launch.RankRun` (status ``ok``, ``timeout``, ``crash``, ``oom`` or
        ``invalid_config``), never raised; only ranks that cannot start at all raise."""
        ...

    def close(self) -> None:
        """End the ranks; a later :meth:`run` starts (or waits for) new ones."""
        ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...
