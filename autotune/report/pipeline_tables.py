"""A pipeline trial's stages as a plain table ([Note: pipeline bubble] in ``autotune.analysis``): per
stage, the ranks holding it, its blocks, its compute, FSDP communication, overlap, P2P and bubble.
``cli.py`` renders it with rich after :func:`~autotune.report.tables.get_tables`, ``html.py`` after
the trial's tables; a trial without pipeline stages, and a search report, have none."""

from __future__ import annotations

import re

from autotune.report.formatting import fmt
from autotune.report.model import Report, ReportTable, TrialSummary

STAGE_TABLE = [  # (column, stage field of the trace summary's ``pipeline`` section, format)
    ("step", "step_ms", "ms"),
    ("compute", "compute_ms", "ms"),
    ("FSDP comm", "fsdp_comm_ms", "ms"),
    ("exposed", "exposed_fsdp_comm_ms", "ms"),
    ("overlap", "overlap_ratio_time_weighted", "pct"),
    ("P2P", "p2p_ms", "ms"),
    ("bubble", "bubble_ms", "ms"),
]
_NUMBERED = re.compile(r"^(?P<prefix>.*?)(?P<n>\d+)$")


def get_pipeline_tables(report: Report) -> list[ReportTable]:
    """A trial report's "Pipeline stages" table; none for a trial without stages or a search report."""
    table = get_stage_table(report.trials[0]) if report.kind == "trial" else None
    return [table] if table is not None else []


def describe_blocks(blocks: list[str]) -> str:
    """``layers.0-3`` for consecutive numbered blocks, ``layers.0, layers.2`` otherwise; ``-`` for none."""
    runs: list[list] = []  # [prefix, first, last] or [name]
    for block in blocks:
        match = _NUMBERED.match(block)
        if match is None:
            runs.append([block])
            continue
        prefix, n = match["prefix"], int(match["n"])
        if runs and len(runs[-1]) == 3 and runs[-1][0] == prefix and runs[-1][2] == n - 1:
            runs[-1][2] = n
        else:
            runs.append([prefix, n, n])
    parts = [r[0] if len(r) == 1 else f"{r[0]}{r[1]}" + (f"-{r[2]}" if r[2] > r[1] else "") for r in runs]
    return ", ".join(parts) or "-"


def get_stage_table(trial: TrialSummary) -> ReportTable | None:
    """Per pipeline stage, medians over the (rank, step) rows of the ranks holding it; None without stages."""
    pipeline = (trial.shown_trace_metrics or {}).get("pipeline")
    if not pipeline:
        return None
    note = ", scaled" if trial.trace_scale is not None else ""
    virtual = f" x {pipeline['virtual_stages']} virtual" if pipeline["virtual_stages"] > 1 else ""
    table = ReportTable(
        title=(
            f"Pipeline stages (pp {pipeline['pp']}{virtual}, {pipeline['schedule']}): median over each stage's ranks "
            f"and steps (ms{note}); FSDP comm of the stage's units, exposed where the rank does not compute, overlap "
            "hidden / FSDP comm; P2P: sends and receives outstanding; bubble: waiting on P2P"
        ),
        columns=["stage", "ranks", "blocks", *(c for c, _, _ in STAGE_TABLE)],
    )
    for stage in pipeline["stages"]:
        table.rows.append(
            [
                str(stage["stage"]),
                ", ".join(str(r) for r in stage["ranks"]) or "-",
                describe_blocks(stage["blocks"]),
                *(fmt(stage[key], kind) for _, key, kind in STAGE_TABLE),
            ]
        )
    return table
