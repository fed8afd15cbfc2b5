"""Link emulation: collectives are held to the link model, numerics stay bitwise equal."""

from __future__ import annotations

import json

import pytest

from autotune.trials import get_link_name
from autotune.trials import TrialSpec, run_trial
from fsdp_runtime import default_config
from profiles import load_cluster_profile, load_model_profile

LATENCY_US = 4000.0
BANDWIDTH_GBPS = 0.05
# One rank per node: the 2-rank shard group crosses nodes. Slow enough that the model,
# not loopback gloo, decides every collective's completion.
SLOW_CLUSTER = f"""
name = "slow-test-link"
description = "test cluster with a very slow inter-node link"
backend = "gloo"
device = "cpu"
ranks_per_node = 1
memory_per_rank_gib = 1.0

[links.inter_node]
latency_us = {LATENCY_US}
bandwidth_gbps = {BANDWIDTH_GBPS}
"""


def test_link_class_follows_node_boundaries():
    assert get_link_name([0, 1], ranks_per_node=2) == "intra_node"
    assert get_link_name([2, 3], ranks_per_node=2) == "intra_node"
    assert get_link_name([0, 2], ranks_per_node=2) == "inter_node"
    assert get_link_name([1, 2], ranks_per_node=2) == "inter_node"
    assert get_link_name([0, 1, 2, 3], ranks_per_node=8) == "intra_node"


def test_unemulated_cluster_gives_no_emulator():
    from autotune.trials import LinkEmulator

    assert LinkEmulator.from_cluster(load_cluster_profile("cpu-gloo")) is None
    assert LinkEmulator.from_cluster(load_cluster_profile("cpu-emulated-ib")) is not None


@pytest.mark.multirank
def test_emulated_link_holds_collectives_and_keeps_losses_bitwise(pool2, tmp_path):
    cluster = tmp_path / "slow.toml"
    cluster.write_text(SLOW_CLUSTER)
    config = default_config(load_model_profile("tiny").unit_names)
    common = dict(model="tiny", config=config, world_size=2, num_warmup=1, num_measured=2, profile=False, timeout_s=120, backend="gloo")
    plain = run_trial(TrialSpec(out_dir=tmp_path / "plain", **common), pool=pool2)
    slow = run_trial(TrialSpec(out_dir=tmp_path / "slow", cluster=str(cluster), **common), pool=pool2)
    assert plain.status == slow.status == "ok", (plain.reason, slow.reason)

    for p, s in zip(plain.metrics.ranks, slow.metrics.ranks):
        assert p.losses == s.losses  # bitwise: the data still moved through gloo
        assert p.link_emulation is None
        stats = s.link_emulation
        # Only FSDP's traffic is emulated: not the trial's barriers, not its pruning vote.
        assert set(stats) == {"all_gather", "reduce_scatter"}
        for kind in stats.values():
            assert kind["count"] > 0 and kind["count_by_link"] == {"inter_node": kind["count"]}
            expected = kind["count"] * LATENCY_US * 1e-6 + kind["num_bytes"] / (BANDWIDTH_GBPS * 1e9)
            assert kind["modeled_s"] == pytest.approx(expected)
            assert kind["held_s"] > 0
    env = json.loads((tmp_path / "slow" / "env.json").read_text())
    assert env["link_emulation"]["cluster"] == "slow-test-link"
    assert env["link_emulation"]["links"] == {"inter_node": {"latency_us": LATENCY_US, "bandwidth_gbps": BANDWIDTH_GBPS}}
