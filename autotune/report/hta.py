"""HTA's (``hta``, package traceinsight) GPU analyses of the best and defaults trials' traces.

Temporal breakdown (idle / compute / non-compute share of each rank's GPU time), kernel
breakdown (time per kernel type) and idle time (per rank and CUDA stream: host wait, kernel
wait, other). All three read device kernels on CUDA streams; a CPU (gloo) trace has none, so on
CPU traces the report says they do not apply instead of drawing empty figures.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from autotune.report.frames import FigureSection
from autotune.report.gpu_step import add_attribution
from autotune.report.model import TrialSummary, TrialTraces

HTA_FIGURES = {
    "hta_temporal": "temporal breakdown",
    "hta_kernels": "kernel breakdown",
    "hta_idle": "idle time breakdown",
}
CPU_TRACES_LINE = (
    "HTA's temporal breakdown, kernel breakdown and idle time do not apply to these traces: they are CPU traces (gloo), "
    "and HTA's analyses read GPU kernels on CUDA streams, of which CPU traces have none."
)
_TEMPORAL = {
    "idle_time_pctg": ("idle", "#9d9d9d"),
    "compute_time_pctg": ("compute", "#4c78a8"),
    "non_compute_time_pctg": ("non-compute (comm, memory)", "#f58518"),
}
_IDLE_COLORS = {"host_wait": "#b279a2", "kernel_wait": "#54a24b", "other": "#9d9d9d"}


def run_hta(paths: list[Path]) -> dict[str, pd.DataFrame]:
    """HTA's three analyses of one trial's traces (one per rank), all ranks, every profiled step:
    ``temporal`` (rank, *_pctg), ``kernels`` (kernel_type, sum, percentage), ``idle`` (rank, stream,
    idle_category, idle_time, idle_time_ratio)."""
    from autotune.analysis import FsdpTraceAnalysis, open_hta_analysis

    ranks = {rank: trace.path for rank, trace in FsdpTraceAnalysis(paths).traces.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HTA's own pandas deprecations, not ours to act on
        analysis = open_hta_analysis(ranks)
        kernels, _ = analysis.get_gpu_kernel_breakdown(visualize=False, include_memory_kernels=True)
        idle, _ = analysis.get_idle_time_breakdown(ranks=list(ranks), visualize=False)
        return {"temporal": analysis.get_temporal_breakdown(visualize=False), "kernels": kernels, "idle": idle}


def get_temporal_figure(results: dict[str, dict[str, pd.DataFrame]]) -> go.Figure:
    """Stacked bars per (trial, rank): % of the rank's GPU time idle, computing, in other kernels."""
    fig = go.Figure()
    for column, (name, color) in _TEMPORAL.items():
        x = [
            [label for label, r in results.items() for _ in r["temporal"]["rank"]],
            [f"rank {k}" for r in results.values() for k in r["temporal"]["rank"]],
        ]
        y = [v for r in results.values() for v in r["temporal"][column]]
        fig.add_bar(x=x, y=y, name=name, marker_color=color)
    fig.update_layout(
        title="HTA temporal breakdown (% of each rank's GPU time)",
        barmode="stack",
        yaxis_title="%",
        yaxis_range=[0, 100],
    )
    return fig


def get_kernel_figure(results: dict[str, dict[str, pd.DataFrame]]) -> go.Figure:
    """Grouped bars per kernel type: its share of GPU kernel time in each trial (all ranks)."""
    fig = go.Figure()
    for label, r in results.items():
        kernels = r["kernels"]
        fig.add_bar(
            x=kernels["kernel_type"],
            y=kernels["percentage"],
            name=label,
            customdata=kernels["sum"] / 1e3,
            hovertemplate="%{x}: %{y:.1f}% (%{customdata:.2f} ms)<extra>" + label + "</extra>",
        )
    fig.update_layout(title="HTA kernel breakdown (% of GPU kernel time, all ranks)", barmode="group", yaxis_title="%")
    return fig


def get_idle_figure(results: dict[str, dict[str, pd.DataFrame]]) -> go.Figure:
    """Stacked bars per (trial, rank and stream): idle time by HTA's category, ms."""
    idle = pd.concat([r["idle"].assign(trial=label) for label, r in results.items()], ignore_index=True)
    idle["where"] = [f"rank {k} stream {s}" for k, s in zip(idle["rank"], idle["stream"])]
    fig = go.Figure()
    for category, color in _IDLE_COLORS.items():
        rows = idle[idle["idle_category"] == category]
        if not rows.empty:
            fig.add_bar(x=[rows["trial"], rows["where"]], y=rows["idle_time"] / 1e3, name=category, marker_color=color)
    fig.update_layout(title="HTA idle time per rank and CUDA stream (ms, by cause)", barmode="stack", yaxis_title="ms")
    return fig


def get_hta_section(compared: dict[str, tuple[TrialSummary, TrialTraces]]) -> FigureSection:
    """The HTA part of a search report for best and defaults (``compared`` from
    :func:`autotune.report.compare.get_compared_traces`), with each GPU trial's step attribution
    beside HTA's figures (:mod:`autotune.report.gpu_step`)."""
    section = FigureSection(title="HTA analyses (GPU traces)")
    gpu = {label: traces for label, (_, traces) in compared.items() if traces.device == "gpu"}
    if not gpu:
        devices = {traces.device for _, traces in compared.values()}
        if "cpu" in devices:
            section.lines.append(CPU_TRACES_LINE)
        else:
            reasons = (
                "; ".join(f"{label}: {traces.error}" for label, (_, traces) in compared.items())
                or "no trial to analyse"
            )
            section.absent = dict.fromkeys(HTA_FIGURES, f"no traces HTA could read ({reasons})")
        return section
    section.title = "HTA analyses and the GPU step attribution (GPU traces)"
    _add_hta(section, gpu)
    add_attribution(section, {label: traces.attribution for label, traces in gpu.items()})
    return section


def _add_hta(section: FigureSection, gpu: dict[str, TrialTraces]) -> None:
    """HTA's three figures of each GPU trial's traces, or one line per trial HTA failed on."""
    results: dict[str, Any] = {}
    for label, traces in gpu.items():
        try:
            results[label] = run_hta(traces.paths)
        except Exception as e:  # HTA is a third-party parser: any failure is one line, the report stands
            section.lines.append(
                f"HTA failed on {label}'s traces: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            )
    if not results:
        section.absent.update(dict.fromkeys(HTA_FIGURES, "HTA could not analyse the traces (see above)"))
        return
    section.lines += [
        f"{label}: HTA read {len(gpu[label].paths)} traces in {gpu[label].paths[0].parent}" for label in results
    ]
    for name, draw in (
        ("hta_temporal", get_temporal_figure),
        ("hta_kernels", get_kernel_figure),
        ("hta_idle", get_idle_figure),
    ):
        section.figures[name] = draw(results)
