"""The JSON summary that trials store under ``metrics.json["trace_metrics"]``.

Schema (``schema_version`` 4; times in ms; quantities defined in [Note: trace metrics] and,
for pipeline trials, [Note: pipeline bubble])::

    {
      "schema_version": 4,
      "kind": "trace_metrics",
      "device": "cpu" | "gpu",
      "num_ranks": int,
      "per_rank": [{
          "rank": int,
          "trace": str,                      # file name of the rank's trace
          "stages": [int] | null,            # pipeline stages the rank holds; null: no pipeline
          "profiler_peak_allocated_bytes": int | null,   # over the whole profiled window
          "overlap_ratio_time_weighted": float | null,   # hidden / total communication time of
                                             # all the rank's steps (HTA's figure); null without comm
          "steps": [{                        # one per ProfilerStep#N, in time order
              "step": int, "step_ms", "compute_ms", "comm_ms",
              "all_gather_ms", "reduce_scatter_ms", "all_reduce_ms", "send_recv_ms", "other_comm_ms",
              "exposed_comm_ms", "overlap_ratio" (null without comm),
              "bound_ms", "bound_ratio" (null when bound_ms is 0),
              "num_collectives": int, "barrier_ms",
              "p2p_ms", "bubble_ms" (null without a pipeline),
              "profiler_peak_allocated_bytes": int | null}],
          "per_unit": [{                     # one per FSDP unit, in order of first appearance;
              "unit": str,                   # values are medians over the rank's steps
              "stage": int | null,           # the unit's pipeline stage; null: no pipeline
              "comm_ms", "all_gather_ms", "reduce_scatter_ms", "all_reduce_ms", "send_recv_ms",
              "other_comm_ms", "exposed_comm_ms", "overlap_ratio", "num_collectives", "hook_ms"}]}],
      "aggregate": {
          "num_steps": int,                  # (rank, step) rows aggregated
          <every step field but "step">,     # median over all (rank, step) rows;
                                             # profiler_peak_allocated_bytes: max instead
          "overlap_ratio_time_weighted": float | null,   # hidden / total communication time
                                             # summed over ranks: the headline overlap figure
          "per_unit": [<per_unit rows>]},    # median over all (rank, step) rows of the unit (of
                                             # the (stage, unit): each stage has its own root)
      "pipeline": null | {                   # null: not a pipeline trial (no layout given)
          "pp": int, "virtual_stages": int, "schedule": str | null,
          "stages": [{                       # one per stage, in stage order
              "stage": int, "ranks": [int], "blocks": [str], "units": [str],
              "num_steps": int,              # (rank, step) rows of the ranks holding it
              "step_ms", "compute_ms", "fsdp_comm_ms", "exposed_fsdp_comm_ms", "overlap_ratio",
              "num_collectives", "p2p_ms", "bubble_ms",   # medians over those rows
              "overlap_ratio_time_weighted"}]}  # 1 - summed exposed / summed FSDP comm of those rows
    }

Medians skip nulls; a field that is null everywhere stays null.

Versions: v1 named the profiler peaks ``peak_memory_bytes``; v2 had no ``send_recv_ms``
(send/recv counted in ``other_comm_ms``) and no ``overlap_ratio_time_weighted``. Reading
a v2 summary adds ``send_recv_ms: null`` (not measured apart) and derives the time-weighted
ratios from its steps (1 - sum of exposed / sum of comm), which equals today's figure when
the steps' collectives do not overlap one another. v3 had no pipeline figures: reading one
adds ``stages``, ``p2p_ms``, ``bubble_ms``, ``stage`` and ``pipeline`` as null (a v3 summary
of a pipeline trial counted link emulation's P2P holds as ``other`` communication and left
gloo's send/recv out: the report analyses such a trial's traces again).
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from autotune.analysis._events import RankEvents
from autotune.analysis._pipeline import PipelineLayout, get_unit_modules, model_order
from autotune.analysis._pipeline_analysis import STAGE_COLUMNS
from autotune.analysis._step_analysis import STEP_COLUMNS, get_profiler_peak
from autotune.analysis._unit_analysis import UNIT_COLUMNS
from autotune.artifacts import check_artifact

SUMMARY_KIND = "trace_metrics"
SUMMARY_SCHEMA_VERSION = 4
STEP_FIELDS = [c for c in STEP_COLUMNS if c not in ("rank", "step")]
UNIT_FIELDS = [c for c in UNIT_COLUMNS if c not in ("rank", "step", "unit", "stage")]
STAGE_FIELDS = [c for c in STAGE_COLUMNS if c not in ("rank", "step", "stage")]
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


def _unit_medians(units: pd.DataFrame, keys: list[tuple[int | None, str]]) -> list[dict[str, Any]]:
    """Medians of each ``(stage, unit)``'s rows (stage None everywhere without a pipeline)."""
    rows = []
    for stage, unit in keys:
        same_stage = units["stage"].isna() if stage is None else units["stage"] == stage
        mine = units[(units["unit"] == unit).to_numpy() & same_stage.to_numpy(dtype=bool)]
        rows.append({"unit": unit, "stage": stage, **{f: _median(mine[f]) for f in UNIT_FIELDS}})
    return rows


def _unit_keys(events_by_rank: dict[int, RankEvents]) -> list[tuple[int | None, str]]:
    """Every ``(stage, unit)`` in order of first appearance (pipeline: stage by stage)."""
    keys = list(dict.fromkeys((e.unit_stages.get(u), u) for e in events_by_rank.values() for u in e.units))
    return sorted(keys, key=lambda k: -1 if k[0] is None else k[0])


