"""``autotune search``: Optuna ask/tell over the FSDP2 knobs, driving the trial launcher.

Data flow: model (a profile, factory or HF config: :mod:`profiles.sources`) + machine -> :func:`autotune.search.search_plan.make_search_plan`
(real model or scale proxy) -> :class:`autotune.search.space.SearchSpace` -> per trial a
:class:`RuntimeConfig` -> :func:`autotune.trials.run_trial` -> metrics -> ``study.tell``
(:mod:`autotune.search.loop`) -> best config -> side-by-side confirmation against the
defaults (:mod:`autotune.search.confirm`) -> the same against torchtitan's recipe
(:mod:`autotune.search.recipe`) -> consolidation timing -> emitted config
(:mod:`autotune.search.emit`) -> tables. The report (``report/``) is the next stage's:
:func:`autotune.report.write_search_report`; :func:`autotune.pipeline.search_and_report` runs both.

A run directory holds::

    study.db              Optuna storage (SQLite) unless --storage names another
    trials/trial_NNNN/    each trial's dir (traces, metrics.json, config.toml, env.json)
    best.toml, best.json  the winning runtime config (applies with fsdp_runtime unchanged)
    results.csv, results.json   one row per trial
    search.json           summary (:class:`~autotune.search.results.SearchRecord`)
    report/               ``autotune report`` of the run dir (written by autotune.report)

Robustness rules are in [Note: search robustness] (:mod:`autotune.search.loop`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.search.confirm import run_final_round
from autotune.search.consolidation import time_consolidation
from autotune.search.context import SearchContext
from autotune.search.emit import emit_best
from autotune.search.loop import get_rows, open_pool, search_loop, warm_up
from autotune.search.nodes import get_world_notes
from autotune.search.outcome import STORAGE_ERRORS, apply_pending
from autotune.search.predictions import summarize_predictions
from autotune.search.preflight import preflight
from autotune.search.presearch import PRESEARCH_ATTR, add_predictions, run_presearch
from autotune.search.proxy import ModelPlan
from autotune.search.recipe import profiles_at_end, run_recipe_round
from autotune.search.reference import get_anchors
from autotune.search.results import SearchRecord, TrialRow, pick_best, write_results
from autotune.search.search_plan import SearchPlan, get_rounds, make_search_plan
from autotune.search.settings import SearchError, SearchReporter, SearchSettings, SilentReporter
from autotune.search.shortfall import get_shortfall
from autotune.search.space import SearchSpace
from autotune.search.study import check_budget, claim_out_dir, close_interrupted, open_study, resolve_plan
from autotune.search.target import Target
from autotune.trials import (
    check_cuda_devices,
    check_device_type,
    check_fits_gpu,
    get_overlap_warning,
)
from fsdp_runtime import RuntimeConfig, get_unsupported_knobs
from profiles.sources import load_model_source


@dataclass(kw_only=True)
class SearchSummary:
    """What :func:`run_search` returns: the run's rows and plan, and the record written as ``search.json``."""

    out_dir: Path
    """Where this worker wrote its files (the run dir, or its own dir under ``workers/``)."""
    study_dir: Path
    """The run dir that holds the study's trials (``settings.out_dir``)."""
    plan: ModelPlan
    rows: list[TrialRow]
    record: SearchRecord
    best_config_path: Path | None = None
    report_paths: list[Path] = field(default_factory=list)
    """``report/report.html`` and the PNGs, once :func:`autotune.report.write_search_report` wrote them."""

    @property
    def best(self) -> TrialRow | None:
        return self.record.best

    @property
    def confirmation(self) -> dict[str, Any] | None:
        return self.record.confirmation

    def to_dict(self) -> dict[str, Any]:
        return self.record.to_dict()


