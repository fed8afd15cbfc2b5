"""UnitAnalyzer: per rank, step and FSDP unit, the communication metrics of [Note: trace metrics]
(``stage``: the unit's pipeline stage, None without a pipeline layout)."""

from __future__ import annotations

import pandas as pd

from autotune.analysis import _intervals as iv
from autotune.analysis._comm_metrics import KIND_COLUMNS, US_PER_MS, get_comm_figures
from autotune.analysis._events import RankEvents
from autotune.analysis._steps import get_step_slices, get_window_compute

UNIT_COLUMNS = [
    "rank",
    "step",
    "unit",
    "stage",
    "comm_ms",
    *KIND_COLUMNS,
    "exposed_comm_ms",
    "overlap_ratio",
    "num_collectives",
    "hook_ms",
]


class UnitAnalyzer:
    """One row per (rank, profiled step, FSDP unit), units in order of first appearance."""

    @classmethod
    def get_unit_metrics(cls, events: RankEvents) -> pd.DataFrame:
        rows = []
        hooks = {
            unit: iv.union(spans[["start", "end"]].to_numpy())
            for unit, spans in events.labels.groupby("unit", sort=False)
        }
        hiding = get_window_compute(events)
        for s in get_step_slices(events):
            for unit in events.units:
                hook_ms = iv.total(iv.clip(hooks[unit], s.start, s.end)) / US_PER_MS
                mine = s.units == unit
                figures = get_comm_figures(s.comm[mine], s.kinds[mine], hiding)
                stage = events.unit_stages.get(unit)
                rows.append(
                    {"rank": events.rank, "step": s.step, "unit": unit, "stage": stage, **figures, "hook_ms": hook_ms}
                )
        return pd.DataFrame(rows, columns=UNIT_COLUMNS).astype({"stage": object})
