"""``autotune plan``: rank the whole search space in the simulator for a cluster; emit the best config."""

from __future__ import annotations

import functools
from typing import Any

from autotune.plan.emit import emit_plan
from autotune.plan.evaluate import REDUCED_DEPTHS, PlanReporter, Pricer, StagedEvaluator, make_pricer
from autotune.plan.pipeline import PipelinePricer, get_pp_degrees, make_pipeline_pricer, rank_pipelines
from autotune.plan.result import PlanError, PlanResult, PlanSettings, SilentPlanReporter
from autotune.search import KnobFactory, RankedPoint, SearchError, SearchSpace, check_mesh, rank_staged
from autotune.sim import DeviceProfile, Hardware, ModelWork, Simulator, get_model_work
from autotune.trials import resolve_precision
from fsdp_runtime import MixedPrecisionConfig, find_block_names
from profiles import ModelSource, load_cluster_profile, load_model_source

PLAN_STAGED_TOP = 8
"""Configs (the fastest, and the fastest that fit) whose memory-knob variants are simulated at full depth:
``num_top`` of :func:`autotune.search.rank_staged`, which says why it is smaller than the presearch's."""


def run_plan(settings: PlanSettings, *, reporter: PlanReporter | None = None) -> PlanResult:
    """Simulate every point of the search space on the cluster, rank, and emit the best config."""
    reporter = reporter or SilentPlanReporter()
    profile, hardware, mp, degrees = _prepare(settings, reporter)
    reporter.on_phase(f"tracing {profile.name} on fake tensors (FLOPs, bytes, activation memory per unit)")
    work = get_model_work(profile, mp.param_dtype)
    searched_ac = settings.memory_knobs and settings.activation_checkpointing == "auto"
    # without PP 1 ranked, a fixed mesh is the pipelines' data-parallel one: FSDP2's defaults stay the reference
    space = _get_space(settings, work, hardware, searched_ac=searched_ac, mp=mp, fixed=1 in degrees)
    factory = KnobFactory(space, world_size=hardware.world_size, device=hardware.cluster.device, mixed_precision=mp)
    ac, ac_reason = _choose_checkpointing(settings, factory, work, hardware, space, searched=searched_ac)
    full, reduced = _get_pricers(settings, work, hardware, space, factory=factory, mp=mp, ac=ac)
    default_params = space.get_default_params()
    evaluator = StagedEvaluator(
        full=full,
        reduced=reduced,
        default=default_params,
        reporter=reporter,
        num_workers=settings.num_workers,
        describe=functools.partial(
            _describe_stage,
            settings,
            profile.name,
            hardware,
            num_blocks=len(work.block_names),
            extrapolated=reduced is not None,
            ac=ac,
            searched_ac=searched_ac,
        ),
    )
    order = functools.partial(_get_order_key, default_params=default_params)
    rows, default = _rank_fsdp(space, evaluator, full, ranked=1 in degrees, key=order)
    pricers = {
        pp: make_pipeline_pricer(pp, space, work, hardware, mp=mp, ac=ac, fixed_mesh=settings.fixed_mesh)
        for pp in degrees
        if pp > 1
    }
    pipelines = rank_pipelines(pricers, searched_ac=searched_ac, reporter=reporter, num_workers=settings.num_workers)
    rows = sorted(rows + pipelines.rows, key=order)
    result = PlanResult(
        settings=settings,
        world_size=hardware.world_size,
        activation_checkpointing=ac,
        ac_reason=ac_reason,
        ranked=[r for r in rows if r.prediction.fits],
        dropped=[r for r in rows if not r.prediction.fits],
        num_evaluated=len(rows),
        evaluate_s=evaluator.evaluate_s + pipelines.evaluate_s,
        default=default,
        num_simulated=evaluator.num_simulated + pipelines.num_simulated,
        num_pruned=evaluator.num_pruned,
        num_exact=evaluator.num_exact + pipelines.num_simulated,
        ac_in_config=searched_ac,
        mixed_precision=mp,
        memory_margin=hardware.memory_margin,
        pp_degrees=degrees,
    )
    if result.ranked:
        _choose_best(result, factory, full.simulator, pricers)
        result.out_files = emit_plan(result, profile.name, hardware)
    return result