def run_search(settings: SearchSettings, *, reporter: SearchReporter | None = None) -> SearchSummary:
    """Run (or continue) a search and write the run directory; returns the summary."""
    reporter = reporter or SilentReporter()
    search_plan = prepare_search(settings)
    profile, device_type, mp = search_plan.source, search_plan.device_type, search_plan.precision
    study, created = open_study(settings, settings.get_study_name(profile.name))
    own_dir, lock = claim_out_dir(settings.out_dir)  # ``lock`` stays referenced (held) until we return
    plan, search_plan.baseline = resolve_plan(
        study, settings, profile, search_plan.model, mixed_precision=mp, baseline=search_plan.baseline
    )
    search_plan.model = plan
    apply_pending(study, settings.out_dir / "pending")
    close_interrupted(study)
    space = make_space(settings, search_plan)
    notes = [*space.notes, *get_environment_notes(device_type), *get_node_notes(settings, space)]
    for line in search_plan.describe():  # what it will run and cost ([Note: the search plan])
        reporter.on_phase(line)
    if hasattr(reporter, "on_plan"):  # a reporter that names the baseline in its trial lines
        reporter.on_plan(search_plan)
    for note in notes:  # knobs left out; CUDA_DEVICE_MAX_CONNECTIONS=1; the meshes by node
        reporter.on_phase(note)
    if created:
        study.enqueue_trial(space.get_default_params(), user_attrs={"is_default": True})
    reporter.on_start(plan, settings, len(study.get_trials(deepcopy=False)))
    # One pool for everything that runs ranks: trials, confirmation and consolidation timing
    # all see the same warmed-up processes (see warm_up).
    with open_pool(settings) as pool:
        ctx = SearchContext(
            study=study, space=space, settings=settings, plan=plan, reporter=reporter, pool=pool, own_dir=own_dir
        )
        ctx.profile_at_end = profiles_at_end(ctx)  # [Note: the emitted config's trace]
        search_plan.rounds = get_rounds(settings, search_plan.target, recipe=ctx.profile_at_end)
        ctx.ledger.rounds = search_plan.rounds  # the ETA's plan ([Note: round costs])
        warm_up(ctx)
        try:
            run_presearch(ctx)  # --presearch sim: the defaults, calibration, the simulator's top-k enqueued
            stopped = search_loop(ctx)
            reporter.on_trials_done(stopped)
            return finish_search(ctx, search_plan, stopped_because=stopped)
        except STORAGE_ERRORS as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise SearchError(
                f"the study storage became unavailable ({first}); every finished trial is kept: continue with --resume",
                field="storage",
            ) from None


def prepare_search(settings: SearchSettings, *, target: Target | None = None) -> SearchPlan:
    """Before anything is written: the search plan (the model source loaded once, the target, the
    trials' precision, the model or its proxy, the baseline, the cost), checked against this machine
    (or ``target``: the GPU scripts' dry runs) and the settings."""
    plan = make_search_plan(settings, target=target)
    check_machine(settings, plan)
    check_budget(plan.model, settings)
    preflight(settings, num_blocks=len(plan.source.block_names))
    return plan


def get_node_notes(settings: SearchSettings, space: SearchSpace) -> list[str]:
    """Where the world spans nodes (the cluster profile's ``ranks_per_node`` below the world size),
    one line naming every mesh of the space by node ([Note: node pool])."""
    if settings.cluster is None:
        return []
    from autotune.search.nodes import describe_mesh_nodes, describe_world

    per_node = get_ranks_per_node(settings)
    if per_node is None:
        return []
    meshes = "; ".join(describe_mesh_nodes(m, settings.world_size, per_node) for m in space.get_mesh_choices())
    return [f"{describe_world(settings.world_size, per_node)}: {meshes}"]


def get_ranks_per_node(settings: SearchSettings) -> int | None:
    """The ranks of one node where the world spans nodes (the cluster profile's ``ranks_per_node``
    below the world size); None on one node or without a cluster profile."""
    if settings.cluster is None:
        return None
    from profiles import load_cluster_profile

    per_node = load_cluster_profile(settings.cluster).ranks_per_node
    return per_node if per_node < settings.world_size else None


def check_machine(settings: SearchSettings, plan: SearchPlan) -> None:
    """Before anything is written: the model trains on the device (torchtitan 0.3.0's not on CPU); on CUDA
    a GPU per rank (not for ``--plan-for``, which answers for another node), and the run model's sharded
    training state fits one GPU."""
    device_type, run = plan.device_type, plan.model.run
    check_device_type(run, device_type)
    # across nodes, each node's ranks find their GPUs when the world forms
    if settings.workers is None and plan.target.planned_for is None:
        check_cuda_devices(settings.world_size, device_type)
    memory = plan.target.memory_per_rank_bytes
    check_fits_gpu(run, settings.world_size, plan.precision, device_type=device_type, total_memory=memory)


def get_environment_notes(device_type: str) -> list[str]:
    """Lines about this process's environment that change what the trials measure (each with its fix)."""
    import os

    return [line for line in (get_overlap_warning(os.environ, device_type),) if line]


def make_space(settings: SearchSettings, search_plan: SearchPlan) -> SearchSpace:
    """The space of ``settings``' knobs for the model the trials run (the proxy's blocks and edge modules),
    every config in the plan's precision, its defaults the plan's baseline (checkpointing then searched)."""
    plan, baseline = search_plan.model, search_plan.baseline.checkpointing
    # A custom rank program builds its own model, which need not have the run model's edge modules.
    embeddings, head = _find_edges(plan) if settings.root_knobs and settings.rank_program is None else ((), ())
    return SearchSpace(
        block_names=tuple(plan.run.block_names),
        world_size=settings.world_size,
        num_microbatches=settings.num_microbatches,
        device_type=search_plan.device_type,
        fixed_mesh=settings.fixed_mesh,
        pipeline_degrees=settings.pipeline_degrees,
        grouping=settings.grouping,
        checkpointing=settings.get_checkpointing() or baseline != "none",
        baseline_checkpointing=baseline,
        root_knobs=settings.root_knobs,
        embedding_names=embeddings,
        head_names=head,
        ranks_per_node=get_ranks_per_node(settings),
        unsupported_knobs=tuple(get_unsupported_knobs().items()),
        mixed_precision=search_plan.precision,
        search_reduce_dtype=settings.search_reduce_dtype,
    )


