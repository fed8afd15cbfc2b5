"""A model priced on a GPU by the simulator: as itself or a scale proxy, and the baseline that fits
([Note: the search plan] in :mod:`autotune.search.search_plan`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from autotune.search.proxy import MIN_DIM, ModelPlan, as_itself, get_widths, shrink_widths
from autotune.search.target import Target
from fsdp_runtime import MixedPrecisionConfig

if TYPE_CHECKING:
    from autotune.search.settings import SearchSettings
    from autotune.sim import Hardware, StepPrediction
    from profiles.sources import ModelSource

Checkpointing = Literal["none", "selective", "full"]
BASELINE_LEVELS: tuple[Checkpointing, ...] = ("none", "selective", "full")
"""The baseline's checkpointing, least first: the first whose predicted peak is safe is the baseline."""


@dataclass(frozen=True, kw_only=True)
class Baseline:
    """The reference of every pair, and what every speedup is quoted over ([Note: the search plan])."""

    checkpointing: Checkpointing = "none"
    """Activation checkpointing on every block of FSDP2's defaults: none, selective or full."""
    reason: str = "FSDP2's defaults"
    predicted_peak_gib: float | None = None

    @property
    def name(self) -> str:
        if self.checkpointing == "none":
            return "FSDP2's defaults"
        return f"FSDP2's defaults with {self.checkpointing} activation checkpointing on every block"

    @property
    def short_name(self) -> str:
        """For a column or a trial line: ``the defaults`` or ``the defaults+full AC``."""
        return "the defaults" if self.checkpointing == "none" else f"the defaults+{self.checkpointing} AC"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "checkpointing": self.checkpointing,
            "reason": self.reason,
            "predicted_peak_gib": self.predicted_peak_gib,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Baseline:
        if not data:
            return cls()
        return cls(
            checkpointing=data.get("checkpointing", "none"),
            reason=data.get("reason", ""),
            predicted_peak_gib=data.get("predicted_peak_gib"),
        )


class GpuPricer:
    """The simulator for one model source on the target's GPUs: each checkpointing level of FSDP2's
    defaults, and the leanest config, priced ([Note: the search plan])."""

    def __init__(self, source: ModelSource, target: Target, precision: MixedPrecisionConfig, num_microbatches: int):
        from autotune.search.space import SearchSpace
        from autotune.sim import Hardware, Simulator, get_model_work

        assert target.cluster is not None
        self.work = get_model_work(source, precision.param_dtype or "bfloat16")
        self.hardware: Hardware = Hardware(target.cluster, target.num_nodes, num_ranks=target.world_size)
        self.simulator = Simulator(self.work, self.hardware)
        self.space = SearchSpace(
            block_names=tuple(self.work.block_names),
            world_size=target.world_size,
            num_microbatches=num_microbatches,
            device_type="cuda",
            checkpointing=True,
            root_knobs=True,
            mixed_precision=precision,
        )

    def price(self, checkpointing: Checkpointing, *, leanest: bool = False) -> StepPrediction:
        """FSDP2's defaults with ``checkpointing`` on every block; ``leanest``: also the root resharded after forward."""
        params = self.space.get_default_params()
        if checkpointing != "none":
            params.update(ac_units="all", ac_kind=checkpointing)
        if leanest:
            params["root_reshard_after_forward"] = "true"
        return self.simulator.simulate(self.space.build_config(params))


def plan_model_on_gpu(
    source: ModelSource, target: Target, precision: MixedPrecisionConfig, settings: SearchSettings
) -> tuple[ModelPlan, GpuPricer | None]:
    """The model as itself where its leanest config fits the GPU (or ``--no-proxy``), else the largest
    scale proxy whose leanest config does (or ``--proxy``); with ``--step-budget-s``, the defaults'
    simulated step must also be within it."""
    pricer = _try_pricer(source, target, precision, settings.num_microbatches)
    if pricer is None:  # a source the simulator cannot trace: the training state alone decides
        return _plan_untraced(source, target, precision, settings), None
    lean = pricer.price("full", leanest=True)
    step = pricer.price("none").step_s
    usable = pricer.hardware.usable_memory_bytes
    over = []
    if not lean.fits:
        over.append(
            f"its leanest config (full checkpointing on every block, every unit resharded) peaks at "
            f"{lean.peak_memory_bytes / 2**30:.1f} GiB per GPU on {target.world_size} ranks, over the {usable / 2**30:.1f} GiB usable"
        )
    if settings.step_budget_s is not None and step > settings.step_budget_s:
        over.append(f"~{step:.2f} s a step simulated, over --step-budget-s {settings.step_budget_s:g}")
    if settings.proxy is False or (not over and settings.proxy is not True):
        reason = (
            f"its leanest config peaks at {lean.peak_memory_bytes / 2**30:.1f} of {usable / 2**30:.1f} GiB usable per GPU"
            if not over
            else "--no-proxy: " + "; ".join(over)
        )
        return as_itself(source, reason, lean.peak_memory_bytes, step), pricer
    reason = "; ".join(over) if over else "--proxy"
    return _find_gpu_proxy(source, target, precision, settings, reason=reason)


