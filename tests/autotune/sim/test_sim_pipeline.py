"""Pipeline schedules with FSDP2 inside each stage ([Note: pipeline schedules] in autotune/sim/pipeline.py)."""

from __future__ import annotations

import dataclasses
import types
from collections import Counter

import pytest

from autotune.sim import (
    SCHEDULES,
    Hardware,
    PipelinePrediction,
    PipelineSimulator,
    PipelineSpec,
    Simulator,
    get_model_work,
    get_pipeline_order,
    resolve_knobs,
    time_order,
)
from autotune.sim.model_work import PassWork
from autotune.sim.pipeline import _StageSchedule
from autotune.sim.pipeline_stages import check_pipeline
from fsdp_runtime import ROOT_UNIT, MeshConfig, MixedPrecisionConfig, PipelineConfig, RuntimeConfig, UnitConfig
from fsdp_runtime.errors import ConfigError
from profiles import load_cluster_profile, load_model_profile

BF16 = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")

# (schedule, pp, virtual stages, microbatches): torch's schedules at several shapes
SHAPES = [
    ("gpipe", 2, 1, 4),
    ("gpipe", 4, 1, 8),
    ("1f1b", 2, 1, 2),
    ("1f1b", 4, 1, 8),
    ("1f1b", 4, 1, 6),
    ("interleaved_1f1b", 2, 2, 4),
    ("interleaved_1f1b", 4, 2, 8),
    ("interleaved_1f1b", 4, 3, 12),
    ("interleaved_1f1b", 2, 4, 8),
    ("interleaved_zero_bubble", 2, 2, 4),
    ("interleaved_zero_bubble", 4, 2, 8),
]


def _unit_seconds(stage: int, kind: str) -> float:
    return {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}[kind]


@pytest.mark.parametrize(("schedule", "pp", "v", "m"), SHAPES)
def test_each_schedule_order_is_valid(schedule, pp, v, m):
    """Every stage runs each microbatch's forward once and its backward once (I then W for zero
    bubble), on its own rank (stage s on rank s % pp), forward before backward; the order runs to
    the end with every dependency respected (no rank waits forever)."""
    order = get_pipeline_order(schedule, pp, v, m)
    assert len(order) == pp
    kinds = ("F", "I", "W") if schedule == "interleaved_zero_bubble" else ("F", "B")
    for rank, actions in enumerate(order):
        assert all(stage % pp == rank for stage, _, _ in actions)
        counts = Counter((stage, kind) for stage, _, kind in actions)
        assert counts == {(rank + i * pp, kind): m for i in range(v) for kind in kinds}
        assert len(set(actions)) == len(actions)
        position = {action: i for i, action in enumerate(actions)}
        for stage, mb, kind in actions:
            if kind != "F":
                assert position[stage, mb, "F"] < position[stage, mb, kind]
            if kind == "W":
                assert position[stage, mb, "I"] < position[stage, mb, "W"]
    # each stage's microbatches in order, forward and backward
    for actions in order:
        for stage in {s for s, _, _ in actions}:
            for kind in kinds:
                assert [mb for s, mb, k in actions if (s, k) == (stage, kind)] == list(range(m))
    timing = time_order(order, _unit_seconds, num_stages=pp * v, p2p_s=[0.0] * (pp * v - 1))
    assert timing.step_s >= m * 3.0


def _torch_order(schedule: str, pp: int, v: int, m: int) -> list[list[tuple[int, int, str]]]:
    """torch's own ``pipeline_order``, built on stand-in stages (no process group: the schedules read
    only the stages' indices, sizes and ranks while ordering)."""
    from torch.distributed.pipelining import schedules

    cls = {
        "gpipe": schedules.ScheduleGPipe,
        "1f1b": schedules.Schedule1F1B,
        "interleaved_1f1b": schedules.ScheduleInterleaved1F1B,
        "interleaved_zero_bubble": schedules.ScheduleInterleavedZeroBubble,
    }[schedule]

    def stage(index: int, rank: int) -> types.SimpleNamespace:
        n = pp * v
        return types.SimpleNamespace(
            stage_index=index,
            num_stages=n,
            group_size=pp,
            group_rank=rank,
            is_first=index == 0,
            is_last=index == n - 1,
            submod=None,
        )

    out = []
    for rank in range(pp):
        built = cls(stage(rank, rank), m) if v == 1 else cls([stage(i * pp + rank, rank) for i in range(v)], m)
        kinds = {"F": "F", "B": "B", "I": "I", "W": "W"}
        out.append(
            [
                (a.stage_index, a.microbatch_index, kinds[a.computation_type.value])
                for a in built.pipeline_order[rank]
                if a is not None and a.computation_type.value in kinds
            ]
        )
    return out


