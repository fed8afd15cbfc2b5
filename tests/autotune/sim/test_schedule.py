"""The FSDP2 step schedule on hand-computed cases: two blocks with known costs, a root that costs nothing.

Costs (seconds): forward F = 10, backward B = 20, all-gather A = 4, reduce-scatter R = 6,
all-reduce (HSDP) 8; copies and the optimizer are free. Every expected number below is
worked out by hand from [Note: FSDP2 step schedule] in a comment next to it.
"""

from __future__ import annotations

import dataclasses

import pytest

from autotune.sim.costs import MeshCosts
from autotune.sim.hardware import Group, Hardware
from autotune.sim.knobs import Knobs
from autotune.sim.model_work import ActivationProfile
from autotune.sim.schedule import StepSchedule
from profiles import AcceleratorSpec, ClusterProfile, LinkClass

F, B, A, R, AR = 10.0, 20.0, 4.0, 6.0, 8.0
N = 2  # blocks; unit 2 is the root


def _hardware(device: str = "cuda") -> Hardware:
    accelerator = AcceleratorSpec(
        name="test", peak_tflops={"bfloat16": 1.0}, gemm_efficiency=1.0, attention_efficiency=1.0, hbm_gbps=1.0
    )
    links = {
        "intra_node": LinkClass(latency_us=0.0, bandwidth_gbps=1.0),
        "inter_node": LinkClass(latency_us=0.0, bandwidth_gbps=1.0),
    }
    cluster = ClusterProfile(
        name="test",
        description="",
        backend="nccl",
        device=device,
        ranks_per_node=8,
        memory_per_rank_gib=1.0,
        links=links,
        accelerator=accelerator,
    )
    return Hardware(cluster, 1)


def _costs(*, all_gather: float = A, hsdp: bool = False) -> MeshCosts:
    def per_unit(block: float, root: float = 0.0) -> list[float]:
        return [block] * N + [root]

    group = Group(4, 1, 4)
    return MeshCosts(
        replicate=2 if hsdp else 1,
        shard=4,
        shard_group=group,
        replicate_group=Group(2, 1, 2) if hsdp else Group(1, 1, 1),
        param_bytes=2,
        reduce_bytes=4,
        padded=per_unit(1000, 1000),
        sharded=per_unit(250, 250),
        forward_s=per_unit(F),
        backward_s=per_unit(B),
        head_forward_s=0.0,
        head_backward_s=0.0,
        all_gather_s=per_unit(all_gather),
        copy_out_s=per_unit(0.0),
        reduce_scatter_s=per_unit(R),
        copy_in_s=per_unit(0.0),
        all_reduce_s=per_unit(AR if hsdp else 0.0),
        upcast_s=per_unit(0.0),
        concat_s=per_unit(0.0),
        restore_s=per_unit(0.0),
        optimizer_s=0.0,
    )


def _knobs(**changes) -> Knobs:
    base = Knobs(
        num_microbatches=1,
        hsdp=False,
        replicate=1,
        shard=4,
        unshard_async=False,
        max_rs_buffers=1,
        param_dtype="bfloat16",
        reduce_dtype="float32",
        reshard_after_forward=(True, True, False),
        forward_prefetch=(None,) * 3,
        backward_prefetch=(None,) * 3,
        sync=("every",) * 3,
        reshard_after_backward=(True,) * 3,
        defer_concat=(True,) * 3,
    )
    return dataclasses.replace(base, **changes)


ACTIVATIONS = ActivationProfile(
    head=0.0, block_saved=1e5, block_input=1e4, block_forward_peak=1.5e5, block_backward_peak=1.8e5, tail_peak=3e5
)


def _step(knobs: Knobs, costs: MeshCosts | None = None, device: str = "cuda") -> StepSchedule:
    schedule = StepSchedule(
        knobs, costs or _costs(hsdp=knobs.hsdp), ACTIVATIONS, _hardware(device), activation_checkpointing=False
    )
    for index in range(knobs.num_microbatches):
        schedule.run_microbatch(index)
    schedule.run_optimizer()
    return schedule


