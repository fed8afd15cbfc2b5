"""[Note: host path probe]: the host's path per block pass, timed on a step that trains as any other."""

from __future__ import annotations

import functools

import torch

from autotune.trials import build_training
from autotune.trials.host_probe import NUM_INTERVALS, HostProbe, probe_host_path
from fsdp_runtime import config_to_dict, default_config
from profiles import load_model_profile

CPU = torch.device("cpu")


def test_the_probed_step_trains_the_same_and_times_each_block_pass(one_rank_group):
    """Losses bitwise equal to unprobed steps (the probe only reads the clock and waits for the
    device); a gap per consecutive block in each pass, at most NUM_INTERVALS of them used; the
    hooks gone afterwards; a recompute under full checkpointing is not timed again."""
    for checkpointing in ("none", "full"):
        config = default_config(load_model_profile("tiny").unit_names, num_microbatches=2)
        config = config_to_dict(config)
        for unit in config["units"][:-1]:
            unit["activation_checkpointing"] = checkpointing
        plain = build_training(0, 1, model="tiny", config=config)
        expected = [plain.step(s) for s in range(3)]
        probed = build_training(0, 1, model="tiny", config=config)
        synced: list[str] = []
        hooks = [(len(b._forward_pre_hooks), len(b._forward_hooks)) for b in HostProbe(probed.model, print).blocks]
        with HostProbe(probed.model, functools.partial(synced.append, "sync")) as probe:
            losses = [probed.step(0), probed.step(1, probe=probe)]
        losses.append(probed.step(2))
        assert losses == expected, checkpointing
        num_blocks = len(probe.blocks)
        assert num_blocks == 4 and synced == ["sync", "sync"]  # before the first forward and its backward
        assert len(probe.forward_times) == len(probe.backward_times) == num_blocks, checkpointing
        result = probe.get_result()
        assert result is not None and result["block_forward"] > 0 and result["block_backward"] > 0
        assert [(len(b._forward_pre_hooks), len(b._forward_hooks)) for b in probe.blocks] == hooks  # FSDP2's only
    assert NUM_INTERVALS >= 2


def test_probe_host_path_returns_the_step_s_loss(one_rank_group):
    config = config_to_dict(default_config(load_model_profile("tiny").unit_names))
    expected = build_training(0, 1, model="tiny", config=config).step(0)
    loss, timed = probe_host_path(build_training(0, 1, model="tiny", config=config), 0, CPU)
    assert loss == expected and set(timed) == {"block_forward", "block_backward"}


def test_a_model_without_repeated_blocks_is_not_timed():
    probe = HostProbe(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), lambda: None)
    with probe:
        probe.before_forward()
    assert probe.blocks == [] and probe.get_result() is None
