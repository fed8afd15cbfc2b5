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

from autotune.analysis import FsdpTraceAnalysis, PipelineLayout, TraceError
from autotune.artifacts import ArtifactError
from autotune.report.attribution import get_step_attribution
from autotune.report.host_time import get_host_time
from autotune.report.model import TRACE_GLOB, Comparison, Report, ReportError, TrialSummary, TrialTraces
from autotune.search import SearchRecord, TrialRow, pick_best, read_results
from autotune.trials import INCOMPLETE_MARKER, TrialMetrics
from fsdp_runtime import AutotuneError, load_config

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
        if (
            path.match(TRACE_GLOB)
            or path.name.endswith((".pt.trace.json", ".pt.trace.json.gz"))
            or _looks_like_trace(path)
        ):
            found.append(path)
    return found


def read_pipeline_layout(trial_dir: Path) -> PipelineLayout | None:
    """The pipeline layout of the trial dir's ``config.toml``; None without stages, or without a readable config."""
    try:
        return PipelineLayout.from_config(load_config(trial_dir / "config.toml"))
    except AutotuneError:
        return None


def load_trial(trial_dir: Path, *, analyze_traces: bool = True, feasible: bool = True) -> TrialSummary:
    """A trial dir's summary; traces are analysed when metrics.json has no trace summary, or when a
    pipeline trial's summary has no pipeline figures (written before trace summary v4), with the
    pipeline layout of the dir's ``config.toml``.

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
        trial.ratio, trial.ratio_spread, trial.profiler_overhead = (
            metrics.ratio,
            metrics.paired.get("ratio_spread"),
            metrics.profiler_overhead,
        )
        trial.profiler_cpu_overhead, trial.profiler = metrics.profiler_cpu_overhead, metrics.profiler
        trial.own_step_ms = {r.rank: list(r.own_step_ms) for r in metrics.ranks}
        trial.process_peak_bytes, trial.trace_metrics, trial.analysis_error = (
            metrics.process_peak_bytes,
            metrics.trace_metrics,
            metrics.analysis_error,
        )
        trial.shard_size = get_shard_size(metrics)
    traces = find_traces(trial_dir)
    pipeline = read_pipeline_layout(trial_dir)
    stale = pipeline is not None and trial.trace_metrics is not None and trial.trace_metrics.get("pipeline") is None
    if (trial.trace_metrics is None or stale) and traces and analyze_traces:
        try:
            trial.trace_metrics = FsdpTraceAnalysis(traces, pipeline=pipeline).summarize()
        except TraceError as e:
            trial.analysis_error = str(e)
    return trial


def get_shard_size(metrics: TrialMetrics) -> int:
    """Ranks per shard group of a trial: its mesh's ``shard``, else its world size over ``replicate``."""
    mesh = metrics.mesh or {}
    return int(mesh.get("shard") or max(metrics.world_size // max(int(mesh.get("replicate") or 1), 1), 1))


def _read_search(root: Path) -> SearchRecord | None:
    """``search.json`` if the search wrote one; a file that is not one is an error."""
    if not (root / "search.json").exists():
        return None
    try:
        return SearchRecord.read(root / "search.json")
    except ArtifactError as e:
        raise ReportError(str(e)) from None


def _read_rows(root: Path) -> list[TrialRow]:
    """The rows of ``results.json`` (empty when the search wrote none)."""
    if not (root / "results.json").exists():
        return []
    try:
        return read_results(root)
    except ArtifactError as e:
        raise ReportError(str(e)) from None


def _trial_name(trial_dir: str) -> str:
    """The name of the dir under ``trials/`` that holds ``trial_dir`` (``trials/trial_0003/remeasured``: ``trial_0003``)."""
    parts = Path(trial_dir).parts
    return next((part for prev, part in zip(parts, parts[1:]) if prev == "trials"), Path(trial_dir).name)


def _find_trial(trials: list[TrialSummary], root: Path, trial_dir: str | None) -> TrialSummary | None:
    """The loaded trial whose dir is ``trial_dir`` or holds it (a re-measured trial's ``trials/trial_N/remeasured``)."""
    if not trial_dir:
        return None
    target = root / trial_dir
    return next((t for t in trials if t.path == target or t.path in target.parents), None)


def _load_compared(
    root: Path, trials: list[TrialSummary], row: TrialRow | None, number: int | None
) -> TrialSummary | None:
    """The trial dir that stands for trial ``number`` (its re-measurement where it had one): from its row, else by name."""
    if row is not None and row.trial_dir and (root / row.trial_dir / "metrics.json").exists():
        return load_trial(root / row.trial_dir, analyze_traces=False, feasible=row.feasible)
    return next((t for t in trials if t.name == f"trial_{number:04d}"), None) if number is not None else None


def _describe_comparison(best_number: int | None, lowest: TrialRow | None, conf: dict, emitted: bool) -> str:
    """Which trial is "best" in the report and why; the lowest objective where it is another trial."""
    if not emitted:
        if conf.get("emitted") == "defaults":
            why = conf.get("verdict") or "the defaults were emitted (no finalist beat them side by side)"
            return f"{why}; shown as best: trial {best_number}, the lowest ratio in the search"
        if conf.get("memory"):
            return f"best = trial {best_number}, the search's pick, emitted because {conf['memory']}"
        return f"best = trial {best_number}, the lowest ratio in the search (no final round ran)"
    final = {f.get("trial"): f.get("ratio") for f in conf.get("finalists", [])}
    ratio = f"ratio {final[best_number]:.3f}, " if final.get(best_number) is not None else ""
    text = (
        f"best = trial {best_number}, the emitted config: the fastest of {len(final)} finalists re-measured against the defaults "
        f"in the final round ({ratio}"
    )
    if conf.get("speedup_from") == "verdict":  # v11: its speedup from a window that did not choose it
        text += f"then {conf['speedup_median']:.3f}x the defaults' speed in a window that did not choose it)"
    else:
        text += f"{conf['speedup_median']:.3f}x the defaults' speed)"
    if lowest is not None and lowest.number != best_number:
        again = f", {final[lowest.number]:.3f} in the final round" if final.get(lowest.number) is not None else ""
        text += (
            f"; the lowest ratio in the search was trial {lowest.number} ({lowest.objective:.3f} in the search{again})"
        )
    return text


def _with_final_trace(root: Path, best: TrialSummary, record: SearchRecord | None) -> TrialSummary:
    """The config to emit as profiled in the recipe round, where its search trial took no trace
    ([Note: the emitted config's trace] in :mod:`autotune.search.recipe`)."""
    recipe = (record.recipe if record else None) or {}
    if best.trace_metrics is not None or not recipe.get("profiled") or recipe.get("candidate") != "search":
        return best
    final = root / "final" / Path(recipe["dir"]).name
    return (
        load_trial(final, analyze_traces=False, feasible=best.feasible) if (final / "metrics.json").exists() else best
    )


def get_comparison(
    root: Path, trials: list[TrialSummary], record: SearchRecord | None, rows: list[TrialRow]
) -> Comparison | None:
    """Best vs defaults (see :class:`~autotune.report.model.Comparison`); None without a best trial."""
    by_number = {r.number: r for r in rows}
    lowest = record.best if record and record.best else pick_best(rows)
    conf = (record.confirmation if record else None) or {}
    recipe_emitted = bool(record and record.recipe and record.recipe.get("emitted") == "recipe")
    emitted = conf.get("winner") is not None and not recipe_emitted
    best_number = conf["winner"] if conf.get("winner") is not None else (lowest.number if lowest else None)
    best_row = by_number.get(best_number) or (lowest if lowest and lowest.number == best_number else None)
    best = _load_compared(root, trials, best_row, best_number)
    if best is None:
        return None
    best = _with_final_trace(root, best, record)
    default_row = (record.default if record else None) or next((r for r in rows if r.is_default), None)
    default_number = default_row.number if default_row else None
    default = _load_compared(root, trials, by_number.get(default_number, default_row), default_number)
    return Comparison(
        best=best,
        best_number=best_number,
        default=default,
        default_number=default_number,
        lowest_number=lowest.number if lowest else None,
        emitted=emitted,
        note=(
            f"torchtitan's recipe was emitted (trial {best_number}, the search's pick, was not faster than it side by side)"
            if recipe_emitted
            else _describe_comparison(best_number, lowest, conf, emitted)
        ),
    )


def load_trial_traces(trial: TrialSummary) -> TrialTraces:
    """A trial's traces read once: their timeline, device and (GPU) step attribution, or the one-line
    reason they cannot be read."""
    paths = find_traces(trial.path)
    if not paths:
        # A search trial slower than the best so far skips its profiled window ([Note: measured against the best]).
        return TrialTraces(
            error=f"no traces in {trial.path} (a search trial that did not beat the best so far is not profiled)"
        )
    try:
        analysis = FsdpTraceAnalysis(paths)
        return TrialTraces(
            paths=paths,
            device=analysis.device,
            timeline=analysis.get_timeline(),
            attribution=get_step_attribution(analysis, shard_size=trial.shard_size),
            host=get_host_time(analysis),
        )
    except TraceError as e:
        return TrialTraces(paths=paths, error=str(e))


def load_search(
    root: Path,
    *,
    search: SearchRecord | None = None,
    rows: list[TrialRow] | None = None,
    storage: str | None = None,
    study_name: str | None = None,
) -> Report:
    """A search dir's report; ``search`` and ``rows`` replace its ``search.json`` and ``results.json``
    (a worker reporting its own); ``storage``/``study_name`` locate its Optuna study (default ``root/study.db``)."""
    trial_dirs = sorted(
        {p.parent for pattern in ("trials/*/metrics.json", f"trials/*/{INCOMPLETE_MARKER}") for p in root.glob(pattern)}
    )
    rows = _read_rows(root) if rows is None else rows
    feasible = {_trial_name(r.trial_dir): r.feasible for r in rows if r.trial_dir}
    trials = [load_trial(d, analyze_traces=False, feasible=feasible.get(d.name, True)) for d in trial_dirs]
    record = search or _read_search(root)
    best = (
        _find_trial(trials, root, record.best.trial_dir)
        if record and record.best and record.best.trial_dir
        else pick_best(trials)
    )
    return Report(
        kind="search",
        root=root,
        trials=trials,
        best=best,
        search=record,
        rows=rows,
        comparison=get_comparison(root, trials, record, rows),
        storage=storage,
        study_name=study_name,
    )


def load_report(
    path: str | Path,
    *,
    search: SearchRecord | None = None,
    rows: list[TrialRow] | None = None,
    storage: str | None = None,
    study_name: str | None = None,
) -> Report:
    """A trial report (``metrics.json`` or traces in ``path``) or a search report (``path/trials/*/metrics.json``;
    the keywords as in :func:`load_search`)."""
    root = Path(path)
    if not root.is_dir():
        raise ReportError(f"{root}: no such directory")
    traces = find_traces(root)
    if (root / "metrics.json").exists() or traces:
        trial = load_trial(root)
        return Report(
            kind="trial", root=root, trials=[trial], best=trial, trace_paths=traces, pipeline=read_pipeline_layout(root)
        )
    if any(root.glob("trials/*/metrics.json")):
        return load_search(root, search=search, rows=rows, storage=storage, study_name=study_name)
    raise ReportError(
        f"{root}: neither a trial dir (metrics.json or chrome trace files: {TRACE_GLOB}, *.json, *.json.gz) nor a search dir (trials/*/metrics.json)"
    )
