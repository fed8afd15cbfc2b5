"""The report as one self-contained HTML file: tables and plotly figures, plotly.js inline."""

from __future__ import annotations

import html
from pathlib import Path
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from autotune.report.frames import LANE_COLORS, get_lanes, get_step_frame, get_trials_frame, get_unit_frame
from autotune.report.model import Report, ReportTable
from autotune.report.tables import get_tables


_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}h1{font-size:1.4em}caption{font-weight:bold;text-align:left}"""


def get_timeline_figure(report: Report) -> go.Figure | None:
    """Per rank: compute, each collective kind and the exposed part, on one time axis."""
    if report.timeline is None or report.timeline.empty:
        return None
    lanes = get_lanes(report.timeline)
    fig = go.Figure()
    for lane, color in LANE_COLORS.items():
        rows = lanes[lanes["lane"] == lane]
        if rows.empty:
            continue
        fig.add_bar(x=rows["end_ms"] - rows["start_ms"], base=rows["start_ms"], y=rows["y"], orientation="h", name=lane,
                    marker={"color": color, "line": {"width": 0}}, hovertemplate="%{y}<br>%{base:.3f} ms +%{x:.3f} ms<extra></extra>")  # fmt: skip
    title = "Timeline: compute vs communication (red: exposed communication)" + (", as traced (not scaled)" if report.trials[0].trace_scale else "")
    fig.update_layout(title=title, barmode="overlay", bargap=0.2,
                      xaxis_title="ms from the first profiled step", height=120 + 28 * lanes["y"].nunique())  # fmt: skip
    fig.update_yaxes(categoryorder="array", categoryarray=list(dict.fromkeys(lanes["y"]))[::-1])
    return fig


def get_unit_figure(report: Report) -> go.Figure | None:
    """Per FSDP unit: communication hidden under compute vs exposed (median per step)."""
    units = get_unit_frame(report.trials[0])
    if units.empty:
        return None
    fig = go.Figure()
    fig.add_bar(x=units["unit"], y=units["hidden_comm_ms"], name="hidden", marker_color=LANE_COLORS["compute"])
    fig.add_bar(x=units["unit"], y=units["exposed_comm_ms"], name="exposed", marker_color=LANE_COLORS["exposed"])
    scaled = ", scaled to the unprofiled step" if report.trials[0].trace_scale else ""
    fig.update_layout(title=f"Communication per FSDP unit (median per step{scaled})", barmode="stack", yaxis_title="ms")
    return fig


def get_step_figure(report: Report) -> go.Figure | None:
    """Per profiled step: overlap ratio per rank, and step time against its physical bound."""
    steps = get_step_frame(report.trials[0])
    if steps.empty:
        return None
    fig = make_subplots(rows=1, cols=2, subplot_titles=("Overlap per step", "Step time vs bound max(compute, comm)"))
    for rank, rows in steps.groupby("rank"):
        fig.add_scatter(x=rows["step"], y=100 * rows["overlap_ratio"].astype(float), mode="lines+markers", name=f"rank {rank} overlap", row=1, col=1)
        label = [f"r{rank} s{s}" for s in rows["step"]]
        fig.add_bar(x=label, y=rows["step_ms"], name=f"rank {rank} step", marker_color=LANE_COLORS["other"], row=1, col=2)
        fig.add_bar(x=label, y=rows["bound_ms"], name=f"rank {rank} bound", marker_color=LANE_COLORS["compute"], row=1, col=2)
    fig.update_yaxes(title_text="% of communication hidden", range=[0, 105], row=1, col=1)
    fig.update_yaxes(title_text="ms", row=1, col=2)
    fig.update_xaxes(title_text="step", dtick=1, row=1, col=1)
    return fig


def get_search_figure(report: Report) -> go.Figure | None:
    """Every trial's unprofiled step time (best highlighted) and its overlap."""
    trials = get_trials_frame(report)
    trials = trials[trials["step_ms"].notna()] if not trials.empty else trials
    if trials.empty:
        return None
    colors = [LANE_COLORS["exposed"] if b else LANE_COLORS["compute"] for b in trials["best"]]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("Step time per trial (red: best)", "Overlap vs step time"))
    fig.add_bar(x=trials["name"], y=trials["step_ms"], marker_color=colors, name="step ms", row=1, col=1)
    fig.add_scatter(x=trials["step_ms"], y=100 * trials["overlap_ratio"].astype(float), mode="markers", text=trials["name"],
                    marker={"color": colors, "size": 9}, name="trials", row=1, col=2)  # fmt: skip
    fig.update_yaxes(title_text="ms", row=1, col=1)
    fig.update_xaxes(title_text="step ms", row=1, col=2)
    fig.update_yaxes(title_text="overlap %", row=1, col=2)
    return fig


def get_figures(report: Report) -> dict[str, go.Figure]:
    """The report's figures by file stem (``timeline``, ``units``, ``steps`` or ``trials``)."""
    if report.kind == "search":
        makers = {"trials": get_search_figure}
    else:
        makers = {"timeline": get_timeline_figure, "units": get_unit_figure, "steps": get_step_figure}
    figures = {name: make(report) for name, make in makers.items()}
    return {name: fig for name, fig in figures.items() if fig is not None}


def _table_html(table: ReportTable) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in table.columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in table.rows)
    return f"<table><caption>{html.escape(table.title)}</caption><tr>{head}</tr>{body}</table>"


def write_html(report: Report, path: Path) -> Path:
    """Write the report; the first figure carries plotly.js inline so the file opens offline."""
    parts = [f"<h1>fsdp-autotune {report.kind} report: {html.escape(str(report.root))}</h1>"]
    parts += [_table_html(t) for t in get_tables(report)]
    for i, fig in enumerate(get_figures(report).values()):
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))
    if report.timeline_error:
        parts.append(f"<p>Timeline unavailable: {html.escape(report.timeline_error)}</p>")
    if report.kind == "trial" and report.trace_paths:
        parts.append("<p>Raw traces: open the trial dir's <code>trace_rank*.json.gz</code> files in "
                     "<a href='https://ui.perfetto.dev'>Perfetto</a> or chrome://tracing.</p>")  # fmt: skip
    doc = f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>fsdp-autotune report</title><style>{_STYLE}</style></head><body>{''.join(parts)}</body></html>"
    path.write_text(doc, encoding="utf-8")
    return path
