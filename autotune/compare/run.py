"""``autotune compare``: configs run alone, in rounds, and their speedups over the first.

    from autotune.compare import CompareSettings, run_compare
    record, path = run_compare(CompareSettings(model="tiny", configs=["defaults", "runs/search/best.toml"]))

Each run is one unpaired, unprofiled trial (:func:`autotune.trials.run_trial`) on fresh ranks
with its own model build: no reference beside it, no rank pool, no model kept warm, as the
config runs in a training job. The runs go round by round in the order of [Note: compare
rounds]; each run's trial dir is ``--out``/``roundR/I-NAME`` (an earlier comparison's rounds are
removed first: :func:`clear_previous_runs`) and ``compare.json``
(:class:`~autotune.compare.record.CompareRecord`) is written once, at the end: a comparison
that stops early (a failed run, an interrupt) leaves its runs' dirs and no ``compare.json``.
"""

from __future__ import annotations

import re
import shutil
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

from autotune.compare.configs import ComparedConfig, load_compare_configs
from autotune.compare.record import FILE_NAME, CompareRecord, ConfigFigures
from autotune.compare.settings import (
    CompareReporter,
    CompareRunError,
    CompareSettings,
    SilentCompareReporter,
)
from autotune.compare.stats import INTERVAL_METHOD, get_round_order, get_speedup_interval, is_settled
from autotune.trials import TrialResult, run_trial


def run_compare(settings: CompareSettings, *, reporter: CompareReporter | None = None) -> tuple[CompareRecord, Path]:
    """Run every config alone, round by round, until ``max_rounds`` or ``--until-ci`` stops it;
    write ``compare.json`` and return it with its path. Raises before any run for a config that
    cannot run (:class:`~autotune.compare.settings.CompareError`), and
    :class:`~autotune.compare.settings.CompareRunError` for a run that fails."""
    reporter = reporter or SilentCompareReporter()
    configs = load_compare_configs(settings, reporter)
    start = time.monotonic()
    (settings.out_dir / FILE_NAME).unlink(missing_ok=True)  # a previous comparison's, never this one's
    clear_previous_runs(settings.out_dir)
    runs: list[list[TrialResult]] = [[] for _ in configs]
    orders: list[list[int]] = []
    stopped = "rounds"
    for r in range(settings.max_rounds):
        orders.append(get_round_order(r, len(configs)))
        for i in orders[-1]:
            runs[i].append(_run_one(settings, configs[i], i, r))
            reporter.on_run(r + 1, settings.max_rounds, configs[i].label, runs[i][-1])
        intervals = [get_speedup_interval(get_round_ratios(runs[0], own)) for own in runs[1:]]
        if is_settled(intervals, r + 1, settings.until_ci_pct):
            stopped = "interval"
            break
    record = CompareRecord(
        model=settings.model,
        world_size=settings.world_size,
        backend=settings.trial_spec(configs[0].config, settings.out_dir).backend,
        cluster=settings.cluster,
        num_microbatches=configs[0].config.num_microbatches,
        num_warmup=settings.num_warmup,
        num_measured=settings.num_measured,
        num_rounds=len(orders),
        max_rounds=settings.max_rounds,
        until_ci_pct=settings.until_ci_pct,
        stopped=stopped,
        interval_method=INTERVAL_METHOD,
        orders=orders,
        configs=[get_figures(item, own, runs[0]) for item, own in zip(configs, runs)],
        wall_s=round(time.monotonic() - start, 1),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    return record, record.write(settings.out_dir / FILE_NAME)


def clear_previous_runs(out_dir: Path) -> list[Path]:
    """Remove an earlier comparison's ``roundR`` dirs from ``out_dir`` (one with more rounds would
    leave its later rounds beside this one's); only a dir whose every entry is a run's trial dir
    (a ``config.toml`` in it) is removed, so nothing else of ``out_dir`` is touched. Returns them."""
    removed = []
    for path in sorted(out_dir.glob("round*")) if out_dir.is_dir() else []:
        runs = list(path.iterdir()) if path.is_dir() and re.fullmatch(r"round\d+", path.name) else []
        if runs and all((run / "config.toml").is_file() for run in runs):
            shutil.rmtree(path)
            removed.append(path)
    return removed


def get_round_ratios(first: list[TrialResult], own: list[TrialResult]) -> list[float]:
    """Per round, the first config's run median over this config's ([Note: compare interval])."""
    return [a.step_ms / b.step_ms for a, b in zip(first, own)]


def get_figures(item: ComparedConfig, own: list[TrialResult], first: list[TrialResult]) -> ConfigFigures:
    """One config's figures over its runs; its speedup over the first config's (none for the first itself)."""
    peaks = [r.process_peak_bytes for r in own]
    known = [p for p in peaks if p is not None]
    figures = ConfigFigures(
        label=item.label,
        source=item.source,
        step_ms=statistics.median(r.step_ms for r in own),
        process_peak_bytes=max(known) if known else None,
        step_ms_per_round=[r.step_ms for r in own],
        process_peak_bytes_per_round=peaks,
        dirs=[str(r.out_dir) for r in own],
    )
    if own is first:
        return figures
    figures.round_ratios = get_round_ratios(first, own)
    interval = get_speedup_interval(figures.round_ratios)
    figures.speedup = statistics.median(figures.round_ratios)
    if interval is not None:
        figures.speedup_low, figures.speedup_high, figures.verdict = interval.low, interval.high, interval.verdict
    return figures


def get_run_dir(settings: CompareSettings, item: ComparedConfig, index: int, round_index: int) -> Path:
    """``OUT/roundR/I-NAME``: R and I from 1, NAME the word or the file's stem."""
    name = item.source if item.source != "file" else re.sub(r"[^\w.-]+", "_", Path(item.label).stem) or "config"
    return settings.out_dir / f"round{round_index + 1}" / f"{index + 1}-{name}"


def _run_one(settings: CompareSettings, item: ComparedConfig, index: int, round_index: int) -> TrialResult:
    out_dir = get_run_dir(settings, item, index, round_index)
    result = run_trial(settings.trial_spec(item.config, out_dir))
    if not result.ok or result.step_ms is None:
        reason = f": {result.reason[:200]}" if result.reason else ""
        raise CompareRunError(
            f"{item.label}: its run in round {round_index + 1} failed ({result.status}{reason}); see {out_dir}"
        )
    return result
