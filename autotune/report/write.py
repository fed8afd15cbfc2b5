"""Write a report's files: the one place that dispatches to the HTML and PNG renderers."""

from __future__ import annotations

from pathlib import Path

from typing import TYPE_CHECKING

from autotune.report.html import write_html
from autotune.report.load import load_report
from autotune.report.model import Report
from autotune.report.png import write_pngs
from fsdp_runtime.errors import AutotuneError

if TYPE_CHECKING:
    from autotune.search import SearchSummary


def write_report(report: Report, out_dir: str | Path) -> list[Path]:
    """Write ``report.html`` (plotly.js inline: opens offline) and one PNG per plot; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [write_html(report, out / "report.html"), *write_pngs(report, out)]


def write_search_report(summary: "SearchSummary") -> "SearchSummary":
    """The report of a finished search into ``report/`` of its worker's dir, noted in its
    ``search.json``; a failure to render is recorded there, never raised (the search's results stand)."""
    record = summary.record
    try:
        summary.report_paths = write_report(load_report(summary.study_dir, search=record), summary.out_dir / "report")
        record.report, record.report_error = [str(p) for p in summary.report_paths], None
    except (AutotuneError, OSError, ValueError) as e:
        record.report, record.report_error = [], f"{type(e).__name__}: {e}"
    record.write(summary.out_dir / "search.json")
    return summary
