"""``autotune plan``'s pipeline axis: PP degrees, schedules and virtual stages, ranked jointly with the
FSDP2 knobs inside each stage ([Note: pipeline schedules] in :mod:`autotune.sim.pipeline`).

[Note: the plan's pipeline axis]
Every PP degree ``p`` the plan ranks (``--pp``; default 1 and the degrees up to ``PP_MAX_DEGREE``
that divide both the world size and the model's blocks) is its own space: the FSDP2 knobs over
the data-parallel mesh of ``world / p`` ranks (:class:`autotune.search.SearchSpace` at that world
size), with ``p x M`` microbatches per step, ``M`` being ``--microbatches``: every degree then
trains the same tokens per optimizer step (the global batch), so that their steps compare; a
microbatch stays the model profile's batch x sequence. To that space it adds the schedule
(the runtime config's: ``gpipe``, ``1f1b``, and ``interleaved_1f1b`` with ``PP_VIRTUAL_STAGES``
stages per rank where they divide the blocks; zero bubble is priced by the simulator, not offered
by the runtime) and ``every_keep_unsharded`` (a ``sync = "every"`` block keeps its
parameters after backward: then only its reduce-scatters run per microbatch, the overlap
[Note: pipeline schedules] is about; FSDP2 honours ``reshard_after_backward`` when it reduces).

A pipeline step costs 10-50 ms to simulate for llama70b (every microbatch of every stage runs),
so the degrees are not walked exhaustively; each is ranked in two stages, like
[Note: staged ranking]:

1. *Core*: every mesh of the data-parallel world x reshard after forward (true, false) x the sync
   patterns that matter here (every block reduces each microbatch, with and without keeping its
   parameters; or none does, at each level, with and without keeping them) x every schedule, all
   with the memory knobs at their first choice, except checkpointing (when it is searched):
   full on every block, the memory a pipeline's in-flight microbatches usually need. Prefetch
   stays FSDP2's implicit one, one reduce-scatter buffer: the overlap knobs move llama-sized
   steps by well under 1% on H100s ([Note: plan speed]'s figures), the schedule by tens of %.
2. *Memory*: every memory-knob variant (:func:`autotune.search.iter_memory_variants`: blocks
   per unit that divide a stage, checkpointing patterns, the root's knobs) of the
   ``PP_STAGED_TOP`` fastest core configs and the ``PP_STAGED_TOP`` fastest that fit safely.

Both stages run at full depth (no extrapolation: a stage's blocks are fewer than the model's).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from autotune.plan.evaluate import PlanReporter, run_groups
from autotune.plan.result import PlanError
from autotune.search import KnobFactory, RankedPoint, SearchSpace, iter_memory_variants
from autotune.sim import Hardware, Knobs, ModelWork, PipelinePrediction, PipelineSimulator, PipelineSpec
from fsdp_runtime import PIPELINE_SCHEDULES, ROOT_UNIT, MixedPrecisionConfig, RuntimeConfig

PP_MAX_DEGREE = 8
"""The largest PP degree ranked by default."""
PP_VIRTUAL_STAGES = (2, 4)
"""Stages per pp rank the interleaved schedules are ranked with (where they divide the blocks)."""
PP_STAGED_TOP = 4
"""Core pipeline configs whose memory-knob variants are simulated: the fastest, and the fastest that fit."""
PP_KEYS = ("pp", "pp_schedule", "pp_virtual", "every_keep_unsharded")
"""The parameters a pipeline point adds to the FSDP2 space's."""
_GROUP = 16
"""Points per task handed to a worker."""


def get_pp_degrees(requested: tuple[int, ...] | None, world_size: int, num_blocks: int) -> list[int]:
    """The PP degrees to rank: ``requested``, or 1 and the degrees up to ``PP_MAX_DEGREE`` dividing the
    world size and the blocks; a degree the cluster or the model cannot split is refused in one line."""
    if requested is None:
        return [p for p in range(1, PP_MAX_DEGREE + 1) if world_size % p == 0 and num_blocks % p == 0]
    for p in requested:
        if p < 1 or world_size % p or num_blocks % p:
            raise PlanError(
                f"PP degree {p} does not divide the world size {world_size} and the model's {num_blocks} blocks",
                field="pp_degrees",
            )
    return sorted(set(requested))


def get_schedule_choices(pp: int, num_blocks: int) -> list[tuple[str, int]]:
    """``(schedule, virtual stages)`` pairs a PP degree can run the model with: the runtime config's schedules
    (``fsdp_runtime.PIPELINE_SCHEDULES``; not zero bubble, which the simulator prices but FSDP2 stages did not
    train correctly with), interleaved ones where ``pp x v`` divides the blocks."""
    return [
        (schedule, v)
        for schedule in PIPELINE_SCHEDULES
        for v in ((1,) if schedule in ("gpipe", "1f1b") else PP_VIRTUAL_STAGES)
        if num_blocks % (pp * v) == 0
    ]


