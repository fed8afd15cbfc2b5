"""Search: Optuna over the FSDP2 knobs, driving trials; emits the winning runtime config.

Modules in data-flow order: :mod:`~autotune.search.settings` (what to search, errors,
progress protocol) -> :mod:`~autotune.search.search_plan` (made once: the target
(:mod:`~autotune.search.target`), the model as itself or a proxy (:mod:`~autotune.search.proxy`; on a
GPU :mod:`~autotune.search.gpu_pricing`), the baseline, the links, each round's cost
(:mod:`~autotune.search.cost`)) ->
:mod:`~autotune.search.space` (Optuna params -> per-unit config) ->
:mod:`~autotune.search.study` (sampler, storage, stale trials) ->
:mod:`~autotune.search.loop` (ask/tell over trials) -> :mod:`~autotune.search.results`
(rows, the best-trial rule, ``search.json``) -> :mod:`~autotune.search.confirm` ->
:mod:`~autotune.search.verdict` -> :mod:`~autotune.search.recipe` ->
:mod:`~autotune.search.consolidation` -> :mod:`~autotune.search.emit`;
:mod:`~autotune.search.run` strings them together. :mod:`~autotune.search.ranking` walks the
space through the step simulator and ranks it (``--presearch sim`` and ``autotune plan``).
"""

from autotune.search.dry_run import dry_run_search
from autotune.search.gpu_pricing import Baseline, get_baseline
from autotune.search.preflight import check_mesh
from autotune.search.proxy import ModelPlan, get_plan_hint, plan_for_this_machine, plan_model
from autotune.search.ranking import KnobFactory, RankedPoint, get_forward_key, iter_memory_variants, rank_staged
from autotune.search.results import SearchRecord, TrialRow, pick_best, read_results
from autotune.search.run import SearchSummary, describe_interrupted, run_search
from autotune.search.search_plan import SearchPlan, make_search_plan
from autotune.search.settings import SAMPLERS, SearchError, SearchReporter, SearchSettings, SilentReporter
from autotune.search.space import DEFAULTS_DESCRIPTION, SearchSpace, describe_params, describe_params_diff
from autotune.search.target import Target, get_planned_target, get_this_gpu_target
from autotune.search.verdict import describe_figure

__all__ = [
    "dry_run_search",
    "Baseline",
    "SearchPlan",
    "Target",
    "get_baseline",
    "get_planned_target",
    "get_this_gpu_target",
    "make_search_plan",
    "DEFAULTS_DESCRIPTION",
    "SAMPLERS",
    "KnobFactory",
    "ModelPlan",
    "RankedPoint",
    "SearchError",
    "SearchRecord",
    "SearchReporter",
    "SearchSettings",
    "SearchSpace",
    "SearchSummary",
    "SilentReporter",
    "TrialRow",
    "check_mesh",
    "describe_figure",
    "describe_interrupted",
    "describe_params",
    "describe_params_diff",
    "get_forward_key",
    "get_plan_hint",
    "iter_memory_variants",
    "pick_best",
    "plan_for_this_machine",
    "plan_model",
    "rank_staged",
    "read_results",
    "run_search",
]
