"""The GPU step attribution in the HTML report ([Note: GPU step attribution]): one plotly figure
(device ms per step: a stacked bar per part of the step, one color per kernel class, idle
last) and the attribution tables. A GPU trial report has it as a section of its own; a search
report in its HTA section, beside HTA's kernel breakdown and idle time, for best and defaults.
A CPU trial has no device kernels and no such section."""

from __future__ import annotations

import plotly.graph_objects as go

from autotune.report.attribution import CLASS_TITLES, StepAttribution
from autotune.report.frames import CLASS_COLORS, FigureSection, get_attribution_frame
from autotune.report.gpu_tables import describe_attribution, get_attribution_tables
from autotune.report.model import Report

GPU_FIGURES = {"gpu_attribution": "GPU step attribution"}
GPU_SECTION_TITLE = "Where the GPU step's device time goes (by kernel class and part of the step)"


def get_attribution_figure(attributions: dict[str, StepAttribution]) -> go.Figure:
    """Stacked bars per part of the step (grouped per trial when there are several), one color per
    kernel class, idle as its own bar: device ms per step."""
    frames = {label: get_attribution_frame(a) for label, a in attributions.items()}
    several = len(frames) > 1

    def x_of(pairs: list[tuple[str, str]]) -> list:
        return [[label for label, _ in pairs], [part for _, part in pairs]] if several else [p for _, p in pairs]

    fig = go.Figure()
    order = [(label, part) for label, f in frames.items() for part in dict.fromkeys(f["part_title"])]
    fig.add_bar(x=x_of(order), y=[0] * len(order), showlegend=False, hoverinfo="skip")  # fixes the parts' order
    for cls, color in CLASS_COLORS.items():
        rows = [(label, row) for label, f in frames.items() for row in f[f["cls"] == cls].itertuples()]
        if not rows:
            continue
        fig.add_bar(
            x=x_of([(label, row.part_title) for label, row in rows]),
            y=[row.ms for _, row in rows],
            name=CLASS_TITLES.get(cls, "idle"),
            marker_color=color,
            customdata=[100 * row.share for _, row in rows],
            hovertemplate="%{x}: %{y:.2f} ms (%{customdata:.1f}% of the span)<extra>"
            + CLASS_TITLES.get(cls, "idle")
            + "</extra>",
        )
    fig.update_layout(
        title="GPU step: device ms per step by part of the step (bars) and kernel class (colors)",
        barmode="stack",
        yaxis_title="ms per step",
    )
    return fig


def add_attribution(section: FigureSection, attributions: dict[str, StepAttribution | None]) -> None:
    """Add the attribution of each GPU trial (label -> its attribution; None: CPU traces) to
    ``section``: one line per trial, the figure and the tables; a one-line reason where it has none."""
    usable = {}
    for label, attribution in attributions.items():
        who = f"{label}: " if label else ""
        if attribution is None:
            continue
        if attribution.error:
            section.lines.append(f"{who}no GPU step attribution: {attribution.error}")
            continue
        usable[label] = attribution
        section.lines.append(
            f"{who}GPU step attribution, {describe_attribution(attribution)}: kernels by class and by the part of "
            "the step whose host span launched them (the tail's forward holds the loss's backward too)"
        )
    if not usable:
        section.absent["gpu_attribution"] = "no GPU trace with device kernels in a profiled step"
        return
    section.figures["gpu_attribution"] = get_attribution_figure(usable)
    for label, attribution in usable.items():
        section.tables += get_attribution_tables(attribution, f"{label}: " if label else "")


def get_gpu_step_section(report: Report) -> FigureSection | None:
    """A GPU trial report's attribution section; None for a CPU trial, a search or unusable traces."""
    attribution = report.attribution if report.kind == "trial" else None
    if attribution is None:
        return None
    section = FigureSection(title=GPU_SECTION_TITLE)
    add_attribution(section, {"": attribution})
    return section
