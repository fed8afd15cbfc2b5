"""Calibration ([Note: calibration]): trace costs from hand-built labels, collective fits by hand,
measured prices with and without link emulation, and a calibration from real trials."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from _measured_profiles import get_measured_profile
from _search_fixtures import nosync_params

from autotune.search import SearchSpace
from autotune.sim import Hardware, Simulator, get_model_work
from autotune.sim.calibrate import _fit_sync, _memory_speed, _predict, calibrate, fit_collective
from autotune.sim.calibration_trial import CalibrationTrial, read_calibration_trial
from autotune.sim.costs import get_padded_numel
from autotune.sim.hardware import get_group
from autotune.sim.measured import LOCAL_HOOK_KEYS, CollectiveFit, MeasuredProfile
from autotune.sim.trace_costs import TraceCosts, get_trace_costs
from autotune.trials import TrialSpec, run_trial
from profiles import load_cluster_profile, load_model_profile

US = 1e-6


def _events() -> SimpleNamespace:
    """One step [0, 1000] us of a two-block model, one microbatch: labels as FSDP2 records them on CPU
    with blocking collectives (the comm rows are the gloo spans they wait for)."""
    labels = [
        (0, 10, "root_pre_forward", "root"),
        (10, 30, "pre_forward", "root"),
        (25, 30, "all_gather_copy_out", "root"),
        (40, 70, "pre_forward", "layers.0"),
        (60, 70, "all_gather_copy_out", "layers.0"),
        (170, 172, "post_forward", "layers.0"),
        (175, 205, "pre_forward", "layers.1"),
        (195, 205, "all_gather_copy_out", "layers.1"),
        (305, 307, "post_forward", "layers.1"),
        (357, 360, "post_forward", "root"),
        (400, 420, "pre_backward", "root"),
        (402, 418, "backward_prefetch", "layers.1"),
        (450, 460, "pre_backward", "layers.1"),
        (452, 460, "all_gather_copy_out", "layers.1"),
        (660, 662, "post_backward_accumulate", "layers.1"),
        (662, 663, "post_backward_reshard", "layers.1"),
        (663, 690, "post_backward_reduce", "layers.1"),
        (690, 700, "pre_backward", "layers.0"),
        (692, 700, "all_gather_copy_out", "layers.0"),
        (900, 902, "post_backward_accumulate", "layers.0"),
        (902, 930, "post_backward_reduce", "layers.0"),
        (940, 980, "root_post_backward_callback", "root"),
        (945, 975, "post_backward_reduce", "root"),
    ]
    comm = [
        (12, 25, "all_gather", "root"),
        (42, 60, "all_gather", "layers.0"),
        (177, 195, "all_gather", "layers.1"),
        (403, 417, "all_gather", "layers.1"),
        (665, 685, "reduce_scatter", "layers.1"),
        (905, 925, "reduce_scatter", "layers.0"),
        (950, 970, "reduce_scatter", "root"),
    ]
    return SimpleNamespace(
        steps=pd.DataFrame({"step": [1], "start": [0.0], "end": [1000.0]}),
        labels=pd.DataFrame(labels, columns=["start", "end", "phase", "unit"]).astype({"start": float, "end": float}),
        comm=pd.DataFrame(
            [(a, b, a, k, u) for a, b, k, u in comm], columns=["start", "end", "issue_ts", "kind", "unit"]
        ).astype({"start": float, "end": float}),
        barriers=pd.DataFrame(columns=["start", "end", "issue_ts"], dtype=float),
    )


def test_trace_costs_attribute_the_time_between_fsdp_labels_by_hand():
    costs = get_trace_costs({0: _events()}, block_names=("layers.0", "layers.1"), num_microbatches=1)
    # gaps after pre_forward(root) 10; block forwards 100 + 2 (post_forward) + 3 (to the next block) + 100 + 2 over 2 blocks;
    # the tail 50 (norm, output) + 3 (its post_forward) + 40 (loss); backward: tail 30, blocks 200 each, head 10 after block 0
    assert costs.segments == pytest.approx(
        {
            "head.forward": 10 * US,
            "block.forward": 103.5 * US,
            "tail.forward": 93 * US,
            "tail.backward": 30 * US,
            "block.backward": 200 * US,
            "head.backward": 10 * US,
        }
    )
    # hooks: label time minus the collectives in it, priced at the lower quartile of the calls. unshard: blocks 12, 12
    # (forward), 10, 10 (backward): 10; root 20 - 13; the root's pre-backward holds no copy-out of its own (6 = 20 - 14
    # of b1's prefetch); post-hooks (2 + 1) and 2 per post-backward, the reshard's 1 spread evenly: 2.5 each;
    # reduces 27 - 20 and 28 - 20: 7 + (8 - 7) / 4; the root's callback 40 - 20
    assert costs.hooks == pytest.approx(
        {
            "unshard.block": 10 * US,
            "unshard.root": 7 * US,
            "pre_hook.block": 0.0,
            "pre_hook.root": 6 * US,
            "post_hook.block": 2.5 * US,
            "post_hook.root": 0.0,
            "reduce.block": 7.25 * US,
            "reduce.root": 20 * US,
        }
    )
    assert costs.microbatch_s == pytest.approx(10 * US) and costs.optimizer_s == pytest.approx(20 * US)
    assert sorted(costs.collectives) == sorted(
        [
            ("all_gather", "root", 13 * US),
            ("all_gather", "layers.0", 18 * US),
            ("all_gather", "layers.1", 18 * US),
            ("all_gather", "layers.1", 14 * US),
            ("reduce_scatter", "layers.1", 20 * US),
            ("reduce_scatter", "layers.0", 20 * US),
            ("reduce_scatter", "root", 20 * US),
        ]
    )


def _with_storm(events, *units: str):
    """``events`` with a page-fault storm (100 us more) in the reduce hooks of ``units``."""
    labels = events.labels
    labels.loc[(labels["phase"] == "post_backward_reduce") & labels["unit"].isin(units), "end"] += 100
    return events


def test_a_hook_is_priced_at_the_lower_quartile_of_its_calls_not_at_a_burst_in_one_step():
    """A page-fault burst in one call (a reduce's ``chunk_cat`` 100 us longer) on one rank in one step:
    the per-step mean of that rank's step moves to 57.5 us, and a median of the four ranks' and steps'
    means would read (7.5 + 57.5) / 2 = 32.5 us with a burst on two of them; the lower quartile of the
    calls (7, 7, 8, 8, 8, 8, 107, 107) reads 7.75."""
    burst = _with_storm(_events(), "layers.1")
    costs = get_trace_costs(
        {0: burst, 1: _events(), 2: burst, 3: _events()}, block_names=("layers.0", "layers.1"), num_microbatches=1
    )
    assert costs.hooks["reduce.block"] == pytest.approx(7.75 * US)
    # what the burst's rank alone reads: its two calls 8 and 107, the lower quartile a quarter of the way up
    alone = get_trace_costs({0: burst}, block_names=("layers.0", "layers.1"), num_microbatches=1)
    assert alone.hooks["reduce.block"] == pytest.approx(32.75 * US)
    # uncounted time of a key (post_backward_reshard: 1 us) is shared evenly by its counted calls
    assert costs.hooks["post_hook.block"] == pytest.approx(2.5 * US)


def test_a_storm_over_most_calls_leaves_the_hook_at_its_clean_calls():
    """Storms in the profiled window hit 10 of a rank's 16 reduce calls on ``wide`` (2026-11-28): the
    median call then is a stormy one. Here five of eight calls are stormy (7, 8, 8, 107, 107, 107, 108,
    108): the median reads 107 us, the lower quartile 8 us, a clean call's."""
    clean = _events()
    one = _with_storm(_events(), "layers.1")
    both = [_with_storm(_events(), "layers.0", "layers.1") for _ in range(2)]
    costs = get_trace_costs(
        {0: one, 1: both[0], 2: both[1], 3: clean}, block_names=("layers.0", "layers.1"), num_microbatches=1
    )
    assert costs.hooks["reduce.block"] == pytest.approx(8 * US)


def test_a_trace_on_a_shard_group_of_one_counts_its_copies_as_local_hooks():
    """HSDP Nx1: no all-gather and no copy-out label; the pre-forward hooks' copies and the reduces
    (an all-reduce in them) count under the local keys, the pre-backward hooks as before."""
    events = _events()
    events.labels = events.labels[events.labels["phase"] != "all_gather_copy_out"].reset_index(drop=True)
    comm = events.comm[events.comm["kind"] != "all_gather"].copy()
    comm["kind"] = "all_reduce"
    events.comm = comm.reset_index(drop=True)
    local = get_trace_costs({0: events}, block_names=("layers.0", "layers.1"), num_microbatches=1, local=True)
    # pre-forwards: root 20, blocks 30 and 30; reduces 27 - 20 and 28 - 20 (lower quartile 7.25); the root's callback 40 - 20
    assert {k: v for k, v in local.hooks.items() if "local" in k} == pytest.approx(
        {
            "unshard_local.block": 30 * US,
            "unshard_local.root": 20 * US,
            "reduce_local.block": 7.25 * US,
            "reduce_local.root": 20 * US,
        }
    )
    # pre-backwards: blocks 10 each, the root 20 (no prefetch's all-gather in it any more); nothing counts as a copy-out
    assert local.hooks["pre_hook.block"] == pytest.approx(10 * US) and local.hooks["pre_hook.root"] == pytest.approx(
        20 * US
    )
    assert local.hooks["unshard.block"] == 0.0 and local.hooks["reduce.block"] == 0.0
    # Read as an ordinary trace, the same labels hold no local keys.
    assert not any(
        "local" in k
        for k in get_trace_costs({0: events}, block_names=("layers.0", "layers.1"), num_microbatches=1).hooks
    )


def test_eager_concat_labels_are_counted_apart_from_the_hooks_around_them():
    """``defer_concat = false``: fsdp_runtime's ``eager_concat`` label after a block's post-backward
    (top level) and inside the root's post-backward callback (nested) count under ``concat``."""
    events = _events()
    labels = events.labels
    labels.loc[(labels["phase"] == "post_backward_reduce") & (labels["unit"] == "layers.1"), "phase"] = (
        "eager_concat"  # 663-690, no reduce
    )
    events.labels = pd.concat(
        [labels, pd.DataFrame([(976.0, 979.0, "eager_concat", "root")], columns=labels.columns)], ignore_index=True
    )
    events.comm = events.comm[
        ~((events.comm["kind"] == "reduce_scatter") & (events.comm["unit"] == "layers.1"))
    ].reset_index(drop=True)
    costs = get_trace_costs({0: events}, block_names=("layers.0", "layers.1"), num_microbatches=1)
    assert costs.hooks["concat.block"] == pytest.approx(27 * US) and costs.hooks["concat.root"] == pytest.approx(3 * US)
    # layers.0's reduce alone (28 - 20); the root's callback less its nested concat (40 - 20 - 3); compute as before
    assert costs.hooks["reduce.block"] == pytest.approx(8 * US) and costs.hooks["reduce.root"] == pytest.approx(17 * US)
    assert costs.segments == pytest.approx(
        get_trace_costs({0: _events()}, block_names=("layers.0", "layers.1"), num_microbatches=1).segments
    )
    assert (
        "restore.block" not in costs.hooks
        and "concat.block"
        not in get_trace_costs({0: _events()}, block_names=("layers.0", "layers.1"), num_microbatches=1).hooks
    )


def test_collective_fits_by_hand():
    exact = fit_collective([(2, 1e6, 1e-3 + 2e-3), (2, 3e6, 1e-3 + 6e-3)], 2)
    assert (exact.latency_s, exact.seconds_per_byte) == pytest.approx((1e-3, 2e-9))
    # a point at 4 ranks moves (3/4) / (1/2) = 1.5x the bytes of one at 2: 2e6 bytes there count as 3e6
    scaled = fit_collective([(2, 1e6, 3e-3), (4, 2e6, 7e-3)], 2)
    assert (scaled.latency_s, scaled.seconds_per_byte) == pytest.approx((1e-3, 2e-9))
    assert scaled.get_seconds(2e6, 4) == pytest.approx(7e-3) and scaled.get_seconds(1e9, 1) == 0.0
    # a free fit with a negative latency goes through the origin: slope = sum(xy) / sum(x^2) = 7e3 / 5e12
    origin = fit_collective([(2, 1e6, 1e-3), (2, 2e6, 3e-3)], 2)
    assert (origin.latency_s, origin.seconds_per_byte) == pytest.approx((0.0, 1.4e-9))


def test_measured_collectives_are_held_to_emulated_links():
    emulated = Hardware(load_cluster_profile("cpu-emulated-ib"), num_ranks=4, measured=get_measured_profile())
    shard2, world4 = get_group(2, 1, 2), get_group(4, 1, 2)
    # 10 MB inside a node: real 100 us + 10 ms beats the emulated 50 us + 10 ms (1 GB/s)
    assert emulated.get_collective_seconds("all_gather", 1e7, shard2) == pytest.approx(1e-4 + 1e-2)
    # across 2 nodes: real 100 us + 10 ms x 1.5 (4 ranks' ring), held to 200 us + 40 ms (0.25 GB/s)
    assert emulated.get_collective_seconds("all_gather", 1e7, world4) == pytest.approx(2e-4 + 4e-2)
    assert emulated.get_real_collective_seconds("all_gather", 1e7, world4) == pytest.approx(1e-4 + 1.5e-2)
    raw = Hardware(load_cluster_profile("cpu-gloo"), num_ranks=4, measured=get_measured_profile())
    assert raw.get_collective_seconds("all_gather", 1e7, world4) == pytest.approx(1e-4 + 1.5e-2) and raw.world_size == 4
    # gloo runs reduce-scatter and all-reduce as one all-reduce: either fit prices both
    both = get_measured_profile(
        collectives={"reduce_scatter": CollectiveFit(latency_s=0.0, seconds_per_byte=1e-9, group_size=2)}
    )
    assert (
        both.get_real_seconds("all_reduce", 1e6, 2) == pytest.approx(1e-3)
        and both.get_real_seconds("all_gather", 1e6, 2) == 0.0
    )
    assert MeasuredProfile.from_dict(both.to_dict()) == both


def test_measured_prices_simulate_a_cpu_step_with_mesh_dependent_optimizer():
    work = get_model_work(load_model_profile("tiny"), "float32")
    hardware = Hardware(load_cluster_profile("cpu-gloo"), num_ranks=2, measured=get_measured_profile(world_size=2))
    space = SearchSpace(block_names=work.block_names, world_size=2, num_microbatches=1, device_type="cpu")
    simulator = Simulator(work, hardware)
    fsdp = simulator.simulate(space.build_config(space.get_default_params()))
    assert fsdp.step_s > 0 and fsdp.mfu == 0.0  # no device peak on a CPU profile
    # 2x1 keeps the whole model on each rank: twice the optimizer's elements, no all-gather
    replicated, sharded = (
        simulator.get_costs(_knobs_of(space, "hsdp:2x1", work)),
        simulator.get_costs(_knobs_of(space, "fsdp", work)),
    )
    assert (
        replicated.optimizer_s == pytest.approx(2 * sharded.optimizer_s, rel=0.01)
        and sum(replicated.all_gather_s) == 0.0
    )
    assert sharded.all_gather_s[0] == pytest.approx(
        1e-4 + sharded.padded[0] * 4 * 1e-9
    )  # the fit at 2 ranks, float32 params


def test_the_wait_per_collective_is_fitted_from_a_trial_that_skips_sync():
    """A machine whose collectives each cost 2 ms more than their transfer: a trial that skips
    gradient sync is measured at its true ratio to the defaults; the fit recovers the wait and
    the compute scale with the anchor still predicted exactly."""
    work = get_model_work(load_model_profile("tiny"), "float32")
    space = SearchSpace(block_names=work.block_names, world_size=2, num_microbatches=4, device_type="cpu")
    defaults = space.get_default_params()
    nosync = nosync_params(defaults, keep_unsharded=False, defer_concat=True)
    fits = {
        "all_gather": CollectiveFit(latency_s=1e-4, seconds_per_byte=1e-9, group_size=2),
        "reduce_scatter": CollectiveFit(latency_s=1e-4, seconds_per_byte=2e-9, group_size=2),
    }
    truth = get_measured_profile(world_size=2, num_microbatches=4, collectives=fits, sync_s=2e-3, compute_scale=1.3)
    anchor = CalibrationTrial(
        path=Path("defaults"), config=space.build_config(defaults), world_size=2, step_s=0.0, cluster=None
    )
    trial = CalibrationTrial(
        path=Path("nosync"), config=space.build_config(nosync), world_size=2, step_s=0.0, cluster=None
    )
    target = _predict(work, anchor, truth)
    trial.ratio = _predict(work, trial, truth) / target
    assert trial.ratio < 0.9  # 4 microbatches: 3 of 4 reduce-scatters (and their waits) skipped
    fitted = _fit_sync(work, anchor, trial, dataclasses.replace(truth, sync_s=0.0, compute_scale=1.0), target)
    assert fitted.sync_s == pytest.approx(2e-3, rel=1e-3) and fitted.compute_scale == pytest.approx(1.3, rel=1e-3)
    assert _predict(work, anchor, fitted) == pytest.approx(target, rel=1e-6)
    # Without the wait the skipped sync is predicted to save less than it did.
    bare = dataclasses.replace(fitted, sync_s=0.0)
    assert _predict(work, trial, bare) / _predict(work, anchor, bare) > trial.ratio + 0.01
    # A trial measured slower than any wait explains leaves the wait at 0 (never negative).
    trial.ratio = 1.2
    assert _fit_sync(work, anchor, trial, dataclasses.replace(truth, sync_s=0.0), target).sync_s == 0.0
    # The wait is added to every collective's price, an emulated link's hold included.
    hardware = Hardware(load_cluster_profile("cpu-emulated-ib"), num_ranks=2, measured=fitted)
    bare = Hardware(
        load_cluster_profile("cpu-emulated-ib"), num_ranks=2, measured=dataclasses.replace(fitted, sync_s=0.0)
    )
    group = get_group(2, 1, 2)
    assert hardware.get_collective_seconds("all_gather", 1e7, group) - bare.get_collective_seconds(
        "all_gather", 1e7, group
    ) == pytest.approx(2e-3)


@pytest.mark.parametrize("async_paired", [False, True], ids=["async-step", "async-ratio"])
def test_calibration_recovers_the_profile_its_trials_were_made_from(monkeypatch, async_paired):
    """Trace costs made from a known profile of ``tiny`` on 2 ranks, and each calibration trial's
    step (or its ratio to the anchor's config) predicted from that profile: ``calibrate`` finds the
    profile again. Known: collectives 300 us + 2 ns/B (all-gather) and 100 us + 4 ns/B
    (reduce-scatter), compute scale 1.3, a 300 us wait per collective, a CPU share of 0.6 (a wait
    much longer hides the asynchronous all-gathers' CPU time from the step: no share could be fitted)."""
    work = get_model_work(load_model_profile("tiny"), "float32")
    space = SearchSpace(block_names=work.block_names, world_size=2, num_microbatches=2, device_type="cpu")
    defaults = space.get_default_params()
    fits = {
        "all_gather": CollectiveFit(latency_s=3e-4, seconds_per_byte=2e-9, group_size=2),
        "reduce_scatter": CollectiveFit(latency_s=1e-4, seconds_per_byte=4e-9, group_size=2),
    }
    # Both collectives of a unit move its padded float32 parameters (gloo reduces the full buffer).
    padded = {unit: get_padded_numel(shapes, 2) for unit, shapes in work.param_shapes.items()}
    costs = TraceCosts(
        segments=get_measured_profile().segments,
        hooks=get_measured_profile().hooks,
        microbatch_s=1e-4,
        optimizer_s=1e-9 * sum(n // 2 for n in padded.values()),
        collectives=[
            (kind, unit, fit.latency_s + 4 * n * fit.seconds_per_byte)
            for kind, fit in fits.items()
            for unit, n in padded.items()
        ],
    )
    assert len({n for n in padded.values()}) > 1  # two sizes at least: latency and bandwidth apart
    truth = get_measured_profile(
        name="truth",
        world_size=2,
        num_microbatches=2,
        collectives=fits,
        memory_bytes_per_s=_memory_speed(costs, work, 2, 4),
        compute_scale=1.3,
        sync_s=3e-4,
        cpu_share=0.6,
        add_bytes_per_s=20e9,
        page_fault_s=2e-6,
    )
    # The probes measure this machine; here they report the truth's figures.
    module = sys.modules[calibrate.__module__]
    monkeypatch.setattr(module, "measure_add_bytes_per_s", lambda: truth.add_bytes_per_s)
    monkeypatch.setattr(module, "measure_page_fault_s", lambda: truth.page_fault_s)
    nosync = {**defaults, "nosync_blocks": "all", "nosync_level_fsdp": "last", "defer_concat": True}
    trials = {
        name: CalibrationTrial(
            path=Path(name), config=space.build_config(params), world_size=2, step_s=0.0, cluster=None
        )
        for name, params in (
            ("defaults", defaults),
            ("nosync", nosync),
            ("async", {**defaults, "unshard_async": "on", "forward_prefetch": "depth1"}),
        )
    }
    for trial in trials.values():
        trial.step_s = _predict(work, trial, truth)
    anchor, paired = trials["defaults"], [trials["nosync"]] + [trials["async"]] * async_paired
    for trial in paired:
        trial.ratio = trial.step_s / anchor.step_s
    # ``autotune.sim.calibrate`` the name is the function: patch its module's reader.
    monkeypatch.setattr(sys.modules[calibrate.__module__], "load_trace_costs", lambda trial, work, local=False: costs)
    profile = calibrate(work, anchor, extra=[trials["nosync"], trials["async"]], fit_sync=True)
    assert (profile.compute_scale, profile.sync_s, profile.cpu_share) == pytest.approx((1.3, 3e-4, 0.6), rel=1e-3)
    for kind, fit in fits.items():
        got = profile.collectives[kind]
        assert (got.latency_s, got.seconds_per_byte) == pytest.approx((fit.latency_s, fit.seconds_per_byte), rel=1e-6)
        assert got.num_points == 3 * len(padded)  # every unit's, from each of the three trials
    assert profile.optimizer_s_per_element == pytest.approx(1e-9)
    assert (profile.segments, profile.hooks) == (truth.segments, truth.hooks)
    # The async trial's share is what each measurement (its step, or its ratio in pairs) said.
    measured = "x the anchor's config in pairs" if async_paired else f"{1e3 * trials['async'].step_s:.1f} ms"
    assert any(note.startswith("cpu share 0.60 from async") and measured in note for note in profile.notes)
    for trial in trials.values():
        assert _predict(work, trial, profile) == pytest.approx(trial.step_s, rel=1e-3)


def test_a_shard_group_of_one_is_priced_by_its_own_copies_where_measured():
    work = get_model_work(load_model_profile("tiny"), "float32")
    space = SearchSpace(block_names=work.block_names, world_size=2, num_microbatches=1, device_type="cpu")
    local = {
        "unshard_local.block": 5e-4,
        "unshard_local.root": 6e-4,
        "reduce_local.block": 7e-4,
        "reduce_local.root": 8e-4,
    }
    plain = get_measured_profile(world_size=2, compute_scale=2.0)
    measured = dataclasses.replace(plain, hooks={**plain.hooks, **local})

    def costs(profile, mesh):
        return Simulator(work, Hardware(load_cluster_profile("cpu-gloo"), num_ranks=2, measured=profile)).get_costs(
            _knobs_of(space, mesh, work)
        )

    replicated = costs(measured, "hsdp:2x1")
    assert replicated.copy_out_s[0] == pytest.approx(2.0 * 5e-4) and replicated.copy_out_s[-1] == pytest.approx(
        2.0 * 6e-4
    )
    assert replicated.copy_in_s[0] == pytest.approx(2.0 * 7e-4) and replicated.copy_in_s[-1] == pytest.approx(
        2.0 * 8e-4
    )
    # A sharded mesh keeps the anchor's hooks; without local keys a shard group of one falls back to them.
    assert costs(measured, "fsdp").copy_out_s == costs(plain, "fsdp").copy_out_s == costs(plain, "hsdp:2x1").copy_out_s
    assert costs(plain, "hsdp:2x1").copy_out_s[0] == pytest.approx(2.0 * 1e-4)


def _knobs_of(space: SearchSpace, mesh: str, work):
    from autotune.sim import resolve_knobs

    return resolve_knobs(
        space.build_config({**space.get_default_params(), "mesh": mesh}), work.block_names, world_size=2, device="cpu"
    )


@pytest.mark.multirank
def test_calibration_from_real_trials_reproduces_its_anchor_and_fits_the_cpu_share(pool2, tmp_path):
    work = get_model_work(load_model_profile("tiny"), "float32")
    space = SearchSpace(block_names=work.block_names, world_size=2, num_microbatches=2, device_type="cpu")
    defaults = space.get_default_params()
    dirs = {}
    nosync = nosync_params(defaults, keep_unsharded=False, defer_concat=False)
    for name, params, reference in (
        ("defaults", defaults, None),
        ("async", {**defaults, "unshard_async": "on", "forward_prefetch": "depth1"}, None),
        ("nosync", nosync, space.build_config(defaults)),
        ("local", {**defaults, "mesh": "hsdp:2x1"}, None),
    ):
        spec = TrialSpec(
            model="tiny",
            config=space.build_config(params),
            world_size=2,
            out_dir=tmp_path / name,
            num_warmup=1,
            num_measured=3,
            num_profiled=2,
            timeout_s=120,
            reference=reference,
        )
        assert run_trial(spec, pool=pool2).ok
        dirs[name] = read_calibration_trial(tmp_path / name)
    assert dirs["nosync"].ratio is not None and dirs["async"].ratio is None
    profile = calibrate(work, dirs["defaults"], extra=[dirs["async"], dirs["nosync"], dirs["local"]], fit_sync=True)
    assert calibrate(work, dirs["defaults"], extra=[dirs["nosync"]]).sync_s == 0.0  # the wait is fitted only when asked
    assert _predict(work, dirs["defaults"], profile) == pytest.approx(dirs["defaults"].step_s, rel=1e-3)
    # Each fit is its bisection's answer on a 2-core box's noisy measurements (exact recovery is the synthetic
    # test above). The wait per collective moves the no-sync trial's predicted ratio from where no wait puts it
    # towards its measured ratio, never past it; no wait where the trial measured slower than that. (The bracket
    # ends at a wait of 0.9 steps over all collectives: a measurement no wait explains stays above.)
    nosync, measured = dirs["nosync"], dirs["nosync"].ratio
    bare = calibrate(work, dirs["defaults"], extra=[dirs["async"], dirs["nosync"], dirs["local"]])
    fitted, unfitted = (_predict(work, nosync, p) / _predict(work, dirs["defaults"], p) for p in (profile, bare))
    assert (profile.sync_s == 0.0) == (measured >= unfitted), (profile.sync_s, measured, unfitted)
    assert min(measured, unfitted) * (1 - 1e-3) <= fitted <= unfitted * (1 + 1e-6), (fitted, measured, unfitted)
    assert any(note.startswith("sync wait") and str(nosync.path) in note for note in profile.notes)
    # The CPU share: the async trial at its measured step, or a share of 0 (1.5) where it measured faster (slower).
    share, step = profile.cpu_share, dirs["async"].step_s
    predicted = _predict(work, dirs["async"], profile)
    assert (
        predicted == pytest.approx(step, rel=1e-3)
        or (share == 0.0 and predicted > step)
        or (share == 1.5 and predicted < step)
    ), (share, predicted, step)
    assert any(note.startswith(f"cpu share {share:.2f} from {dirs['async'].path}") for note in profile.notes)
    assert profile.collectives["all_gather"].num_points > 0 and profile.collectives["all_gather"].seconds_per_byte > 0
    assert (
        all(v >= 0 for v in (*profile.segments.values(), *profile.hooks.values()))
        and profile.segments["block.backward"] > 0
    )
    # The replicated trial's plain copies price a shard group of one (HSDP 2x1 ran no copy-out to read).
    assert all(profile.hooks[key] > 0 for key in LOCAL_HOOK_KEYS) and any(
        "shard group of one" in note for note in profile.notes
    )
    # The no-sync trial concatenates eagerly: fsdp_runtime's labels price the concat and the restore.
    assert all(profile.hooks[key] > 0 for key in ("concat.block", "restore.block")) and any(
        "eager concat" in note for note in profile.notes
    )
    assert any("anchor" in note for note in profile.notes) and MeasuredProfile.from_dict(profile.to_dict()) == profile


def test_the_cpu_accuracy_figure_leaves_out_the_settings_hook_quantile_was_chosen_on():
    """[Note: fit and held-out sets]: ``trace_costs.HOOK_QUANTILE`` was chosen by replaying recorded
    ``sim_accuracy.py`` runs of ``small`` and ``wide`` on raw loopback; ``sim_accuracy.py``'s accuracy figure
    (``results.json`` ``held_out``) pools the other settings only, the fit set's apart."""
    from autotune.sim.fit_split import CPU_HELD_OUT, get_fit_trials, is_cpu_held_out
    from autotune.sim.fitted import CPU_STEP
    from autotune.sim.trace_costs import HOOK_QUANTILE_FIT
    from benchmarks.sim_accuracy import summarize_split

    assert set(HOOK_QUANTILE_FIT.fit_on) == {"small/raw", "wide/raw"} <= get_fit_trials(CPU_STEP)
    assert not set(CPU_HELD_OUT) & get_fit_trials(CPU_STEP)

    def result(workload: str, setting: str, error: float) -> dict:
        row = {"status": "ok", "measured_ms": 10.0, "measured_ratio": 1.0, "predicted_ratio": 1.0 + error}
        split = "held out" if is_cpu_held_out(workload, setting) else "fit set"
        return {"workload": workload, "setting": setting, "split": split, "rows": [row, row]}

    results = [result("small", "raw", 0.01), result("wide", "raw", 0.02), result("small", "emulated", 0.30)]
    held, fit = summarize_split(results, "held out"), summarize_split(results, "fit set")
    assert held["settings"] == ["small/emulated"] and held["ratio_median_abs_error"] == pytest.approx(0.30)
    assert fit["settings"] == ["small/raw", "wide/raw"] and fit["ratio_median_abs_error"] == pytest.approx(0.015)
    assert not [s for s in held["settings"] if s in get_fit_trials(CPU_STEP)]
