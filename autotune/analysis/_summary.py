"""The JSON summary that trials store under ``metrics.json["trace_metrics"]``.

Schema (``schema_version`` 2; v1 named the profiler peaks ``peak_memory_bytes``; times in ms; quantities defined in [Note: trace metrics])::

    {
      "schema_version": 1,
      "kind": "trace_metrics",
      "device": "cpu" | "gpu",
      "num_ranks": int,
      "per_rank": [{
          "rank": int,
          "trace": str,                      # file name of the rank's trace
          "profiler_peak_allocated_bytes": int | null,   # over the whole profiled window
          "steps": [{                        # one per ProfilerStep#N, in time order
              "step": int, "step_ms", "compute_ms", "comm_ms",
              "all_gather_ms", "reduce_scatter_ms", "all_reduce_ms", "other_comm_ms",
              "exposed_comm_ms", "overlap_ratio" (null without comm),
              "bound_ms", "bound_ratio" (null when bound_ms is 0),
              "num_collectives": int, "barrier_ms", "profiler_peak_allocated_bytes": int | null}],
          "per_unit": [{                     # one per FSDP unit, in order of first appearance;
              "unit": str,                   # values are medians over the rank's steps
              "comm_ms", "all_gather_ms", "reduce_scatter_ms", "all_reduce_ms",
              "other_comm_ms", "exposed_comm_ms", "overlap_ratio", "num_collectives", "hook_ms"}]}],
      "aggregate": {
          "num_steps": int,                  # (rank, step) rows aggregated
          <every step field but "step">,     # median over all (rank, step) rows;
                                             # profiler_peak_allocated_bytes: max instead
          "per_unit": [<per_unit rows>]}     # median over all (rank, step) rows of the unit
    }

Medians skip nulls; a field that is null everywhere stays null.
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
SUMMARY_SCHEMA_VERSION = 2
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


def _aggregate(steps: pd.DataFrame, units: pd.DataFrame, unit_order: list[str]) -> dict[str, Any]:
    aggregate: dict[str, Any] = {"num_steps": int(len(steps))}
    for f in STEP_FIELDS:
        aggregate[f] = _median(steps[f])
    peaks = pd.to_numeric(steps["profiler_peak_allocated_bytes"], errors="coerce").dropna()
    aggregate["profiler_peak_allocated_bytes"] = int(peaks.max()) if len(peaks) else None
    aggregate["per_unit"] = _unit_medians(units, unit_order)
    return aggregate


def build_summary(events_by_rank: dict[int, RankEvents], steps: pd.DataFrame, units: pd.DataFrame, *, device: str) -> dict[str, Any]:
    """The summary of every rank and the cross-rank aggregate (schema above)."""
    unit_order = list(dict.fromkeys(u for e in events_by_rank.values() for u in e.units))
    per_rank = []
    for rank, events in events_by_rank.items():
        rank_units = units[units["rank"] == rank]
        per_rank.append({
            "rank": rank,
            "trace": events.path.name,
            "profiler_peak_allocated_bytes": get_profiler_peak(events.memory),
            "steps": _records(steps[steps["rank"] == rank], ["step", *STEP_FIELDS]),
            "per_unit": _unit_medians(rank_units, events.units),
        })  # fmt: skip
    return {
        "schema_version": SUMMARY_SCHEMA_VERSION,
        "kind": SUMMARY_KIND,
        "device": device,
        "num_ranks": len(per_rank),
        "per_rank": per_rank,
        "aggregate": _aggregate(steps, units, unit_order),
    }


def _rename_peak(row: dict[str, Any]) -> dict[str, Any]:
    row = dict(row)
    if "peak_memory_bytes" in row:
        row["profiler_peak_allocated_bytes"] = row.pop("peak_memory_bytes")
    return row


def _migrate_v1(data: dict[str, Any]) -> dict[str, Any]:
    """v1 -> v2: the profiler's peaks are ``profiler_peak_allocated_bytes``."""
    per_rank = [{**_rename_peak(r), "steps": [_rename_peak(s) for s in r.get("steps", [])]} for r in data.get("per_rank", [])]
    return {**data, "per_rank": per_rank, "aggregate": _rename_peak(data.get("aggregate") or {})}


def check_summary(data: Any, *, source: str) -> dict[str, Any]:
    """A stored trace summary, checked (kind, version) and upgraded to the current schema."""
    return check_artifact(data, kind=SUMMARY_KIND, version=SUMMARY_SCHEMA_VERSION, migrations={1: _migrate_v1}, source=source)