def _try_pricer(
    source: ModelSource, target: Target, precision: MixedPrecisionConfig, num_microbatches: int
) -> GpuPricer | None:
    from profiles.factory import FactoryModel

    try:
        return GpuPricer(source, target, precision, num_microbatches)
    except Exception:
        if isinstance(source, FactoryModel):
            return None
        raise


def _find_gpu_proxy(
    source: ModelSource, target: Target, precision: MixedPrecisionConfig, settings: SearchSettings, *, reason: str
) -> tuple[ModelPlan, GpuPricer]:
    """The widest proxy (widths halved at each try, the sequence kept) whose leanest config fits and,
    with a budget, whose defaults' step is within it; the narrowest where none does."""
    if get_widths(source) is None:
        from autotune.search.proxy import refuse_opaque

        raise refuse_opaque(source, [reason])
    factor = 2
    while True:
        _, overrides = shrink_widths(source, factor, source.seq_len)
        overrides = {k: v for k, v in overrides.items() if k not in ("seq_len", "batch_size")}  # the shape stays
        candidate = source.with_overrides(**overrides)
        pricer = GpuPricer(candidate, target, precision, settings.num_microbatches)
        lean = pricer.price("full", leanest=True)
        step = pricer.price("none").step_s
        in_budget = settings.step_budget_s is None or step <= settings.step_budget_s
        if (lean.fits and in_budget) or get_widths(candidate)["dim"] <= MIN_DIM:
            return ModelPlan(
                requested=source,
                run=candidate,
                is_proxy=True,
                reason=f"{reason}; the proxy's leanest config peaks at {lean.peak_memory_bytes / 2**30:.1f} GiB",
                estimated_memory_per_rank=int(lean.peak_memory_bytes),
                estimated_step_s=step,
                overrides=overrides,
            ), pricer
        factor *= 2


def _plan_untraced(
    source: ModelSource, target: Target, precision: MixedPrecisionConfig, settings: SearchSettings
) -> ModelPlan:
    """A factory the simulator cannot trace: measured as it is (its activations unknown), refused where
    its sharded training state alone is over the GPU."""
    from autotune.trials.precision import check_fits_gpu

    check_fits_gpu(source, target.world_size, precision, device_type="cuda", total_memory=target.memory_per_rank_bytes)
    return as_itself(source, "a factory the simulator cannot trace: its sharded training state fits", 0, 0.0)


def get_baseline(
    source: ModelSource,
    target: Target,
    precision: MixedPrecisionConfig,
    *,
    num_microbatches: int,
    asked: Checkpointing | None = None,
) -> Baseline:
    """The baseline of ``source`` on ``target`` ([Note: the search plan]): what a search measures every
    pair against and ``autotune compare``'s ``defaults`` word builds."""
    if asked is not None or not target.on_gpu:
        return choose_baseline(None, target, asked)
    return choose_baseline(_try_pricer(source, target, precision, num_microbatches), target, asked)


def choose_baseline(pricer: GpuPricer | None, target: Target, asked: Checkpointing | None = None) -> Baseline:
    """FSDP2's defaults where their simulated peak is safe, else the least checkpointing on every block
    whose peak is (full where none is safe but it fits); on CPU, or untraced, the defaults; ``asked``
    (``--baseline-ac``) wins."""
    if asked is not None:
        return Baseline(checkpointing=asked, reason=f"--baseline-ac {asked}")
    if pricer is None:
        why = "a CPU box: no GPU memory to price" if not target.on_gpu else "the simulator cannot trace this model"
        return Baseline(reason=why)
    tried = []
    for level in BASELINE_LEVELS:
        prediction = pricer.price(level)
        peak = prediction.peak_memory_bytes / 2**30
        usable = prediction.memory_capacity_bytes / 2**30
        label = "FSDP2's defaults" if level == "none" else f"with {level} checkpointing"
        if prediction.is_safe:
            if level == "none":
                return Baseline(
                    reason=f"they fit: predicted peak {peak:.1f} of {usable:.1f} GiB usable", predicted_peak_gib=peak
                )
            reason = f"{'; '.join(tried)}; {label} {peak:.1f} GiB, which fits"
            return Baseline(checkpointing=level, reason=reason, predicted_peak_gib=peak)
        edge = (
            f" (safe below {prediction.memory_edge_bytes / 2**30:.1f})"
            if prediction.fits and prediction.memory_edge_bytes
            else ""
        )
        tried.append(
            f"{label} {'peak' if level == 'none' else ''} {peak:.1f} GiB, over the {usable:.1f} usable{edge}".replace(
                "  ", " "
            )
        )
    full = pricer.price("full")
    return Baseline(
        checkpointing="full",
        reason=f"no level is safe ({'; '.join(tried)}): full checkpointing, at the edge of memory",
        predicted_peak_gib=full.peak_memory_bytes / 2**30,
    )
