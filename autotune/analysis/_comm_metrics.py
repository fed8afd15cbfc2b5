"""Communication figures of one set of collectives against one set of compute intervals."""

from __future__ import annotations

import numpy as np
import pandas as pd

from autotune.analysis import _intervals as iv
from autotune.analysis._events import COMM_KINDS

US_PER_MS = 1000.0


def kind_column(kind: str) -> str:
    """``all_gather_ms``, ..., ``other_comm_ms``: the column of one collective kind."""
    return "other_comm_ms" if kind == "other" else f"{kind}_ms"


KIND_COLUMNS = [kind_column(k) for k in COMM_KINDS]


def get_comm_figures(comm: pd.DataFrame, compute: np.ndarray) -> dict[str, float | int | None]:
    """``comm_ms``, one column per kind, ``exposed_comm_ms``, ``overlap_ratio``, ``num_collectives``.

    ``comm`` rows are collectives (``start``, ``end``, ``kind``); ``compute`` a merged set.
    """
    raw = comm[["start", "end"]].to_numpy(dtype=float)
    kinds = comm["kind"].to_numpy()
    spans = iv.union(raw)
    figures: dict[str, float | int | None] = {"comm_ms": iv.total(spans) / US_PER_MS}
    for kind in COMM_KINDS:
        figures[kind_column(kind)] = iv.total(iv.union(raw[kinds == kind])) / US_PER_MS
    exposed = iv.total(iv.subtract(spans, compute)) / US_PER_MS
    figures["exposed_comm_ms"] = exposed
    figures["overlap_ratio"] = 1.0 - exposed / figures["comm_ms"] if figures["comm_ms"] > 0 else None
    figures["num_collectives"] = int(len(comm))
    return figures
