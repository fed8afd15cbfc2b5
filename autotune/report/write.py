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


def write_search_report(
    summary: SearchSummary, *, storage: str | None = None, study_name: str | None = None
) -> SearchSummary:
    """The report of a finished search into ``report/`` of its worker's dir, noted in its
    ``search.json``; a failure to render is recorded there, never raised (the search's results stand).

    ``storage``/``study_name``: the search's Optuna study (``SearchSettings.get_storage()`` and
    ``get_study_name``); default ``<run dir>/study.db`` and the only study there."""
    record = summary.record
    try:
        report = load_report(
            summary.study_dir, search=record, rows=summary.rows, storage=storage, study_name=study_name
        )
        summary.report_paths = write_report(report, summary.out_dir / "report")
        record.report, record.report_error = [str(p) for p in summary.report_paths], None
    except (AutotuneError, OSError, ValueError) as e:
        record.report, record.report_error = [], f"{type(e).__name__}: {e}"
    record.write(summary.out_dir / "search.json")
    return summary