@dataclass(kw_only=True)
class PipelinePricer:
    """The space, knobs and simulator of one PP degree."""

    pp: int
    space: SearchSpace
    factory: KnobFactory
    simulator: PipelineSimulator

    def get_spec(self, params: dict[str, Any]) -> PipelineSpec:
        return PipelineSpec(
            pp=self.pp,
            schedule=params["pp_schedule"],
            virtual_stages=params["pp_virtual"],
            num_microbatches=self.space.num_microbatches,
        )

    def get_knobs(self, params: dict[str, Any]) -> Knobs:
        knobs = self.factory.get_knobs(_get_stage_params(params))
        if not params.get("every_keep_unsharded"):
            return knobs
        root = len(knobs.sync) - 1
        keep = tuple(
            False if u < root and sync == "every" else rab
            for u, (sync, rab) in enumerate(zip(knobs.sync, knobs.reshard_after_backward))
        )
        return dataclasses.replace(knobs, reshard_after_backward=keep)

    def simulate_group(self, points: list[dict[str, Any]]) -> tuple[list[PipelinePrediction], int]:
        return [self.simulator.simulate_knobs(self.get_knobs(p), self.get_spec(p)) for p in points], len(points)

    def build_config(self, params: dict[str, Any]) -> tuple[RuntimeConfig, bool]:
        """The point's runtime config, and whether it could carry the pipeline (schema 3's ``mesh.pp`` and
        ``[pipeline]``; a config without them holds the data-parallel mesh and every stage's units)."""
        config = self.factory.build_config(_get_stage_params(params))
        if params.get("every_keep_unsharded"):
            units = [
                dataclasses.replace(u, reshard_after_backward=False) if u.name != ROOT_UNIT and u.sync == "every" else u
                for u in config.units
            ]
            config = dataclasses.replace(config, units=units)
        spec = self.get_spec(params)
        if "pp" not in {f.name for f in dataclasses.fields(config.mesh)} or not hasattr(config, "pipeline"):
            return config, False
        pipeline = dataclasses.replace(
            config.pipeline, schedule=spec.schedule, virtual_stages=spec.virtual_stages, blocks_per_stage=None
        )
        return dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, pp=spec.pp), pipeline=pipeline), True


def _get_stage_params(params: dict[str, Any]) -> dict[str, Any]:
    """A point's FSDP2 parameters, which the space over one stage's data-parallel world expands (its own
    ``pp`` would be a pipeline of that world)."""
    return {k: v for k, v in params.items() if k not in PP_KEYS}


def make_pipeline_pricer(
    pp: int,
    space: SearchSpace,
    work: ModelWork,
    hardware: Hardware,
    *,
    mp: MixedPrecisionConfig,
    ac: bool,
    fixed_mesh: str | None = None,
) -> PipelinePricer:
    """``space`` (the plan's, over the whole world) as degree ``pp`` sees it: ``world / pp`` ranks (the
    data-parallel mesh fixed to ``fixed_mesh`` if given), ``pp`` times the microbatches."""
    simulator = PipelineSimulator(work, hardware, activation_checkpointing=ac)
    dp = simulator.get_dp_hardware(pp)
    stage_space = dataclasses.replace(
        space, world_size=dp.world_size, num_microbatches=space.num_microbatches * pp, fixed_mesh=fixed_mesh
    )
    factory = KnobFactory(stage_space, world_size=dp.world_size, device=dp.cluster.device, mixed_precision=mp)
    return PipelinePricer(pp=pp, space=stage_space, factory=factory, simulator=simulator)


def get_core_points(pricer: PipelinePricer, *, searched_ac: bool) -> list[dict[str, Any]]:
    """Stage 1 of [Note: the plan's pipeline axis]: meshes x reshard after forward x sync x schedules."""
    space, points = pricer.space, []
    schedules = get_schedule_choices(pricer.pp, len(space.block_names))
    for mesh in space.get_mesh_choices():
        base = dataclasses.replace(space, fixed_mesh=mesh).get_default_params()
        if searched_ac:
            base.update(ac_units="all", ac_kind="full")
        reshard_key = next(k for k in base if k.startswith("reshard_after_forward"))
        for reshard in ("true", "false"):
            for sync in _get_sync_variants(space, mesh):
                points.extend(
                    {**base, reshard_key: reshard, **sync, "pp": pricer.pp, "pp_schedule": s, "pp_virtual": v}
                    for s, v in schedules
                )
    return points


