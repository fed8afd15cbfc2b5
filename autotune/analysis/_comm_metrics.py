"""Communication figures of one set of collectives against the compute that can hide them."""

from __future__ import annotations

import numpy as np

from autotune.analysis import _intervals as iv
from autotune.analysis._events import COMM_KINDS

US_PER_MS = 1000.0


def kind_column(kind: str) -> str:
    """``all_gather_ms``, ..., ``send_recv_ms``, ``other_comm_ms``: the column of one collective kind."""
    return "other_comm_ms" if kind == "other" else f"{kind}_ms"


KIND_COLUMNS = [kind_column(k) for k in COMM_KINDS]


def get_overlap_ratio(comm_ms: float, exposed_ms: float) -> float | None:
    """1 - exposed / comm: the fraction of communication hidden under compute; None without communication."""
    return 1.0 - exposed_ms / comm_ms if comm_ms > 0 else None


def get_comm_figures(spans: np.ndarray, kinds: np.ndarray, hiding: np.ndarray) -> dict[str, float | int | None]:
    """``comm_ms``, one column per kind, ``exposed_comm_ms``, ``overlap_ratio``, ``num_collectives``.

    ``spans``: ``(n, 2)`` collectives (one row each), ``kinds`` their kinds; ``hiding`` the
    merged compute set that hides communication.
    """
    spans = np.asarray(spans, dtype=float).reshape(-1, 2)
    merged = iv.union(spans)
    figures: dict[str, float | int | None] = {"comm_ms": iv.total(merged) / US_PER_MS}
    for kind in COMM_KINDS:
        figures[kind_column(kind)] = iv.total(iv.union(spans[kinds == kind])) / US_PER_MS
    figures["exposed_comm_ms"] = iv.total(iv.subtract(merged, hiding)) / US_PER_MS
    figures["overlap_ratio"] = get_overlap_ratio(figures["comm_ms"], figures["exposed_comm_ms"])
    figures["num_collectives"] = int(len(spans))
    return figures