def test_defaults_expose_the_first_all_gather_and_the_last_reduce_scatter():
    # forward: AG b0 [0,4] exposed (4); AG b1 [4,8] under b0's compute [4,14]; b1 computes [14,24]
    # backward: the root prefetches b1 [14,18], b1 prefetches b0 [24,28]; b1 [24,44], RS b1 [44,50] under b0 [44,64];
    # RS b0 [64,70]: the root's post-backward (final callback) waits for it (6 exposed).
    step = _step(_knobs())
    assert step.t.end == pytest.approx(70.0)
    assert step.t.exposed == pytest.approx([4.0 + 6.0, 0.0, 0.0])
    assert step.t.comm == pytest.approx([2 * A + R, 2 * A + R, 0.0])


def test_explicit_forward_prefetch_equals_implicit_on_gpu_but_holds_a_buffer_longer():
    # FSDP2 issues b1's all-gather after b0's wait_for_unshard either way: same deps, same times.
    implicit, explicit = _step(_knobs()), _step(_knobs(forward_prefetch=((1,), (), None)))
    assert explicit.t.end == implicit.t.end and explicit.t.exposed == implicit.t.exposed
    assert explicit.mem.peak >= implicit.mem.peak


def test_async_unshard_on_gpu_serializes_implicit_prefetch_and_explicit_prefetch_restores_it():
    # async: an all-gather starts when the compute issued before it ends. Implicit: AG b1 [14,18] after b0's
    # compute, exposed 4 in forward; backward: AG b1 [28,32] exposed 4, AG b0 [32,36] under b1 [32,52];
    # RS b1 [52,58], b0 [52,72], RS b0 [72,78] exposed 6: 78.
    serial = _step(_knobs(unshard_async=True))
    assert serial.t.end == pytest.approx(78.0)
    assert serial.t.exposed == pytest.approx([4.0 + 6.0, 4.0 + 4.0, 0.0])
    # explicit forward prefetch of b1 from b0's pre-forward: AG b1 [4,8] runs under b0's compute again
    prefetched = _step(_knobs(unshard_async=True, forward_prefetch=((1,), (), None)))
    assert prefetched.t.end == pytest.approx(74.0)


def test_reshard_after_forward_false_skips_backward_all_gathers_and_hides_slow_ones():
    # A = 25 > F: forward AG b0 [0,25] exposed 25, AG b1 [25,50]: b0 computes [25,35], b1 waits to 50 (15 exposed), [50,60].
    # raf=True: backward AG b1 (gate: b1's copy-out at 50) [50,75] exposed 15 (compute free at 60), b1 [75,95],
    # AG b0 [75,100] exposed 5, b0 [100,120], RS b1 [95,101] and RS b0 [120,126] exposed 6: 126.
    slow = _costs(all_gather=25.0)
    resharded = _step(_knobs(), slow)
    assert resharded.t.end == pytest.approx(126.0)
    # raf=False: no backward all-gather; b1 [60,80], b0 [80,100], RS b0 [100,106]: 106.
    kept = _step(_knobs(reshard_after_forward=(False, False, False)), slow)
    assert kept.t.end == pytest.approx(106.0)
    assert kept.t.comm[0] == pytest.approx(25.0 + R) and resharded.t.comm[0] == pytest.approx(50.0 + R)
    assert kept.mem.peak > resharded.mem.peak  # both blocks' unsharded params live through the backward


def test_int_reshard_after_forward_gathers_from_a_smaller_group_in_backward():
    # raf = 2: after forward each block keeps a 1/2 slice; backward all-gathers run over 2 ranks of one node
    # (1000 elements x 2 bytes at 1 GB/s: 2 us) instead of the 25 s of the full group: about the 106 of raf=False.
    slow = _costs(all_gather=25.0)
    halved = _step(_knobs(reshard_after_forward=(2, 2, False)), slow)
    assert halved.t.end == pytest.approx(106.0, abs=1e-3)
    resharded, kept = _step(_knobs(), slow), _step(_knobs(reshard_after_forward=(False, False, False)), slow)
    assert resharded.mem.peak < halved.mem.peak < kept.mem.peak


def test_no_sync_skips_reduce_scatters_on_non_final_microbatches():
    # sync every, 2 microbatches: each microbatch as the default step (70), the second starts at 70: 140.
    every = _step(_knobs(num_microbatches=2))
    assert every.t.end == pytest.approx(140.0)
    assert every.t.comm[0] == pytest.approx(2 * (2 * A + R))
    # sync last: microbatch 0 has no block reduce-scatter, so nothing waits at its end: it ends at 64; microbatch 1 as before: 134.
    last = _step(_knobs(num_microbatches=2, sync=("last", "last", "every")))
    assert last.t.end == pytest.approx(134.0)
    assert last.t.comm[0] == pytest.approx(2 * (2 * A) + R)
    assert last.mem.peak > every.mem.peak  # unsharded gradients accumulate across microbatches


