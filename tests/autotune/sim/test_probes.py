"""The CPU probes and what they price: page faults of a grouped unit's large buffers, autograd's accumulation."""

from __future__ import annotations

import dataclasses

import pytest

from autotune.sim.costs import get_mesh_costs
from autotune.sim.hardware import Hardware
from autotune.sim.measured import HOOK_KEYS, SEGMENT_KEYS, CollectiveFit, MeasuredProfile
from autotune.sim.model_work import get_model_work
from autotune.sim.probes import (
    MMAP_THRESHOLD_MAX_BYTES,
    get_fault_seconds,
    get_grouping_fault_seconds,
    get_mmap_threshold_bytes,
    measure_add_bytes_per_s,
    measure_page_fault_s,
)
from profiles import load_cluster_profile, load_model_profile


def test_the_probes_measure_this_machine():
    fault, add = measure_page_fault_s(), measure_add_bytes_per_s()
    assert 1e-8 < fault < 1e-4  # a page fault: tens of ns (bare metal) to tens of us (a loaded VM)
    assert 1e8 < add < 1e12


def test_only_buffers_past_the_mmap_threshold_fault_and_grouping_pays_only_the_excess(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert get_mmap_threshold_bytes() == MMAP_THRESHOLD_MAX_BYTES == 32 * 2**20
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(2**20))
    assert get_mmap_threshold_bytes() == 2**20
    threshold, fault = 32 * 2**20, 2e-6
    assert get_fault_seconds(threshold, fault, threshold) == 0.0
    assert get_fault_seconds(2 * threshold, fault, threshold) == pytest.approx(2 * threshold / 4096 * fault)
    block = 20e6  # one block's buffer: below; four blocks': above
    assert get_grouping_fault_seconds([block], 1, fault, threshold) == 0.0
    assert get_grouping_fault_seconds([block], 4, fault, threshold) == pytest.approx(4 * block / 4096 * fault)
    # blocks already past it: their calibrated hooks hold their faults, grouping adds none
    assert get_grouping_fault_seconds([40e6], 4, fault, threshold) == pytest.approx(0.0)


def _measured(**changes) -> MeasuredProfile:
    segments = dict.fromkeys(SEGMENT_KEYS, 1e-3)
    hooks = dict.fromkeys(HOOK_KEYS, 1e-4)
    fit = CollectiveFit(latency_s=0.0, seconds_per_byte=1e-10, group_size=2)
    profile = MeasuredProfile(
        name="test",
        world_size=2,
        num_microbatches=2,
        segments=segments,
        hooks=hooks,
        microbatch_s=0.0,
        optimizer_s_per_element=1e-9,
        memory_bytes_per_s=2e9,
        collectives={"all_gather": fit, "reduce_scatter": fit},
    )
    return dataclasses.replace(profile, **changes)


def test_a_grouped_unit_pays_page_faults_and_accumulation_is_priced_at_the_add_speed():
    # A model whose 4-block unit's buffers pass 32 MiB: dim 512, ffn 2048 (4.2 M float32 elements, 17 MB a block).
    work = get_model_work(
        load_model_profile("tiny").with_overrides(dim=512, ffn_hidden_dim=2048, num_heads=8, num_kv_heads=8), "float32"
    )
    cluster = load_cluster_profile("cpu-gloo")

    def costs(profile: MeasuredProfile, blocks):
        hardware = Hardware(cluster, num_ranks=2, measured=profile)
        return get_mesh_costs(
            work,
            hardware,
            replicate=1,
            shard=2,
            param_dtype="float32",
            reduce_dtype="float32",
            activation_checkpointing=False,
            unit_blocks=blocks,
        )

    group = ((0, 1, 2, 3),)
    faults, none = costs(_measured(page_fault_s=2e-6), group), costs(_measured(), group)
    block_bytes = faults.padded[0] / 4 * 4
    assert 4 * block_bytes > 32 * 2**20 > block_bytes
    # unshard: FSDP2's all-gather output and gloo's flat copy; reduce: input, gloo's copy, the shard
    assert faults.copy_out_s[0] - none.copy_out_s[0] == pytest.approx(2 * 4 * block_bytes / 4096 * 2e-6)
    # (the shard of 4 blocks, 2 blocks' bytes on 2 ranks, passes 32 MiB too)
    assert faults.copy_in_s[0] - none.copy_in_s[0] == pytest.approx((2 * 4 + 4 / 2) * block_bytes / 4096 * 2e-6)
    assert faults.copy_out_s[-1] == none.copy_out_s[-1]  # the root: calibrated as itself
    ungrouped = costs(_measured(page_fault_s=2e-6), None)
    assert ungrouped.copy_out_s == costs(_measured(), None).copy_out_s
    # autograd's in-place add: at the probe's speed, not the hooks' (Python-bound) memory speed
    fast = costs(_measured(add_bytes_per_s=20e9), None)
    assert fast.accumulate_s[0] == pytest.approx(3 * fast.padded[0] * 4 / 20e9)
    assert ungrouped.accumulate_s[0] == pytest.approx(3 * fast.padded[0] * 4 / 2e9)


def test_a_version_2_measured_profile_reads_with_no_probes():
    data = _measured().to_dict()
    data["schema_version"] = 2
    for key in ("page_fault_s", "add_bytes_per_s"):
        data.pop(key)
    profile = MeasuredProfile.from_dict(data)
    assert profile.page_fault_s == 0.0 and profile.add_bytes_per_s == 0.0
