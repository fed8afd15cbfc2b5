"""What one trial measured, in the fields a search's rows and a report's trials both hold.

:class:`TrialFigures` is the one owner of those fields and of the objective they are ranked by:
``autotune.search.TrialRow`` (a study's trial, ``results.json``) and
``autotune.report.TrialSummary`` (a trial dir as the report reads it) extend it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class TrialFigures:
    """A trial's status and its measured figures (from its ``metrics.json``, or the study's record of it)."""

    status: str
    """The trial's own status (ok, pruned, timeout, crash, oom, invalid_config, interrupted)."""
    reason: str = ""
    """Why it did not succeed, in one line; empty when it did."""
    step_ms: float | None = None
    """Median unprofiled step time (the slowest rank's per step); None without measurements."""
    ratio: float | None = None
    """Median candidate/defaults step-time ratio of the trial's pairs (see [Note: paired measurement]);
    None for a trial not measured in pairs."""
    ratio_spread: float | None = None
    """Interquartile range of the pairs' ratios over their median."""
    profiler_overhead: float | None = None
    """Profiled / unprofiled step time: how far the trial's traces are from its timed steps."""
    process_peak_bytes: int | None = None
    """Largest process peak over ranks (see :mod:`autotune.trials.metrics`)."""
    feasible: bool = True
    """Process peak within the search's memory budget (always True without a budget)."""

    @property
    def succeeded(self) -> bool:
        return self.status == "ok"

    @property
    def objective(self) -> float | None:
        """What a search minimises: the paired ratio, else (a trial without pairs) the step time."""
        return self.ratio if self.ratio is not None else self.step_ms
