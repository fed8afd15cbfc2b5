"""``autotune plan``'s settings and result: what a plan is asked and what it found (data only;
:mod:`~autotune.plan.run` ranks, :mod:`~autotune.plan.emit` writes)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from autotune.search import RankedPoint
from autotune.sim import MemoryMargin, StepPrediction
from autotune.trials import check_dtype
from fsdp_runtime import AutotuneError, MixedPrecisionConfig, RuntimeConfig

ActivationCheckpointing = Literal["auto", "none", "full"]


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
    pp_degrees: tuple[int, ...] | str | None = None
    """PP degrees to rank ([Note: the plan's pipeline axis] in :mod:`autotune.plan.pipeline`), or their
    comma-separated list (``1,2,4,8``); None: 1 and the degrees up to 8 that divide the world size and the
    model's blocks."""
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
        if isinstance(self.pp_degrees, str):
            self.pp_degrees = _parse_degrees(self.pp_degrees)
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise PlanError(f"{self.out_dir} exists and is not a directory", field="out_dir")


def _parse_degrees(text: str) -> tuple[int, ...]:
    try:
        degrees = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise PlanError(
            f"PP degrees must be integers separated by commas (1,2,4), got {text!r}", field="pp_degrees"
        ) from None
    if min(degrees) < 1:
        raise PlanError(f"PP degrees must be >= 1, got {text!r}", field="pp_degrees")
    return degrees


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
    pp_degrees: list[int] = field(default_factory=lambda: [1])
    """The PP degrees ranked (1: FSDP2 alone)."""
    best_per_pp: list[RankedPoint] = field(default_factory=list)
    """Each PP degree's best config that fits (the fastest safe one, else the fastest), in degree order."""
    pipeline_in_config: bool = False
    """The emitted config carries its pipeline (schema 3's ``mesh.pp`` and ``[pipeline]``); False for PP 1,
    or where this ``fsdp_runtime`` has no pipeline schema."""
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