def _rank_fsdp(
    space: SearchSpace, evaluator: StagedEvaluator, full: Pricer, *, ranked: bool, key: Any
) -> tuple[list[RankedPoint], RankedPoint]:
    """FSDP2 alone (PP 1) ranked, and its defaults: the reference speedups are over, ranked or not."""
    default_params = space.get_default_params()
    if ranked:
        rows = rank_staged(space, evaluator, num_top=PLAN_STAGED_TOP, top_fitting=True, key=key)
        return rows, next(row for row in rows if row.params == default_params)
    return [], RankedPoint(params=default_params, prediction=full.simulate_group([default_params])[0][0])


def _prepare(
    settings: PlanSettings, reporter: PlanReporter
) -> tuple[ModelSource, Hardware, MixedPrecisionConfig, list[int]]:
    """The model, the cluster and the plan's precision, and the PP degrees to rank: every setting checked
    (one line each) before anything is printed; then where the prices come from."""
    profile = load_model_source(settings.model)
    hardware = Hardware(load_cluster_profile(settings.cluster), settings.num_nodes, device=_read_device(settings))
    _ = hardware.accelerator  # a profile without one fails here, in one line
    mp = get_plan_precision(settings, hardware)
    _check_device(settings, hardware, mp)
    degrees = _get_degrees(settings, hardware, len(find_block_names(profile.build(device="meta"))), reporter)
    for line in hardware.describe_prices():
        reporter.on_phase(line)
    return profile, hardware, mp, degrees


def _choose_best(
    result: PlanResult, factory: KnobFactory, simulator: Simulator, pricers: dict[int, PipelinePricer]
) -> None:
    """The emitted config (the fastest safe one, else the fastest), its full prediction, and each PP degree's best."""
    best = next((row for row in result.ranked if not row.prediction.at_edge), result.ranked[0])
    result.best = best
    pp = best.params.get("pp", 1)
    if pp == 1:
        result.best_config = factory.build_config(best.params)
        result.best_detail = simulator.simulate(result.best_config)
    else:
        result.best_config, result.pipeline_in_config = pricers[pp].build_config(best.params)
        result.best_detail = pricers[pp].simulate_group([best.params])[0][0]
    for degree in result.pp_degrees:
        rows = [r for r in result.ranked if r.params.get("pp", 1) == degree]
        if rows:
            result.best_per_pp.append(next((r for r in rows if not r.prediction.at_edge), rows[0]))


