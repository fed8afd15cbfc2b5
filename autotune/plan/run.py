"""``autotune plan``: rank the whole search space in the simulator for a cluster; emit the best config."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from autotune.plan.evaluate import REDUCED_DEPTHS, PlanReporter, Pricer, StagedEvaluator, make_pricer
from autotune.plan.record import PlanRecord
from autotune.search import KnobFactory, RankedPoint, SearchSpace, check_mesh, rank_staged
from autotune.sim import DeviceProfile, Hardware, MemoryMargin, ModelWork, Simulator, StepPrediction, get_model_work
from autotune.trials import check_dtype, resolve_precision
from fsdp_runtime import AutotuneError, MixedPrecisionConfig, Provenance, RuntimeConfig, save_config
from profiles import load_cluster_profile, load_model_source

ActivationCheckpointing = Literal["auto", "none", "full"]
PLAN_STAGED_TOP = 8
"""Configs (the fastest, and the fastest that fit) whose memory-knob variants are simulated at full depth:
``num_top`` of :func:`autotune.search.rank_staged`, which says why it is smaller than the presearch's."""


class PlanError(AutotuneError):
    """``autotune plan`` cannot run with these settings."""


@dataclass(kw_only=True)
class PlanSettings:
    model: str = "llama8b"
    cluster: str = "h100-node"
    num_nodes: int = 1
    num_microbatches: int = 2
    out_dir: Path = Path("runs/plan")
    activation_checkpointing: ActivationCheckpointing = "auto"
    """The training script's activation checkpointing, per block: ``none``, ``full``, or ``auto``:
    with ``memory_knobs``, searched per unit and set in the emitted config (the script checkpoints
    nothing itself); without, none if FSDP2's defaults fit in memory without it and outside the
    memory margin ([Note: memory margin] in :mod:`autotune.sim.margin`), else full."""
    fixed_mesh: str | None = None
    param_dtype: str | None = None
    """Unsharded parameters' dtype; None: the cluster device's default (bfloat16 on CUDA), as
    ``autotune search`` resolves it ([Note: precision defaults] in :mod:`autotune.trials.precision`)."""
    reduce_dtype: str | None = None
    """Gradient reduction's dtype; None: float32."""
    num_top: int = 10
    device_profile: Path | None = None
    """A GPU measured by ``autotune calibrate`` ([Note: device profile]): its rates price compute,
    copies, the optimizer and the host floor in place of the cluster's datasheet figures."""
    num_workers: int = field(default_factory=lambda: min(8, os.cpu_count() or 1))
    """Processes simulating in parallel."""
    exact: bool = False
    """Simulate every point at the model's depth, never extrapolated from shallower ones ([Note: plan speed])."""
    memory_knobs: bool = True
    """Also rank blocks per unit, the root's knobs and (with ``activation_checkpointing = "auto"``)
    per-unit checkpointing in the config, staged ([Note: staged ranking]; ``PLAN_STAGED_TOP`` fastest)."""

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        for name, ok, problem in (
            ("num_nodes", self.num_nodes >= 1, f"nodes must be >= 1, got {self.num_nodes}"),
            ("num_microbatches", self.num_microbatches >= 1, f"microbatches must be >= 1, got {self.num_microbatches}"),
            ("num_top", self.num_top >= 1, f"top must be >= 1, got {self.num_top}"),
            ("num_workers", self.num_workers >= 1, f"workers must be >= 1, got {self.num_workers}"),
            (
                "activation_checkpointing",
                self.activation_checkpointing in ("auto", "none", "full"),
                f"activation checkpointing must be auto, none or full, got {self.activation_checkpointing!r}",
            ),
        ):
            if not ok:
                raise PlanError(problem, field=name)
        check_dtype(self.param_dtype, field="param_dtype")
        check_dtype(self.reduce_dtype, field="reduce_dtype")
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise PlanError(f"{self.out_dir} exists and is not a directory", field="out_dir")


class SilentPlanReporter:
    def on_phase(self, message: str) -> None:
        pass

    def on_start(self, total: int) -> None:
        pass

    def on_advance(self, count: int) -> None:
        pass


