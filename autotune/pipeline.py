"""The whole job of ``autotune search``: the search stage, then the report stage.

Stages import only upstream (search never imports report); this is the one place that
strings them together for the CLI and for library users.
"""

from __future__ import annotations

from autotune.report import write_search_report
from autotune.search import SearchReporter, SearchSettings, SearchSummary, SilentReporter, run_search

__all__ = ["search_and_report"]


def search_and_report(settings: SearchSettings, *, reporter: SearchReporter | None = None) -> SearchSummary:
    """:func:`autotune.search.run_search`, then its report into the run dir (``report/``)."""
    reporter = reporter or SilentReporter()
    summary = run_search(settings, reporter=reporter)
    reporter.on_phase("writing the search report")
    # The study the report draws Optuna's figures from: wherever the search kept it (PostgreSQL,
    # a journal file, or the default <out>/study.db).
    study_name = settings.get_study_name(summary.plan.requested.name)
    return write_search_report(summary, storage=settings.get_storage(), study_name=study_name)