@pytest.mark.parametrize(("schedule", "pp", "v", "m"), SHAPES)
def test_orders_are_torchs(schedule, pp, v, m):
    try:
        expected = _torch_order(schedule, pp, v, m)
    except Exception as error:  # a torch whose schedules need more of a stage than these stand-ins give
        pytest.skip(f"torch's {schedule} schedule does not build on stand-in stages: {error}")
    ours = get_pipeline_order(schedule, pp, v, m)
    # torch 2.13's Schedule1F1B writes its last rank's forwards one microbatch ahead in pipeline_order (1..m for
    # 0..m-1: its `forward_mb` starts at 0 when that rank has no warm-up); its runtime, _step_microbatches, runs
    # microbatches 0..m-1 as ours does. Every other rank and schedule must match action for action.
    ranks = range(pp - 1) if schedule == "1f1b" else range(pp)
    assert [ours[r] for r in ranks] == [expected[r] for r in ranks]


@pytest.mark.parametrize(
    ("schedule", "pp", "v", "m"),
    [("1f1b", 4, 1, 8), ("1f1b", 2, 1, 6), ("interleaved_1f1b", 4, 2, 8), ("interleaved_1f1b", 2, 4, 8)],
)
def test_the_bubble_of_equal_stages_without_communication_is_the_textbook_one(schedule, pp, v, m):
    """Equal stages, no transfer time: the step is the ideal ``m x (F + B)`` per rank plus
    ``(pp - 1) / (v x m)`` of it (Narayanan et al. 2021, eq. 1 and 2), for backward 1x and 2x the forward."""
    order = get_pipeline_order(schedule, pp, v, m)
    for backward in (1.0, 2.0):
        timing = time_order(
            order,
            lambda stage, kind, b=backward: (1.0 if kind == "F" else b) / v,
            num_stages=pp * v,
            p2p_s=[0.0] * (pp * v - 1),
        )
        ideal = m * (1.0 + backward)
        assert timing.step_s == pytest.approx(ideal * (1 + (pp - 1) / (v * m)))
        assert all(busy == pytest.approx(ideal) for busy in timing.busy_s)


# -- FSDP2 inside each stage -------------------------------------------------------------------


def _tiny_work(num_layers: int = 8):
    return get_model_work(load_model_profile("tiny").with_overrides(num_layers=num_layers), "bfloat16")


def _hardware(num_nodes: int = 1, *, num_ranks: int | None = None, accelerator=None, **links) -> Hardware:
    """h100-node, its links' (and accelerator's) figures replaced where given (``inter_node={"bandwidth_gbps": 5.0}``)."""
    cluster = load_cluster_profile("h100-node")
    if accelerator:
        cluster = dataclasses.replace(cluster, accelerator=dataclasses.replace(cluster.accelerator, **accelerator))
    if links:
        replaced = {name: dataclasses.replace(cluster.links[name], **changes) for name, changes in links.items()}
        cluster = dataclasses.replace(cluster, links={**cluster.links, **replaced})
    return Hardware(cluster, num_nodes, num_ranks=num_ranks)


def _knobs(work, dp: int, *, sync: str = "every", keep: bool = False, raf: bool | None = None, buffers=None, m=8):
    units = [
        UnitConfig(name=b, sync=sync, reshard_after_backward=not keep, reshard_after_forward=raf)
        for b in work.block_names
    ]
    units.append(UnitConfig(name=ROOT_UNIT, sync=sync, reshard_after_backward=not keep))
    config = RuntimeConfig(
        num_microbatches=m, units=units, mixed_precision=BF16, reduce_scatter_max_input_buffers=buffers
    )
    return resolve_knobs(config, work.block_names, world_size=dp, device="cuda")


