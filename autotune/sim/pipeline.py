"""Pipeline parallelism with FSDP2 inside each stage: one training step of a PP schedule.

[Note: pipeline schedules]
The world is ``pp x replicate x shard``, pp outermost as torchtitan lays it out: pp rank ``r``
holds the ranks ``r x dp .. r x dp + dp - 1`` (``dp = world / pp``), and each stage is an FSDP2
root over that data-parallel mesh. The model's blocks are cut into ``pp x v`` stages (``v``
virtual stages per pp rank; stage ``s`` on pp rank ``s % pp``, torch's looped placement); the
first stage also holds the embeddings, the last the final norm, the output head and the loss.
A stage's FSDP units are the config's units whose blocks it holds, its root the stage module
(the cut: :mod:`autotune.sim.pipeline_stages`).

What one step costs is found by running the schedule, not by a formula:

1. *Action order.* Per pp rank, the ordered list of ``(stage, microbatch, kind)`` actions,
   ``kind`` F (forward), B (full backward) or, for zero bubble, I (input gradients) and W
   (weight gradients): :func:`get_pipeline_order` writes them as torch 2.13's schedules do
   (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
   ``ScheduleInterleavedZeroBubble``; ``tests/autotune/sim/test_sim_pipeline.py`` compares them
   with torch's own ``pipeline_order``).
2. *Dependencies.* F(s, i) starts after F(s-1, i) ended and its activations arrived (a
   point-to-point transfer: latency + bytes / one rank's link, intra- or inter-node by where
   the two pp ranks sit); B or I(s, i) after B or I(s+1, i) and its gradient's transfer;
   each rank runs its actions in order, one at a time. Sends do not hold the sender (NCCL's
   send runs on its own stream), and do not share the links FSDP2's collectives use.
3. *Each action runs FSDP2's own schedule* ([Note: FSDP2 step schedule]) for that stage and
   microbatch, on the pp rank's streams and links (one :class:`Timeline` per rank, shared by its
   virtual stages): all-gathers, prefetch, reshard, reduce-scatters by each unit's sync
   level, as ``fsdp_runtime.apply_pipeline``'s stages set them per microbatch. What differs
   from a step without PP is *when FSDP2 waits for its reductions*. A pipeline stage's
   backward is not the step's last (torch's ``PipelineStage`` says so to FSDP2 with
   ``set_is_last_backward(False)``), so FSDP2's final callback does not make the compute
   stream wait: a ``sync = "every"`` unit's reduce-scatter of microbatch i runs while the
   stage computes *other* microbatches' forwards and backwards (the overlap PaddlePaddle's
   pull request 57446 built by hand for 1F1B), and is waited for only when the reduce-scatter buffers run out
   or after the stage's last backward. A ``sync = "last"`` unit reduces once, in the stage's
   last backward, where that backward's remaining units hide all but its tail; it holds the
   stage's unsharded gradients across microbatches instead. (torch's stage on its own turns
   sync off for every unit and reduces all of them after the last backward; the runtime
   config sets each unit's level instead, and ``fsdp_runtime``'s ``TunedStage`` tells FSDP2
   which backward is the last as torch's stage does.) Waiting after every backward, as
   without PP, is what ``test_sync_every_reduce_scatters_hide_behind_other_microbatches``
   prices against.
   With zero bubble, I runs the backward without the weights' gradients (all of it but half
   the block GEMMs and the embeddings' backward) and W the rest, followed by each unit's
   post-backward (its reshard and reduction): the weights' gradients exist only then. (The
   runtime config does not offer zero bubble: with FSDP2 stages it did not keep the math on
   torch 2.13, [Note: pipeline stages] in ``fsdp_runtime/pipeline.py``; it is priced here
   for comparison, and ``autotune plan`` does not rank it.)
4. *Memory.* A rank holds, besides its stages' shards and optimizer state, the saved
   activations of every microbatch whose forward ran and whose backward (W, for zero
   bubble) has not: GPipe all ``m``, 1F1B ``pp - r`` on rank ``r``, interleaved what torch's
   order leaves in flight. A stage keeps each in-flight microbatch's input, its blocks'
   saved activations and (the last stage) the loss's; the running action adds its own peak
   as FSDP2's schedule prices it.
5. *Result.* The step ends when the slowest rank ends its optimizer steps (one per virtual
   stage). Per rank: busy compute, FSDP communication the compute stream waited for
   (exposed), and the rest of the step it idled (the bubble: waiting for another stage,
   including the end of the step). With zero communication and equal stages the bubble is
   ``(pp - 1) / (v x m)`` of the ideal step for 1F1B and interleaved 1F1B (tested as a check,
   not used as the model).

Not modelled: torch's runtime for multi-stage schedules also unshards whole stages ahead of
their actions (``_add_unshard_reshard``, up to 3 stages at once); here each unit's FSDP2
knobs govern, as the runtime config asks. Point-to-point transfers never contend with
collectives; a rank's virtual stages share one stream per kind of collective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from autotune.sim.costs import ORIG_BYTES, MeshCostCache
from autotune.sim.hardware import Hardware
from autotune.sim.knobs import Knobs, resolve_knobs
from autotune.sim.model_work import ModelWork
from autotune.sim.pipeline_order import Action, get_pipeline_order, run_order
from autotune.sim.pipeline_stages import (
    PipelineSpec,
    check_pipeline,
    get_pipeline_spec,
    get_stage_work,
    get_weight_seconds,
    slice_knobs,
    split_units,
)
from autotune.sim.prediction import PipelinePrediction, StagePrediction, UnitPrediction, get_group_name
from autotune.sim.schedule import GRADS, StepSchedule
from autotune.sim.timeline import COMPUTE, MemoryLedger, Timeline
from fsdp_runtime import RuntimeConfig
from fsdp_runtime.errors import ConfigError


class _RankLedger(MemoryLedger):
    """A pp rank's memory: its stages' FSDP2 state, plus ``held``, the activations of the microbatches in
    flight other than the running action's."""

    __slots__ = ("held",)

    def __init__(self, static: float) -> None:
        super().__init__(static)
        self.held = 0.0

    def checkpoint(self, activations: float) -> None:
        super().checkpoint(activations + self.held)