@dataclass(kw_only=True)
class PlanResult:
    settings: PlanSettings
    world_size: int
    activation_checkpointing: bool
    """The training script checkpoints every block (outside the config)."""
    ac_reason: str
    ac_in_config: bool = False
    """Checkpointing was searched per unit: the emitted config sets it."""
    ranked: list[RankedPoint]
    """Configs that fit, fastest first (those at the edge of memory among them, flagged by their prediction)."""
    dropped: list[RankedPoint]
    """Configs over memory, least over first."""
    num_evaluated: int
    """Configs with a prediction (simulated, or identical to one that was)."""
    evaluate_s: float
    num_simulated: int = 0
    """Distinct simulations (points whose knobs are equal share one: [Note: plan speed])."""
    num_pruned: int = 0
    """Configs not simulated because another point dominates them ([Note: plan speed])."""
    num_exact: int = 0
    """Configs simulated at the model's full depth (all of them unless extrapolated, [Note: plan speed])."""
    default: RankedPoint
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    """The precision every config was simulated in (:func:`get_plan_precision`)."""
    memory_margin: MemoryMargin | None = None
    """How far below the usable memory a peak is safe ([Note: memory margin])."""
    best: RankedPoint | None = None
    """The emitted config: the fastest that fits outside the memory margin, else the fastest that fits (at the edge)."""
    best_config: RuntimeConfig | None = None
    best_detail: StepPrediction | None = None
    out_files: list[Path] = field(default_factory=list)

    def get_distinct_top(self) -> list[tuple[RankedPoint, int]]:
        """The best configs with distinct predictions (step to the microsecond, peak memory to the
        MiB), each the simplest of its kind (the ranking's tie-break), with how many configs
        predict the same; the emitted config's kind among them even where configs at the edge of
        memory take the first ``num_top`` places."""
        distinct: dict[tuple[int, int], list[Any]] = {}
        best_key = _get_distinct_key(self.best) if self.best is not None else None
        for row in self.ranked:
            key = _get_distinct_key(row)
            if key in distinct:
                distinct[key][1] += 1
            elif len(distinct) < self.settings.num_top or key == best_key:
                distinct[key] = [row, 1]
        return [(row, count) for row, count in distinct.values()]

    def is_emitted(self, row: RankedPoint) -> bool:
        """``row`` is of the emitted config's kind (:meth:`get_distinct_top`'s: predicted alike)."""
        return self.best is not None and _get_distinct_key(row) == _get_distinct_key(self.best)

    @property
    def num_at_edge(self) -> int:
        """Configs that fit the usable memory but not with the margin."""
        return sum(1 for row in self.ranked if row.prediction.at_edge)

    @property
    def faster_at_edge(self) -> list[RankedPoint]:
        """Configs ranked before the emitted one: all at the edge of memory."""
        return self.ranked[: self.ranked.index(self.best)] if self.best is not None else []

    def get_edge_note(self) -> str | None:
        """Why the emitted config is not the fastest that fits, or that it is at the edge of memory itself; None if neither."""
        if self.best is None or self.memory_margin is None:
            return None
        margin, peak = self.memory_margin, self.best.prediction.peak_memory_bytes / 2**30
        if self.best.prediction.at_edge:
            return (
                f"at the edge of memory: every config that fits predicts a peak within the memory margin; this one, "
                f"the fastest, predicts {peak:.1f} GiB ({margin.describe()}): it may run out of memory, "
                "so measure its peak (autotune trial) before training with it"
            )
        faster = self.faster_at_edge
        if not faster:
            return None
        ratio = faster[0].prediction.step_s / self.best.prediction.step_s
        return (
            f"{len(faster)} faster configs fit but are at the edge of memory and were not emitted ({margin.describe()}); "
            f"the fastest of them predicts {ratio:.3f}x this one's step time at a {faster[0].prediction.peak_memory_bytes / 2**30:.1f} GiB peak"
        )

    @property
    def ac_label(self) -> str:
        return "per unit, in the config" if self.ac_in_config else ("full" if self.activation_checkpointing else "none")

    @property
    def configs_per_s(self) -> float:
        return self.num_evaluated / self.evaluate_s if self.evaluate_s > 0 else float("inf")


def _get_distinct_key(row: RankedPoint) -> tuple[int, int]:
    """Step to the microsecond, peak memory to the MiB: configs predicted alike."""
    return round(row.prediction.step_s * 1e6), round(row.prediction.peak_memory_bytes / 2**20)


def run_plan(settings: PlanSettings, *, reporter: PlanReporter | None = None) -> PlanResult:
    """Simulate every point of the search space on the cluster, rank, and emit the best config."""
    reporter = reporter or SilentPlanReporter()
    profile = load_model_source(settings.model)
    hardware = Hardware(load_cluster_profile(settings.cluster), settings.num_nodes, device=_read_device(settings))
    _ = hardware.accelerator  # a profile without one fails here, in one line
    check_mesh(settings.fixed_mesh, hardware.world_size)
    mp = get_plan_precision(settings, hardware)
    _check_device(settings, hardware, mp)
    for line in hardware.describe_prices():
        reporter.on_phase(line)
    reporter.on_phase(f"tracing {profile.name} on fake tensors (FLOPs, bytes, activation memory per unit)")
    work = get_model_work(profile, mp.param_dtype)
    searched_ac = settings.memory_knobs and settings.activation_checkpointing == "auto"
    space = _get_space(settings, work, hardware, searched_ac=searched_ac, mp=mp)
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
    rows = rank_staged(space, evaluator, num_top=PLAN_STAGED_TOP, top_fitting=True, key=order)
    result = PlanResult(
        settings=settings,
        world_size=hardware.world_size,
        activation_checkpointing=ac,
        ac_reason=ac_reason,
        ranked=[r for r in rows if r.prediction.fits],
        dropped=[r for r in rows if not r.prediction.fits],
        num_evaluated=len(rows),
        evaluate_s=evaluator.evaluate_s,
        default=next(row for row in rows if row.params == default_params),
        num_simulated=evaluator.num_simulated,
        num_pruned=evaluator.num_pruned,
        num_exact=evaluator.num_exact,
        ac_in_config=searched_ac,
        mixed_precision=mp,
        memory_margin=hardware.memory_margin,
    )
    if result.ranked:
        result.best = next((row for row in result.ranked if not row.prediction.at_edge), result.ranked[0])
        result.best_config = factory.build_config(result.best.params)
        result.best_detail = full.simulator.simulate(result.best_config)
        result.out_files = _emit(result, profile.name, hardware)
    return result


