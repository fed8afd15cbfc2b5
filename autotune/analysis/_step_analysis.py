"""StepAnalyzer: per rank and per profiled step, the metrics of [Note: trace metrics]."""

from __future__ import annotations

import pandas as pd

from autotune.analysis import _intervals as iv
from autotune.analysis._comm_metrics import KIND_COLUMNS, US_PER_MS, get_comm_figures
from autotune.analysis._events import RankEvents, get_step_comm, get_step_compute

STEP_COLUMNS = [
    "rank", "step", "step_ms", "compute_ms", "comm_ms", *KIND_COLUMNS, "exposed_comm_ms",
    "overlap_ratio", "bound_ms", "bound_ratio", "num_collectives", "barrier_ms", "profiler_peak_allocated_bytes",
]  # fmt: skip


def get_profiler_peak(memory: pd.DataFrame, start: float | None = None, end: float | None = None) -> int | None:
    """Largest ``Total Allocated`` of the profiler's memory events (accelerator ones if any), or None."""
    if memory.empty:
        return None
    device = memory[memory["device_type"] != 0] if (memory["device_type"] != 0).any() else memory
    if start is not None:
        device = device[(device["ts"] >= start) & (device["ts"] < end)]
    return int(device["total_allocated"].max()) if not device.empty else None


class StepAnalyzer:
    """One row per (rank, profiled step)."""

    @classmethod
    def get_step_metrics(cls, events: RankEvents) -> pd.DataFrame:
        rows = [cls._get_step_row(events, step, start, end) for step, start, end in events.steps.itertuples(index=False)]
        return pd.DataFrame(rows, columns=STEP_COLUMNS)

    @staticmethod
    def _get_step_row(events: RankEvents, step: int, start: float, end: float) -> dict[str, object]:
        compute = get_step_compute(events, start, end)
        figures = get_comm_figures(get_step_comm(events, start, end), compute)
        step_ms = (end - start) / US_PER_MS
        compute_ms = iv.total(compute) / US_PER_MS
        bound_ms = max(compute_ms, figures["comm_ms"])
        barriers = get_step_comm(events, start, end, barriers=True)
        return {
            "rank": events.rank,
            "step": step,
            "step_ms": step_ms,
            "compute_ms": compute_ms,
            **figures,
            "bound_ms": bound_ms,
            "bound_ratio": step_ms / bound_ms if bound_ms > 0 else None,
            "barrier_ms": iv.total(iv.union(barriers[["start", "end"]].to_numpy())) / US_PER_MS,
            "profiler_peak_allocated_bytes": get_profiler_peak(events.memory, start, end),
        }