class _StageSchedule(StepSchedule):
    """FSDP2's schedule of one stage, with zero bubble's backward split in I and W."""

    weight_s: list[float]
    """Per unit, the weight-gradient compute of a backward (what W runs)."""
    saved_per_microbatch: float
    """What one microbatch in flight keeps on this stage."""

    def run_input_backward(self) -> None:
        """I: unshard and compute the input gradients; the weights' gradients and reductions wait for W."""
        c, root = self.c, self.n
        self.mem.phase = "backward"
        self.mem.checkpoint(self.act_tail)
        for u, activations in (
            (root, self.act_root_backward),
            *((u, self.act_backward[u]) for u in range(root - 1, -1, -1)),
        ):
            self._pre_backward(u)
            self.t.compute(c.backward_s[u] - self.weight_s[u])
            self.mem.checkpoint(activations)

    def run_weight_backward(self, is_last: bool, *, finalize: bool) -> None:
        """W: each unit's weight gradients, then its post-backward (reshard, reduction by its sync level)."""
        for u in range(self.n - 1, -1, -1):
            self._compute_weights(u, self.weight_s[u], self.act_backward[u])
            self._post_backward(u, is_last)
        root = self.n
        self._compute_weights(root, self.weight_s[root] + self.c.head_backward_s, self.act_head)
        self._post_backward(root, is_last)
        if finalize:
            self.finalize_backward()

    def _compute_weights(self, u: int, seconds: float, activations: float) -> None:
        self.t.compute(seconds)
        grown = self.unsharded_bytes[u] - self.grad_bytes[u]
        if grown > 0:
            self.grad_bytes[u] += grown
            self.mem.live[GRADS] += grown
        elif self.c.accumulate_s:
            self.t.compute(self.c.accumulate_s[u])
        self.mem.checkpoint(activations)


@dataclass(kw_only=True)
class _Stage:
    index: int
    rank: int
    blocks: range
    schedule: _StageSchedule
    optimizer_s: float
    in_flight: int = 0
    max_in_flight: int = 0
    num_backward: int = 0
    compute_s: float = 0.0
    comm_s: float = 0.0
    exposed_s: float = 0.0


