"""``autotune plan``: the search space ranked by the step simulator (:mod:`autotune.sim`) for a
cluster this machine does not have; the best config is emitted with ``simulated`` provenance.

:mod:`~autotune.plan.points` walks the space of :class:`autotune.search.SearchSpace`
([Note: enumerating the search space]); :mod:`~autotune.plan.run` simulates, ranks, emits;
:mod:`~autotune.plan.tables` formats the results as report tables. Imports search and sim
(upstream), never the reverse.
"""

from autotune.plan.run import PlanError, PlanReporter, PlanResult, PlanRow, PlanSettings, SilentPlanReporter, run_plan

__all__ = ["PlanError", "PlanReporter", "PlanResult", "PlanRow", "PlanSettings", "SilentPlanReporter", "run_plan"]
