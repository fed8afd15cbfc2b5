"""Predicted vs measured: how the presearch's predictions compared with the trials' measurements
(``search.json``'s ``presearch`` summary; see [Note: presearch] in :mod:`autotune.search.presearch`;
the terminal's table is :func:`autotune.report.get_prediction_table`)."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autotune.search.results import TrialRow


def summarize_predictions(rows: list[TrialRow], presearch: dict[str, Any] | None) -> dict[str, Any] | None:
    """``search.json``'s ``presearch``: what was ranked and how predictions compared with measurements."""
    if not presearch:
        return None
    pairs = [
        (r.predicted_step_ms, r.step_ms) for r in rows if r.predicted_step_ms and r.step_ms and r.state == "COMPLETE"
    ]
    errors = [p / m - 1 for p, m in pairs]
    summary = {k: v for k, v in presearch.items() if k != "profile"}
    summary["num_compared"] = len(pairs)
    summary["median_abs_error"] = statistics.median(abs(e) for e in errors) if errors else None
    summary["spearman"] = get_spearman([p for p, _ in pairs], [m for _, m in pairs]) if len(pairs) > 2 else None
    return summary


def get_spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (ties share their mean rank)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out, i = [0.0] * len(values), 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return sum((a - mx) * (b - my) for a, b in zip(rx, ry)) / var if var else None
