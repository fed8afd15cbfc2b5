"""``adopt_fsdp``: a model other code sharded, taken over ([Note: adopting a sharded model]).

One rank in-process: what is read from the model (mesh, precision), and each mismatch between
the model's sharding and a config refused by name. That an adopted model trains as a fresh build
of the config (every in-place knob set): tests/fsdp_runtime/test_switch.py; inside torchtitan's
trainer: tests/profiles/test_torchtitan.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdp_runtime import (
    ConfigError,
    MeshConfig,
    MixedPrecisionConfig,
    UnitConfig,
    adopt_fsdp,
    default_config,
)
from profiles import build_model, load_model_profile

pytestmark = pytest.mark.torch_matrix

BLOCKS = [f"layers.{i}" for i in range(load_model_profile("tiny").shape.num_layers)]
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _sharded(*, edges: bool = False, skip: str | None = None, grouped: bool = False):
    """The tiny model sharded by hand, as a trainer's own code would: each block (the first two
    in one call where ``grouped``; ``skip`` left out), the embeddings where ``edges``, the root."""
    model = build_model(load_model_profile("tiny"), seed=0)
    blocks = [b for b in BLOCKS if b != skip]
    if grouped:
        fully_shard([model.get_submodule(b) for b in blocks[:2]], mp_policy=BF16)
        blocks = blocks[2:]
    for block in blocks:
        fully_shard(model.get_submodule(block), mp_policy=BF16)
    if edges:
        fully_shard(model.get_submodule("tok_embeddings"), mp_policy=BF16)
    fully_shard(model, mp_policy=BF16)
    return model


def test_the_mesh_and_the_precision_are_read_from_the_model(one_rank_group):
    applied = adopt_fsdp(_sharded(), default_config(BLOCKS), device_type="cpu")
    assert list(applied.units) == [*BLOCKS, "root"]
    assert applied.config.mesh == MeshConfig() and applied.mesh.ndim == 1
    assert applied.config.mixed_precision == MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")
    stated = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")
    assert (
        adopt_fsdp(
            _sharded(), dataclasses.replace(default_config(BLOCKS), mixed_precision=stated)
        ).config.mixed_precision
        is stated
    )


@pytest.mark.parametrize(
    ("model", "config", "field", "says"),
    [
        ({"edges": True}, default_config(BLOCKS), "units", "tok_embeddings is sharded but in no unit"),
        ({"skip": BLOCKS[1]}, default_config(BLOCKS), "units[1]", f"{BLOCKS[1]} (TransformerBlock) is not sharded"),
        ({}, None, "units[0]", "were sharded by separate fully_shard calls"),
        (
            {"grouped": True},
            default_config(BLOCKS),
            "units[1]",
            f"sharded in one fully_shard call with unit {BLOCKS[0]}",
        ),
        ({}, "precision", "mixed_precision", "the config says"),
        ({}, "bf16-reduce", "mixed_precision", "the config says"),  # reduce None: in bf16, not the model's fp32
        ({}, "two-shards", "mesh", "the model is sharded over a (1,) mesh"),
    ],
)
def test_a_config_that_does_not_describe_the_model_s_sharding_is_refused_by_name(
    one_rank_group, model, config, field, says
):
    if config is None:  # the first two blocks as one unit, sharded apart
        config = dataclasses.replace(
            default_config(BLOCKS),
            units=[UnitConfig(name="pair", modules=BLOCKS[:2]), *default_config(BLOCKS).units[2:]],
        )
    elif config == "precision":
        config = dataclasses.replace(
            default_config(BLOCKS), mixed_precision=MixedPrecisionConfig(param_dtype="float16")
        )
    elif config == "bf16-reduce":
        config = dataclasses.replace(
            default_config(BLOCKS), mixed_precision=MixedPrecisionConfig(param_dtype="bfloat16")
        )
    elif config == "two-shards":
        config = dataclasses.replace(default_config(BLOCKS), mesh=MeshConfig(shard=2))
    with pytest.raises(ConfigError) as caught:
        adopt_fsdp(_sharded(**model), config)
    assert caught.value.field == field and says in str(caught.value)