def get_plan_precision(settings: PlanSettings, hardware: Hardware) -> MixedPrecisionConfig:
    """The plan's precision: the options, else the default of the cluster's device (as a search there resolves it)."""
    return resolve_precision(
        hardware.cluster.device, param_dtype=settings.param_dtype, reduce_dtype=settings.reduce_dtype
    )


def _get_space(
    settings: PlanSettings, work: ModelWork, hardware: Hardware, *, searched_ac: bool, mp: MixedPrecisionConfig
) -> SearchSpace:
    return SearchSpace(
        block_names=work.block_names,
        world_size=hardware.world_size,
        num_microbatches=settings.num_microbatches,
        device_type=hardware.cluster.device,
        fixed_mesh=settings.fixed_mesh,
        grouping=settings.memory_knobs,
        root_knobs=settings.memory_knobs,
        checkpointing=searched_ac,
        mixed_precision=mp,
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


def _emit(result: PlanResult, model_name: str, hardware: Hardware) -> list[Path]:
    """``best.toml``/``best.json`` (provenance: simulated, the cluster) and ``plan.json``."""
    import torch

    detail = result.best_detail
    assert result.best_config is not None and detail is not None
    speedup = result.default.prediction.step_s / detail.step_s if result.default.prediction.fits else None
    provenance = Provenance(
        produced_by="autotune plan (simulated)",
        model=model_name,
        world_size=result.world_size,
        backend=hardware.cluster.backend,
        torch_version=torch.__version__,
        measured=False,
        created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        notes=_get_notes(result, hardware, speedup),
        metrics={**detail.to_metrics(), **({"predicted_speedup_vs_default": speedup} if speedup else {})},
    )
    config = dataclasses.replace(result.best_config, provenance=provenance)
    out = result.settings.out_dir
    files = [save_config(config, out / "best.toml"), save_config(config, out / "best.json")]
    return [*files, _get_record(result, model_name, hardware).write(out / "plan.json")]


def _get_notes(result: PlanResult, hardware: Hardware, speedup: float | None) -> list[str]:
    """The emitted config's provenance notes: simulated on what, the checkpointing assumption, the choice."""
    best, detail, settings = result.best, result.best_detail, result.settings
    assert best is not None and detail is not None
    notes = [
        f"simulated, not measured: autotune plan ranked {result.num_evaluated} configs on {settings.num_nodes} x {hardware.cluster.name} "
        f"({result.world_size} ranks of {hardware.accelerator.name}) with the FSDP2 step simulator (autotune.sim)",
        (
            f"activation checkpointing is set per unit in this config ({result.ac_reason}); the training script must not checkpoint the blocks itself"
            if result.ac_in_config
            else f"assumes activation checkpointing {'full (every block)' if result.activation_checkpointing else 'none'} in the training script ({result.ac_reason}); this config does not set it"
        ),
        f"chosen: {best.description}",
        *hardware.describe_prices(),
    ]
    if speedup is not None:
        notes.append(
            f"predicted {speedup:.3f}x FSDP2's defaults ({1e3 * result.default.prediction.step_s:.0f} ms -> {1e3 * detail.step_s:.0f} ms per step)"
        )
    edge = result.get_edge_note()
    return [*notes, edge] if edge else notes


def _get_record(result: PlanResult, model_name: str, hardware: Hardware) -> PlanRecord:
    best, detail, settings = result.best, result.best_detail, result.settings
    assert best is not None and detail is not None
    return PlanRecord(
        model=model_name,
        cluster=hardware.cluster.name,
        num_nodes=settings.num_nodes,
        world_size=result.world_size,
        num_microbatches=settings.num_microbatches,
        activation_checkpointing="per_unit"
        if result.ac_in_config
        else ("full" if result.activation_checkpointing else "none"),
        num_evaluated=result.num_evaluated,
        num_simulated=result.num_simulated,
        num_pruned=result.num_pruned,
        num_exact=result.num_exact,
        num_fit=len(result.ranked),
        num_dropped=len(result.dropped),
        configs_per_s=result.configs_per_s,
        default={"config": result.default.description, **result.default.prediction.to_dict()},
        best={"config": best.description, "params": best.params, **detail.to_dict()},
        top=[
            {
                "config": r.description,
                "params": r.params,
                "num_alike": n,
                **r.prediction.to_metrics(),
                "at_edge": r.prediction.at_edge,
            }
            for r, n in result.get_distinct_top()
        ],
        memory_margin=result.memory_margin.to_dict() if result.memory_margin else None,
        num_at_edge=result.num_at_edge,
    )
