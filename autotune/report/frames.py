"""DataFrames the report's plots draw (shared by the HTML and the PNG renderers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from autotune.report.attribution import CLASS_TITLES, PARTS, StepAttribution
from autotune.report.model import Report, ReportTable, TrialSummary

LANE_COLORS = {
    "compute": "#4c78a8",
    "all_gather": "#54a24b",
    "reduce_scatter": "#f58518",
    "all_reduce": "#b279a2",
    "send_recv": "#72b7b2",
    "other": "#9d9d9d",
    "exposed": "#e45756",
}
"""One color per timeline lane; ``exposed`` (communication while not computing) stands out in red."""
CLASS_COLORS = {
    "gemm": "#4c78a8",
    "attention_forward": "#72b7b2",
    "attention_backward": "#54a24b",
    "elementwise": "#eeca3b",
    "loss": "#b279a2",
    "copy": "#f58518",
    "memset": "#ff9da6",
    "optimizer": "#9d755d",
    "communication": "#e45756",
    "idle": "#bab0ac",
}
"""One color per kernel class (``autotune.analysis.KERNEL_CLASSES``) and for idle device time."""


@dataclass(kw_only=True)
class FigureSection:
    """One part of the HTML report: its figures by name, and for each figure it should have but
    does not, the one line saying why (never an exception: the rest of the report stands)."""

    title: str
    figures: dict[str, Any] = field(default_factory=dict)
    """Figure name (``optuna_history``, ``compare_units``, ...) -> plotly figure."""
    absent: dict[str, str] = field(default_factory=dict)
    """Figure name -> why it is not there."""
    lines: list[str] = field(default_factory=list)
    """One-line notes shown under the title."""
    tables: list[ReportTable] = field(default_factory=list)
    """Tables shown after the figures."""


def get_lanes(timeline: pd.DataFrame) -> pd.DataFrame:
    """Timeline rows with a ``y`` label per (rank, lane), lanes in :data:`LANE_COLORS` order."""
    order = {lane: i for i, lane in enumerate(LANE_COLORS)}
    frame = timeline.assign(order=timeline["lane"].map(lambda lane: order.get(lane, len(order)))).sort_values(
        ["rank", "order", "start_ms"], kind="stable"
    )
    return frame.assign(y=[f"rank {r} {lane}" for r, lane in zip(frame["rank"], frame["lane"])])


def get_step_frame(trial: TrialSummary) -> pd.DataFrame:
    """One row per (rank, profiled step) of the trace summary as the report shows it (times scaled, see [Note: scaled trace times])."""
    rows = [{"rank": r["rank"], **s} for r in (trial.shown_trace_metrics or {}).get("per_rank", []) for s in r["steps"]]
    return pd.DataFrame(rows)


def get_unit_frame(trial: TrialSummary) -> pd.DataFrame:
    """The shown aggregate per-unit rows, with ``hidden_comm_ms`` = comm - exposed; a pipeline trial's
    units named with their stage (``root (stage 1)``: each stage has its own root)."""
    frame = pd.DataFrame(((trial.shown_trace_metrics or {}).get("aggregate") or {}).get("per_unit", []))
    if not frame.empty:
        frame["hidden_comm_ms"] = frame["comm_ms"] - frame["exposed_comm_ms"]
    if not frame.empty and frame.get("stage", pd.Series(dtype=object)).notna().any():
        frame["unit"] = [u if pd.isna(s) else f"{u} (stage {int(s)})" for u, s in zip(frame["unit"], frame["stage"])]
    return frame


def get_trials_frame(report: Report) -> pd.DataFrame:
    """One row per trial of a search report: name, status, step_ms, overlap_ratio, best."""
    return pd.DataFrame(
        [
            {
                "name": t.name,
                "status": t.status,
                "step_ms": t.step_ms,
                "overlap_ratio": t.get_aggregate("overlap_ratio"),
                "best": t is report.best,
            }
            for t in report.trials
        ]
    )


def get_unit_compare_frame(best: TrialSummary, default: TrialSummary | None) -> pd.DataFrame:
    """Per FSDP unit (the best trial's order, then any only the defaults have): exposed and total
    communication of both trials, ms per step (shown, i.e. scaled where the trial's traces are)."""
    columns = ["unit", "exposed_comm_ms", "comm_ms"]
    frames = {
        "best": get_unit_frame(best),
        "defaults": get_unit_frame(default) if default is not None else pd.DataFrame(),
    }
    frames = {k: (f[columns] if not f.empty else pd.DataFrame(columns=columns)) for k, f in frames.items()}
    merged = frames["best"].merge(
        frames["defaults"], on="unit", how="outer", suffixes=("_best", "_defaults"), sort=False
    )
    order = list(dict.fromkeys([*frames["best"]["unit"], *frames["defaults"]["unit"]]))
    return merged.set_index("unit").loc[order].reset_index() if order else merged


def get_attribution_frame(attribution: StepAttribution) -> pd.DataFrame:
    """One row per (part of the step, kernel class) that ran, then one for idle, in the tables' order:
    ``part`` and ``cls`` (keys), ``part_title``, ``class_title``, ``ms`` per step, ``share`` of the span."""
    by_part_class = attribution.by_part_class()
    rows = [
        {"part": part, "cls": cls, "ms": by_part_class[part, cls]}
        for part in PARTS
        for cls in CLASS_TITLES
        if by_part_class.get((part, cls), 0.0) > 0
    ]
    rows.append({"part": "idle", "cls": "idle", "ms": attribution.idle_ms})
    frame = pd.DataFrame(rows, columns=["part", "cls", "ms"])
    frame["part_title"] = [PARTS.get(p, "idle") for p in frame["part"]]
    frame["class_title"] = [CLASS_TITLES.get(c, "idle") for c in frame["cls"]]
    frame["share"] = frame["ms"] / attribution.span_ms if attribution.span_ms > 0 else 0.0
    return frame