def _get_sync_variants(space: SearchSpace, mesh: str) -> list[dict[str, Any]]:
    every = [{"nosync_blocks": "none"}, {"nosync_blocks": "none", "every_keep_unsharded": True}]
    suffix = space.get_sync_suffix(mesh)
    levels = ["last", "replica_last"] if suffix == "hsdp" else ["last"]
    skipped = [
        {
            "nosync_blocks": "all",
            f"nosync_level_{suffix}": level,
            "keep_unsharded": keep,
            **({"defer_concat": True} if level == "last" else {}),
        }
        for level in levels
        for keep in (False, True)
    ]
    return every + skipped


def get_memory_points(pricer: PipelinePricer, seeds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stage 2: every memory-knob variant of ``seeds`` whose units fit inside a stage."""
    points: dict[tuple[Any, ...], dict[str, Any]] = {}
    for seed in seeds:
        per_stage = len(pricer.space.block_names) // (pricer.pp * seed["pp_virtual"])
        variants = list(iter_memory_variants(pricer.space, seed["mesh"]))
        memory_keys = {k for variant in variants for k in variant}
        kept = {k: v for k, v in seed.items() if k not in memory_keys}
        for variant in variants:
            if per_stage % variant.get("blocks_per_unit", 1) == 0:
                point = {**kept, **variant}
                points.setdefault(tuple(sorted(point.items(), key=str)), point)
    return list(points.values())


@dataclass(kw_only=True)
class PipelineRanking:
    """Every pipeline point ranked, with what it took."""

    rows: list[RankedPoint]
    pricers: dict[int, PipelinePricer]
    num_simulated: int
    evaluate_s: float


def rank_pipelines(
    pricers: dict[int, PipelinePricer], *, searched_ac: bool, reporter: PlanReporter, num_workers: int
) -> PipelineRanking:
    """Both stages of [Note: the plan's pipeline axis] for every degree, in one pool per stage."""
    started = time.perf_counter()
    order = list(pricers)
    core = {pp: get_core_points(pricers[pp], searched_ac=searched_ac) for pp in order}
    reporter.on_phase(
        f"pipelines: {sum(map(len, core.values()))} core configs of PP {', '.join(map(str, order))} "
        "(schedules, meshes, sync, reshard; checkpointing full where searched), at full depth"
    )
    rows = _evaluate(pricers, order, core, reporter, num_workers)
    seeds = {pp: _get_seeds([r for r in rows if r.params["pp"] == pp]) for pp in order}
    memory = {pp: get_memory_points(pricers[pp], seeds[pp]) for pp in order}
    reporter.on_phase(
        f"pipelines: {sum(map(len, memory.values()))} memory-knob variants of the {PP_STAGED_TOP} fastest core "
        f"configs and the {PP_STAGED_TOP} fastest that fit, per PP degree"
    )
    rows += _evaluate(pricers, order, memory, reporter, num_workers)
    return PipelineRanking(
        rows=rows, pricers=pricers, num_simulated=len(rows), evaluate_s=time.perf_counter() - started
    )


def _get_seeds(rows: list[RankedPoint]) -> list[dict[str, Any]]:
    ranked = sorted(rows, key=lambda r: r.prediction.step_s)
    safe = [r for r in ranked if r.prediction.is_safe]
    chosen = {id(r): r for r in [*ranked[:PP_STAGED_TOP], *safe[:PP_STAGED_TOP]]}
    return [r.params for r in chosen.values()]


def _evaluate(
    pricers: dict[int, PipelinePricer],
    order: list[int],
    points: dict[int, list[dict[str, Any]]],
    reporter: PlanReporter,
    num_workers: int,
) -> list[RankedPoint]:
    tasks = [
        (i, points[pp][start : start + _GROUP])
        for i, pp in enumerate(order)
        for start in range(0, len(points[pp]), _GROUP)
    ]
    reporter.on_start(sum(len(group) for _, group in tasks))
    results, _ = run_groups([pricers[pp] for pp in order], tasks, num_workers, reporter, 1.0)
    return [
        RankedPoint(params=p, prediction=prediction)
        for (_, group), predictions in zip(tasks, results)
        for p, prediction in zip(group, predictions)
    ]


def get_pipeline_summary(row: RankedPoint, num_microbatches: int) -> dict[str, Any]:
    """What ``plan.json`` records of a ranked config's pipeline (PP 1: none, ``num_microbatches`` as given)."""
    prediction = row.prediction
    if not isinstance(prediction, PipelinePrediction):
        return {"pp": 1, "schedule": None, "virtual_stages": 1, "num_microbatches": num_microbatches}
    spec = prediction.pipeline
    return {
        "pp": spec.pp,
        "schedule": spec.schedule,
        "virtual_stages": spec.virtual_stages,
        "num_microbatches": spec.num_microbatches,
    }
