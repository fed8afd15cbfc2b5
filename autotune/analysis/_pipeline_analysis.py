"""PipelineAnalyzer: per rank and step, the P2P time and the bubble; per stage, its compute, FSDP
communication, overlap, P2P and bubble ([Note: pipeline bubble])."""

from __future__ import annotations

import numpy as np
import pandas as pd

from autotune.analysis import _intervals as iv
from autotune.analysis._comm_metrics import US_PER_MS, get_comm_figures
from autotune.analysis._events import RankEvents
from autotune.analysis._pipeline import get_stage_at, get_stage_spans
from autotune.analysis._steps import StepSlice, get_step_slices, get_window_compute

STAGE_COLUMNS = [
    "rank",
    "step",
    "stage",
    "step_ms",
    "compute_ms",
    "fsdp_comm_ms",
    "exposed_fsdp_comm_ms",
    "overlap_ratio",
    "num_collectives",
    "p2p_ms",
    "bubble_ms",
]


def _get_busy(events: RankEvents) -> np.ndarray:
    """What the rank does besides waiting on P2P: its compute and its collectives (every step)."""
    if "busy" not in events.cache:
        comm = events.comm[["start", "end"]].to_numpy(dtype=float).reshape(-1, 2)
        events.cache["busy"] = iv.union(np.concatenate([get_window_compute(events), comm]))
    return events.cache["busy"]


def _get_p2p_ends(events: RankEvents) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every P2P transfer's end (sorted) with its stage, and the union of the transfers (pending time)."""
    if "p2p_ends" not in events.cache:
        p2p = events.p2p
        order = np.argsort(p2p["end"].to_numpy(dtype=float), kind="stable")
        events.cache["p2p_ends"] = (
            p2p["end"].to_numpy(dtype=float)[order],
            p2p["stage"].to_numpy(dtype=object)[order],
            iv.union(p2p[["start", "end"]].to_numpy(dtype=float)),
        )
    return events.cache["p2p_ends"]


def get_waits(events: RankEvents, s: StepSlice) -> tuple[np.ndarray, np.ndarray]:
    """The step's P2P waits (merged, ``(n, 2)``) and the stage of the transfer each waited for.

    Each idle gap of the step (neither compute nor a collective) in which a transfer completes is a
    wait from the gap's start to the last completion in it, counted where a transfer is pending
    (see [Note: pipeline bubble]).
    """
    ends, stages, pending = _get_p2p_ends(events)
    idle = iv.subtract(np.array([[s.start, s.end]], dtype=float), _get_busy(events))
    if len(ends) == 0 or len(idle) == 0:
        return iv.EMPTY.copy(), np.empty(0, dtype=object)
    last = np.searchsorted(ends, idle[:, 1], side="right") - 1
    waited = (last >= 0) & (ends[np.maximum(last, 0)] > idle[:, 0])
    waits = np.column_stack([idle[waited, 0], ends[last[waited]]])
    return waits, stages[last[waited]]


def _get_bubble_ms(events: RankEvents, waits: np.ndarray) -> float:
    return iv.total(iv.intersect(iv.union(waits), _get_p2p_ends(events)[2])) / US_PER_MS


def get_step_pipeline_figures(events: RankEvents, s: StepSlice) -> dict[str, float | None]:
    """``p2p_ms`` and ``bubble_ms`` of one step of the rank; None without a pipeline layout."""
    if not events.stages:
        return {"p2p_ms": None, "bubble_ms": None}
    waits, _ = get_waits(events, s)
    return {"p2p_ms": iv.total(iv.union(s.p2p)) / US_PER_MS, "bubble_ms": _get_bubble_ms(events, waits)}


def _get_stage_compute(events: RankEvents, s: StepSlice, stage: int) -> np.ndarray:
    """The step's compute inside the stage's action labels (all of it on a rank holding one stage)."""
    if len(events.stages) == 1:
        return s.compute
    if events.device == "cpu":
        return iv.intersect(s.compute, get_stage_spans(events, stage))
    compute = events.compute
    issue = compute["issue_ts"].to_numpy(dtype=float)
    mine = (issue >= s.start) & (issue < s.end) & (get_stage_at(events, issue) == stage)
    return iv.union(compute[["start", "end"]].to_numpy(dtype=float)[mine])


class PipelineAnalyzer:
    """One row per (rank, profiled step, stage the rank holds); none without a pipeline layout."""

    @classmethod
    def get_stage_metrics(cls, events: RankEvents) -> pd.DataFrame:
        hiding = get_window_compute(events)
        rows = [
            cls._get_stage_row(events, s, stage, hiding) for s in get_step_slices(events) for stage in events.stages
        ]
        return pd.DataFrame(rows, columns=STAGE_COLUMNS)

    @staticmethod
    def _get_stage_row(events: RankEvents, s: StepSlice, stage: int, hiding: np.ndarray) -> dict[str, object]:
        units = [u for u, st in events.unit_stages.items() if st == stage]
        mine = np.array([u in units for u in s.units], dtype=bool)
        figures = get_comm_figures(s.comm[mine], s.kinds[mine], hiding)
        p2p = s.p2p[s.p2p_stages == stage]
        waits, waited_for = get_waits(events, s)
        return {
            "rank": events.rank,
            "step": s.step,
            "stage": stage,
            "step_ms": (s.end - s.start) / US_PER_MS,
            "compute_ms": iv.total(_get_stage_compute(events, s, stage)) / US_PER_MS,
            "fsdp_comm_ms": figures["comm_ms"],
            "exposed_fsdp_comm_ms": figures["exposed_comm_ms"],
            "overlap_ratio": figures["overlap_ratio"],
            "num_collectives": figures["num_collectives"],
            "p2p_ms": iv.total(iv.union(p2p)) / US_PER_MS,
            "bubble_ms": _get_bubble_ms(events, waits[waited_for == stage]),
        }
