"""Write a report's files: the one place that dispatches to the HTML and PNG renderers."""

from __future__ import annotations

from pathlib import Path

from autotune.report.html import write_html
from autotune.report.model import Report
from autotune.report.png import write_pngs


def write_report(report: Report, out_dir: str | Path) -> list[Path]:
    """Write ``report.html`` (plotly.js inline: opens offline) and one PNG per plot; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [write_html(report, out / "report.html"), *write_pngs(report, out)]
