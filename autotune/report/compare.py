"""Best vs defaults side by side: exposed communication per FSDP unit, and both timelines on one time axis."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from autotune.report.formatting import fmt
from autotune.report.frames import LANE_COLORS, FigureSection, get_lanes, get_unit_compare_frame
from autotune.report.load import load_trial_traces
from autotune.report.model import Comparison, Report, TrialSummary, TrialTraces

COMPARE_FIGURES = {
    "compare_units": "exposed communication per unit, best vs defaults",
    "compare_timelines": "timelines of best and defaults",
}
BEST_COLOR, DEFAULT_COLOR = "#e45756", "#9d9d9d"


def get_compared_traces(comparison: Comparison | None) -> dict[str, tuple[TrialSummary, TrialTraces]]:
    """Label (``best: trial 11 (emitted)``, ``defaults: trial 0``) -> the trial and its traces, read once."""
    if comparison is None:
        return {}
    pairs = [(comparison.best_label, comparison.best), (comparison.default_label, comparison.default)]
    return {label: (trial, load_trial_traces(trial)) for label, trial in pairs if trial is not None}


def get_unit_compare_figure(comparison: Comparison) -> go.Figure | None:
    """Grouped bars per FSDP unit: the exposed communication of best and defaults (ms per step, median)."""
    units = get_unit_compare_frame(comparison.best, comparison.default)
    if units.empty:
        return None
    fig = go.Figure()
    for who, label, color in (
        ("best", comparison.best_label, BEST_COLOR),
        ("defaults", comparison.default_label, DEFAULT_COLOR),
    ):
        fig.add_bar(
            x=units["unit"],
            y=units[f"exposed_comm_ms_{who}"],
            name=label,
            marker_color=color,
            customdata=units[f"comm_ms_{who}"],
            hovertemplate="%{x}: %{y:.2f} ms exposed of %{customdata:.2f} ms communication<extra>" + label + "</extra>",
        )
    fig.update_layout(
        title="Exposed communication per FSDP unit (median per step): best vs defaults",
        barmode="group",
        yaxis_title="ms per step",
    )
    return fig


def add_lane_bars(
    fig: go.Figure, lanes: pd.DataFrame, *, label: str = "", shown: set[str] | None = None, **subplot: int
) -> None:
    """One horizontal bar trace per lane of ``lanes`` (:func:`get_lanes`), in :data:`LANE_COLORS`;
    ``label`` heads the hover text. With ``shown`` (the lanes already in the legend, updated here) the
    traces of one lane share a legend entry across subplots; ``subplot``: ``row`` and ``col``."""
    for lane, color in LANE_COLORS.items():
        spans = lanes[lanes["lane"] == lane]
        if spans.empty:
            continue
        legend = {} if shown is None else {"legendgroup": lane, "showlegend": lane not in shown}
        fig.add_bar(
            x=spans["end_ms"] - spans["start_ms"],
            base=spans["start_ms"],
            y=spans["y"],
            orientation="h",
            name=lane,
            **legend,
            marker={"color": color, "line": {"width": 0}},
            **subplot,
            hovertemplate=(f"{label}<br>" if label else "") + "%{y}<br>%{base:.3f} ms +%{x:.3f} ms<extra></extra>",
        )
        if shown is not None:
            shown.add(lane)


def _subplot_title(label: str, trial: TrialSummary, traces: TrialTraces) -> str:
    if traces.timeline is None or traces.timeline.empty:
        return f"{label}: no timeline ({traces.error or 'no intervals in its traces'})"
    return f"{label}: step {fmt(trial.step_ms)} ms unprofiled, exposed {fmt(trial.get_aggregate('exposed_comm_ms'))} ms per step"


def get_timeline_compare_figure(compared: dict[str, tuple[TrialSummary, TrialTraces]]) -> go.Figure | None:
    """The timelines of best and defaults as two subplots on one shared time axis (ms from each
    trial's first profiled step, as traced: the shared axis shows which steps take longer)."""
    usable = {
        label: traces.timeline
        for label, (_, traces) in compared.items()
        if traces.timeline is not None and not traces.timeline.empty
    }
    if not usable:
        return None
    lanes = {label: get_lanes(compared[label][1].timeline) if label in usable else None for label in compared}
    heights = [max(lane["y"].nunique(), 1) if lane is not None else 1 for lane in lanes.values()]
    fig = make_subplots(
        rows=len(compared),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.12,
        row_heights=[h / sum(heights) for h in heights],
        subplot_titles=[_subplot_title(label, trial, traces) for label, (trial, traces) in compared.items()],
    )
    shown: set[str] = set()
    for row, (label, frame) in enumerate(lanes.items(), start=1):
        if frame is None:
            continue
        add_lane_bars(fig, frame, label=label, shown=shown, row=row, col=1)
        fig.update_yaxes(categoryorder="array", categoryarray=list(dict.fromkeys(frame["y"]))[::-1], row=row, col=1)
    fig.update_layout(
        title="Timelines on one time axis (red: exposed communication; as traced, not scaled)",
        barmode="overlay",
        bargap=0.2,
        height=160 + 28 * sum(heights) + 40 * len(compared),
    )
    fig.update_xaxes(title_text="ms from the trial's first profiled step", row=len(compared), col=1)
    return fig


def get_compare_section(report: Report, compared: dict[str, tuple[TrialSummary, TrialTraces]]) -> FigureSection:
    """The best-vs-defaults part of a search report; ``compared`` from :func:`get_compared_traces`."""
    section = FigureSection(title="Best vs defaults")
    comparison = report.comparison
    if comparison is None:
        section.absent = {name: "no successful trial to compare with the defaults" for name in COMPARE_FIGURES}
        return section
    section.lines.append(
        f"{comparison.best_label} vs {comparison.default_label} (which trial is best, and why: the first line of this report)."
    )
    if comparison.default is None:
        section.lines.append("The defaults trial's dir is missing: only the best trial is shown.")
    units = get_unit_compare_figure(comparison)
    if units is not None:
        section.figures["compare_units"] = units
    else:
        section.absent["compare_units"] = (
            "neither trial has per-unit trace figures (metrics.json without a trace summary, or traces without FSDP units)"
        )
    timelines = get_timeline_compare_figure(compared)
    if timelines is not None:
        section.figures["compare_timelines"] = timelines
    else:
        reasons = "; ".join(f"{label}: {traces.error or 'no intervals'}" for label, (_, traces) in compared.items())
        section.absent["compare_timelines"] = f"no timeline could be built ({reasons})"
    return section
