"""``simulate``: one training step of a runtime config on a cluster -> a :class:`StepPrediction`
(:mod:`autotune.sim.prediction`); a config with pipeline stages is handed to
:class:`~autotune.sim.pipeline.PipelineSimulator`, which runs this schedule inside each stage."""

from __future__ import annotations

from autotune.sim.costs import MeshCostCache, MeshCosts
from autotune.sim.hardware import Hardware
from autotune.sim.knobs import Knobs, resolve_knobs
from autotune.sim.model_work import ModelWork
from autotune.sim.pipeline import PipelineSimulator
from autotune.sim.prediction import StepPrediction, UnitPrediction, get_group_name
from autotune.sim.schedule import StepSchedule
from fsdp_runtime import ROOT_UNIT, RuntimeConfig


class Simulator:
    """Simulates configs of one model on one cluster; mesh costs are computed once per mesh."""

    def __init__(self, work: ModelWork, hardware: Hardware, *, activation_checkpointing: bool = False) -> None:
        self.work, self.hardware, self.ac = work, hardware, activation_checkpointing
        self.flops_per_microbatch = work.get_flops_per_microbatch()
        # A measured profile of a CPU box has no device peak: MFU is then 0.
        self.peak_flops = (
            hardware.get_peak_flops(work.dtype) if hardware.measured is None or hardware.cluster.accelerator else 0.0
        )
        self._costs = MeshCostCache(work, hardware, activation_checkpointing=activation_checkpointing)
        margin = hardware.memory_margin
        self.memory_edge_bytes = margin.edge_bytes if margin is not None else None

    def get_costs(self, knobs: Knobs) -> MeshCosts:
        return self._costs.get(knobs)

    def simulate(self, config: RuntimeConfig) -> StepPrediction:
        if getattr(config.mesh, "pp", 1) > 1:  # schema 3's pipeline: [Note: pipeline schedules]
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
                    get_group_name(self.work.block_names[b[0]], self.work.block_names[b[-1]])
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