def test_a_unit_that_reduces_every_microbatch_keeps_its_parameters_without_reshard_after_backward():
    # FSDP2 honours reshard_after_backward on the reduce path too (FSDPParamGroup.post_backward). raf=False, 2
    # microbatches. Microbatch 0: AG b0 [0,4] exposed 4, AG b1 [4,8], b0 [4,14], b1 [14,24]; backward b1 [24,44],
    # RS b1 [44,50], b0 [44,64], RS b0 [64,70] exposed 6: 70. Resharded after backward, microbatch 1 gathers again
    # (AG b0 [70,74] exposed 4, ...): 140; kept, it does not: b0 [70,80], b1 [80,90], b1 [90,110], b0 [110,130],
    # RS b0 [130,136] exposed 6: 136.
    no_raf = (False, False, False)
    resharded = _step(_knobs(num_microbatches=2, reshard_after_forward=no_raf))
    kept = _step(_knobs(num_microbatches=2, reshard_after_forward=no_raf, reshard_after_backward=(False, False, True)))
    assert resharded.t.end == pytest.approx(140.0) and kept.t.end == pytest.approx(136.0)
    assert resharded.t.comm[0] == pytest.approx(2 * A + 2 * R) and kept.t.comm[0] == pytest.approx(A + 2 * R)


def test_eager_concat_costs_a_copy_per_non_sync_microbatch_and_a_restore():
    # defer_concat = False (FSDP1's eager cat): each block concatenates (3) on microbatch 0 and restores (1) on the last.
    costs = dataclasses.replace(_costs(), concat_s=[3.0, 3.0, 0.0], restore_s=[1.0, 1.0, 0.0])
    nosync = ("last", "last", "every")
    deferred = _step(_knobs(num_microbatches=2, sync=nosync), costs)
    eager = _step(_knobs(num_microbatches=2, sync=nosync, defer_concat=(False, False, True)), costs)
    assert eager.t.compute_busy - deferred.t.compute_busy == pytest.approx(2 * 3.0 + 2 * 1.0)
    assert eager.t.end > deferred.t.end


def test_autograd_accumulating_into_a_kept_grad_costs_a_read_modify_write_per_later_microbatch():
    # Same dtypes (float32 params and reduction), deferred concat: on non-sync microbatches the unsharded
    # grads stay on the parameters and autograd adds each later microbatch's into them (5 a block here).
    same = dataclasses.replace(_costs(), param_bytes=4, reduce_bytes=4)
    costs = dataclasses.replace(same, accumulate_s=[5.0, 5.0, 5.0])
    fp32 = {"param_dtype": "float32", "reduce_dtype": "float32"}
    free = _step(_knobs(num_microbatches=3, sync=("last", "last", "every"), **fp32), same)
    paid = _step(_knobs(num_microbatches=3, sync=("last", "last", "every"), **fp32), costs)
    # microbatches 1 and 2 find microbatch 0's grads on both blocks; the root (sync every) never keeps its own
    assert paid.t.compute_busy - free.t.compute_busy == pytest.approx(2 * 2 * 5.0)
    every = _step(_knobs(num_microbatches=3, **fp32), costs)
    assert every.t.compute_busy == pytest.approx(_step(_knobs(num_microbatches=3, **fp32), same).t.compute_busy)
    # mixed precision: FSDP2 up-casts into its own accumulator and drops the grad, autograd adds nothing
    mixed = _step(
        _knobs(num_microbatches=3, sync=("last", "last", "every")),
        dataclasses.replace(_costs(), accumulate_s=[5.0] * 3),
    )
    assert mixed.t.compute_busy == pytest.approx(
        _step(_knobs(num_microbatches=3, sync=("last", "last", "every"))).t.compute_busy
    )