def _get_degrees(settings: PlanSettings, hardware: Hardware, num_blocks: int, reporter: PlanReporter) -> list[int]:
    """The PP degrees to rank ([Note: the plan's pipeline axis]); with a fixed mesh, those whose data-parallel
    world it covers."""
    degrees = get_pp_degrees(settings.pp_degrees, hardware.world_size, num_blocks)
    if 1 in degrees:
        check_mesh(settings.fixed_mesh, hardware.world_size)
    kept = []
    for pp in degrees:
        try:
            check_mesh(settings.fixed_mesh, hardware.world_size // pp)
            kept.append(pp)
        except SearchError:
            reporter.on_phase(
                f"PP {pp} left out: --mesh {settings.fixed_mesh} does not cover its {hardware.world_size // pp} data-parallel ranks"
            )
    if not kept:
        raise PlanError(
            f"no PP degree of {', '.join(map(str, degrees))} leaves --mesh {settings.fixed_mesh} its ranks",
            field="pp_degrees",
        )
    return kept


def get_plan_precision(settings: PlanSettings, hardware: Hardware) -> MixedPrecisionConfig:
    """The plan's precision: the options, else the default of the cluster's device (as a search there resolves it)."""
    return resolve_precision(
        hardware.cluster.device, param_dtype=settings.param_dtype, reduce_dtype=settings.reduce_dtype
    )


def _get_space(
    settings: PlanSettings,
    work: ModelWork,
    hardware: Hardware,
    *,
    searched_ac: bool,
    mp: MixedPrecisionConfig,
    fixed: bool = True,
) -> SearchSpace:
    return SearchSpace(
        block_names=work.block_names,
        world_size=hardware.world_size,
        num_microbatches=settings.num_microbatches,
        device_type=hardware.cluster.device,
        fixed_mesh=settings.fixed_mesh if fixed else None,
        grouping=settings.memory_knobs,
        root_knobs=settings.memory_knobs,
        checkpointing=searched_ac,
        mixed_precision=mp,
        ranks_per_node=per_node if (per_node := hardware.cluster.ranks_per_node) < hardware.world_size else None,
    )


def _get_pricers(
    settings: PlanSettings,
    work: ModelWork,
    hardware: Hardware,
    space: SearchSpace,
    *,
    factory: KnobFactory,
    mp: MixedPrecisionConfig,
    ac: bool,
) -> tuple[Pricer, tuple[Pricer, Pricer] | None]:
    """The full-depth pricer, and for a deep model (unless ``exact``) the shallower ones it is extrapolated from."""
    full = Pricer(factory=factory, simulator=Simulator(work, hardware, activation_checkpointing=ac))
    if len(work.block_names) <= 2 * REDUCED_DEPTHS[1] or settings.exact:
        return full, None
    shallow, deep = (
        make_pricer(work, hardware, space, mixed_precision=mp, activation_checkpointing=ac, depth=d)
        for d in REDUCED_DEPTHS
    )
    return full, (shallow, deep)


def _describe_stage(
    settings: PlanSettings,
    model_name: str,
    hardware: Hardware,
    num_points: int,
    second_stage: bool,
    *,
    num_blocks: int,
    extrapolated: bool,
    ac: bool,
    searched_ac: bool,
) -> str:
    """The phase line of one stage of the ranking ([Note: staged ranking])."""
    if second_stage:
        return (
            f"memory knobs (blocks per unit, the root's knobs{', checkpointing per unit' if searched_ac else ''}): "
            f"{num_points} variants of the {PLAN_STAGED_TOP} fastest configs and the {PLAN_STAGED_TOP} fastest that fit, at full depth"
        )
    return (
        f"simulating {num_points} configs of {model_name} on {settings.num_nodes} x {hardware.cluster.name} "
        f"({hardware.world_size} ranks, {settings.num_microbatches} microbatches, activation checkpointing {'full' if ac else 'none'})"
        + (
            f"; at {' and '.join(map(str, REDUCED_DEPTHS))} blocks, extrapolated to {num_blocks}, the fastest then at full depth"
            if extrapolated
            else ""
        )
    )


def _read_device(settings: PlanSettings) -> DeviceProfile | None:
    return DeviceProfile.read(settings.device_profile) if settings.device_profile is not None else None


def _check_device(settings: PlanSettings, hardware: Hardware, mp: Any) -> None:
    """A device profile prices the precision it was measured in, on the accelerator it was measured on."""
    device = hardware.device
    if device is None:
        return
    measured = (device.measured_on.get("param_dtype"), device.measured_on.get("reduce_dtype"))
    if measured != (mp.param_dtype, mp.reduce_dtype):
        raise PlanError(
            f"device profile {settings.device_profile} was measured in {measured[0]}/{measured[1]}, the plan runs "
            f"{mp.param_dtype}/{mp.reduce_dtype}: pass --param-dtype/--reduce-dtype to match, or calibrate a trial in that precision",
            field="device_profile",
        )
    gpu = device.device.lower().removeprefix("nvidia ").strip()
    if gpu and gpu not in hardware.accelerator.name.lower():
        raise PlanError(
            f"device profile {settings.device_profile} was measured on {device.device}, cluster {hardware.cluster.name} has "
            f"{hardware.accelerator.name}: use a cluster profile of that GPU",
            field="device_profile",
        )


def _get_order_key(row: RankedPoint, default_params: dict[str, Any]) -> tuple[Any, ...]:
    """Configs that fit first, ranked: full depth before extrapolated, then fastest; among configs
    within a microsecond, the fewest knobs changed from the defaults, then the least memory. Then
    those over memory, the least over first."""
    if not row.prediction.fits:
        return (1, row.prediction.peak_memory_bytes)
    changed = sum(1 for k, v in row.params.items() if default_params.get(k) != v)
    return (0, not row.exact, round(row.prediction.step_s * 1e6), changed, row.prediction.peak_memory_bytes)


def _choose_checkpointing(
    settings: PlanSettings,
    factory: KnobFactory,
    work: ModelWork,
    hardware: Hardware,
    space: SearchSpace,
    *,
    searched: bool,
) -> tuple[bool, str]:
    """Whether the training script checkpoints every block itself (outside the config), and why."""
    if searched:
        return False, "searched per unit (none, selective or full on a pattern of blocks) and set in the emitted config"
    if settings.activation_checkpointing != "auto":
        return settings.activation_checkpointing == "full", f"--ac {settings.activation_checkpointing}"
    knobs = factory.get_knobs(space.get_default_params())
    prediction = Simulator(work, hardware).simulate_knobs([knobs])[0]
    if prediction.is_safe:
        return False, "FSDP2's defaults fit without it, outside the memory margin"
    return (
        True,
        f"without it FSDP2's defaults {'are at the edge of memory' if prediction.fits else 'do not fit'}: "
        f"{prediction.describe_memory()}; --ac none ranks without it",
    )
