"""``autotune compare``'s record as a report table and lines (``cli.py`` renders them with rich)."""

from __future__ import annotations

from pathlib import Path

from autotune.compare.record import CompareRecord, ConfigFigures
from autotune.report import ReportTable, fmt


def get_compare_table(record: CompareRecord) -> ReportTable:
    """Per config: its median step, its peak memory, and its speedup over the first with the interval."""
    stop = f"; stopped: every interval within {record.until_ci_pct:g}%" if record.stopped == "interval" else ""
    title = (
        f"{record.model} on {record.world_size} {record.backend} ranks, each config alone on fresh ranks: "
        f"{record.num_rounds} rounds of {record.num_measured} steps ({record.num_warmup} warm-up){stop}"
    )
    rows = [_row(i, c) for i, c in enumerate(record.configs)]
    columns = ["#", "config", "step ms", "peak MB", "speedup", "90% interval", "verdict"]
    return ReportTable(title=title, columns=columns, rows=rows)


def _row(index: int, figures: ConfigFigures) -> list[str]:
    peak = f"{figures.process_peak_bytes / 2**20:,.0f}" if figures.process_peak_bytes is not None else "-"
    cells = [str(index + 1), figures.label, fmt(figures.step_ms), peak]
    if index == 0:
        return [*cells, "1 (base)", "", ""]
    low, high = figures.speedup_low, figures.speedup_high
    interval = f"{low:.3f}-{high:.3f}" if low is not None and high is not None else "-"
    return [*cells, fmt(figures.speedup, "x"), interval, figures.verdict or "-"]


def describe_speedup(index: int, figures: ConfigFigures, first: str) -> str:
    """One config's speedup over the first in a sentence, saying when its interval includes 1.0."""
    interval = f"90% interval {figures.speedup_low:.3f}-{figures.speedup_high:.3f}"
    speedup = fmt(figures.speedup, "x")
    if figures.verdict in ("faster", "slower"):
        return f"#{index + 1} {figures.label}: {figures.verdict} than {first}, {speedup} as fast ({interval})"
    return f"#{index + 1} {figures.label}: no faster than {first}, within noise ({speedup}; {interval} includes 1.0)"


def get_compare_lines(record: CompareRecord, path: Path) -> list[str]:
    """A sentence per compared config, how the speedup and its interval are made, and where the record went."""
    first = record.configs[0].label
    lines = [describe_speedup(i, c, first) for i, c in enumerate(record.configs) if c.verdict is not None]
    lines.append(
        f"speedup: per round, #1's run median over the config's, the median of {record.num_rounds} rounds; "
        f"interval: {record.interval_method}"
    )
    lines.append(f"wrote {path}; each run's trial dir in {path.parent}/roundR/")
    return lines