def test_hsdp_all_reduce_follows_each_reduce_scatter_on_the_replicate_link():
    # RS b1 [44,50] then AR b1 [50,58] on its own stream and link; RS b0 [64,70], AR b0 [70,78]:
    # the final callback waits for the last all-reduce: 78 (b0 exposed 4 + 6 + 8; the root's own all-reduce,
    # free but queued behind b0's on the link, charges its wait to b0).
    step = _step(_knobs(hsdp=True, replicate=2))
    assert step.t.end == pytest.approx(78.0)
    assert step.t.exposed == pytest.approx([4.0 + R + AR, 0.0, 0.0])
    # replica_last on 2 microbatches: microbatch 0 reduce-scatters without all-reducing (ends at 70),
    # microbatch 1 as above from 70: 148 instead of 156.
    every = _step(_knobs(hsdp=True, replicate=2, num_microbatches=2))
    replica_last = _step(
        _knobs(hsdp=True, replicate=2, num_microbatches=2, sync=("replica_last", "replica_last", "every"))
    )
    assert every.t.end == pytest.approx(156.0)
    assert replica_last.t.end == pytest.approx(148.0)


def test_more_reduce_scatter_buffers_let_compute_run_ahead_of_a_slow_reduce_scatter():
    # RS b1 = 25 [44,69], RS b0 = 6, the root's head backward 10. One buffer: b0's post-backward waits for RS b1
    # before packing (64 -> 69, 5 exposed), RS b0 [69,75], head [69,79]: 79. Two buffers: b0 packs at 64,
    # RS b0 queues on the link [69,75], head [64,74]; the root's post-backward waits for RS b1 (69, hidden);
    # the final wait is for RS b0 (74 -> 75): 75.
    slow_rs = dataclasses.replace(_costs(), reduce_scatter_s=[R, 25.0, 0.0], head_backward_s=10.0)
    one, two = _step(_knobs(), slow_rs), _step(_knobs(max_rs_buffers=2), slow_rs)
    assert one.t.end == pytest.approx(79.0) and two.t.end == pytest.approx(75.0)
    assert one.t.exposed[1] == pytest.approx(5.0) and two.t.exposed[1] == pytest.approx(0.0)
    assert two.t.exposed[0] == pytest.approx(4.0 + 1.0)  # the forward all-gather, and the last second of RS b0


def test_cpu_reduce_scatter_blocks_the_host():
    # gloo: the host runs everything; all-gathers are async (unshard_async, auto on CPU) but issued only when the
    # host reaches them, reduce-scatters block. Forward: AG b0 [0,4], b0 [4,14], AG b1 [14,18] exposed, b1 [18,28].
    # Backward: AG b1 [28,32] exposed, AG b0 [32,36] under b1 [32,52], RS b1 [52,58] blocks, b0 [58,78], RS b0 [78,84].
    step = _step(_knobs(unshard_async=True), device="cpu")
    assert step.t.end == pytest.approx(84.0)
    assert step.t.exposed == pytest.approx([4.0 + R, 4.0 + 4.0 + R, 0.0])


@pytest.mark.parametrize("sync", ["every", "last"])
def test_microbatches_beyond_three_repeat_the_second(sync):
    # the simulator runs microbatches 0, 1 and the last, and adds M - 3 copies of microbatch 1 (same unit state on entry)
    from autotune.sim.predict import _finish_step

    knobs = _knobs(
        num_microbatches=6, sync=(sync, sync, "every"), reshard_after_backward=(False, False, True), max_rs_buffers=2
    )
    full = _step(knobs)
    fast = StepSchedule(knobs, _costs(), ACTIVATIONS, _hardware(), activation_checkpointing=False)
    fast.run_forward()
    end, exposed, comm = _finish_step(fast, 6)
    assert (
        end == pytest.approx(full.t.end)
        and exposed == pytest.approx(full.t.exposed)
        and comm == pytest.approx(full.t.comm)
    )
    assert fast.mem.peak == pytest.approx(full.mem.peak)


