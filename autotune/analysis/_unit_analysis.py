"""UnitAnalyzer: per rank, step and FSDP unit, the communication metrics of [Note: trace metrics]."""

from __future__ import annotations

import pandas as pd

from autotune.analysis import _intervals as iv
from autotune.analysis._comm_metrics import KIND_COLUMNS, US_PER_MS, get_comm_figures
from autotune.analysis._events import RankEvents, get_step_comm, get_step_compute

UNIT_COLUMNS = [
    "rank", "step", "unit", "comm_ms", *KIND_COLUMNS, "exposed_comm_ms", "overlap_ratio",
    "num_collectives", "hook_ms",
]  # fmt: skip


class UnitAnalyzer:
    """One row per (rank, profiled step, FSDP unit), units in order of first appearance."""

    @classmethod
    def get_unit_metrics(cls, events: RankEvents) -> pd.DataFrame:
        rows = []
        hooks = {unit: iv.union(spans[["start", "end"]].to_numpy()) for unit, spans in events.labels.groupby("unit", sort=False)}
        for step, start, end in events.steps.itertuples(index=False):
            compute = get_step_compute(events, start, end)
            comm = get_step_comm(events, start, end)
            by_unit = dict(tuple(comm.groupby("unit", sort=False)))
            for unit in events.units:
                hook_ms = iv.total(iv.clip(hooks[unit], start, end)) / US_PER_MS
                figures = get_comm_figures(by_unit.get(unit, comm.iloc[:0]), compute)
                rows.append({"rank": events.rank, "step": step, "unit": unit, **figures, "hook_ms": hook_ms})
        return pd.DataFrame(rows, columns=UNIT_COLUMNS)
