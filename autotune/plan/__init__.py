"""``autotune plan``: the search space ranked by the step simulator (:mod:`autotune.sim`) for a
cluster this machine does not have; the best config is emitted with ``simulated`` provenance.

The space is walked and ranked by :mod:`autotune.search.ranking` ([Note: staged ranking]), which
``--presearch sim`` uses too; :mod:`~autotune.plan.evaluate` prices its points in parallel
([Note: plan speed]); :mod:`~autotune.plan.result` holds its settings and result, :mod:`~autotune.plan.run` ranks,
:mod:`~autotune.plan.emit` writes the config and :mod:`~autotune.plan.record` (``plan.json``); :mod:`~autotune.plan.pipeline` adds the PP degrees ([Note: the plan's pipeline axis]); :mod:`~autotune.plan.tables` formats the results as report tables. Imports
search, sim and report (upstream), never the reverse.
"""

from autotune.plan.evaluate import PlanReporter
from autotune.plan.record import PlanRecord
from autotune.plan.result import PlanError, PlanResult, PlanSettings, SilentPlanReporter
from autotune.plan.run import get_plan_precision, run_plan
from autotune.plan.tables import get_config_lines, get_pipeline_table, get_plan_lines, get_plan_table, get_unit_table

__all__ = [
    "PlanError",
    "PlanRecord",
    "PlanReporter",
    "PlanResult",
    "PlanSettings",
    "get_plan_precision",
    "SilentPlanReporter",
    "get_config_lines",
    "get_pipeline_table",
    "get_plan_lines",
    "get_plan_table",
    "get_unit_table",
    "run_plan",
]