def test_the_bubble_of_equal_stages_through_fsdp2_without_communication():
    """The FSDP2 model on one rank per stage (no collectives), no transfer time, no memory-bound work (FSDP2's
    copies, the optimizer: infinitely fast memory) and stages made equal (no embeddings or head): each rank
    idles ``(pp - 1) / (v x m)`` of its compute."""
    work = _tiny_work(8)
    nothing = PassWork()
    equal = dataclasses.replace(
        work,
        work={k: (w if k[0] == "block" else nothing) for k, w in work.work.items()},
        param_shapes={**work.param_shapes, ROOT_UNIT: ()},
    )
    for schedule, pp, v, m in (("1f1b", 4, 1, 8), ("interleaved_1f1b", 2, 2, 4), ("interleaved_1f1b", 4, 2, 8)):
        hardware = _hardware(
            num_ranks=pp,
            accelerator={"hbm_gbps": float("inf"), "host_floor_us": {}},
            intra_node={"latency_us": 0.0, "bandwidth_gbps": float("inf")},
            inter_node={"latency_us": 0.0, "bandwidth_gbps": float("inf")},
        )
        simulator = PipelineSimulator(equal, hardware)
        spec = PipelineSpec(pp=pp, schedule=schedule, virtual_stages=v, num_microbatches=m)
        prediction = simulator.simulate_knobs(_knobs(equal, 1, m=m), spec)
        assert all(stage.exposed_comm_s == 0.0 for stage in prediction.stages)
        compute = sum(s.compute_s for s in prediction.stages if s.rank == 0)
        idle = prediction.stages[0].bubble_fraction * prediction.step_s
        assert idle / compute == pytest.approx((pp - 1) / (v * m), rel=1e-6), schedule


