"""The report's data: what one trial, or a search, measured. Plain data; rendering lives elsewhere."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pandas as pd

from autotune.analysis import FsdpTraceAnalysis, TraceError
from autotune.search import SearchRecord
from fsdp_runtime.errors import AutotuneError

REPORT_SCHEMA_VERSION = 1
TRACE_GLOB = "trace_rank*.json*"


class ReportError(AutotuneError):
    """A report's input dir is missing, unreadable or neither a trial nor a search dir."""


@dataclass(kw_only=True)
class TrialSummary:
    """One trial as the report sees it."""

    name: str
    path: Path
    status: str
    reason: str = ""
    step_ms: float | None = None
    """Median unprofiled step time (``metrics.json``); None without metrics.json."""
    ratio: float | None = None
    """A paired trial's median step-time ratio against the defaults (see [Note: paired measurement])."""
    ratio_spread: float | None = None
    profiler_overhead: float | None = None
    """Profiled / unprofiled step time of the trial: how far its traces are from the timed steps."""
    process_peak_bytes: int | None = None
    feasible: bool = True
    """Within the search's memory budget (from ``results.json``; True without one)."""
    trace_metrics: dict[str, Any] | None = None
    """``autotune.analysis.summarize_traces`` output (from metrics.json, else from the traces)."""
    analysis_error: str | None = None

    @property
    def succeeded(self) -> bool:
        return self.status == "ok"

    @property
    def objective(self) -> float | None:
        return self.ratio if self.ratio is not None else self.step_ms

    def get_aggregate(self, key: str) -> Any:
        return ((self.trace_metrics or {}).get("aggregate") or {}).get(key)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "status": self.status, "reason": self.reason, "step_ms": self.step_ms, "ratio": self.ratio,
            "ratio_spread": self.ratio_spread, "profiler_overhead": self.profiler_overhead,
            "process_peak_bytes": self.process_peak_bytes, "feasible": self.feasible, "analysis_error": self.analysis_error,
            "trace_metrics": self.trace_metrics,
        }  # fmt: skip


@dataclass(kw_only=True)
class ReportTable:
    """Plain rows for a terminal table: values are already formatted strings."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)


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
    timeline_error: str | None = None
    """Why the timeline could not be built (an unusable trace), once :attr:`timeline` was asked for."""
    _timeline: pd.DataFrame | None = field(default=None, repr=False)

    @property
    def timeline(self) -> pd.DataFrame | None:
        """``FsdpTraceAnalysis.get_timeline()`` of a trial's traces (read on first use), else None."""
        if self._timeline is None and self.trace_paths and self.timeline_error is None:
            try:
                self._timeline = FsdpTraceAnalysis(self.trace_paths).get_timeline()
            except TraceError as e:
                self.timeline_error = str(e)
        return self._timeline

    def to_json(self) -> dict[str, Any]:
        """The report's summary as JSON-able data (what ``autotune report --json`` prints)."""
        trials = [t.to_json() for t in self.trials]
        body = {"schema_version": REPORT_SCHEMA_VERSION, "kind": f"{self.kind}_report", "dir": str(self.root)}
        if self.kind == "trial":
            return body | trials[0]
        search = self.search.to_dict() if self.search else None
        return body | {"best": self.best.name if self.best else None, "search": search, "trials": trials}
