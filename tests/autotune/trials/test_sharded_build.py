"""A model built sharded (meta device, shard, materialise the shards: [Note: sharded build]) trains
exactly as a full build: losses bitwise on 2 gloo ranks, for FSDP, HSDP and a grouped unit."""

from __future__ import annotations

import dataclasses

import pytest

from fsdp_runtime import MeshConfig, UnitConfig, config_to_dict, default_config
from profiles import load_model_profile

pytestmark = pytest.mark.multirank

BLOCKS = list(load_model_profile("tiny").block_names)


def test_a_sharded_build_trains_as_a_full_build(pool2):
    grouped = [UnitConfig(name="layers.0-1", modules=BLOCKS[:2]), *default_config(BLOCKS[2:]).units]
    configs = {
        "fsdp": default_config(BLOCKS, num_microbatches=2),
        "hsdp": dataclasses.replace(default_config(BLOCKS), mesh=MeshConfig(kind="hsdp", replicate=2)),
        "grouped": dataclasses.replace(default_config(BLOCKS), units=grouped),
    }
    run = pool2.run(
        "_harness:train_full_and_sharded",
        {"model": "tiny", "configs": [config_to_dict(c) for c in configs.values()], "num_steps": 3},
        timeout_s=180,
    )
    assert run.ok, f"{run.status}: {run.reason}\n{run.stderr_tails}"
    for rank_results in run.results:
        for name, result in zip(configs, rank_results, strict=True):
            assert result["sharded"] == result["full"], name
            assert result["sharded_devices"] == ["cpu"], name
            assert (result["full_init_sharded"], result["sharded_init_sharded"]) == (False, True), name
    assert run.results[0][0]["full"] != run.results[1][0]["full"]  # the ranks train on their own data
