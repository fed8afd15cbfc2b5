"""The JSON summary that trials store under ``metrics.json["trace_metrics"]``.

Schema (``schema_version`` 3; times in ms; quantities defined in [Note: trace metrics])::

    {
      "schema_version": 3,
      "kind": "trace_metrics",
      "device": "cpu" | "gpu",
      "num_ranks": int,
      "per_rank": [{
          "rank": int,
          "trace": str,                      # file name of the rank's trace
          "profiler_peak_allocated_bytes": int | null,   # over the whole profiled window
          "overlap_ratio_time_weighted": float | null,   # hidden / total communication time of
                                             # all the rank's steps (HTA's figure); null without comm
          "steps": [{                        # one per ProfilerStep#N, in time order
              "step": int, "step_ms", "compute_ms", "comm_ms",
              "all_gather_ms", "reduce_scatter_ms", "all_reduce_ms", "send_recv_ms", "other_comm_ms",
              "exposed_comm_ms", "overlap_ratio" (null without comm),
              "bound_ms", "bound_ratio" (null when bound_ms is 0),
              "num_collectives": int, "barrier_ms", "profiler_peak_allocated_bytes": int | null}],
          "per_unit": [{                     # one per FSDP unit, in order of first appearance;
              "unit": str,                   # values are medians over the rank's steps
              "comm_ms", "all_gather_ms", "reduce_scatter_ms", "all_reduce_ms", "send_recv_ms",
              "other_comm_ms", "exposed_comm_ms", "overlap_ratio", "num_collectives", "hook_ms"}]}],
      "aggregate": {
          "num_steps": int,                  # (rank, step) rows aggregated
          <every step field but "step">,     # median over all (rank, step) rows;
                                             # profiler_peak_allocated_bytes: max instead
          "overlap_ratio_time_weighted": float | null,   # hidden / total communication time
                                             # summed over ranks: the headline overlap figure
          "per_unit": [<per_unit rows>]}     # median over all (rank, step) rows of the unit
    }

Medians skip nulls; a field that is null everywhere stays null.

Versions: v1 named the profiler peaks ``peak_memory_bytes``; v2 had no ``send_recv_ms``
(send/recv counted in ``other_comm_ms``) and no ``overlap_ratio_time_weighted``. Reading
a v2 summary adds ``send_recv_ms: null`` (not measured apart) and derives the time-weighted
ratios from its steps (1 - sum of exposed / sum of comm), which equals today's figure when
the steps' collectives do not overlap one another.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from autotune.analysis._events import RankEvents
from autotune.analysis._step_analysis import STEP_COLUMNS, get_profiler_peak
from autotune.analysis._unit_analysis import UNIT_COLUMNS
from autotune.artifacts import check_artifact

SUMMARY_KIND = "trace_metrics"
SUMMARY_SCHEMA_VERSION = 3
STEP_FIELDS = [c for c in STEP_COLUMNS if c not in ("rank", "step")]
UNIT_FIELDS = [c for c in UNIT_COLUMNS if c not in ("rank", "step", "unit")]
_INT_FIELDS = {"step", "num_collectives", "profiler_peak_allocated_bytes"}


def _plain(value: Any) -> Any:
    """A JSON-able Python scalar: NaN/None -> None, numpy numbers -> int/float."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return None
    if hasattr(value, "item"):
        value = value.item()
    return None if isinstance(value, float) and math.isnan(value) else value


def _records(frame: pd.DataFrame, columns: list[str]) -> list[dict[str, Any]]:
    return [{c: _plain(row[c]) for c in columns} for row in frame.to_dict("records")]


def _median(series: pd.Series) -> float | None:
    values = pd.to_numeric(series, errors="coerce").dropna()
    return float(values.median()) if len(values) else None


def _unit_medians(units: pd.DataFrame, order: list[str]) -> list[dict[str, Any]]:
    groups = dict(tuple(units.groupby("unit", sort=False)))
    return [{"unit": unit, **{f: _median(groups[unit][f]) for f in UNIT_FIELDS}} for unit in order]


def _time_weighted(comm_ms: float, exposed_ms: float) -> float | None:
    return 1.0 - exposed_ms / comm_ms if comm_ms > 0 else None


def _aggregate(steps: pd.DataFrame, units: pd.DataFrame, unit_order: list[str], window: pd.DataFrame) -> dict[str, Any]:
    aggregate: dict[str, Any] = {"num_steps": int(len(steps))}
    for f in STEP_FIELDS:
        aggregate[f] = _median(steps[f])
    peaks = pd.to_numeric(steps["profiler_peak_allocated_bytes"], errors="coerce").dropna()
    aggregate["profiler_peak_allocated_bytes"] = int(peaks.max()) if len(peaks) else None
    aggregate["overlap_ratio_time_weighted"] = _time_weighted(
        float(window["comm_ms"].sum()), float(window["exposed_comm_ms"].sum())
    )
    aggregate["per_unit"] = _unit_medians(units, unit_order)
    return aggregate


