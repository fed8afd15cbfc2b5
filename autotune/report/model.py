"""The report's data: what one trial, or a search, measured. Plain data; rendering lives elsewhere."""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pandas as pd

from autotune.analysis import FsdpTraceAnalysis, PipelineLayout, TraceError
from autotune.report.attribution import StepAttribution, get_step_attribution
from autotune.report.host_time import HostTime
from autotune.search import SearchRecord, TrialRow
from autotune.trials import TrialFigures
from fsdp_runtime.errors import AutotuneError

REPORT_SCHEMA_VERSION = 1
TRACE_GLOB = "trace_rank*.json*"
OVERHEAD_TOLERANCE = 0.03
"""A trial whose profiled steps are further than this from its unprofiled ones (wall) has its
trace times scaled in the report (see [Note: scaled trace times])."""
MAX_STEP_NOISE = 0.2
"""A rank's own unprofiled steps agree when their median absolute deviation is at most this
share of their median (two steps: the slower at most 1.5x the faster); otherwise their median is
no step time to scale a trace to, and the report shows it as measured."""
TRACE_SCALE_RANGE = (0.5, 2.0)
"""The per-rank trace scales the report applies. On this 2-core box the profiled / unprofiled
wall ratio measured 0.55-1.72 with the load moving between the windows (the profiler's own cost
is a few %, [Note: what a trial measures]): a scale beyond this says that the load differed,
not what the profiler cost."""


class ReportError(AutotuneError):
    """A report's input dir is missing, unreadable or neither a trial nor a search dir."""


@dataclass(kw_only=True)
class TrialSummary(TrialFigures):
    """One trial dir as the report sees it: its :class:`~autotune.trials.TrialFigures` (from
    ``metrics.json``; :attr:`feasible` from the search's ``results.json``), traces and profiler cost."""

    name: str
    path: Path
    profiler_cpu_overhead: float | None = None
    """Profiled / unprofiled training-thread CPU time (:attr:`profiler_overhead` is the wall time's)."""
    profiler: dict[str, Any] = field(default_factory=dict)
    """``metrics.json``'s ``profiler`` (page faults, per-rank figures with ``trace_scale``); empty before v4."""
    own_step_ms: dict[int, list[float]] = field(default_factory=dict)
    """Per rank, its own unprofiled step times (``metrics.json``'s ``ranks``): whether the trace scale is trusted."""
    trace_metrics: dict[str, Any] | None = None
    """``autotune.analysis.summarize_traces`` output (from metrics.json, else from the traces)."""
    analysis_error: str | None = None
    shard_size: int | None = None
    """Ranks per shard group (``metrics.json``'s mesh and world size); None without ``metrics.json``."""

    @property
    def trace_scale(self) -> dict[int, float] | None:
        """Per rank, the factor this trial's trace times are shown scaled by, or None when they are
        shown as measured (overhead within :data:`OVERHEAD_TOLERANCE`, no per-rank figures, or a
        scale not to trust: :attr:`trace_scale_refused`)."""
        if not self._beyond_tolerance() or self.trace_scale_refused:
            return None
        return {r["rank"]: r["trace_scale"] for r in self.profiler["per_rank"]}

    @property
    def trace_scale_refused(self) -> str | None:
        """Why trace times beyond :data:`OVERHEAD_TOLERANCE` are shown as measured, not scaled: a rank
        whose unprofiled steps disagree (:data:`MAX_STEP_NOISE`) or whose scale is outside
        :data:`TRACE_SCALE_RANGE`; None when they are scaled or within the tolerance."""
        if not self._beyond_tolerance():
            return None
        low, high = TRACE_SCALE_RANGE
        for figures in self.profiler["per_rank"]:
            rank, scale = figures["rank"], figures["trace_scale"]
            steps = self.own_step_ms.get(rank, [])
            noise = _relative_mad(steps) if len(steps) > 1 else 0.0
            if noise > MAX_STEP_NOISE:
                return (
                    f"rank {rank}'s unprofiled steps disagree ({min(steps):.0f} to {max(steps):.0f} ms, "
                    f"deviation {100 * noise:.0f}% of their median > {100 * MAX_STEP_NOISE:.0f}%)"
                )
            if not low <= scale <= high:
                return (
                    f"rank {rank}'s scale ×{scale:.2f} is outside ×{low:.1f}-×{high:.1f} "
                    "(the load differed between the timed and the traced steps)"
                )
        return None

    def _beyond_tolerance(self) -> bool:
        return bool(
            self.profiler.get("per_rank")
            and self.profiler_overhead is not None
            and abs(self.profiler_overhead - 1) > OVERHEAD_TOLERANCE
        )

    @property
    def shown_trace_metrics(self) -> dict[str, Any] | None:
        """The trace summary the report shows: :attr:`trace_metrics` scaled by :attr:`trace_scale`."""
        scale = self.trace_scale
        return (
            scale_trace_metrics(self.trace_metrics, scale)
            if self.trace_metrics is not None and scale
            else self.trace_metrics
        )

    def get_aggregate(self, key: str) -> Any:
        """A field of the shown trace summary's cross-rank aggregate."""
        return ((self.shown_trace_metrics or {}).get("aggregate") or {}).get(key)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "reason": self.reason,
            "step_ms": self.step_ms,
            "ratio": self.ratio,
            "ratio_spread": self.ratio_spread,
            "profiler_overhead": self.profiler_overhead,
            "profiler_cpu_overhead": self.profiler_cpu_overhead,
            "process_peak_bytes": self.process_peak_bytes,
            "feasible": self.feasible,
            "analysis_error": self.analysis_error,
            "trace_metrics": self.trace_metrics,
            "trace_scale": self.trace_scale,
            "trace_scale_refused": self.trace_scale_refused,
        }