def _find_edges(plan: ModelPlan) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The run model's embeddings and head (``find_edge_modules`` on the meta device), or none
    when the model cannot be built there: then the root is searched but never split."""
    from fsdp_runtime import find_edge_modules

    try:
        embeddings, head = find_edge_modules(plan.run.build(device="meta"))
    except Exception:  # a factory that cannot build on meta: no split offered, nothing else changes
        return (), ()
    return tuple(embeddings), tuple(head)


def _with_fastest_consolidation(ctx: SearchContext, config: RuntimeConfig) -> tuple[RuntimeConfig, dict[str, Any]]:
    """Time consolidation per method and emit the fastest measured here (on CPU gloo broadcast
    beats all_gather for large tensors; see [Note: all_gather consolidation])."""
    ctx.reporter.on_phase("timing checkpoint consolidation of the emitted config")
    consolidation = time_consolidation(ctx, config)
    if not consolidation.get("seconds"):
        return config, consolidation
    fastest = min(consolidation["seconds"], key=consolidation["seconds"].get)
    consolidation["chosen"] = fastest
    return dataclasses.replace(
        config, checkpoint=dataclasses.replace(config.checkpoint, consolidation=fastest)
    ), consolidation


def finish_search(ctx: SearchContext, search_plan: SearchPlan | None = None, *, stopped_because: str) -> SearchSummary:
    """Confirm best vs defaults side by side; write the best config, the tables and ``search.json``."""
    rows = add_predictions(ctx, get_rows(ctx.study))
    best = pick_best(rows)
    plan = ctx.plan
    record = SearchRecord(
        model=plan.requested.name,
        proxy={"is_proxy": plan.is_proxy, "name": plan.proxy_name, "reason": plan.reason, "overrides": plan.overrides},
        num_trials=len(rows),
        stopped_because=stopped_because,
        best=best,
        default=next((r for r in rows if r.is_default), None),
        mixed_precision=dataclasses.asdict(ctx.space.mixed_precision),
        searched_reduce_dtype=ctx.space.search_reduce_dtype,
        notes=[
            *get_environment_notes(ctx.space.device_type),
            *get_node_notes(ctx.settings, ctx.space),
            *get_world_notes(ctx.pool),
        ],
    )
    record.search_plan = search_plan.to_dict() if search_plan is not None else None
    record.baseline = search_plan.baseline.to_dict() if search_plan is not None else None
    record.presearch = summarize_predictions(rows, ctx.study.user_attrs.get(PRESEARCH_ATTR))
    record.shortfall = get_shortfall(ctx, rows, stopped_because)
    record.anchors = get_anchors(ctx)
    for line in record.shortfall:
        ctx.reporter.on_phase(f"warning: {line}")
    summary = SearchSummary(out_dir=ctx.write_dir, study_dir=ctx.settings.out_dir, plan=plan, rows=rows, record=record)
    if best is not None:
        config, record.confirmation = run_final_round(ctx, rows)
        config, record.recipe = run_recipe_round(ctx, config, record.confirmation)  # [Note: beating the recipe]
        config, record.consolidation = _with_fastest_consolidation(ctx, config)
        summary.best_config_path = emit_best(
            ctx,
            config,
            best=best,
            default=record.default,
            confirmation=record.confirmation,
            consolidation=record.consolidation,
            recipe=record.recipe,
        )
        record.best_config = str(summary.best_config_path)
    write_results(rows, ctx.write_dir)
    record.rounds = ctx.ledger.to_dict()  # [Note: round costs]
    record.write(ctx.write_dir / "search.json")
    return summary


def describe_interrupted(settings: SearchSettings) -> str:
    """One line for a search stopped by Ctrl-C or SIGTERM: what the study kept and how to go on."""
    import optuna

    name = settings.get_study_name(load_model_source(settings.model).name)
    try:
        from autotune.search.study import make_storage

        trials = optuna.load_study(study_name=name, storage=make_storage(settings.get_storage(), settings)).get_trials(
            deepcopy=False
        )
        kept = f"{sum(t.state.is_finished() and t.user_attrs.get('status') != 'interrupted' for t in trials)} finished trial(s)"
    except Exception:  # the study may not exist yet, or its storage be the thing that failed
        kept = "every finished trial"
    return f"interrupted: {kept} kept in study {name!r} ({settings.get_storage()}); the running trial was closed as FAIL; to continue, run the same command with --resume"
