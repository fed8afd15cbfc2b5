"""Stage splits (no ranks): which modules each stage holds, the one-line refusals, and the
stage modules chained reproducing the model's forward bitwise."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fsdp_runtime import ConfigError, MeshConfig, PipelineConfig, RuntimeConfig, UnitConfig, default_config
from fsdp_runtime.pipeline import Passthrough, build_stage_module, get_stage_config, split_stages
from profiles import build_model, load_model_profile

pytestmark = pytest.mark.torch_matrix

BLOCKS = [f"layers.{i}" for i in range(4)]


def _model(**shape) -> torch.nn.Module:
    profile = load_model_profile("tiny")
    if shape:
        profile = dataclasses.replace(profile, shape=dataclasses.replace(profile.shape, **shape))
    return build_model(profile, seed=0)


def _staged(pp: int = 2, schedule: str = "1f1b", virtual_stages: int = 1, split=None, units=None) -> RuntimeConfig:
    config = default_config(BLOCKS, num_microbatches=4)
    return dataclasses.replace(
        config,
        units=units if units is not None else config.units,
        mesh=MeshConfig(pp=pp),
        pipeline=PipelineConfig(schedule=schedule, virtual_stages=virtual_stages, blocks_per_stage=split),
    )


def test_an_even_split_puts_embeddings_first_and_the_head_last():
    split = split_stages(_model(), _staged())
    assert split.blocks == (("layers.0", "layers.1"), ("layers.2", "layers.3"))
    assert split.get_modules(0) == ("layers.0", "layers.1", "tok_embeddings")
    assert split.get_modules(1) == ("layers.2", "layers.3", "norm", "output")
    interleaved = split_stages(_model(), _staged(schedule="interleaved_1f1b", virtual_stages=2))
    assert interleaved.blocks == (("layers.0",), ("layers.1",), ("layers.2",), ("layers.3",))


def test_an_explicit_split_is_used_and_checked_against_the_model():
    assert split_stages(_model(), _staged(split=[3, 1])).blocks == (("layers.0", "layers.1", "layers.2"), ("layers.3",))
    with pytest.raises(ConfigError, match=r"^pipeline\.blocks_per_stage: sums to 5 blocks but the model has 4"):
        split_stages(_model(), _staged(split=[3, 2]))


def test_stages_that_do_not_divide_the_blocks_are_refused_in_one_line():
    with pytest.raises(ConfigError) as error:
        split_stages(_model(num_layers=5), dataclasses.replace(_staged(), units=[]))
    assert "\n" not in str(error.value)
    assert str(error.value).startswith("mesh.pp: 5 blocks do not split evenly into 2 stages")


def test_a_unit_spanning_two_stages_is_refused():
    units = [
        UnitConfig(name="layers.0"),
        UnitConfig(name="layers.1-2", modules=["layers.1", "layers.2"]),
        UnitConfig(name="layers.3"),
        UnitConfig(name="root"),
    ]
    with pytest.raises(
        ConfigError, match=r"^units\[1\]\.modules: spans pipeline stages \(layers\.1 in stage 0, layers\.2 in stage 1\)"
    ):
        split_stages(_model(), _staged(units=units))


def test_a_prefetch_into_another_stage_is_refused():
    config = _staged()
    units = [dataclasses.replace(u, forward_prefetch=["layers.2"]) if u.name == "layers.1" else u for u in config.units]
    with pytest.raises(
        ConfigError, match=r"^units\[1\]\.forward_prefetch\[0\]: 'layers\.2' is in stage 1, 'layers\.1' in stage 0"
    ):
        split_stages(_model(), dataclasses.replace(config, units=units))


def test_tied_embeddings_are_refused():
    with pytest.raises(ConfigError, match=r"^mesh\.pp: Llama ties a parameter of tok_embeddings to .*output"):
        split_stages(_model(tie_embeddings=True), _staged())


def test_each_stage_config_holds_its_units_and_the_root():
    config = _staged()
    units = [
        dataclasses.replace(u, forward_prefetch=["layers.0", "layers.3"]) if u.name == "root" else u
        for u in config.units
    ]
    config = dataclasses.replace(config, units=units)
    split = split_stages(_model(), config)
    first, second = (get_stage_config(split, s, config) for s in (0, 1))
    assert first.unit_names == ["layers.0", "layers.1", "root"] and second.unit_names == [
        "layers.2",
        "layers.3",
        "root",
    ]
    assert first.get_unit("root").forward_prefetch == ["layers.0"]
    assert second.get_unit("root").forward_prefetch == ["layers.3"]
    assert first.mesh.pp == 1 and first.pipeline == PipelineConfig()


def test_stage_modules_chained_are_the_model_bitwise():
    model = _model()
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    want = model(tokens)
    split = split_stages(model, _staged(schedule="interleaved_1f1b", virtual_stages=2))
    stages = [build_stage_module(model, split, s, copy_model=True) for s in range(split.num_stages)]
    assert isinstance(stages[1].tok_embeddings, Passthrough) and isinstance(stages[0].layers[1], Passthrough)
    assert isinstance(stages[3].layers[3], torch.nn.Module) and not isinstance(stages[3].layers[3], Passthrough)
    h = tokens
    for stage in stages:
        h = stage(h)
    assert torch.equal(h, want)
    assert sum(p.numel() for s in stages for p in s.parameters()) == sum(p.numel() for p in model.parameters())