class PipelineSimulator:
    """Simulates pipeline configs of one model on one cluster ([Note: pipeline schedules])."""

    def __init__(self, work: ModelWork, hardware: Hardware, *, activation_checkpointing: bool = False) -> None:
        self.work, self.hardware, self.ac = work, hardware, activation_checkpointing
        self.flops_per_microbatch = work.get_flops_per_microbatch()
        self.peak_flops = (
            hardware.get_peak_flops(work.dtype) if hardware.measured is None or hardware.cluster.accelerator else 0.0
        )
        self._stage_costs: dict[tuple[Any, ...], MeshCostCache] = {}

    def get_dp_hardware(self, pp: int) -> Hardware:
        """The cluster as one stage's data-parallel mesh sees it: ``world / pp`` ranks, pp outermost."""
        world = self.hardware.world_size
        if pp < 1 or world % pp:
            raise ConfigError("mesh.pp", f"{pp} does not divide the world size {world}")
        return dataclasses.replace(self.hardware, num_ranks=world // pp)

    def simulate(self, config: RuntimeConfig) -> PipelinePrediction:
        """One step of a schema-3 config with ``mesh.pp`` > 1 (its knobs resolved over the whole world:
        ``validate_for_world`` gives each stage's data-parallel mesh)."""
        spec = get_pipeline_spec(config)
        knobs = resolve_knobs(
            config, self.work.block_names, world_size=self.hardware.world_size, device=self.hardware.cluster.device
        )
        stage_of = {b: s for s, blocks in enumerate(check_pipeline(spec, len(self.work.block_names))) for b in blocks}
        index = {name: b for b, name in enumerate(self.work.block_names)}
        for i, unit in enumerate(config.units):  # as fsdp_runtime.pipeline refuses it, naming the unit
            stages = {stage_of[index[m]] for m in unit.get_modules() if m in index}
            if len(stages) > 1:
                raise ConfigError(
                    f"units[{i}].modules",
                    f"spans pipeline stages {sorted(stages)}",
                    fix="group only blocks of one stage",
                )
        return self.simulate_knobs(knobs, spec)

    def simulate_knobs(self, knobs: Knobs, spec: PipelineSpec) -> PipelinePrediction:
        """One step of ``spec`` with every stage's FSDP2 knobs taken from ``knobs`` (the whole model's
        units, resolved over the data-parallel mesh)."""
        ranges = check_pipeline(spec, len(self.work.block_names))
        hardware = self.get_dp_hardware(spec.pp)
        stages = [
            self._build_stage(s, units, ranges[s], spec, knobs, hardware)
            for s, units in enumerate(split_units(knobs, ranges, self.work.block_names))
        ]
        run = _PipelineRun(stages, spec)
        order = get_pipeline_order(spec.schedule, spec.pp, spec.virtual_stages, spec.num_microbatches)
        p2p = self._get_p2p_seconds(spec, hardware.world_size)
        run_order(order, run.run, num_stages=spec.num_stages, p2p_s=p2p)
        run.run_optimizers()
        return self._predict(run, spec, max(p2p, default=0.0))

    def _build_stage(
        self, index: int, units: list[int], blocks: range, spec: PipelineSpec, knobs: Knobs, hardware: Hardware
    ) -> _Stage:
        first, last = index == 0, index == spec.num_stages - 1
        key = (spec.pp, first, last, len(blocks))
        if key not in self._stage_costs:
            work = get_stage_work(self.work, self.work.block_names[blocks.start : blocks.stop], first=first, last=last)
            self._stage_costs[key] = MeshCostCache(work, hardware, activation_checkpointing=self.ac)
        stage_costs = self._stage_costs[key]
        stage_knobs = slice_knobs(knobs, units, blocks.start)
        costs = stage_costs.get(stage_knobs)
        work = stage_costs.work
        schedule = _StageSchedule(
            stage_knobs,
            costs,
            work.activations,
            hardware,
            activation_checkpointing=self.ac,
            root_head_fraction=work.root_head_fraction,
        )
        schedule.weight_s = get_weight_seconds(work, hardware, costs.backward_s, costs.unit_num_blocks)
        tail = work.activations.tail_peak - work.activations.block_saved - work.activations.head if last else 0.0
        schedule.saved_per_microbatch = schedule.act_head + schedule.act_saved + max(tail, 0.0)
        return _Stage(
            index=index, rank=index % spec.pp, blocks=blocks, schedule=schedule, optimizer_s=costs.optimizer_s
        )

    def _get_p2p_seconds(self, spec: PipelineSpec, dp: int) -> list[float]:
        """Per stage boundary, one microbatch's activations (or their gradient) between the two pp ranks."""
        per_node = self.hardware.cluster.ranks_per_node
        size = self.work.activations.block_input
        seconds = []
        for s in range(spec.num_stages - 1):
            here, there = (s % spec.pp) * dp, ((s + 1) % spec.pp) * dp
            seconds.append(self.hardware.get_p2p_seconds(size, inter_node=here // per_node != there // per_node))
        return seconds

    def _predict(self, run: _PipelineRun, spec: PipelineSpec, p2p_s: float) -> PipelinePrediction:
        step = max(t.end for t in run.timelines)
        busy = [t.compute_busy for t in run.timelines]
        exposed = [sum(t.exposed) for t in run.timelines]
        bubbles = [max(0.0, step - b - e) / step for b, e in zip(busy, exposed)]
        peak = max(range(spec.pp), key=lambda r: run.ledgers[r].peak)
        ledger = run.ledgers[peak]
        m, names = spec.num_microbatches, self.work.block_names
        stages = [
            StagePrediction(
                stage=s.index,
                rank=s.rank,
                blocks=_describe_blocks(names, s.blocks),
                compute_s=s.compute_s,
                comm_s=s.comm_s,
                exposed_comm_s=s.exposed_s,
                optimizer_s=s.optimizer_s,
                max_in_flight=s.max_in_flight,
                bubble_fraction=bubbles[s.rank],
                peak_memory_bytes=run.ledgers[s.rank].peak,
            )
            for s in run.stages
        ]
        return PipelinePrediction(
            step_s=step,
            compute_s=max(busy),
            comm_s=max(sum(t.comm) for t in run.timelines),
            exposed_comm_s=max(exposed),
            tokens_per_s_per_device=m * self.work.tokens / (step * spec.pp),
            mfu=m * self.flops_per_microbatch / (spec.pp * step * self.peak_flops) if self.peak_flops else 0.0,
            peak_memory_bytes=ledger.peak,
            memory_capacity_bytes=self.hardware.usable_memory_bytes,
            memory_edge_bytes=self.hardware.memory_margin.edge_bytes if self.hardware.memory_margin else None,
            memory_breakdown=ledger.get_peak_breakdown(),
            phase_peaks=dict(ledger.phase_peaks),
            units=[
                UnitPrediction(name=f"stage {s.stage} ({s.blocks})", comm_s=s.comm_s, exposed_s=s.exposed_comm_s)
                for s in stages
            ],
            pipeline=spec,
            bubble_fraction=sum(bubbles) / len(bubbles),
            p2p_s=p2p_s,
            stages=stages,
        )


class _PipelineRun:
    """The state of one simulated step: per pp rank a timeline and a memory ledger its stages share."""

    def __init__(self, stages: list[_Stage], spec: PipelineSpec) -> None:
        self.stages, self.m = stages, spec.num_microbatches
        self.local = [[s for s in stages if s.rank == r] for r in range(spec.pp)]
        self.timelines, self.ledgers = [], []
        for local in self.local:
            schedules = [s.schedule for s in local]
            timeline = Timeline(max(len(x.c.padded) for x in schedules), host_blocks=schedules[0].cpu)
            ledger = _RankLedger(sum(3 * ORIG_BYTES * sum(x.c.sharded) for x in schedules))
            for x in schedules:
                x.t, x.mem = timeline, ledger
            self.timelines.append(timeline)
            self.ledgers.append(ledger)

    def run(self, rank: int, action: Action, ready: float) -> float:
        """One action on its rank, after its input arrived (an idle wait, not exposed communication)."""
        index, _, kind = action
        stage, t = self.stages[index], self.timelines[rank]
        t.compute(0.0, ((ready, -1, None),))
        before = (sum(t.exposed), sum(t.comm), t.compute_busy)
        held = sum(s.in_flight * s.schedule.saved_per_microbatch for s in self.local[rank])
        self.ledgers[rank].held = held - (stage.schedule.saved_per_microbatch if kind != "F" else 0.0)
        if kind == "F":
            stage.schedule.run_forward()
            stage.in_flight += 1
            stage.max_in_flight = max(stage.max_in_flight, stage.in_flight)
        elif kind == "I":
            stage.schedule.run_input_backward()
        else:
            stage.num_backward += 1
            last = stage.num_backward == self.m
            if kind == "B":
                stage.schedule.run_backward(last, finalize=last)
            else:
                stage.schedule.run_weight_backward(last, finalize=last)
            stage.in_flight -= 1
        stage.exposed_s += sum(t.exposed) - before[0]
        stage.comm_s += sum(t.comm) - before[1]
        stage.compute_s += t.compute_busy - before[2]
        return t.streams[COMPUTE]

    def run_optimizers(self) -> None:
        for rank, local in enumerate(self.local):
            self.ledgers[rank].held = 0.0
            for stage in local:
                stage.schedule.run_optimizer()


def _describe_blocks(names: tuple[str, ...], blocks: range) -> str:
    first, last = names[blocks.start], names[blocks.stop - 1]
    return first if first == last else get_group_name(first, last)
