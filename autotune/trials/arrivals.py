"""The arrival board: when each rank issued each collective, shared by the ranks of one host
(see [Note: link emulation] in :mod:`autotune.trials.linkemu`)."""

from __future__ import annotations

import mmap
import os
import re
from pathlib import Path

import numpy as np

BOARD_ENV = "AUTOTUNE_LINKEMU_BOARD"
"""Directory of the :class:`ArrivalBoard` the ranks of one launch share (set by the rank entry point)."""


class ArrivalBoard:
    """Issue times of the collectives of every rank on this host, in shared memory.

    One file per process group, named by the group's name (the same on every rank) and size,
    holding ``SLOTS`` (sequence number + 1, ``time.monotonic()``) pairs per rank of the group; 0 marks
    an empty slot. A rank writes its slot before it issues the collective and reads its
    peers' after the collective has completed, when each of them must have written it: no
    lock is needed. ``time.monotonic`` is one clock for every process of a host.
    """

    SLOTS = 64
    """A rank never runs more than a few collectives ahead of a peer on one group (each
    needs the peer to complete); 64 slots leave a wide margin before one is reused."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._tables: dict[tuple[str, int], np.ndarray] = {}

    def _get_table(self, group_name: str, group_size: int) -> np.ndarray:
        table = self._tables.get((group_name, group_size))
        if table is None:
            path = self.root / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', group_name)}-{group_size}.arrivals"
            size = group_size * self.SLOTS * 2 * 8
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size < size:
                    os.ftruncate(fd, size)  # every rank sets the same size: a race only repeats it
                buffer = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            table = np.frombuffer(buffer, dtype=np.float64).reshape(group_size, self.SLOTS, 2)
            self._tables[group_name, group_size] = table
        return table

    def post(self, group_name: str, group_size: int, group_rank: int, seq: int, issued: float) -> None:
        """Record that this rank issued collective ``seq`` of the group at ``issued``."""
        slot = self._get_table(group_name, group_size)[group_rank, seq % self.SLOTS]
        slot[1] = issued
        slot[0] = seq + 1  # written last: a slot whose sequence matches holds its time

    def get_last_arrival(self, group_name: str, group_size: int, seq: int) -> float | None:
        """The latest issue time of collective ``seq`` over the ranks that posted it; None if none did."""
        slots = self._get_table(group_name, group_size)[:, seq % self.SLOTS]
        posted = slots[slots[:, 0] == seq + 1, 1]
        return float(posted.max()) if len(posted) else None
