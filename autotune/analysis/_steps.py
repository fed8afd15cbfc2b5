"""One rank's events cut by profiled step, once: what the step, unit and timeline analyzers read.

A collective (or barrier, or GPU kernel) belongs to the step whose ``[start, end)`` holds its
issue time; steps are the training thread's ``ProfilerStep#N`` spans, which follow one
another, so one ``searchsorted`` over the step starts places every event.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from autotune.analysis import _intervals as iv
from autotune.analysis._events import RankEvents


@dataclass(frozen=True)
class StepSlice:
    """What one profiled step issued; times in microseconds, interval sets merged unless said."""

    step: int
    start: float
    end: float
    compute: np.ndarray
    """The step's own compute (CPU: the training thread's, clipped to the step; GPU: the kernels launched in it)."""
    comm: np.ndarray
    """``(n, 2)`` spans of the collectives issued in the step, one row each (not merged)."""
    kinds: np.ndarray
    """Kind of each collective (``COMM_KINDS``)."""
    units: np.ndarray
    """FSDP unit of each collective (None outside any label)."""
    barriers: np.ndarray
    """``(n, 2)`` spans of the barriers issued in the step (not merged)."""
    p2p: np.ndarray
    """``(n, 2)`` spans of the pipeline P2P transfers issued in the step (not merged; none without a layout)."""
    p2p_stages: np.ndarray
    """Stage of each P2P transfer (None where no action label says)."""


def _step_of(times: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Index of the step holding each time, -1 for none."""
    at = np.searchsorted(starts, times, side="right") - 1
    inside = (at >= 0) & (times < ends[np.maximum(at, 0)]) if len(starts) else np.zeros(len(times), dtype=bool)
    return np.where(inside, at, -1)


def _split(frame: pd.DataFrame, steps: int, starts: np.ndarray, ends: np.ndarray) -> list[np.ndarray]:
    """Row positions of ``frame`` per step, by issue time (rows keep their order)."""
    at = _step_of(frame["issue_ts"].to_numpy(dtype=float), starts, ends)
    order = np.argsort(at, kind="stable")
    bounds = np.searchsorted(at[order], np.arange(steps + 1), side="left")
    return [order[bounds[i] : bounds[i + 1]] for i in range(steps)]


def _step_computes(events: RankEvents, starts: np.ndarray, ends: np.ndarray) -> list[np.ndarray]:
    compute = events.compute
    if events.device == "cpu":  # already a merged set
        spans = compute[["start", "end"]].to_numpy(dtype=float).reshape(-1, 2)
        first = np.searchsorted(spans[:, 1], starts, side="right")
        last = np.searchsorted(spans[:, 0], ends, side="left")
        return [iv.clip(spans[a:b], s, e) for a, b, s, e in zip(first, last, starts, ends)]
    spans = compute[["start", "end"]].to_numpy(dtype=float).reshape(-1, 2)
    return [iv.union(spans[rows]) for rows in _split(compute, len(starts), starts, ends)]


def get_step_slices(events: RankEvents) -> list[StepSlice]:
    """Every profiled step of the rank, in time order (computed once per :class:`RankEvents`)."""
    if "steps" not in events.cache:
        steps = events.steps
        starts, ends = steps["start"].to_numpy(dtype=float), steps["end"].to_numpy(dtype=float)
        comm, barriers = events.comm, events.barriers
        comm_spans, kinds = (
            comm[["start", "end"]].to_numpy(dtype=float).reshape(-1, 2),
            comm["kind"].to_numpy(dtype=object),
        )
        units = comm["unit"].to_numpy(dtype=object)
        barrier_spans = barriers[["start", "end"]].to_numpy(dtype=float).reshape(-1, 2)
        p2p_spans, p2p_stages = (
            events.p2p[["start", "end"]].to_numpy(dtype=float).reshape(-1, 2),
            events.p2p["stage"].to_numpy(dtype=object),
        )
        computes = _step_computes(events, starts, ends)
        comm_rows, barrier_rows = _split(comm, len(steps), starts, ends), _split(barriers, len(steps), starts, ends)
        p2p_rows = _split(events.p2p, len(steps), starts, ends)
        events.cache["steps"] = [
            StepSlice(
                step=int(n),
                start=float(s),
                end=float(e),
                compute=computes[i],
                comm=comm_spans[comm_rows[i]],
                kinds=kinds[comm_rows[i]],
                units=units[comm_rows[i]],
                barriers=barrier_spans[barrier_rows[i]],
                p2p=p2p_spans[p2p_rows[i]],
                p2p_stages=p2p_stages[p2p_rows[i]],
            )
            for i, (n, s, e) in enumerate(zip(steps["step"], starts, ends))
        ]
    return events.cache["steps"]


def get_window_compute(events: RankEvents) -> np.ndarray:
    """The compute of every profiled step, merged: what hides communication (see [Note: trace metrics])."""
    if "window_compute" not in events.cache:
        slices = get_step_slices(events)
        events.cache["window_compute"] = (
            iv.union(np.concatenate([s.compute for s in slices])) if slices else iv.EMPTY.copy()
        )
    return events.cache["window_compute"]
