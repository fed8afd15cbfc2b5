"""Config schema: lossless TOML/JSON round trips, old-version fixtures, precise errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fsdp_runtime import (
    SCHEMA_VERSION,
    ConfigError,
    MeshConfig,
    MixedPrecisionConfig,
    PipelineConfig,
    Provenance,
    RuntimeConfig,
    UnitConfig,
    config_to_dict,
    default_config,
    dumps_config,
    load_config,
    loads_config,
    save_config,
    validate_config,
    validate_for_world,
)

pytestmark = pytest.mark.torch_matrix

DATA = Path(__file__).parents[1] / "data" / "configs"
BLOCKS = [f"layers.{i}" for i in range(4)]


def _rich_config() -> RuntimeConfig:
    """Every field away from its default, including None vs [] and bool vs int."""
    config = default_config(BLOCKS, num_microbatches=4)
    units = [
        dataclasses.replace(
            config.units[0], reshard_after_forward=2, forward_prefetch=["layers.1", "layers.2"], backward_prefetch=[]
        ),
        dataclasses.replace(config.units[1], reshard_after_forward=False, sync="replica_last"),
        dataclasses.replace(
            config.units[2],
            sync="last",
            defer_concat=False,
            reshard_after_backward=False,
            activation_checkpointing="selective",
        ),
        dataclasses.replace(
            config.units[3],
            name="layers.3-4",
            modules=["layers.3", "layers.4"],
            reshard_after_forward=True,
            backward_prefetch=["layers.2"],
            activation_checkpointing="full",
        ),
        config.units[4],
    ]
    return dataclasses.replace(
        config,
        units=units,
        mesh=MeshConfig(kind="hsdp", replicate=2, shard=4, pp=2),
        pipeline=PipelineConfig(schedule="interleaved_1f1b", virtual_stages=2, blocks_per_stage=[1, 2, 1, 1]),
        mixed_precision=MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32"),
        unshard_async="on",
        reduce_scatter_max_input_buffers=2,
        provenance=Provenance(
            produced_by="autotune 0.1.0 search",
            model="llama8b",
            proxy_model="llama8b@dim256",
            world_size=8,
            measured=True,
            notes=['times are the proxy\'s "not" llama8b'],
            metrics={"speedup_vs_default": 1.25},
        ),
    )


@pytest.mark.parametrize("fmt", ["toml", "json"])
def test_round_trip_is_lossless(fmt, tmp_path):
    config = _rich_config()
    assert loads_config(dumps_config(config, fmt), fmt) == config
    path = save_config(config, tmp_path / f"cfg.{fmt}")
    loaded = load_config(path)
    assert loaded == config
    assert loaded.units[0].reshard_after_forward == 2 and loaded.units[3].reshard_after_forward is True
    assert loaded.units[0].backward_prefetch == [] and loaded.units[1].forward_prefetch is None
    assert loaded.units[3].modules == ["layers.3", "layers.4"] and loaded.units[0].modules is None
    assert [u.activation_checkpointing for u in loaded.units] == ["none", "none", "selective", "full", "none"]


def test_toml_and_json_agree(tmp_path):
    config = _rich_config()
    assert load_config(save_config(config, tmp_path / "a.toml")) == load_config(
        save_config(config, tmp_path / "a.json")
    )


def test_version_1_fixtures_still_load():
    """Configs written by released versions stay readable (see tests/data/configs): a v1 file
    reads as the current version, the fields v2 added at their defaults."""
    toml_v1 = load_config(DATA / "v1_example.toml")
    json_v1 = load_config(DATA / "v1_example.json")
    assert toml_v1 == json_v1
    assert SCHEMA_VERSION == 4 and toml_v1.schema_version == SCHEMA_VERSION
    assert toml_v1.get_unit("layers.0").forward_prefetch == ["layers.1"]
    assert toml_v1.get_unit("layers.1").sync == "last"
    assert all(u.modules is None and u.activation_checkpointing == "none" for u in toml_v1.units)


def test_configs_without_schema_2_fields_are_written_as_version_1(tmp_path):
    """Old readers keep reading what does not use the new fields; what does, they refuse."""
    plain = default_config(BLOCKS, num_microbatches=2)
    data = config_to_dict(plain)
    assert data["schema_version"] == 1 and all(
        set(u) == {f.name for f in dataclasses.fields(UnitConfig)} - {"modules", "activation_checkpointing"}
        for u in data["units"]
    )
    assert load_config(save_config(plain, tmp_path / "plain.toml")) == plain
    for unit in (
        dataclasses.replace(plain.units[0], activation_checkpointing="full"),
        dataclasses.replace(plain.units[0], name="layers.0+", modules=["layers.0"]),
    ):
        config = dataclasses.replace(plain, units=[unit, *plain.units[1:]])
        assert config_to_dict(config)["schema_version"] == 2
        assert load_config(save_config(config, tmp_path / "v2.json")) == config


def test_configs_without_pipeline_stages_are_written_as_version_2_at_most(tmp_path):
    """A config with mesh.pp = 1 stays readable by a version-2 reader; one with stages is version 3."""
    plain = dataclasses.replace(
        default_config(BLOCKS, num_microbatches=2),
        units=[dataclasses.replace(UnitConfig(name="layers.0"), activation_checkpointing="full")]
        + [UnitConfig(name=n) for n in BLOCKS[1:] + ["root"]],
    )
    data = config_to_dict(plain)
    assert data["schema_version"] == 2 and "pipeline" not in data and "pp" not in data["mesh"]
    staged = dataclasses.replace(plain, mesh=MeshConfig(pp=2), pipeline=PipelineConfig(schedule="gpipe"))
    data = config_to_dict(staged)
    assert data["schema_version"] == 3 and data["mesh"]["pp"] == 2 and data["pipeline"]["schedule"] == "gpipe"
    assert load_config(save_config(staged, tmp_path / "v3.toml")) == staged


def test_version_3_fixtures_load():
    toml_v3 = load_config(DATA / "v3_example.toml")
    assert toml_v3 == load_config(DATA / "v3_example.json")
    assert toml_v3.mesh.pp == 2 and toml_v3.mesh.get_shape(8) == (2, 2)
    assert toml_v3.pipeline == PipelineConfig(
        schedule="interleaved_1f1b", virtual_stages=2, blocks_per_stage=[1, 1, 1, 1]
    )


@pytest.mark.parametrize(
    ("mesh", "pipeline", "microbatches", "message"),
    [
        (MeshConfig(pp=0), PipelineConfig(), 1, r"mesh\.pp: must be >= 1, got 0"),
        (MeshConfig(), PipelineConfig(schedule="gpipe"), 1, r"pipeline: is set but mesh\.pp is 1"),
        (
            MeshConfig(pp=2),
            PipelineConfig(schedule="interleaved_1f1b"),
            2,
            r"pipeline\.virtual_stages: schedule 'interleaved_1f1b' needs >= 2",
        ),
        (
            MeshConfig(pp=2),
            PipelineConfig(virtual_stages=2),
            2,
            r"pipeline\.virtual_stages: schedule '1f1b' holds one stage",
        ),
        (
            MeshConfig(pp=2),
            PipelineConfig(blocks_per_stage=[4]),
            2,
            r"pipeline\.blocks_per_stage: has 1 entries for 2 stages",
        ),
        (
            MeshConfig(pp=2),
            PipelineConfig(blocks_per_stage=[4, 0]),
            2,
            r"pipeline\.blocks_per_stage\[1\]: must be >= 1, got 0",
        ),
        (
            MeshConfig(pp=4),
            PipelineConfig(),
            2,
            r"num_microbatches: 2 is fewer than the 4 stages, which schedule '1f1b' needs",
        ),
        (
            MeshConfig(pp=2),
            PipelineConfig(schedule="interleaved_1f1b", virtual_stages=2),
            3,
            r"num_microbatches: 3 is not a multiple of mesh\.pp = 2",
        ),
    ],
)
def test_pipeline_fields_are_checked(mesh, pipeline, microbatches, message):
    config = dataclasses.replace(default_config(BLOCKS), mesh=mesh, pipeline=pipeline, num_microbatches=microbatches)
    with pytest.raises(ConfigError, match=message):
        validate_config(config)


def test_pipeline_degree_must_divide_the_world():
    config = dataclasses.replace(default_config(BLOCKS), mesh=MeshConfig(pp=3))
    with pytest.raises(ConfigError, match=r"mesh\.pp: 3 does not divide the world size 4"):
        validate_for_world(config, 4)
    staged = dataclasses.replace(config, mesh=MeshConfig(pp=2, kind="hsdp", replicate=2))
    assert validate_for_world(staged, 8) == (2, 2)
    with pytest.raises(
        ConfigError, match=r"mesh: pp x replicate x shard = 2 x 2 x 3 does not multiply to the world size 8"
    ):
        validate_for_world(dataclasses.replace(staged, mesh=MeshConfig(pp=2, kind="hsdp", replicate=2, shard=3)), 8)


def test_version_2_fixtures_load():
    toml_v2 = load_config(DATA / "v2_example.toml")
    assert toml_v2 == load_config(DATA / "v2_example.json")
    assert toml_v2.get_unit("layers.0-1").get_modules() == ["layers.0", "layers.1"]
    assert toml_v2.get_unit("layers.0-1").activation_checkpointing == "selective"
    assert toml_v2.get_unit("layers.2").activation_checkpointing == "full" and toml_v2.get_unit(
        "layers.2"
    ).get_modules() == ["layers.2"]
    assert toml_v2.get_unit("norm+output").modules == ["norm", "output"]
    assert toml_v2.get_unit("root").sync == "last"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda d: d["units"][0].update(forward_prefetch=["layers.9"]),
            r"units\[0\]\.forward_prefetch\[0\]: unit 'layers.9' does not exist \(known units: layers.0, layers.1, layers.2, layers.3, root\)",
        ),
        (
            lambda d: d["units"][1].update(backward_prefetch=["layers.1"]),
            r"units\[1\]\.backward_prefetch\[0\]: unit 'layers.1' prefetches itself",
        ),
        (
            lambda d: d["units"][1].update(backward_prefetch=["root"]),
            r"units\[1\]\.backward_prefetch\[0\]: the root unit cannot be prefetched",
        ),
        (
            lambda d: d["units"][2].update(sync="replica_last"),
            r"units\[2\]\.sync: 'replica_last' needs an HSDP mesh \(set mesh.kind = 'hsdp'",
        ),
        (
            lambda d: d["units"][2].update(sync="sometimes"),
            r"units\[2\]\.sync: 'sometimes' is not one of 'every', 'replica_last', 'last'",
        ),
        (
            lambda d: d["units"][0].update(defer_concat=False),
            r"units\[0\]\.defer_concat: false only applies with sync = 'last'",
        ),
        (
            lambda d: d["units"][0].update(reshard_after_forward=1),
            r"units\[0\]\.reshard_after_forward: integer value must be >= 2",
        ),
        (
            lambda d: d["units"][0].update(reshard_after_forward="yes"),
            r"units\[0\]\.reshard_after_forward: expected bool or int or nothing, got 'yes'",
        ),
        (
            lambda d: d["units"][0].update(forwad_prefetch=[]),
            r"units\[0\]\.forwad_prefetch: unknown field \(known fields: name, modules, reshard_after_forward, forward_prefetch",
        ),
        (lambda d: d["units"].append({"name": "layers.0"}), r"units\[5\]\.name: unit 'layers.0' is listed twice"),
        (lambda d: d["units"].append({"sync": "every"}), r"units\[5\]\.name: is required"),
        (lambda d: d["mesh"].update(replicate=2), r"mesh\.replicate: is 2 but mesh.kind is 'fsdp'"),
        (lambda d: d.update(num_microbatches=0), r"num_microbatches: must be >= 1, got 0"),
        (lambda d: d.update(num_microbatches=True), r"num_microbatches: expected an integer, got True"),
        (
            lambda d: d["mixed_precision"].update(param_dtype="fp8"),
            r"mixed_precision\.param_dtype: unknown dtype 'fp8'",
        ),
        # What a v2 file gets from a v1 reader (the same check, one version up).
        (
            lambda d: d.update(schema_version=SCHEMA_VERSION + 1),
            r"schema_version: 5 is newer than this fsdp-autotune understands \(4\) \(upgrade fsdp-autotune\)",
        ),
        (lambda d: d.update(schema_version=0), r"schema_version: 0 was never a schema version"),
        (lambda d: d.pop("schema_version"), r"schema_version: is missing \(add schema_version = 4\)"),
        (
            lambda d: d["units"][2].update(activation_checkpointing="partial"),
            r"units\[2\]\.activation_checkpointing: 'partial' is not one of 'none', 'selective', 'full'",
        ),
        (
            lambda d: d["units"][4].update(activation_checkpointing="full"),
            r"units\[4\]\.activation_checkpointing: the root unit cannot be checkpointed",
        ),
        (
            lambda d: d["units"][4].update(modules=["layers.0"]),
            r"units\[4\]\.modules: the root unit is the model itself and takes no module list",
        ),
        (lambda d: d["units"][0].update(modules=[]), r"units\[0\]\.modules: is empty"),
        (
            lambda d: d["units"][0].update(modules="layers.0"),
            r"units\[0\]\.modules: expected a list or nothing, got 'layers.0'",
        ),
        (
            lambda d: d["units"][0].update(name="layers.0-1", modules=["layers.0", "layers.1"]),
            r"units\[1\]\.name: module 'layers.1' is already in units\[0\]",
        ),
        (
            lambda d: d["units"][0].update(modules=["layers.0", "layers.0.attention"]),
            r"units\[0\]\.modules\[0\]: 'layers.0.attention' is inside 'layers.0' in the same unit",
        ),
        (
            lambda d: d["units"][0].update(modules=["layers.0", "layers.0"]),
            r"units\[0\]\.modules\[1\]: lists module 'layers.0' twice",
        ),
        (
            lambda d: d["units"].insert(0, {"name": "layers", "activation_checkpointing": "full"}),
            r"units\[0\]\.activation_checkpointing: the unit holds units\[1\] \('layers.0'\); checkpointing around another unit is not supported",
        ),
    ],
)
def test_invalid_configs_name_the_field(mutate, message):
    data = config_to_dict(default_config(BLOCKS))
    mutate(data)
    with pytest.raises(ConfigError, match=message):
        loads_config(json.dumps(data), "json", source="cfg.json")


def test_errors_carry_the_source_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("schema_version = 1\nnum_microbatches = -1\n")
    with pytest.raises(ConfigError, match=r"^.*bad\.toml: num_microbatches: must be >= 1, got -1$"):
        load_config(path)
    path.write_text("schema_version = [\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: not valid TOML"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"unknown config format '\.yaml'"):
        load_config(tmp_path / "x.yaml")
    with pytest.raises(ConfigError, match=r"cannot read config"):
        load_config(tmp_path / "missing.toml")


def test_world_size_checks():
    config = RuntimeConfig(mesh=MeshConfig(kind="hsdp", replicate=2, shard=2))
    assert validate_for_world(config, 4) == (2, 2)
    with pytest.raises(ConfigError, match=r"mesh: replicate x shard = 2 x 2 does not multiply to the world size 8"):
        validate_for_world(config, 8)
    assert validate_for_world(RuntimeConfig(mesh=MeshConfig(kind="hsdp", replicate=2)), 8) == (2, 4)
    with pytest.raises(
        ConfigError, match=r"units\[0\]\.reshard_after_forward: 3 is not a proper divisor of the shard size 4"
    ):
        validate_for_world(RuntimeConfig(units=[UnitConfig(name="layers.0", reshard_after_forward=3)]), 4)


def test_save_is_atomic_and_refuses_invalid(tmp_path):
    path = save_config(default_config(BLOCKS), tmp_path / "best.toml")
    before = path.read_text()
    bad = dataclasses.replace(default_config(BLOCKS), num_microbatches=0)
    with pytest.raises(ConfigError):
        save_config(bad, path)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.toml"]
