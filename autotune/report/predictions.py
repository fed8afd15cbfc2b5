"""The presearch's predictions beside the trials' measurements, as a report table ([Note: presearch]
in :mod:`autotune.search.presearch`; ``cli.py`` renders it after a search)."""

from __future__ import annotations

from autotune.report.model import ReportTable
from autotune.search import TrialRow


def get_prediction_table(rows: list[TrialRow]) -> ReportTable | None:
    """The trials that have a prediction, with their measurements; None when none has one."""
    with_prediction = [r for r in rows if r.predicted_step_ms is not None]
    if not with_prediction:
        return None

    def num(value: float | None, form: str) -> str:
        return "-" if value is None else format(value, form)

    table = ReportTable(
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
