"""StepAnalyzer: per rank and per profiled step, the metrics of [Note: trace metrics]."""

from __future__ import annotations

import numpy as np
import pandas as pd

from autotune.analysis import _intervals as iv
from autotune.analysis._comm_metrics import KIND_COLUMNS, US_PER_MS, get_comm_figures, get_overlap_ratio
from autotune.analysis._events import RankEvents
from autotune.analysis._pipeline_analysis import get_step_pipeline_figures
from autotune.analysis._steps import StepSlice, get_step_slices, get_window_compute

STEP_COLUMNS = [
    "rank",
    "step",
    "step_ms",
    "compute_ms",
    "comm_ms",
    *KIND_COLUMNS,
    "exposed_comm_ms",
    "overlap_ratio",
    "bound_ms",
    "bound_ratio",
    "num_collectives",
    "barrier_ms",
    "p2p_ms",
    "bubble_ms",
    "profiler_peak_allocated_bytes",
]
WINDOW_COLUMNS = ["rank", "comm_ms", "exposed_comm_ms", "overlap_ratio_time_weighted"]
ALLOCATOR_COLUMNS = ["rank", "allocated_bytes", "reserved_bytes", "fragmentation"]


def _device_memory(memory: pd.DataFrame) -> pd.DataFrame:
    """The accelerator's memory events when there are any, else the CPU's."""
    return memory[memory["device_type"] != 0] if (memory["device_type"] != 0).any() else memory


def get_profiler_peak(memory: pd.DataFrame, start: float | None = None, end: float | None = None) -> int | None:
    """Largest ``Total Allocated`` of the profiler's memory events (accelerator ones if any), or None."""
    if memory.empty:
        return None
    device = _device_memory(memory)
    if start is not None:
        device = device[(device["ts"] >= start) & (device["ts"] < end)]
    return int(device["total_allocated"].max()) if not device.empty else None


def get_allocator_peak(memory: pd.DataFrame) -> tuple[int, int] | None:
    """``(Total Allocated, Total Reserved)`` of the memory event with the largest ``Total Allocated``
    among those that carry both (accelerator ones if any), or None: the caching allocator's
    reservation at the allocation peak."""
    if memory.empty:
        return None
    device = _device_memory(memory).dropna(subset=["total_reserved"])
    if device.empty:
        return None
    row = device.loc[device["total_allocated"].idxmax()]
    return int(row["total_allocated"]), int(row["total_reserved"])


def _step_peaks(memory: pd.DataFrame, slices: list[StepSlice]) -> list[int | None]:
    """:func:`get_profiler_peak` of every step, with one sort of the memory events."""
    if memory.empty:
        return [None] * len(slices)
    device = _device_memory(memory).sort_values("ts", kind="stable")
    ts, allocated = device["ts"].to_numpy(dtype=float), device["total_allocated"].to_numpy(dtype=float)
    peaks: list[int | None] = []
    for s in slices:
        lo, hi = np.searchsorted(ts, s.start, side="left"), np.searchsorted(ts, s.end, side="left")
        peaks.append(int(allocated[lo:hi].max()) if hi > lo else None)
    return peaks


class StepAnalyzer:
    """One row per (rank, profiled step); one row per rank over the whole profiled window."""

    @classmethod
    def get_step_metrics(cls, events: RankEvents) -> pd.DataFrame:
        slices, hiding = get_step_slices(events), get_window_compute(events)
        peaks = _step_peaks(events.memory, slices)
        rows = [cls._get_step_row(events, s, hiding, peak) for s, peak in zip(slices, peaks)]
        return pd.DataFrame(rows, columns=STEP_COLUMNS)

    @staticmethod
    def _get_step_row(events: RankEvents, s: StepSlice, hiding: np.ndarray, peak: int | None) -> dict[str, object]:
        figures = get_comm_figures(s.comm, s.kinds, hiding)
        step_ms = (s.end - s.start) / US_PER_MS
        compute_ms = iv.total(s.compute) / US_PER_MS
        bound_ms = max(compute_ms, figures["comm_ms"])
        return {
            "rank": events.rank,
            "step": s.step,
            "step_ms": step_ms,
            "compute_ms": compute_ms,
            **figures,
            "bound_ms": bound_ms,
            "bound_ratio": step_ms / bound_ms if bound_ms > 0 else None,
            "barrier_ms": iv.total(iv.union(s.barriers)) / US_PER_MS,
            **get_step_pipeline_figures(events, s),
            "profiler_peak_allocated_bytes": peak,
        }

    @staticmethod
    def get_window_metrics(events: RankEvents) -> dict[str, object]:
        """The rank's communication over all its profiled steps as one union (collectives of
        every step, against the compute of every step): ``overlap_ratio_time_weighted`` is
        the share of that communication time hidden, HTA's ``comp_comm_overlap_ratio``."""
        slices = get_step_slices(events)
        spans = iv.union(np.concatenate([s.comm for s in slices])) if slices else iv.EMPTY.copy()
        comm_ms = iv.total(spans) / US_PER_MS
        exposed_ms = iv.total(iv.subtract(spans, get_window_compute(events))) / US_PER_MS
        return {
            "rank": events.rank,
            "comm_ms": comm_ms,
            "exposed_comm_ms": exposed_ms,
            "overlap_ratio_time_weighted": get_overlap_ratio(comm_ms, exposed_ms),
        }
