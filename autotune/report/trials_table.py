"""The search report's table of every trial: its knobs, its noise, what it was paired with and why it stopped."""

from __future__ import annotations

from autotune.report.formatting import fmt
from autotune.report.model import Comparison, ReportTable
from autotune.search import TrialRow, describe_params

TRIALS_COLUMNS = [
    "trial",
    "status",
    "/defaults",
    "IQR",
    "spread",
    "paired with",
    "attempts",
    "made from",
    "step ms",
    "prof",
    "overlap",
    "exposed ms",
    "peak",
    "knobs",
    "note",
]


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
    """Every trial of a search as the search recorded it: its knobs (as ``autotune search`` prints them)
    and its noise: the paired ratio's median, interquartile range and spread, measurement attempts, and
    the refinement it was made from. Exposed and overlap as traced (not scaled)."""
    title = (
        f"{len(rows)} trials (ratio: median step time / the defaults' in alternating pairs, chained through the "
        "trial it was paired with; IQR and spread of those pairs)"
    )
    table = ReportTable(title=title, columns=list(TRIALS_COLUMNS))
    for row in sorted(rows, key=lambda r: r.number):
        iqr = (
            f"{row.ratio_q25:.3f}-{row.ratio_q75:.3f}"
            if row.ratio_q25 is not None and row.ratio_q75 is not None
            else "-"
        )
        made_from = row.refined_from or ("defaults" if row.is_default else "sampled")
        table.rows.append(
            [
                _mark(row, comparison),
                describe_status(row),
                fmt(row.ratio, "x"),
                iqr,
                fmt(row.ratio_spread, "pct"),
                _describe_reference(row),
                _describe_attempts(row),
                made_from,
                fmt(row.step_ms),
                fmt(row.profiler_overhead, "over"),
                fmt(row.overlap_ratio, "pct"),
                fmt(row.exposed_comm_ms),
                fmt(row.process_peak_bytes, "mb"),
                describe_params(row.params),
                row.reason[:80],
            ]
        )
    return table