def test_cpu_share_of_an_async_all_gather_slows_the_compute_it_overlaps():
    # CPU, async unshard, b0 prefetches b1 in forward; each all-gather's real transfer takes 2 of the host's time
    # when issued (gloo's worker shares the cores). Forward: AG b0 [0,4], its CPU share [0,2], wait to 4 (2 exposed);
    # AG b1 [4,8] + share [4,6]; b0 [6,16]; b1 [16,26]. Backward: the root prefetches b1 [26,30] + share [26,28], wait to
    # 30 (2 exposed); AG b0 [30,34] + share [30,32]; b1 [32,52], RS b1 [52,58]; b0 [58,78], RS b0 [78,84]: 84.
    # Without the share: 80 (AG b0 and b1's backward all-gather exposed 4 each instead of 2).
    knobs = _knobs(unshard_async=True, forward_prefetch=((1,), (), None))
    shared = dataclasses.replace(_costs(), all_gather_cpu_s=[2.0, 2.0, 0.0])
    free, slowed = _step(knobs, device="cpu"), _step(knobs, shared, device="cpu")
    assert free.t.end == pytest.approx(80.0) and slowed.t.end == pytest.approx(84.0)
    assert slowed.t.exposed == pytest.approx([2.0 + R, 2.0 + R, 0.0]) and free.t.exposed == pytest.approx(
        [4.0 + R, 4.0 + R, 0.0]
    )
    assert (
        _step(_knobs(), shared, device="cpu").t.end == _step(_knobs(), device="cpu").t.end
    )  # blocking all-gathers: no share


def test_measured_hook_costs_are_charged_per_call():
    # CPU, blocking all-gathers, nothing resharded after forward. Microbatch overhead 3 [0,3]; AG b0 [3,7], b0 [7,17],
    # AG b1 [17,21], b1 [21,31]. Backward: every unit is unsharded, so each pre-backward hook costs 1 (root [31,32],
    # b1 [32,33]); b1 [33,53], its post-hook 0.5, RS b1 [53.5,59.5]; b0's hook [59.5,60.5], b0 to 80.5, post-hook to 81,
    # RS b0 to 87; the root's post-hook 0.5: 87.5 = the 80 without hooks + 3 + 3 x 1 + 3 x 0.5.
    knobs = _knobs(reshard_after_forward=(False, False, False))
    hooked = dataclasses.replace(_costs(), microbatch_s=3.0, pre_hook_s=[1.0] * 3, post_hook_s=[0.5] * 3)
    assert _step(knobs, device="cpu").t.end == pytest.approx(80.0)
    assert _step(knobs, hooked, device="cpu").t.end == pytest.approx(87.5)


def test_grouped_and_checkpointed_units_keep_what_their_blocks_keep():
    # Unit 0 holds two blocks under full checkpointing (each keeps its input, 1e4), unit 1 one block without
    # (1e5 saved). Forward peaks: a block's own (1.5e5) plus the unit's other block (1e4) plus everything below:
    # unit 0: 1.5e5 + 1e4; unit 1: 1.5e5 + 2e4. The loss: 3e5 traced with one block of 1e5, so 3e5 - 1e5 + 1.2e5;
    # the root's backward: a backward's 1.8e5 plus all saved but the last unit's block: 1.8e5 + 1.2e5 - 1e5.
    costs = dataclasses.replace(_costs(), unit_num_blocks=[2, 1], unit_checkpointing=["full", "none"])
    step = StepSchedule(
        _knobs(),
        costs,
        dataclasses.replace(ACTIVATIONS, block_selective=4e4),
        _hardware(),
        activation_checkpointing=False,
    )
    assert step.act_forward == pytest.approx([1.6e5, 1.7e5]) and step.act_backward == pytest.approx([1.9e5, 2.0e5])
    assert step.act_tail == pytest.approx(3.2e5) and step.act_root_backward == pytest.approx(2.0e5)
    selective = StepSchedule(
        _knobs(),
        dataclasses.replace(costs, unit_checkpointing=["selective", "selective"]),
        dataclasses.replace(ACTIVATIONS, block_selective=4e4),
        _hardware(),
        activation_checkpointing=False,
    )
    assert selective.act_forward == pytest.approx([1.5e5 + 4e4, 1.5e5 + 8e4]) and selective.act_tail == pytest.approx(
        3e5 - 1e5 + 1.2e5
    )


def test_a_pass_ends_no_earlier_than_its_host_launched_it():
    """[Note: host path]: on a GPU the host runs ahead, but a pass whose launches take longer than
    its kernels ends when the host is done; the next pass starts from there."""
    from autotune.sim.timeline import COMPUTE, Timeline

    t = Timeline(2)
    t.compute(5.0, (), 2.0)  # device-bound: the host is ahead
    assert (t.streams[COMPUTE], t.host) == (5.0, 2.0)
    t.compute(1.0, (), 6.0)  # host-bound: launched until 8.0, its kernels take 1.0
    assert (t.streams[COMPUTE], t.host) == (8.0, 8.0)
    t.compute(1.0)
    assert t.streams[COMPUTE] == 9.0 and t.compute_busy == 7.0