def _summarize_stages(
    layout: PipelineLayout | None, stages: pd.DataFrame, events_by_rank: dict[int, RankEvents]
) -> dict[str, Any] | None:
    """The ``pipeline`` section: each stage's figures over the (rank, step) rows of the ranks holding it."""
    if layout is None:
        return None
    rows = []
    for stage in range(layout.num_stages):
        mine = stages[stages["stage"] == stage]
        ranks = sorted(r for r, e in events_by_rank.items() if stage in e.stages)
        units = list(dict.fromkeys(u for r in ranks for u, s in events_by_rank[r].unit_stages.items() if s == stage))
        rows.append(
            {
                "stage": stage,
                "ranks": ranks,
                "blocks": sorted({m for u in units for m in get_unit_modules(u)}, key=model_order),
                "units": units,
                "num_steps": int(len(mine)),
                **{f: _median(mine[f]) for f in STAGE_FIELDS},
                "overlap_ratio_time_weighted": _time_weighted(
                    float(mine["fsdp_comm_ms"].sum()), float(mine["exposed_fsdp_comm_ms"].sum())
                ),
            }
        )
    return {"pp": layout.pp, "virtual_stages": layout.virtual_stages, "schedule": layout.schedule, "stages": rows}


def _time_weighted(comm_ms: float, exposed_ms: float) -> float | None:
    return 1.0 - exposed_ms / comm_ms if comm_ms > 0 else None


def _aggregate(
    steps: pd.DataFrame, units: pd.DataFrame, unit_keys: list[tuple[int | None, str]], window: pd.DataFrame
) -> dict[str, Any]:
    aggregate: dict[str, Any] = {"num_steps": int(len(steps))}
    for f in STEP_FIELDS:
        aggregate[f] = _median(steps[f])
    peaks = pd.to_numeric(steps["profiler_peak_allocated_bytes"], errors="coerce").dropna()
    aggregate["profiler_peak_allocated_bytes"] = int(peaks.max()) if len(peaks) else None
    aggregate["overlap_ratio_time_weighted"] = _time_weighted(
        float(window["comm_ms"].sum()), float(window["exposed_comm_ms"].sum())
    )
    aggregate["per_unit"] = _unit_medians(units, unit_keys)
    return aggregate


def build_summary(
    events_by_rank: dict[int, RankEvents],
    steps: pd.DataFrame,
    units: pd.DataFrame,
    window: pd.DataFrame,
    stages: pd.DataFrame,
    *,
    device: str,
    pipeline: PipelineLayout | None = None,
) -> dict[str, Any]:
    """The summary of every rank and the cross-rank aggregate (schema above); ``window``: one
    row per rank over its whole profiled window (``StepAnalyzer.get_window_metrics``);
    ``stages``: one row per (rank, step, stage) (``PipelineAnalyzer``), empty without ``pipeline``."""
    time_weighted = dict(zip(window["rank"], window["overlap_ratio_time_weighted"]))
    per_rank = []
    for rank, events in events_by_rank.items():
        rank_units = units[units["rank"] == rank]
        per_rank.append(
            {
                "rank": rank,
                "trace": events.path.name,
                "stages": list(events.stages) if pipeline is not None else None,
                "profiler_peak_allocated_bytes": get_profiler_peak(events.memory),
                "overlap_ratio_time_weighted": _plain(time_weighted.get(rank)),
                "steps": _records(steps[steps["rank"] == rank], ["step", *STEP_FIELDS]),
                "per_unit": _unit_medians(rank_units, [(events.unit_stages.get(u), u) for u in events.units]),
            }
        )
    return {
        "schema_version": SUMMARY_SCHEMA_VERSION,
        "kind": SUMMARY_KIND,
        "device": device,
        "num_ranks": len(per_rank),
        "per_rank": per_rank,
        "aggregate": _aggregate(steps, units, _unit_keys(events_by_rank), window),
        "pipeline": _summarize_stages(pipeline, stages, events_by_rank),
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


def _with_keys(
    row: dict[str, Any], *, before: str | None = None, after: str | None = None, **new: Any
) -> dict[str, Any]:
    """``row`` with ``new`` placed just before key ``before`` or after key ``after`` (at the end if absent)."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        if key == before:
            out.update(new)
        out[key] = value
        if key == after:
            out.update(new)
    return out if all(k in out for k in new) else {**out, **new}


def _v4_step(row: dict[str, Any]) -> dict[str, Any]:
    return _with_keys(row, before="profiler_peak_allocated_bytes", p2p_ms=None, bubble_ms=None)


def _v4_units(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_with_keys(u, after="unit", stage=None) for u in rows]


def _migrate_v3(data: dict[str, Any]) -> dict[str, Any]:
    """v3 -> v4: no pipeline figures (null): ``stages``, ``p2p_ms``, ``bubble_ms``, ``stage``, ``pipeline``."""
    per_rank = [
        {
            **_with_keys(rank, after="trace", stages=None),
            "steps": [_v4_step(s) for s in rank.get("steps", [])],
            "per_unit": _v4_units(rank.get("per_unit", [])),
        }
        for rank in data.get("per_rank", [])
    ]
    aggregate = dict(data.get("aggregate") or {})
    aggregate = {**_v4_step(aggregate), "per_unit": _v4_units(aggregate.get("per_unit", []))}
    return {**data, "per_rank": per_rank, "aggregate": aggregate, "pipeline": None}


def check_summary(data: Any, *, source: str) -> dict[str, Any]:
    """A stored trace summary, checked (kind, version) and upgraded to the current schema."""
    migrations = {1: _migrate_v1, 2: _migrate_v2, 3: _migrate_v3}
    return check_artifact(data, kind=SUMMARY_KIND, version=SUMMARY_SCHEMA_VERSION, migrations=migrations, source=source)
