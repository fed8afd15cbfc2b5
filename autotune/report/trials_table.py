"""The search report's table of every trial: its knobs, its noise, what it was paired with and why it stopped;
and how a trial's knobs are shown in every trials table (as the change from the defaults trial's)."""

from __future__ import annotations

from typing import Any

from autotune.report.formatting import fmt
from autotune.report.model import Comparison, ReportTable
from autotune.search import TrialRow, describe_params, describe_params_diff

TRIALS_COLUMNS = [  # what a trial is and how it did first: a page of 1600 pixels shows them without scrolling
    "trial",
    "status",
    "/defaults",
    "IQR",
    "spread",
    "knobs",
    "note",
    "paired with",
    "attempts",
    "made from",
    "step ms",
    "prof",
    "overlap",
    "exposed ms",
    "peak",
]


NOTE_CHARS = 60
"""A trial's note (why it failed, was pruned or infeasible) is cut to this many characters in a table
row; the HTML report shows the whole note on hover, ``results.csv`` has it."""


def get_default_params(rows: list[TrialRow]) -> dict[str, Any] | None:
    """The defaults trial's params, which every trial's knobs are described against; None without one."""
    return next((row.params for row in rows if row.is_default), None)


def describe_knobs(params: dict[str, Any], defaults: dict[str, Any] | None) -> str:
    """A trial's knobs as the change from the defaults' (``defaults`` for the defaults themselves);
    every knob where the search has no defaults trial."""
    return describe_params(params) if defaults is None else describe_params_diff(params, defaults)


def cut(text: str, limit: int) -> str:
    """``text``, or its first ``limit - 1`` characters and an ellipsis."""
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def _mark(row: TrialRow, comparison: Comparison | None) -> str:
    marks = []
    if comparison and row.number == comparison.best_number:
        marks.append("emitted" if comparison.emitted else "best")
    if comparison and row.number == comparison.lowest_number and row.number != comparison.best_number:
        marks.append("lowest ratio")
    if row.is_default:
        marks.append("defaults")
    return f"{row.number} ({', '.join(marks)})" if marks else str(row.number)


def describe_status(row: TrialRow) -> str:
    """``ok``, ``ok (noisy)``, ``ok (= 3)`` for a config measured as trial 3."""
    return (
        row.status
        + (" (noisy)" if row.noisy else "")
        + (f" (= {row.duplicate_of})" if row.duplicate_of is not None else "")
    )


def _describe_attempts(row: TrialRow) -> str:
    """``1``, or ``2 (first: pruned 1.520x)`` for a trial measured again ([Note: paired measurement])."""
    if row.attempts <= 1:
        return str(row.attempts)
    first = " ".join(
        x for x in (row.first_status, fmt(row.first_ratio, "x") if row.first_ratio is not None else None) if x
    )
    return f"{row.attempts} (first: {first})" if first else str(row.attempts)


def _describe_reference(row: TrialRow) -> str:
    """What the trial was paired with and why it stopped ([Note: measured against the best],
    [Note: sequential measurement]): ``defaults, faster`` or ``trial 3 at 0.812x, slower``."""
    against = (
        f"trial {row.reference_trial} at {fmt(row.ratio_to_reference, 'x')}"
        if row.reference_trial is not None
        else "defaults"
    )
    return f"{against}, {row.stopped}" if row.stopped else against


def get_search_trials_table(rows: list[TrialRow], comparison: Comparison | None = None) -> ReportTable:
    """Every trial of a search as the search recorded it: its knobs (the change from the defaults', as
    ``autotune search`` prints them; every knob in the cell's title) and its noise: the paired ratio's
    median, interquartile range and spread, measurement attempts, and the refinement it was made from.
    Exposed and overlap as traced (not scaled). One line per trial."""
    title = (
        f"{len(rows)} trials (ratio: median step time / the defaults' in alternating pairs, chained through the "
        "trial it was paired with; IQR and spread of those pairs; knobs: what differs from the defaults trial, "
        "every knob on hover)"
    )
    table = ReportTable(title=title, columns=list(TRIALS_COLUMNS), one_line=True)
    knobs, note = TRIALS_COLUMNS.index("knobs"), TRIALS_COLUMNS.index("note")
    defaults = get_default_params(rows)
    for row in sorted(rows, key=lambda r: r.number):
        iqr = (
            f"{row.ratio_q25:.3f}-{row.ratio_q75:.3f}"
            if row.ratio_q25 is not None and row.ratio_q75 is not None
            else "-"
        )
        made_from = row.refined_from or ("defaults" if row.is_default else "sampled")
        table.cell_titles[len(table.rows), knobs] = describe_params(row.params)
        if len(row.reason) > NOTE_CHARS:
            table.cell_titles[len(table.rows), note] = row.reason
        table.rows.append(
            [
                _mark(row, comparison),
                describe_status(row),
                fmt(row.ratio, "x"),
                iqr,
                fmt(row.ratio_spread, "pct"),
                describe_knobs(row.params, defaults),
                cut(row.reason, NOTE_CHARS),
                _describe_reference(row),
                _describe_attempts(row),
                made_from,
                fmt(row.step_ms),
                fmt(row.profiler_overhead, "over"),
                fmt(row.overlap_ratio, "pct"),
                fmt(row.exposed_comm_ms),
                fmt(row.process_peak_bytes, "mb"),
            ]
        )
    return table
