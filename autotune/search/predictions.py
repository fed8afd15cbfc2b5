"""Predicted vs measured: how the presearch's predictions compared with the trials' measurements
(``search.json``'s ``presearch`` summary and the terminal's table; see [Note: presearch] in
:mod:`autotune.search.presearch`)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
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


@dataclass(kw_only=True)
class PredictionTable:
    """Predicted vs measured per trial (rendered like the report's tables: title, columns, rows)."""

    title: str
    columns: list[str]
    rows: list[list[str]]


def get_prediction_table(rows: list[TrialRow]) -> PredictionTable | None:
    """The trials that have a prediction, with their measurements; None when none has one."""
    with_prediction = [r for r in rows if r.predicted_step_ms is not None]
    if not with_prediction:
        return None

    def num(value: float | None, form: str) -> str:
        return "-" if value is None else format(value, form)

    table = PredictionTable(
        title="predicted (simulator, calibrated on the defaults' and the calibration trials' traces) vs measured; ratio: step time / the defaults'",
        columns=["trial", "from", "pred ms", "meas ms", "error", "pred ratio", "meas ratio"],
        rows=[],
    )
    for r in sorted(with_prediction, key=lambda r: r.number):
        origin = (
            "defaults"
            if r.is_default
            else (
                f"presearch #{r.presearch_rank}"
                if r.presearch_rank
                else (
                    f"calibration ({r.calibration})" if r.calibration else ("refined" if r.refined_from else "sampled")
                )
            )
        )
        error = r.predicted_step_ms / r.step_ms - 1 if r.step_ms else None
        table.rows.append(
            [
                str(r.number),
                origin,
                num(r.predicted_step_ms, ".1f"),
                num(r.step_ms, ".1f"),
                "-" if error is None else f"{100 * error:+.1f}%",
                num(r.predicted_ratio, ".3f"),
                num(r.ratio, ".3f"),
            ]
        )
    return table
