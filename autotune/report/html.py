"""The report as one self-contained HTML file: tables and plotly figures, plotly.js inline."""

from __future__ import annotations

import html
import re
from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from autotune.report.compare import COMPARE_FIGURES, add_lane_bars, get_compare_section, get_compared_traces
from autotune.report.frames import (
    LANE_COLORS,
    FigureSection,
    get_lanes,
    get_step_frame,
    get_trials_frame,
    get_unit_frame,
)
from autotune.report.gpu_step import GPU_FIGURES, get_gpu_step_section
from autotune.report.host import get_host_tables
from autotune.report.hta import HTA_FIGURES, get_hta_section
from autotune.report.model import Report, ReportTable
from autotune.report.pipeline_tables import get_pipeline_tables
from autotune.report.study import OPTUNA_FIGURES, get_study_section
from autotune.report.tables import get_tables

FIGURES_META = "autotune-figures"
"""The ``<meta>`` whose content lists, comma-separated, every figure the page draws."""


_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
td:first-child,th:first-child,td.text{text-align:left}h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em}
caption{font-weight:bold;text-align:left}p.absent{color:#a33}p.lead{font-weight:bold}
table.one-line td{white-space:nowrap}table.one-line caption{max-width:calc(100vw - 5em)}
td[title]{cursor:help;text-decoration:underline dotted #999}"""


def get_timeline_figure(report: Report) -> go.Figure | None:
    """Per rank: compute, each collective kind and the exposed part, on one time axis."""
    if report.timeline is None or report.timeline.empty:
        return None
    lanes = get_lanes(report.timeline)
    fig = go.Figure()
    add_lane_bars(fig, lanes)
    title = "Timeline: compute vs communication (red: exposed communication)" + (
        ", as traced (not scaled)" if report.trials[0].trace_scale else ""
    )
    fig.update_layout(
        title=title,
        barmode="overlay",
        bargap=0.2,
        xaxis_title="ms from the first profiled step",
        height=120 + 28 * lanes["y"].nunique(),
    )
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
        fig.add_scatter(
            x=rows["step"],
            y=100 * rows["overlap_ratio"].astype(float),
            mode="lines+markers",
            name=f"rank {rank} overlap",
            row=1,
            col=1,
        )
        label = [f"r{rank} s{s}" for s in rows["step"]]
        fig.add_bar(
            x=label, y=rows["step_ms"], name=f"rank {rank} step", marker_color=LANE_COLORS["other"], row=1, col=2
        )
        fig.add_bar(
            x=label, y=rows["bound_ms"], name=f"rank {rank} bound", marker_color=LANE_COLORS["compute"], row=1, col=2
        )
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
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("Step time per trial (red: the lowest objective)", "Overlap vs step time")
    )
    fig.add_bar(x=trials["name"], y=trials["step_ms"], marker_color=colors, name="step ms", row=1, col=1)
    fig.add_scatter(
        x=trials["step_ms"],
        y=100 * trials["overlap_ratio"].astype(float),
        mode="markers",
        text=trials["name"],
        marker={"color": colors, "size": 9},
        name="trials",
        row=1,
        col=2,
    )
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


_NUMBER = re.compile(r"^[-+]?[\d.,]+(x|%| MB)?\*?$|^-$")


def _cell_html(value: str, title: str | None = None) -> str:
    attrs = "" if _NUMBER.match(value) else " class='text'"
    if title is not None:
        attrs += f" title='{html.escape(title, quote=True)}'"
    return f"<td{attrs}>{html.escape(value)}</td>"


def _table_html(table: ReportTable) -> str:
    """Numbers right-aligned, text (knobs, notes) left-aligned; a cell's full text (``cell_titles``) on hover."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in table.columns)
    body = "".join(
        "<tr>" + "".join(_cell_html(v, table.cell_titles.get((i, j))) for j, v in enumerate(row)) + "</tr>"
        for i, row in enumerate(table.rows)
    )
    kind = " class='one-line'" if table.one_line else ""
    return f"<table{kind}><caption>{html.escape(table.title)}</caption><tr>{head}</tr>{body}</table>"


def get_search_sections(report: Report) -> list[FigureSection]:
    """A search report's figure sections, in page order: best vs defaults, Optuna's, the trials, HTA's."""
    compared = get_compared_traces(report.comparison)
    trials = FigureSection(title="Trials (their own trial dirs)", figures=get_figures(report))
    return [get_compare_section(report, compared), get_study_section(report), trials, get_hta_section(compared)]


_DESCRIPTIONS = {**COMPARE_FIGURES, **OPTUNA_FIGURES, **HTA_FIGURES, **GPU_FIGURES}


class _Page:
    """The body being written: plotly.js goes inline with the first figure only; each figure sits in a
    ``div.figure[data-figure=NAME]`` and the head lists every name (what ``autotune.report.browser`` checks)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.names: list[str] = []

    def add_figure(self, name: str, fig: go.Figure) -> None:
        body = fig.to_html(full_html=False, include_plotlyjs=not self.names, div_id=f"figure-{name}")
        self.parts.append(f"<div class='figure' data-figure='{name}'>{body}</div>")
        self.names.append(name)

    def add_section(self, section: FigureSection) -> None:
        self.parts.append(f"<h2>{html.escape(section.title)}</h2>")
        self.parts += [f"<p>{html.escape(line)}</p>" for line in section.lines]
        for name, fig in section.figures.items():
            self.add_figure(name, fig)
        for name, reason in section.absent.items():
            what = _DESCRIPTIONS.get(name, name)
            self.parts.append(
                f"<p class='absent' data-absent='{name}'>No {html.escape(what)} figure: {html.escape(reason)}</p>"
            )
        self.parts += [_table_html(table) for table in section.tables]


def write_html(report: Report, path: Path) -> Path:
    """Write the report; the first figure carries plotly.js inline so the file opens offline."""
    page = _Page()
    page.parts.append(f"<h1>fsdp-autotune {report.kind} report: {html.escape(str(report.root))}</h1>")
    if report.comparison is not None:
        page.parts.append(
            f"<p class='lead'>{html.escape(report.comparison.note[0].upper() + report.comparison.note[1:])}.</p>"
        )
    page.parts += [
        _table_html(t) for t in [*get_tables(report), *get_pipeline_tables(report), *get_host_tables(report)]
    ]
    if report.kind == "search":
        for section in get_search_sections(report):
            page.add_section(section)
    else:
        for name, fig in get_figures(report).items():
            page.add_figure(name, fig)
        gpu = get_gpu_step_section(report)  # GPU trials only: a CPU trial's page is as it was
        if gpu is not None:
            page.add_section(gpu)
    if report.timeline_error:
        page.parts.append(f"<p>Timeline unavailable: {html.escape(report.timeline_error)}</p>")
    if report.kind == "trial" and report.trace_paths:
        page.parts.append(
            "<p>Raw traces: open the trial dir's <code>trace_rank*.json.gz</code> files in "
            "<a href='https://ui.perfetto.dev'>Perfetto</a> or chrome://tracing.</p>"
        )
    head = f"<meta charset='utf-8'><meta name='{FIGURES_META}' content='{','.join(page.names)}'><title>fsdp-autotune report</title><style>{_STYLE}</style>"
    path.write_text(
        f"<!DOCTYPE html><html><head>{head}</head><body>{''.join(page.parts)}</body></html>", encoding="utf-8"
    )
    return path
