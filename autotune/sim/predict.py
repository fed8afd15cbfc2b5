"""``simulate``: one training step of a runtime config on a cluster -> a :class:`StepPrediction`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autotune.sim.costs import MeshCosts, get_mesh_costs
from autotune.sim.hardware import Hardware, SimError
from autotune.sim.knobs import Knobs, resolve_knobs
from autotune.sim.model_work import ModelWork
from autotune.sim.schedule import StepSchedule
from fsdp_runtime import ROOT_UNIT, RuntimeConfig


@dataclass(kw_only=True)
class UnitPrediction:
    name: str
    comm_s: float
    """Seconds of this unit's collectives (all-gathers, reduce-scatters, all-reduces) per step."""
    exposed_s: float
    """Seconds the compute stream waited for them."""

    @property
    def overlap(self) -> float | None:
        return None if self.comm_s <= 0 else max(0.0, 1.0 - self.exposed_s / self.comm_s)


@dataclass(kw_only=True)
class StepPrediction:
    """What the simulator predicts for one optimizer step on one rank."""

    step_s: float
    compute_s: float
    """Seconds the compute stream was busy (kernels, copies, the optimizer)."""
    comm_s: float
    exposed_comm_s: float
    tokens_per_s_per_device: float
    mfu: float
    """Model FLOPs (as FlopCounterMode counts them) per second / the device's dense peak (0 without one: a measured CPU profile)."""
    peak_memory_bytes: float
    memory_capacity_bytes: float
    memory_breakdown: dict[str, float] = field(default_factory=dict)
    units: list[UnitPrediction] = field(default_factory=list)
    phase_peaks: dict[str, float] = field(default_factory=dict)
    """Peak memory in each phase (``forward``, ``backward``, ``optimizer``)."""
    memory_edge_bytes: float | None = None
    """The largest safe peak: ``memory_capacity_bytes`` less the margin ([Note: memory margin]); None: no margin (CPU)."""

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.memory_capacity_bytes

    @property
    def at_edge(self) -> bool:
        """Fits the usable memory, but not with the margin: it may still run out of memory."""
        return self.fits and self.memory_edge_bytes is not None and self.peak_memory_bytes > self.memory_edge_bytes

    @property
    def is_safe(self) -> bool:
        return self.fits and not self.at_edge

    @property
    def memory_headroom_bytes(self) -> float:
        return self.memory_capacity_bytes - self.peak_memory_bytes

    def describe_memory(self) -> str:
        """``peak 91.2 GiB > 77.6 GiB usable (activations 71.0, ...)``."""
        parts = ", ".join(
            f"{k.replace('_', ' ')} {v / 2**30:.1f}"
            for k, v in sorted(self.memory_breakdown.items(), key=lambda kv: -kv[1])[:4]
        )
        relation = "<=" if self.fits else ">"
        edge = (
            f", at the edge (safe below {self.memory_edge_bytes / 2**30:.1f} GiB)"
            if self.at_edge and self.memory_edge_bytes is not None
            else ""
        )
        return f"peak {self.peak_memory_bytes / 2**30:.1f} GiB {relation} {self.memory_capacity_bytes / 2**30:.1f} GiB usable{edge} ({parts})"

    def to_metrics(self) -> dict[str, float]:
        return {
            "predicted_step_ms": 1e3 * self.step_s,
            "predicted_tokens_per_s_per_device": self.tokens_per_s_per_device,
            "predicted_mfu": self.mfu,
            "predicted_exposed_comm_ms": 1e3 * self.exposed_comm_s,
            "predicted_peak_memory_gib": self.peak_memory_bytes / 2**30,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.to_metrics(),
            "fits": self.fits,
            "at_edge": self.at_edge,
            "memory_breakdown_gib": {k: v / 2**30 for k, v in self.memory_breakdown.items()},
            "units": [{"name": u.name, "comm_ms": 1e3 * u.comm_s, "exposed_ms": 1e3 * u.exposed_s} for u in self.units],
        }