def _relative_mad(values: list[float]) -> float:
    median = statistics.median(values)
    return statistics.median(abs(v - median) for v in values) / median if median > 0 else 0.0


def _scale_row(row: dict[str, Any], factor: float) -> dict[str, Any]:
    return {k: v * factor if k.endswith("_ms") and isinstance(v, (int, float)) else v for k, v in row.items()}


def scale_trace_metrics(summary: dict[str, Any], scale: dict[int, float]) -> dict[str, Any]:
    """``summary`` with every time (``*_ms``) of rank r's steps and units multiplied by ``scale[r]``.

    [Note: scaled trace times]
    The traced steps are not the timed ones: the profiler slows them (on CPU a few % of CPU
    time once the heap is prefaulted, and the load on a shared box can move by more between
    the two windows; see [Note: what a trial measures]), so raw trace times can describe a
    slower step than the one timed: compute alone could exceed it. Where the trial's overhead is
    beyond :data:`OVERHEAD_TOLERANCE`, the report shows every trace *time* of rank r (step,
    compute, comm per kind, exposed, barrier, bound, per unit) times s_r = rank r's median
    unprofiled step / its median profiled step (both its own wall times), and leaves
    ratios (overlap, step / bound), counts and bytes as measured. It does so only where every
    rank's unprofiled steps agree (:data:`MAX_STEP_NOISE`) and every s_r lies in
    :data:`TRACE_SCALE_RANGE`: a world-1 trial timed at 141 and 412 ms on a busy box had
    s = 9.4, which describes the load, not the profiler; such a trace is shown as measured
    and the report says why. The cross-rank aggregate's
    step figures are the medians of the scaled rows (as the analysis defines them); its
    per-unit figures (the summary keeps no per-step unit rows) are scaled by the median s_r,
    and a pipeline stage's figures by the median s_r of the ranks holding it.
    Uniform scaling assumes the profiler's cost is spread over the step in proportion to
    time (its per-op recording and page faults are: both follow the ops); comm on gloo's own
    threads is scaled too. ``metrics.json`` keeps the raw summary: scaling is presentation
    only, and the report says how it scaled in one line (:func:`autotune.report.tables.describe_profiler`).
    """
    scaled = copy.deepcopy(summary)
    middle = statistics.median(scale.values())
    for rank in scaled.get("per_rank", []):
        factor = scale.get(rank["rank"], middle)
        rank["steps"] = [_scale_row(step, factor) for step in rank.get("steps", [])]
        rank["per_unit"] = [_scale_row(unit, factor) for unit in rank.get("per_unit", [])]
    aggregate = scaled.get("aggregate")
    if aggregate:
        rows = [step for rank in scaled.get("per_rank", []) for step in rank["steps"]]
        for key in [k for k in aggregate if k.endswith("_ms")]:
            values = [row[key] for row in rows if isinstance(row.get(key), (int, float))]
            aggregate[key] = statistics.median(values) if values else _scale_row({key: aggregate[key]}, middle)[key]
        aggregate["per_unit"] = [_scale_row(unit, middle) for unit in aggregate.get("per_unit", [])]
    for stage in (scaled.get("pipeline") or {}).get("stages", []):
        stage.update(_scale_row(stage, statistics.median([scale.get(r, middle) for r in stage["ranks"]] or [middle])))
    return scaled


