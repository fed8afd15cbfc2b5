"""``autotune report DIR``: what one trial, or a whole search, measured.

    from autotune.report import get_gpu_tables, get_tables, load_report, write_report
    report = load_report("runs/t0")          # a trial dir, or a search dir (trials/*/metrics.json)
    get_tables(report)                       # plain rows for a terminal (cli.py renders them)
    get_pipeline_tables(report)              # a pipeline trial: its stages
    get_gpu_tables(report)                   # a GPU trial: where the step's device time goes
    get_host_tables(report)                  # FSDP's own host time per unit; a host-bound step named
    write_report(report, "runs/t0/report")   # report.html (self-contained) + PNGs

Modules: :mod:`~autotune.report.attribution` (a GPU step's device time by kernel class and
part: [Note: GPU step attribution]) <- :mod:`~autotune.report.model` (the data) <-
:mod:`~autotune.report.load` (reads the artifacts) <- :mod:`~autotune.report.tables` /
:mod:`~autotune.report.pipeline_tables` / :mod:`~autotune.report.gpu_tables` / :mod:`~autotune.report.frames` (rows and DataFrames;
:mod:`~autotune.report.predictions`: the presearch's predicted vs measured) <- figure sections:
:mod:`~autotune.report.gpu_step` (a GPU trial's attribution), a search report's
:mod:`~autotune.report.compare` (best vs defaults), :mod:`~autotune.report.study` (Optuna's figures of the study),
:mod:`~autotune.report.hta` (HTA on GPU traces, with the attribution) <- :mod:`~autotune.report.html` /
:mod:`~autotune.report.png` <- :mod:`~autotune.report.write` (the one dispatcher) <-
:mod:`~autotune.report.browser` (the page checked in headless Chromium,
``python -m autotune.report.browser report.html``). Nothing imports back up this chain.
"""

from autotune.report.attribution import StepAttribution
from autotune.report.formatting import fmt
from autotune.report.gpu_tables import get_gpu_tables
from autotune.report.host import get_host_tables
from autotune.report.load import load_report, load_trial
from autotune.report.model import REPORT_SCHEMA_VERSION, TRACE_GLOB, Report, ReportError, ReportTable, TrialSummary
from autotune.report.pipeline_tables import get_pipeline_tables
from autotune.report.predictions import get_prediction_table
from autotune.report.tables import (
    get_final_round_table,
    get_rank_table,
    get_rounds_table,
    get_search_outcome_lines,
    get_search_rows_table,
    get_tables,
)
from autotune.report.write import write_report, write_search_report

__all__ = [
    "REPORT_SCHEMA_VERSION",
    "TRACE_GLOB",
    "Report",
    "ReportError",
    "ReportTable",
    "StepAttribution",
    "TrialSummary",
    "fmt",
    "get_rounds_table",
    "get_final_round_table",
    "get_gpu_tables",
    "get_host_tables",
    "get_pipeline_tables",
    "get_prediction_table",
    "get_rank_table",
    "get_search_outcome_lines",
    "get_search_rows_table",
    "get_tables",
    "load_report",
    "load_trial",
    "write_report",
    "write_search_report",
]
