"""Search space: the defaults point is FSDP2's defaults; patterns expand to valid per-unit configs."""

from __future__ import annotations

import dataclasses

import optuna
import pytest

from autotune.search import SearchSpace, describe_params
from fsdp_runtime import default_config, validate_config, validate_for_world

BLOCKS = tuple(f"layers.{i}" for i in range(4))


def _space(**kw) -> SearchSpace:
    return SearchSpace(**{"block_names": BLOCKS, "world_size": 4, "num_microbatches": 2, **kw})


def test_defaults_point_is_fsdp2_defaults():
    space = _space()
    config = space.build_config(space.get_default_params())
    expected = dataclasses.replace(default_config(list(BLOCKS), num_microbatches=2), unshard_async="off")
    assert config == expected
    gpu = _space(device_type="cuda")
    assert gpu.build_config(gpu.get_default_params()) == default_config(list(BLOCKS), num_microbatches=2)


def test_mesh_choices_are_every_factorization():
    assert _space().get_mesh_choices() == ["fsdp", "hsdp:2x2", "hsdp:4x1"]
    assert _space(world_size=6).get_mesh_choices() == ["fsdp", "hsdp:2x3", "hsdp:3x2", "hsdp:6x1"]
    assert _space(fixed_mesh="fsdp").get_mesh_choices() == ["fsdp"]


def test_patterns_expand_to_explicit_lists():
    space = _space()
    params = {**space.get_default_params(), "mesh": "hsdp:2x2", "forward_prefetch": "depth2", "backward_prefetch": "paired",
              "nosync_blocks": "every_2nd", "nosync_level_hsdp": "replica_last", "keep_unsharded": True, "reshard_after_forward": "last_block_false"}
    config = space.build_config(params)
    units = {u.name: u for u in config.units}
    assert units["layers.0"].forward_prefetch == ["layers.1", "layers.2"]
    assert units["layers.3"].forward_prefetch == []
    # Backward runs layers.3 first: paired means 3 -> [2, 1], 2 -> [], 1 -> [0], 0 -> [].
    assert [units[f"layers.{i}"].backward_prefetch for i in (3, 2, 1, 0)] == [["layers.2", "layers.1"], [], ["layers.0"], []]
    assert [units[f"layers.{i}"].sync for i in range(4)] == ["replica_last", "every", "replica_last", "every"]
    assert units["layers.0"].reshard_after_backward is False and units["layers.1"].reshard_after_backward is True
    assert [units[f"layers.{i}"].reshard_after_forward for i in range(4)] == [None, None, None, False]
    assert config.mesh.kind == "hsdp" and (config.mesh.replicate, config.mesh.shard) == (2, 2)
    assert units["root"].forward_prefetch is None


def test_int_reshard_is_only_offered_where_it_divides_the_shard():
    space = _space()  # world 4: fsdp shards over 4 ranks, hsdp:2x2 over 2
    base = space.get_default_params()
    assert space.build_config({**base, "reshard_after_forward_shard4": "int:2"}).units[0].reshard_after_forward == 2
    # An int the mesh cannot use is an error, never a silent fall-back onto another point's config.
    with pytest.raises(ValueError, match="proper divisor"):
        space.build_config({**base, "mesh": "hsdp:2x2", "reshard_after_forward": "int:2"})
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    sampled_ints = 0
    for _ in range(80):
        trial = study.ask()
        config = space.suggest(trial)
        if trial.params["mesh"] == "hsdp:2x2":
            assert "reshard_after_forward_shard4" not in trial.params and trial.params["reshard_after_forward"] in ("true", "false", "last_block_false")
        sampled_ints += any(isinstance(u.reshard_after_forward, int) and not isinstance(u.reshard_after_forward, bool) for u in config.units)
        study.tell(trial, 1.0)
    assert sampled_ints > 0, "int reshard never sampled where it is valid"


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_every_sampled_config_is_valid(world_size):
    space = _space(world_size=world_size)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=world_size))
    seen = set()
    for _ in range(60):
        trial = study.ask()
        config = space.suggest(trial)
        validate_config(config)
        validate_for_world(config, world_size)
        assert [u.name for u in config.units] == [*BLOCKS, "root"]
        seen.add(describe_params(trial.params))
        study.tell(trial, 1.0)
    assert len(seen) > 40, "the space is not being explored"


def test_single_microbatch_has_no_sync_knobs():
    space = _space(num_microbatches=1)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(10):
        trial = study.ask()
        assert all(u.sync == "every" for u in space.suggest(trial).units)
        assert "nosync_blocks" not in trial.params
        study.tell(trial, 1.0)
