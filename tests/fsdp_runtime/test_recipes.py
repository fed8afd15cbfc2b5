"""torchtitan's FSDP2 recipe built from a model's structure ([Note: the torchtitan recipe])."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from _required import skip_unless_required

from fsdp_runtime import (
    MixedPrecisionConfig,
    RuntimeConfig,
    apply_fsdp,
    config_to_dict,
    default_config,
    get_torchtitan_config,
    get_torchtitan_units,
)
from profiles import build_model, load_model_profile, load_model_source

pytestmark = pytest.mark.torch_matrix


def _units(model: torch.nn.Module) -> list[tuple[str, list[str] | None, bool | None, str]]:
    return [(u.name, u.modules, u.reshard_after_forward, u.sync) for u in get_torchtitan_units(model)]


def _tiny(*, tied: bool = False) -> torch.nn.Module:
    profile = load_model_profile("tiny")
    return build_model(dataclasses.replace(profile, shape=dataclasses.replace(profile.shape, tie_embeddings=tied)))


def test_llama_debug_model_units_are_torchtitans():
    """torchtitan's llama3 names (tok_embeddings, layers, norm, output): embeddings resharded, the
    norm and the head one unit kept after forward, each block resharded, the root last at its default."""
    model = load_model_source("tiny").build(device="meta")
    assert _units(model) == [
        ("tok_embeddings", None, True, "every"),
        ("layers.0", None, True, "every"),
        ("layers.1", None, True, "every"),
        ("layers.2", None, True, "every"),
        ("layers.3", None, True, "every"),
        ("norm+output", ["norm", "output"], False, "every"),
        ("root", None, None, "every"),
    ]


def test_tied_embeddings_share_one_unit_with_the_head(one_rank_group):
    """torchtitan 0.3.0 groups tok_embeddings, norm and the head when weights are tied; FSDP2 takes it."""
    model = _tiny(tied=True)
    assert model.output.weight is model.tok_embeddings.weight
    assert _units(model)[-2:] == [
        ("tok_embeddings+norm+output", ["tok_embeddings", "norm", "output"], False, "every"),
        ("root", None, None, "every"),
    ]
    applied = apply_fsdp(model, get_torchtitan_config(model))
    assert applied.config.unit_names[0] == "layers.0"
    ids = torch.randint(0, 64, (2, 9))
    model(ids[:, :-1]).float().mean().backward()
    assert model.tok_embeddings.weight.grad is not None


def test_hf_llama_gets_the_recipe_torchtitan_gives_its_own():
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        skip_unless_required("transformers is not installed: pip install 'fsdp-autotune[hf]'")
    shape = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, vocab_size=32)
    with torch.device("meta"):
        untied = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))
        tied = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=True))
    assert _units(untied) == [
        ("model.embed_tokens", None, True, "every"),
        ("model.layers.0", None, True, "every"),
        ("model.layers.1", None, True, "every"),
        ("model.norm+lm_head", ["model.norm", "lm_head"], False, "every"),
        ("root", None, None, "every"),
    ]
    assert _units(tied)[2] == (
        "model.embed_tokens+model.norm+lm_head",
        ["model.embed_tokens", "model.norm", "lm_head"],
        False,
        "every",
    )


def test_the_recipe_keeps_the_base_configs_mesh_precision_and_microbatches():
    model = load_model_source("tiny").build(device="meta")
    base = RuntimeConfig(
        num_microbatches=4,
        unshard_async="off",
        mixed_precision=MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32"),
    )
    config = get_torchtitan_config(model, base)
    assert (config.num_microbatches, config.unshard_async, config.mixed_precision) == (
        4,
        "off",
        base.mixed_precision,
    )
    assert all(u.forward_prefetch is None and u.backward_prefetch is None for u in config.units)
    assert all(u.reshard_after_backward and u.activation_checkpointing == "none" for u in config.units)


def test_apply_fsdp_accepts_the_recipe(one_rank_group):
    """Every unit the recipe names is a module apply_fsdp accepts, and every block is covered."""
    model = _tiny()
    applied = apply_fsdp(model, get_torchtitan_config(model))
    assert applied.config.unit_names == [u.name for u in get_torchtitan_units(model)]


@pytest.mark.multirank
def test_the_recipe_of_a_tied_model_trains_bitwise_as_fsdp2_s_defaults(tmp_path, pool2):
    """2 gloo ranks, 2 microbatches: embeddings, norm and the tied head in one unit keep the sums' order."""
    toml = tmp_path / "tied.toml"
    text = (Path(__file__).resolve().parents[2] / "profiles" / "models" / "tiny.toml").read_text(encoding="utf-8")
    toml.write_text(text.replace('name = "tiny"', 'name = "tiny-tied"') + "tie_embeddings = true\n")
    source = load_model_source(str(toml))
    recipe = get_torchtitan_config(source.build(device="meta"), RuntimeConfig(num_microbatches=2))
    assert recipe.unit_names[-2] == "tok_embeddings+norm+output"
    configs = {"defaults": default_config(source.unit_names, num_microbatches=2), "recipe": recipe}
    losses = {}
    for name, config in configs.items():
        run = pool2.run(
            "_harness:train_losses",
            {"model": str(toml), "config": config_to_dict(config), "num_steps": 2},
            timeout_s=90,
        )
        assert run.ok, run.reason
        losses[name] = run.results
    assert losses["recipe"] == losses["defaults"]