def test_gpipe_holds_every_microbatch_and_1f1b_at_most_pp():
    work = _tiny_work(8)
    hardware = _hardware(2)
    simulator = PipelineSimulator(work, hardware)
    knobs = _knobs(work, hardware.world_size // 4)
    gpipe = simulator.simulate_knobs(knobs, PipelineSpec(pp=4, schedule="gpipe", num_microbatches=8))
    one_f_one_b = simulator.simulate_knobs(knobs, PipelineSpec(pp=4, schedule="1f1b", num_microbatches=8))
    assert [s.max_in_flight for s in gpipe.stages] == [8, 8, 8, 8]
    assert [s.max_in_flight for s in one_f_one_b.stages] == [4, 3, 2, 1]  # pp - rank
    assert one_f_one_b.peak_memory_bytes < gpipe.peak_memory_bytes
    assert one_f_one_b.memory_breakdown["activations"] < gpipe.memory_breakdown["activations"]
    # same work, same bubble: the two differ in memory, not in time
    assert one_f_one_b.step_s == pytest.approx(gpipe.step_s, rel=0.02)


def test_a_slower_inter_node_link_raises_the_point_to_point_cost():
    """pp outermost: on two nodes the two stages of PP 2 sit on different nodes; on one node, on one."""
    work = _tiny_work(8)
    spec = PipelineSpec(pp=2, schedule="1f1b", num_microbatches=4)
    results = {}
    for nodes in (1, 2):
        for bandwidth in (50.0, 0.5):
            hardware = _hardware(nodes, inter_node={"bandwidth_gbps": bandwidth})
            knobs = _knobs(work, hardware.world_size // 2, m=4)
            results[nodes, bandwidth] = PipelineSimulator(work, hardware).simulate_knobs(knobs, spec)
    links = load_cluster_profile("h100-node").links
    size = work.activations.block_input  # one microbatch's hidden states, bfloat16

    def transfer(link, bandwidth):  # latency + bytes over one rank's link at its efficiency
        return link.latency_us * 1e-6 + size / (bandwidth * link.efficiency * 1e9)

    assert results[2, 0.5].p2p_s == pytest.approx(transfer(links["inter_node"], 0.5))
    assert results[2, 50.0].p2p_s == pytest.approx(transfer(links["inter_node"], 50.0))
    assert results[2, 0.5].step_s > results[2, 50.0].step_s
    assert results[2, 0.5].bubble_fraction > results[2, 50.0].bubble_fraction
    intra = links["intra_node"]
    assert results[1, 0.5].p2p_s == results[1, 50.0].p2p_s == pytest.approx(transfer(intra, intra.bandwidth_gbps))


def _slow_shard_link_run(sync: str, *, finalize_every_backward: bool = False, monkeypatch=None):
    """PP 4, 1F1B, 8 microbatches, parameters kept unsharded (only reduce-scatters run per microbatch) over a
    data-parallel link slow enough for one microbatch's reduce-scatters to outlast a stage's backward."""
    work = _tiny_work(8)
    hardware = _hardware(1, intra_node={"bandwidth_gbps": 1.0})
    knobs = _knobs(work, hardware.world_size // 4, sync=sync, keep=True, raf=False, buffers=16)
    if finalize_every_backward:  # FSDP2 without a pipeline: the final callback waits after every backward
        original = _StageSchedule.run_backward
        monkeypatch.setattr(
            _StageSchedule, "run_backward", lambda self, is_last, finalize: original(self, is_last, finalize=True)
        )
    spec = PipelineSpec(pp=4, schedule="1f1b", num_microbatches=8)
    return PipelineSimulator(work, hardware).simulate_knobs(knobs, spec)


def test_sync_every_reduce_scatters_hide_behind_other_microbatches(monkeypatch):
    """A stage's backward is not the step's last: FSDP2 does not wait for its reduce-scatters there, and a
    ``sync = "every"`` unit's reductions of microbatch i run under the stage's later forwards and backwards
    and its bubbles. Waiting after every backward (FSDP2's behaviour without a pipeline) exposes them."""
    every = _slow_shard_link_run("every")
    last = _slow_shard_link_run("last")
    waiting = _slow_shard_link_run("every", finalize_every_backward=True, monkeypatch=monkeypatch)
    assert every.comm_s > 4 * last.comm_s  # a reduction per microbatch instead of one (and one all-gather each)
    assert waiting.exposed_comm_s > every.exposed_comm_s + 0.5 * (every.comm_s - last.comm_s)
    # The 7 extra reductions per stage are (nearly) all hidden: every exposes at most a tenth of them more than
    # last, whose one reduction also falls in the last backward (the same tail either way).
    assert every.exposed_comm_s - last.exposed_comm_s < 0.1 * (every.comm_s - last.comm_s)


def test_sync_last_holds_the_stage_s_unsharded_gradients_across_microbatches():
    work = _tiny_work(8)
    hardware = _hardware(2)
    spec = PipelineSpec(pp=2, schedule="1f1b", num_microbatches=4)
    every, last = (
        PipelineSimulator(work, hardware).simulate_knobs(_knobs(work, hardware.world_size // 2, sync=s, m=4), spec)
        for s in ("every", "last")
    )
    assert last.comm_s < every.comm_s
    assert (
        last.memory_breakdown.get("accumulated_grads", 0.0)
        > 0.0
        == every.memory_breakdown.get("accumulated_grads", 0.0)
    )


def test_stages_must_divide_the_blocks_with_one_line_naming_the_field():
    with pytest.raises(ConfigError) as info:
        check_pipeline(PipelineSpec(pp=3, num_microbatches=3), 8)
    assert info.value.field == "mesh.pp" and "\n" not in str(info.value)  # the field fsdp_runtime.pipeline names
    assert "8 blocks do not split evenly into 3 stages" in str(info.value)
    with pytest.raises(ConfigError, match=r"pipeline.blocks_per_stage: \[3, 3\]") as info:
        check_pipeline(PipelineSpec(pp=2, blocks_per_stage=(3, 3), num_microbatches=2), 8)
    assert check_pipeline(PipelineSpec(pp=2, blocks_per_stage=(3, 5), num_microbatches=2), 8) == [
        range(0, 3),
        range(3, 8),
    ]
    with pytest.raises(ConfigError) as info:
        check_pipeline(PipelineSpec(pp=2, schedule="interleaved_1f1b", num_microbatches=4), 8)
    assert info.value.field == "pipeline.virtual_stages"
    with pytest.raises(ConfigError) as info:
        check_pipeline(PipelineSpec(pp=4, schedule="1f1b", num_microbatches=2), 8)
    assert info.value.field == "num_microbatches"


def test_a_unit_across_two_stages_is_refused():
    work = _tiny_work(8)
    hardware = _hardware(1)
    units = [UnitConfig(name=f"layers.{i}-{i + 2}", modules=[f"layers.{j}" for j in range(i, i + 3)]) for i in (0, 3)]
    config = RuntimeConfig(num_microbatches=2, units=units, mixed_precision=BF16, unlisted_blocks="root")
    knobs = resolve_knobs(config, work.block_names, world_size=4, device="cuda")
    with pytest.raises(ConfigError) as info:
        PipelineSimulator(work, hardware).simulate_knobs(knobs, PipelineSpec(pp=2, num_microbatches=2))
    assert info.value.field == "units" and "layers.3..layers.5" in str(info.value)
    # a schema-3 config names the unit, as fsdp_runtime.pipeline does
    piped = dataclasses.replace(config, mesh=MeshConfig(pp=2))
    with pytest.raises(ConfigError) as info:
        Simulator(work, _hardware(1)).simulate(piped)
    assert info.value.field == "units[1].modules" and "spans pipeline stages [0, 1]" in str(info.value)


def test_every_schedule_prices_a_step_whose_flops_are_the_model_s():
    work = _tiny_work(8)
    hardware = _hardware(2)
    simulator = PipelineSimulator(work, hardware)
    for schedule in SCHEDULES:
        v = 2 if schedule.startswith("interleaved") else 1
        spec = PipelineSpec(pp=2, schedule=schedule, virtual_stages=v, num_microbatches=4)
        p = simulator.simulate_knobs(_knobs(work, hardware.world_size // 2, m=4), spec)
        assert isinstance(p, PipelinePrediction) and len(p.stages) == 2 * v
        # MFU counts each pipeline's microbatches once over its pp ranks
        flops = 4 * work.get_flops_per_microbatch() / 2
        assert p.mfu * p.step_s * hardware.get_peak_flops("bfloat16") == pytest.approx(flops, rel=1e-9)
        assert p.tokens_per_s_per_device * p.step_s == pytest.approx(4 * work.tokens / 2, rel=1e-9)
        assert 0.0 < p.bubble_fraction < 1.0 and p.to_dict()["pipeline"]["schedule"] == schedule


def test_simulate_prices_a_schema_3_config_with_mesh_pp_as_a_pipeline():
    work = _tiny_work(8)
    hardware = _hardware(2)
    config = RuntimeConfig(num_microbatches=4, units=[], mixed_precision=BF16)
    piped = dataclasses.replace(
        config, mesh=MeshConfig(pp=2), pipeline=PipelineConfig(schedule="interleaved_1f1b", virtual_stages=2)
    )
    plain = Simulator(work, hardware).simulate(config)
    prediction = Simulator(work, hardware).simulate(piped)
    assert not isinstance(plain, PipelinePrediction)
    assert isinstance(prediction, PipelinePrediction) and prediction.pipeline.pp == 2
    assert prediction.pipeline.schedule == "interleaved_1f1b" and len(prediction.units) == 4
    assert [s.rank for s in prediction.stages] == [0, 1, 0, 1]
    # each stage shards over the 8 ranks of its pp rank's data-parallel mesh (world 16 = pp 2 x 8)
    knobs = resolve_knobs(piped, work.block_names, world_size=16, device="cuda")
    assert (knobs.replicate, knobs.shard) == (1, 8)


def test_a_schema_3_config_whose_stages_do_not_divide_the_blocks_is_refused_in_one_line():
    work = _tiny_work(8)
    config = RuntimeConfig(num_microbatches=3, units=[], mixed_precision=BF16, mesh=MeshConfig(pp=3))
    with pytest.raises(ConfigError) as info:
        Simulator(work, _hardware(num_ranks=3)).simulate(config)
    assert info.value.field == "mesh.pp" and "\n" not in str(info.value)
    assert str(info.value).startswith("mesh.pp: 8 blocks do not split evenly into 3 stages")
