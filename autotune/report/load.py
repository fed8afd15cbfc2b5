"""Read a trial dir or a search dir into a :class:`~autotune.report.model.Report`.

A *trial dir* holds ``metrics.json`` and ``trace_rank<N>.json[.gz]``; a dir with only
traces works too, and so does any dir of Chrome/Kineto trace files, one per rank, named
anyhow (``*.json``, ``*.json.gz``, e.g. ``worker0.pt.trace.json``): see :func:`find_traces`. A *search dir* holds trial dirs under ``trials/``: the report is their
summaries plus the best one: the trial named by ``search.json``'s ``best.trial_dir`` when
the search wrote one, else :func:`autotune.search.pick_best` over the trials (with the
feasibility ``results.json`` recorded). The traces are only read, never rewritten: they
stay openable in Perfetto / chrome://tracing.
"""

from __future__ import annotations

import gzip
import re
import zlib
from pathlib import Path

from autotune.analysis import FsdpTraceAnalysis, TraceError
from autotune.artifacts import ArtifactError
from autotune.report.model import TRACE_GLOB, Report, ReportError, TrialSummary
from autotune.search import SearchRecord, pick_best, read_results
from autotune.trials import INCOMPLETE_MARKER, TrialMetrics


ARTIFACT_NAMES = frozenset({"metrics.json", "env.json", "search.json", "results.json", "best.json"})
"""The JSON files fsdp-autotune itself writes into trial and search dirs: never traces."""
_SNIFF_BYTES = 1 << 20
_BARE_ARRAY = re.compile(rb'^\s*\[\s*(\]|\{\s*")')


def _looks_like_trace(path: Path) -> bool:
    """Whether a file's first MB is a chrome trace's: a ``traceEvents`` key (torch.profiler,
    Kineto) or the bare-array form of the format. Our artifacts are objects with ``kind``."""
    try:
        with path.open("rb") as f:
            head = f.read(2)
            f.seek(0)
            if head == b"\x1f\x8b":
                with gzip.open(f) as g:
                    prefix = g.read(_SNIFF_BYTES)
            else:
                prefix = f.read(_SNIFF_BYTES)
    except (OSError, EOFError, zlib.error):
        return False
    return b'"traceEvents"' in prefix or _BARE_ARRAY.match(prefix) is not None


def find_traces(folder: Path) -> list[Path]:
    """The chrome traces in ``folder``, sorted by name (not recursive).

    ``trace_rank*.json[.gz]`` (what ``autotune trial`` writes) and ``*.pt.trace.json[.gz]``
    (torch's ``tensorboard_trace_handler``) always count, even when unreadable (the analysis
    then says what is wrong with them); any other ``*.json`` / ``*.json.gz`` counts when its
    content is a chrome trace. fsdp-autotune's own artifacts (:data:`ARTIFACT_NAMES`) never
    do. Each trace's rank comes from its ``distributedInfo``, else ``rank<N>`` in its name,
    else it takes the smallest rank no other trace claims (in this list's order).
    """
    found = []
    for path in sorted(p for p in folder.iterdir() if p.name.endswith((".json", ".json.gz"))):
        if path.name in ARTIFACT_NAMES or not path.is_file():
            continue
        if path.match(TRACE_GLOB) or path.name.endswith((".pt.trace.json", ".pt.trace.json.gz")) or _looks_like_trace(path):
            found.append(path)
    return found


def load_trial(trial_dir: Path, *, analyze_traces: bool = True, feasible: bool = True) -> TrialSummary:
    """A trial dir's summary; traces are analysed when metrics.json has no trace summary.

    An unusable trace (e.g. a trial killed while writing it) becomes ``analysis_error``.
    """
    trial = TrialSummary(name=trial_dir.name, path=trial_dir, status="unknown", feasible=feasible)
    marker = trial_dir / INCOMPLETE_MARKER
    if marker.exists() and not (trial_dir / "metrics.json").exists():
        trial.status, trial.reason = "incomplete", marker.read_text(encoding="utf-8", errors="replace").strip()
    if (trial_dir / "metrics.json").exists():
        try:
            metrics = TrialMetrics.read(trial_dir / "metrics.json")
        except ArtifactError as e:
            raise ReportError(str(e)) from None
        trial.status, trial.reason, trial.step_ms = metrics.status, metrics.reason, metrics.step_ms
        trial.ratio, trial.ratio_spread, trial.profiler_overhead = metrics.ratio, metrics.paired.get("ratio_spread"), metrics.profiler_overhead
        trial.profiler_cpu_overhead, trial.profiler = metrics.profiler_cpu_overhead, metrics.profiler
        trial.process_peak_bytes, trial.trace_metrics, trial.analysis_error = metrics.process_peak_bytes, metrics.trace_metrics, metrics.analysis_error
    traces = find_traces(trial_dir)
    if trial.trace_metrics is None and traces and analyze_traces:
        try:
            trial.trace_metrics = FsdpTraceAnalysis(traces).summarize()
        except TraceError as e:
            trial.analysis_error = str(e)
    return trial


def _read_search(root: Path) -> SearchRecord | None:
    """``search.json`` if the search wrote one; a file that is not one is an error."""
    if not (root / "search.json").exists():
        return None
    try:
        return SearchRecord.read(root / "search.json")
    except ArtifactError as e:
        raise ReportError(str(e)) from None


def _read_feasibility(root: Path) -> dict[str, bool]:
    """Trial dir name -> feasible, from ``results.json`` (empty when the search wrote none)."""
    if not (root / "results.json").exists():
        return {}
    try:
        return {Path(r.trial_dir).name: r.feasible for r in read_results(root) if r.trial_dir}
    except ArtifactError as e:
        raise ReportError(str(e)) from None


def load_search(root: Path, *, search: SearchRecord | None = None) -> Report:
    """A search dir's report; ``search`` replaces its ``search.json`` (a worker reporting its own record)."""
    trial_dirs = sorted({p.parent for pattern in ("trials/*/metrics.json", f"trials/*/{INCOMPLETE_MARKER}") for p in root.glob(pattern)})
    feasible = _read_feasibility(root)
    trials = [load_trial(d, analyze_traces=False, feasible=feasible.get(d.name, True)) for d in trial_dirs]
    record = search or _read_search(root)
    named = Path(record.best.trial_dir).name if record and record.best and record.best.trial_dir else None
    best = next((t for t in trials if t.name == named), None) if named else pick_best(trials)
    return Report(kind="search", root=root, trials=trials, best=best, search=record)


def load_report(path: str | Path, *, search: SearchRecord | None = None) -> Report:
    """A trial report (``metrics.json`` or traces in ``path``) or a search report (``path/trials/*/metrics.json``;
    ``search`` in place of its ``search.json``)."""
    root = Path(path)
    if not root.is_dir():
        raise ReportError(f"{root}: no such directory")
    traces = find_traces(root)
    if (root / "metrics.json").exists() or traces:
        trial = load_trial(root)
        return Report(kind="trial", root=root, trials=[trial], best=trial, trace_paths=traces)
    if any(root.glob("trials/*/metrics.json")):
        return load_search(root, search=search)
    raise ReportError(f"{root}: neither a trial dir (metrics.json or chrome trace files: {TRACE_GLOB}, *.json, *.json.gz) nor a search dir (trials/*/metrics.json)")