def build_summary(
    events_by_rank: dict[int, RankEvents],
    steps: pd.DataFrame,
    units: pd.DataFrame,
    window: pd.DataFrame,
    *,
    device: str,
) -> dict[str, Any]:
    """The summary of every rank and the cross-rank aggregate (schema above); ``window``: one
    row per rank over its whole profiled window (``StepAnalyzer.get_window_metrics``)."""
    time_weighted = dict(zip(window["rank"], window["overlap_ratio_time_weighted"]))
    unit_order = list(dict.fromkeys(u for e in events_by_rank.values() for u in e.units))
    per_rank = []
    for rank, events in events_by_rank.items():
        rank_units = units[units["rank"] == rank]
        per_rank.append(
            {
                "rank": rank,
                "trace": events.path.name,
                "profiler_peak_allocated_bytes": get_profiler_peak(events.memory),
                "overlap_ratio_time_weighted": _plain(time_weighted.get(rank)),
                "steps": _records(steps[steps["rank"] == rank], ["step", *STEP_FIELDS]),
                "per_unit": _unit_medians(rank_units, events.units),
            }
        )
    return {
        "schema_version": SUMMARY_SCHEMA_VERSION,
        "kind": SUMMARY_KIND,
        "device": device,
        "num_ranks": len(per_rank),
        "per_rank": per_rank,
        "aggregate": _aggregate(steps, units, unit_order, window),
    }


def _rename_peak(row: dict[str, Any]) -> dict[str, Any]:
    row = dict(row)
    if "peak_memory_bytes" in row:
        row["profiler_peak_allocated_bytes"] = row.pop("peak_memory_bytes")
    return row


def _migrate_v1(data: dict[str, Any]) -> dict[str, Any]:
    """v1 -> v2: the profiler's peaks are ``profiler_peak_allocated_bytes``."""
    per_rank = [
        {**_rename_peak(r), "steps": [_rename_peak(s) for s in r.get("steps", [])]} for r in data.get("per_rank", [])
    ]
    return {**data, "per_rank": per_rank, "aggregate": _rename_peak(data.get("aggregate") or {})}


def _with_send_recv(row: dict[str, Any]) -> dict[str, Any]:
    """``send_recv_ms: None`` placed before ``other_comm_ms`` (key order as today's writer's)."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        if key == "other_comm_ms":
            out["send_recv_ms"] = None
        out[key] = value
    return out


def _summed_time_weighted(steps: list[dict[str, Any]]) -> float | None:
    comm = sum(s.get("comm_ms") or 0.0 for s in steps)
    return _time_weighted(comm, sum(s.get("exposed_comm_ms") or 0.0 for s in steps))


def _migrate_v2(data: dict[str, Any]) -> dict[str, Any]:
    """v2 -> v3: ``send_recv_ms`` (null: v2 counted send/recv as other) and the time-weighted overlap, from the steps."""
    per_rank, all_steps = [], []
    for rank in data.get("per_rank", []):
        steps = rank.get("steps", [])
        all_steps += steps
        upgraded = {}
        for key, value in rank.items():
            upgraded[key] = value
            if key == "profiler_peak_allocated_bytes":
                upgraded["overlap_ratio_time_weighted"] = _summed_time_weighted(steps)
        upgraded.setdefault("overlap_ratio_time_weighted", _summed_time_weighted(steps))
        upgraded["steps"] = [_with_send_recv(s) for s in steps]
        upgraded["per_unit"] = [_with_send_recv(u) for u in rank.get("per_unit", [])]
        per_rank.append(upgraded)
    aggregate = _with_send_recv(dict(data.get("aggregate") or {}))
    aggregate = {k: v for k, v in aggregate.items() if k != "per_unit"}
    aggregate["overlap_ratio_time_weighted"] = _summed_time_weighted(all_steps)
    aggregate["per_unit"] = [_with_send_recv(u) for u in (data.get("aggregate") or {}).get("per_unit", [])]
    return {**data, "per_rank": per_rank, "aggregate": aggregate}


def check_summary(data: Any, *, source: str) -> dict[str, Any]:
    """A stored trace summary, checked (kind, version) and upgraded to the current schema."""
    migrations = {1: _migrate_v1, 2: _migrate_v2}
    return check_artifact(data, kind=SUMMARY_KIND, version=SUMMARY_SCHEMA_VERSION, migrations=migrations, source=source)
