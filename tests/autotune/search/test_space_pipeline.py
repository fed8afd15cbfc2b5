"""The pipeline axis of the search space: degrees, schedules, and block patterns within stages."""

from __future__ import annotations

import optuna
import pytest

from autotune.search import SearchSpace, describe_params
from fsdp_runtime import validate_config, validate_for_world
from fsdp_runtime.blocks import resolve_units
from fsdp_runtime.pipeline import split_stages
from profiles import build_model, load_model_profile

BLOCKS = tuple(f"layers.{i}" for i in range(4))


def _space(**kw) -> SearchSpace:
    return SearchSpace(
        **{
            "block_names": BLOCKS,
            "world_size": 4,
            "num_microbatches": 4,
            "pipeline_degrees": (1, 2, 4),
            "embedding_names": ("tok_embeddings",),
            "head_names": ("norm", "output"),
            **kw,
        }
    )


def test_degrees_divide_the_world_and_the_blocks_and_schedules_fit_the_microbatches():
    assert _space(pipeline_degrees=(1, 2, 3, 4, 8)).get_pp_choices() == [1, 2, 4]
    assert _space().get_schedule_choices(2) == ["gpipe", "1f1b", "interleaved_1f1b"]
    assert _space().get_schedule_choices(4) == ["gpipe", "1f1b"]  # 8 stages would not divide 4 blocks
    assert _space(num_microbatches=2).get_schedule_choices(4) == ["gpipe"]  # 1F1B needs >= 4 microbatches
    assert _space().get_mesh_choices(2) == ["fsdp", "hsdp:2x1"]


def test_without_stages_nothing_changes():
    plain = SearchSpace(block_names=BLOCKS, world_size=4, num_microbatches=4)
    assert plain.get_pp_choices() == [1] and "pp" not in plain.get_default_params()
    config = plain.build_config(plain.get_default_params())
    assert config.mesh.pp == 1 and config.pipeline.schedule == "1f1b" and config.pipeline.virtual_stages == 1


def test_forced_stages_default_to_1f1b_at_the_least_degree():
    space = _space(pipeline_degrees=(2, 4))
    params = space.get_default_params()
    assert params["pp"] == 2 and params["pp2_schedule"] == "1f1b" and params["mesh_pp2"] == "fsdp"
    config = space.build_config(params)
    assert config.mesh.pp == 2 and config.pipeline.schedule == "1f1b" and validate_for_world(config, 4) == (1, 2)


def test_block_patterns_stay_within_each_stage():
    space = _space(grouping=True, root_knobs=True)
    params = {
        **space.get_default_params(),
        "pp": 2,
        "mesh_pp2": "fsdp",
        "pp2_schedule": "1f1b",
        "forward_prefetch": "depth2",
        "backward_prefetch": "depth1",
        "reshard_after_forward": "last_block_false",
        "root_split": "split",
    }
    config = space.build_config(params)
    fwd = {u.name: u.forward_prefetch for u in config.units}
    bwd = {u.name: u.backward_prefetch for u in config.units}
    assert fwd["tok_embeddings"] == ["layers.0", "layers.1"] and fwd["layers.1"] == []
    assert fwd["layers.2"] == ["layers.3", "norm+output"] and bwd["layers.2"] == []
    assert bwd["norm+output"] == ["layers.3"]
    keep = {u.name: u.reshard_after_forward for u in config.units}
    assert keep["layers.1"] is False and keep["layers.3"] is False and keep["layers.0"] is None
    grouped = space.build_config({**params, "blocks_per_unit": 4, "forward_prefetch": "implicit"})
    assert [u.get_modules() for u in grouped.units[:2]] == [["layers.0", "layers.1"], ["layers.2", "layers.3"]]
    interleaved = space.build_config({**params, "pp2_schedule": "interleaved_1f1b", "forward_prefetch": "implicit"})
    assert interleaved.pipeline.virtual_stages == 2 and interleaved.pipeline.schedule == "interleaved_1f1b"
    assert "pp=2" in describe_params(params) and "sched=1f1b" in describe_params(params)


def test_every_sampled_point_splits_the_real_model():
    """Random points of the joint space pass the checks apply_pipeline runs on the model."""
    space = _space(grouping=True, root_knobs=True, checkpointing=True)
    model = build_model(load_model_profile("tiny"), device="meta")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    degrees = set()
    for _ in range(40):
        trial = study.ask()
        config = space.suggest(trial)
        validate_config(config)
        validate_for_world(config, 4)
        if config.mesh.pp > 1:
            split_stages(model, resolve_units(model, config))
        degrees.add((config.mesh.pp, config.pipeline.schedule))
        study.tell(trial, 1.0)
    assert {pp for pp, _ in degrees} == {1, 2, 4}
    assert (2, "interleaved_1f1b") in degrees


@pytest.mark.parametrize("pp", [2, 4])
def test_the_defaults_of_a_forced_degree_apply_to_the_model(pp):
    space = _space(pipeline_degrees=(pp,))
    config = space.build_config(space.get_default_params())
    model = build_model(load_model_profile("tiny"), device="meta")
    split = split_stages(model, resolve_units(model, config))
    assert split.num_stages == pp
