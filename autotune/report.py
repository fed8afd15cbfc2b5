"""``autotune report DIR``: what one trial, or a whole search, measured.

    from autotune.report import load_report, write_report
    report = load_report("runs/t0")          # a trial dir, or a search dir (trials/*/metrics.json)
    report.get_tables()                      # plain rows for a terminal (cli.py renders them)
    write_report(report, "runs/t0/report")   # report.html (self-contained) + PNGs

A *trial dir* holds ``metrics.json`` (``kind: trial_metrics``, with the trace summary
under ``trace_metrics``) and ``trace_rank<N>.json[.gz]``; a dir with only traces works
too. A *search dir* holds trial dirs under ``trials/``: the report is their summaries
plus the best one: the trial named by ``search.json``'s ``best.trial_dir`` when the
search wrote one (it knows about pruning and memory budgets), else the ``ok`` trial with
the lowest unprofiled ``step_ms``. The traces are only read, never rewritten: they stay openable in
Perfetto / chrome://tracing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pandas as pd

from autotune.analysis import FsdpTraceAnalysis, TraceError
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
    peak_memory_bytes: int | None = None
    trace_metrics: dict[str, Any] | None = None
    """``autotune.analysis.summarize_traces`` output (from metrics.json, else from the traces)."""
    analysis_error: str | None = None

    def get_aggregate(self, key: str) -> Any:
        return ((self.trace_metrics or {}).get("aggregate") or {}).get(key)


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
    search: dict[str, Any] | None = None
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
        trials = [_trial_json(t) for t in self.trials]
        body = {"schema_version": REPORT_SCHEMA_VERSION, "kind": f"{self.kind}_report", "dir": str(self.root)}
        if self.kind == "trial":
            return body | trials[0]
        return body | {"best": self.best.name if self.best else None, "search": self.search, "trials": trials}

    def get_tables(self) -> list[ReportTable]:
        from autotune._report_tables import get_search_tables, get_trial_tables

        return get_trial_tables(self.trials[0]) if self.kind == "trial" else get_search_tables(self.trials, self.best, self.search)


def _trial_json(trial: TrialSummary) -> dict[str, Any]:
    return {
        "name": trial.name, "status": trial.status, "reason": trial.reason, "step_ms": trial.step_ms,
        "peak_memory_bytes": trial.peak_memory_bytes, "analysis_error": trial.analysis_error,
        "trace_metrics": trial.trace_metrics,
    }  # fmt: skip


def _read_metrics(path: Path) -> dict[str, Any]:
    try:
        metrics = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReportError(f"{path}: unreadable metrics ({e})") from None
    if not isinstance(metrics, dict) or metrics.get("kind") != "trial_metrics":
        raise ReportError(f"{path}: not a trial's metrics.json (expected kind 'trial_metrics')")
    return metrics


def load_trial(trial_dir: Path, *, analyze_traces: bool = True) -> TrialSummary:
    """A trial dir's summary; traces are analysed when metrics.json has no trace summary.

    An unusable trace (e.g. a trial killed while writing it) becomes ``analysis_error``.
    """
    metrics_path = trial_dir / "metrics.json"
    metrics = _read_metrics(metrics_path) if metrics_path.exists() else {"status": "unknown"}
    trial = TrialSummary(
        name=trial_dir.name,
        path=trial_dir,
        status=str(metrics.get("status", "unknown")),
        reason=str(metrics.get("reason") or ""),
        step_ms=metrics.get("step_ms"),
        peak_memory_bytes=metrics.get("peak_memory_bytes"),
        trace_metrics=metrics.get("trace_metrics"),
        analysis_error=metrics.get("analysis_error"),
    )
    traces = sorted(trial_dir.glob(TRACE_GLOB))
    if trial.trace_metrics is None and traces and analyze_traces:
        try:
            trial.trace_metrics = FsdpTraceAnalysis(traces).summarize()
        except TraceError as e:
            trial.analysis_error = str(e)
    return trial


def pick_best(trials: list[TrialSummary]) -> TrialSummary | None:
    """The ``ok`` trial with the lowest unprofiled step time."""
    ok = [t for t in trials if t.status == "ok" and t.step_ms is not None]
    return min(ok, key=lambda t: t.step_ms) if ok else None


def build_search_report(root: Path, trials: list[TrialSummary], *, best: str | None = None) -> Report:
    """A search report from trial summaries; ``best`` names the winner, else :func:`pick_best`."""
    chosen = next((t for t in trials if t.name == best), None) if best else pick_best(trials)
    return Report(kind="search", root=root, trials=trials, best=chosen)


def _read_search_summary(root: Path) -> dict[str, Any] | None:
    """``search.json`` (``kind: search_summary``) if the search wrote one."""
    try:
        summary = json.loads((root / "search.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and summary.get("kind") == "search_summary" else None


def _get_search_best(summary: dict[str, Any] | None) -> str | None:
    """The best trial's dir name from the search summary."""
    try:
        return Path(summary["best"]["trial_dir"]).name  # type: ignore[index]
    except (KeyError, TypeError):
        return None


def load_report(path: str | Path) -> Report:
    """A trial report (``metrics.json`` or traces in ``path``) or a search report (``path/trials/*/metrics.json``)."""
    root = Path(path)
    if not root.is_dir():
        raise ReportError(f"{root}: no such directory")
    if (root / "metrics.json").exists() or any(root.glob(TRACE_GLOB)):
        trial = load_trial(root)
        return Report(kind="trial", root=root, trials=[trial], best=trial, trace_paths=sorted(root.glob(TRACE_GLOB)))
    trial_dirs = sorted(p.parent for p in root.glob("trials/*/metrics.json"))
    if trial_dirs:
        summary = _read_search_summary(root)
        report = build_search_report(root, [load_trial(d, analyze_traces=False) for d in trial_dirs], best=_get_search_best(summary))
        report.search = summary
        return report
    raise ReportError(f"{root}: neither a trial dir (metrics.json or {TRACE_GLOB}) nor a search dir (trials/*/metrics.json)")


def write_report(report: Report, out_dir: str | Path) -> list[Path]:
    """Write ``report.html`` (plotly.js inline: opens offline) and one PNG per plot; returns the paths."""
    from autotune._report_html import write_html
    from autotune._report_png import write_pngs

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [write_html(report, out / "report.html"), *write_pngs(report, out)]