class Simulator:
    """Simulates configs of one model on one cluster; mesh costs are computed once per mesh."""

    def __init__(self, work: ModelWork, hardware: Hardware, *, activation_checkpointing: bool = False) -> None:
        self.work, self.hardware, self.ac = work, hardware, activation_checkpointing
        self.flops_per_microbatch = work.get_flops_per_microbatch()
        # A measured profile of a CPU box has no device peak: MFU is then 0.
        self.peak_flops = (
            hardware.get_peak_flops(work.dtype) if hardware.measured is None or hardware.cluster.accelerator else 0.0
        )
        self._costs: dict[tuple[Any, ...], MeshCosts] = {}
        margin = hardware.memory_margin
        self.memory_edge_bytes = margin.edge_bytes if margin is not None else None

    def get_costs(self, knobs: Knobs) -> MeshCosts:
        if knobs.param_dtype != self.work.dtype:
            raise SimError(
                f"mixed_precision.param_dtype is {knobs.param_dtype} but the workload was traced in {self.work.dtype}",
                field="mixed_precision.param_dtype",
            )
        key = (
            knobs.replicate,
            knobs.shard,
            knobs.param_dtype,
            knobs.reduce_dtype,
            knobs.unit_blocks,
            knobs.checkpointing,
        )
        if key not in self._costs:
            self._costs[key] = get_mesh_costs(
                self.work,
                self.hardware,
                replicate=knobs.replicate,
                shard=knobs.shard,
                param_dtype=knobs.param_dtype,
                reduce_dtype=knobs.reduce_dtype,
                activation_checkpointing=self.ac,
                unit_blocks=knobs.unit_blocks,
                checkpointing=knobs.checkpointing,
            )
        return self._costs[key]

    def simulate(self, config: RuntimeConfig) -> StepPrediction:
        if getattr(config.mesh, "pp", 1) > 1:  # schema 3's pipeline: [Note: pipeline schedules]
            from autotune.sim.pipeline import PipelineSimulator  # it builds on this module

            return PipelineSimulator(self.work, self.hardware, activation_checkpointing=self.ac).simulate(config)
        knobs = resolve_knobs(
            config, self.work.block_names, world_size=self.hardware.world_size, device=self.hardware.cluster.device
        )
        return self.simulate_knobs([knobs], with_units=True)[0]

    def simulate_knobs(self, group: list[Knobs], *, with_units: bool = False) -> list[StepPrediction]:
        """Simulate configs that share their first forward (mesh, dtypes, forward prefetch,
        reshard after forward, async unshard): it is simulated once, then forked."""
        first = group[0]
        if any(
            (
                k.replicate,
                k.shard,
                k.unit_blocks,
                k.checkpointing,
                k.forward_prefetch,
                k.reshard_after_forward,
                k.unshard_async,
            )
            != (
                first.replicate,
                first.shard,
                first.unit_blocks,
                first.checkpointing,
                first.forward_prefetch,
                first.reshard_after_forward,
                first.unshard_async,
            )
            for k in group[1:]
        ):
            raise ValueError(
                "simulate_knobs: the group's configs do not share their first forward (units, checkpointing, mesh, forward prefetch or reshard)"
            )
        costs = self.get_costs(first)
        base = StepSchedule(
            first,
            costs,
            self.work.activations,
            self.hardware,
            activation_checkpointing=self.ac,
            root_head_fraction=self.work.root_head_fraction,
        )
        base.run_forward()
        return [self._predict(base.fork(knobs), knobs, with_units) for knobs in group]

    def _predict(self, schedule: StepSchedule, knobs: Knobs, with_units: bool) -> StepPrediction:
        num = knobs.num_microbatches
        step_s, exposed, comm = _finish_step(schedule, num)
        names = (
            [
                *(
                    _group_name(self.work.block_names[b[0]], self.work.block_names[b[-1]])
                    if len(b) > 1
                    else self.work.block_names[b[0]]
                    for b in knobs.unit_blocks
                ),
                ROOT_UNIT,
            ]
            if knobs.unit_blocks
            else [*self.work.block_names, ROOT_UNIT]
        )
        return StepPrediction(
            step_s=step_s,
            compute_s=schedule.t.compute_busy,
            comm_s=sum(comm),
            exposed_comm_s=sum(exposed),
            tokens_per_s_per_device=num * self.work.tokens / step_s,
            mfu=num * self.flops_per_microbatch / (step_s * self.peak_flops) if self.peak_flops else 0.0,
            peak_memory_bytes=schedule.mem.peak,
            memory_capacity_bytes=self.hardware.usable_memory_bytes,
            memory_edge_bytes=self.memory_edge_bytes,
            memory_breakdown=schedule.mem.get_peak_breakdown(),
            phase_peaks=dict(schedule.mem.phase_peaks),
            units=[UnitPrediction(name=name, comm_s=comm[i], exposed_s=exposed[i]) for i, name in enumerate(names)]
            if with_units
            else [],
        )


def _finish_step(schedule: StepSchedule, num_microbatches: int) -> tuple[float, list[float], list[float]]:
    """The rest of a step whose first forward ran: microbatches 0, 1 and the last; microbatches
    2..M-2 repeat microbatch 1's steady state (same unit states on entry), so their time,
    compute and communication are microbatch 1's, scaled."""
    t = schedule.t
    repeats = max(0, num_microbatches - 3)
    schedule.run_backward(num_microbatches == 1)
    before = after = (t.end, list(t.exposed), list(t.comm), t.compute_busy)
    for index in range(1, min(num_microbatches, 3)):
        schedule.run_microbatch(index if index == 1 else num_microbatches - 1)
        if index == 1:
            after = (t.end, list(t.exposed), list(t.comm), t.compute_busy)
    schedule.run_optimizer()
    if not repeats:
        return t.end, t.exposed, t.comm
    exposed = [e + repeats * (a - b) for e, a, b in zip(t.exposed, after[1], before[1])]
    comm = [c + repeats * (a - b) for c, a, b in zip(t.comm, after[2], before[2])]
    t.compute_busy += repeats * (after[3] - before[3])
    return t.end + repeats * (after[0] - before[0]), exposed, comm


def simulate(
    config: RuntimeConfig, work: ModelWork, hardware: Hardware, *, activation_checkpointing: bool = False
) -> StepPrediction:
    """Predict one step of ``config`` (see [Note: FSDP2 step schedule])."""
    return Simulator(work, hardware, activation_checkpointing=activation_checkpointing).simulate(config)


def _group_name(first: str, last: str) -> str:
    """A grouped unit's name as the search space writes it: ``layers.0-1`` (else ``first-last``)."""
    prefix, _, start = first.rpartition(".")
    other, _, end = last.rpartition(".")
    return (
        f"{prefix}.{start}-{end}"
        if prefix and prefix == other and start.isdecimal() and end.isdecimal()
        else f"{first}-{last}"
    )
