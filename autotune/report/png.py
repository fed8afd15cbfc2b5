"""PNG export of the report's plots with matplotlib (kaleido would need a Chrome install)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from autotune.report.frames import (
    CLASS_COLORS,
    LANE_COLORS,
    get_attribution_frame,
    get_lanes,
    get_step_frame,
    get_trials_frame,
    get_unit_frame,
)
from autotune.report.model import Report

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _new_figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def plot_timeline(report: Report) -> Figure | None:
    if report.timeline is None or report.timeline.empty:
        return None
    lanes = get_lanes(report.timeline)
    labels = list(dict.fromkeys(lanes["y"]))
    fig = _new_figure(11, 1 + 0.3 * len(labels))
    ax = fig.subplots()
    for i, label in enumerate(labels):
        rows = lanes[lanes["y"] == label]
        spans = list(zip(rows["start_ms"], rows["end_ms"] - rows["start_ms"]))
        ax.broken_barh(spans, (len(labels) - 1 - i - 0.4, 0.8), facecolors=LANE_COLORS[rows["lane"].iloc[0]])
    ax.set_yticks(range(len(labels)), labels[::-1], fontsize=8)
    ax.set_xlabel("ms from the first profiled step")
    ax.set_title("Compute vs communication (red: exposed communication)")
    return fig


def plot_units(report: Report) -> Figure | None:
    units = get_unit_frame(report.trials[0])
    if units.empty:
        return None
    fig = _new_figure(7, 3.5)
    ax = fig.subplots()
    ax.bar(units["unit"], units["hidden_comm_ms"], color=LANE_COLORS["compute"], label="hidden")
    ax.bar(
        units["unit"],
        units["exposed_comm_ms"],
        bottom=units["hidden_comm_ms"],
        color=LANE_COLORS["exposed"],
        label="exposed",
    )
    ax.set_ylabel("ms per step (median)")
    ax.set_title("Communication per FSDP unit")
    ax.legend()
    return fig


def plot_steps(report: Report) -> Figure | None:
    steps = get_step_frame(report.trials[0])
    if steps.empty:
        return None
    fig = _new_figure(10, 3.5)
    overlap_ax, bound_ax = fig.subplots(1, 2)
    for rank, rows in steps.groupby("rank"):
        overlap_ax.plot(rows["step"], 100 * rows["overlap_ratio"].astype(float), marker="o", label=f"rank {rank}")
    overlap_ax.set(
        title="Overlap per step",
        xlabel="step",
        ylabel="% of communication hidden",
        ylim=(0, 105),
        xticks=sorted(steps["step"].unique()),
    )
    overlap_ax.legend()
    labels = [f"r{r} s{s}" for r, s in zip(steps["rank"], steps["step"])]
    bound_ax.bar(labels, steps["step_ms"], color=LANE_COLORS["other"], label="step")
    bound_ax.bar(labels, steps["bound_ms"], width=0.5, color=LANE_COLORS["compute"], label="bound max(compute, comm)")
    bound_ax.set(title="Step time vs physical bound", ylabel="ms")
    bound_ax.legend(loc="lower right")
    return fig


def plot_trials(report: Report) -> Figure | None:
    trials = get_trials_frame(report)
    trials = trials[trials["step_ms"].notna()] if not trials.empty else trials
    if trials.empty:
        return None
    colors = [LANE_COLORS["exposed"] if b else LANE_COLORS["compute"] for b in trials["best"]]
    fig = _new_figure(10, 3.5)
    step_ax, scatter_ax = fig.subplots(1, 2)
    step_ax.bar(trials["name"], trials["step_ms"], color=colors)
    step_ax.set(title="Step time per trial (red: best)", ylabel="ms")
    step_ax.tick_params(axis="x", labelrotation=60, labelsize=7)
    scatter_ax.scatter(trials["step_ms"], 100 * trials["overlap_ratio"].astype(float), c=colors)
    scatter_ax.set(title="Overlap vs step time", xlabel="step ms", ylabel="overlap %")
    return fig


def plot_gpu_step(report: Report) -> Figure | None:
    """A GPU trial's device ms per step: a bar per part of the step, stacked by kernel class."""
    attribution = report.attribution if report.kind == "trial" else None
    if attribution is None or attribution.error:
        return None
    frame = get_attribution_frame(attribution)
    parts = list(dict.fromkeys(frame["part_title"]))
    fig = _new_figure(9, 4)
    ax = fig.subplots()
    bottom = dict.fromkeys(parts, 0.0)
    for cls in [c for c in CLASS_COLORS if c in set(frame["cls"])]:
        rows = frame[frame["cls"] == cls]
        heights = dict(zip(rows["part_title"], rows["ms"]))
        values = [heights.get(p, 0.0) for p in parts]
        ax.bar(
            parts, values, bottom=[bottom[p] for p in parts], color=CLASS_COLORS[cls], label=rows["class_title"].iloc[0]
        )
        bottom = {p: bottom[p] + v for p, v in zip(parts, values)}
    ax.set(title="GPU step: device time by part and kernel class", ylabel="ms per step")
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def write_pngs(report: Report, out_dir: Path) -> list[Path]:
    """One PNG per plot (``timeline``/``units``/``steps`` and on GPU ``gpu_step``, or ``trials`` for a search)."""
    plots = (
        {"trials": plot_trials}
        if report.kind == "search"
        else {"timeline": plot_timeline, "units": plot_units, "steps": plot_steps, "gpu_step": plot_gpu_step}
    )
    written = []
    for name, plot in plots.items():
        fig = plot(report)
        if fig is not None:
            path = out_dir / f"{name}.png"
            fig.savefig(path)
            written.append(path)
    return written