@dataclass(kw_only=True)
class ReportTable:
    """Plain rows for a terminal table: values are already formatted strings."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    cell_titles: dict[tuple[int, int], str] = field(default_factory=dict)
    """``(row, column)`` -> the full text of a cell that shows less (a trial's knobs as the change from
    the defaults, a cut note); the HTML report shows it on hover."""
    one_line: bool = False
    """The HTML report keeps each row on one line (its cells do not wrap)."""


@dataclass(kw_only=True)
class Comparison:
    """Best vs defaults side by side (a search report): which trial is shown as "best", and why that one.

    "Best" is the emitted config: the final round's winner (``search.json``'s
    ``confirmation.winner``); without one (no final round, or the defaults were emitted) the
    search's lowest objective. The lowest objective can be another trial than the emitted one:
    :attr:`note` says which is which."""

    best: TrialSummary
    best_number: int | None
    default: TrialSummary | None
    default_number: int | None
    lowest_number: int | None
    """The trial with the lowest objective in the search (``search.json``'s ``best``)."""
    emitted: bool
    """Whether :attr:`best` is the emitted config (False: the defaults were emitted, or no final round ran)."""
    note: str
    """One line naming the emitted trial first, then the lowest-objective one where it differs."""

    @property
    def best_label(self) -> str:
        return f"best: trial {self.best_number}" + (" (emitted)" if self.emitted else " (lowest ratio)")

    @property
    def default_label(self) -> str:
        return f"defaults: trial {self.default_number}"


@dataclass(kw_only=True)
class TrialTraces:
    """One trial's traces loaded for the report: its timeline and device (``cpu``/``gpu``), or why not."""

    paths: list[Path] = field(default_factory=list)
    device: str | None = None
    timeline: pd.DataFrame | None = None
    attribution: StepAttribution | None = None
    """GPU traces: where the step's device time goes ([Note: GPU step attribution]); None on CPU."""
    host: HostTime | None = None
    """FSDP2's own host time ([Note: host-bound steps]); None without FSDP labels."""
    error: str | None = None


@dataclass(kw_only=True)
class Report:
    kind: Literal["trial", "search"]
    root: Path
    trials: list[TrialSummary]
    best: TrialSummary | None = None
    trace_paths: list[Path] = field(default_factory=list)
    """A trial report's traces (empty for a search report)."""
    search: SearchRecord | None = None
    """A search report's ``search.json`` (proxy, confirmation vs defaults, consolidation timing)."""
    rows: list[TrialRow] = field(default_factory=list)
    """A search report's rows (``results.json``, or the finished search's own): knobs, noise, attempts."""
    comparison: Comparison | None = None
    """A search report's best vs defaults (None without a successful trial)."""
    storage: str | None = None
    """The search's Optuna storage URL (None: ``<root>/study.db`` when it exists)."""
    study_name: str | None = None
    """The study in :attr:`storage` (None: the only study there)."""
    timeline_error: str | None = None
    """Why the timeline could not be built (an unusable trace), once :attr:`timeline` was asked for."""
    pipeline: PipelineLayout | None = None
    """A pipeline trial's layout (its ``config.toml``): the traces are read with it."""
    _analysis: FsdpTraceAnalysis | None = field(default=None, repr=False)
    _timeline: pd.DataFrame | None = field(default=None, repr=False)
    _attribution: StepAttribution | None = field(default=None, repr=False)

    @property
    def analysis(self) -> FsdpTraceAnalysis | None:
        """A trial report's traces, parsed once on first use (the timeline and the attribution read
        them); None without traces or when they are unusable (:attr:`timeline_error` says why)."""
        if self._analysis is None and self.trace_paths and self.timeline_error is None:
            try:
                self._analysis = FsdpTraceAnalysis(self.trace_paths, pipeline=self.pipeline)
            except TraceError as e:
                self.timeline_error = str(e)
        return self._analysis

    @property
    def timeline(self) -> pd.DataFrame | None:
        """``FsdpTraceAnalysis.get_timeline()`` of a trial's traces (read on first use), else None."""
        if self._timeline is None and self.timeline_error is None and self.analysis is not None:
            try:
                self._timeline = self.analysis.get_timeline()
            except TraceError as e:
                self.timeline_error = str(e)
        return self._timeline

    @property
    def attribution(self) -> StepAttribution | None:
        """A GPU trial's device time per step by kernel class and part ([Note: GPU step attribution]),
        computed on first use; None for a search report, a CPU trial or unusable traces."""
        if self._attribution is None and self.kind == "trial" and self.analysis is not None:
            self._attribution = get_step_attribution(self.analysis, shard_size=self.trials[0].shard_size)
        return self._attribution

    def to_json(self) -> dict[str, Any]:
        """The report's summary as JSON-able data (what ``autotune report --json`` prints)."""
        trials = [t.to_json() for t in self.trials]
        body = {"schema_version": REPORT_SCHEMA_VERSION, "kind": f"{self.kind}_report", "dir": str(self.root)}
        if self.kind == "trial":
            return body | trials[0]
        search = self.search.to_dict() if self.search else None
        return body | {"best": self.best.name if self.best else None, "search": search, "trials": trials}
