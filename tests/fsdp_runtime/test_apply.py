"""apply_fsdp on a single-rank gloo group: unit resolution, knob wiring, errors."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from _required import skip_unless_required
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdp_runtime import ConfigError, RuntimeConfig, UnitConfig, apply_fsdp, default_config, find_block_names
from fsdp_runtime._fsdp_private import get_param_groups
from profiles import build_model, load_model_profile

pytestmark = pytest.mark.torch_matrix


@pytest.fixture(scope="module", autouse=True)
def single_rank_group():
    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _tiny():
    return build_model(load_model_profile("tiny"), seed=0)


class _HFBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Linear(8, 8)


class _HFInner(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(_HFBlock() for _ in range(3))


class _HFCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = _HFInner()
        self.lm_head = nn.Linear(8, 10)


class _GPT2(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.h = nn.ModuleList(_HFBlock() for _ in range(2))


class _Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.stack = nn.ModuleList(_HFBlock() for _ in range(5))
        self.misc = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])


def test_find_block_names_common_shapes():
    assert find_block_names(_tiny()) == [f"layers.{i}" for i in range(4)]
    assert find_block_names(_HFCausalLM()) == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert find_block_names(_GPT2()) == ["transformer.h.0", "transformer.h.1"]
    assert find_block_names(_Custom()) == [f"stack.{i}" for i in range(5)]
    with pytest.raises(ConfigError, match="no repeated blocks found"):
        find_block_names(nn.Linear(2, 2))


def test_default_units_one_per_block_plus_root():
    applied = apply_fsdp(_tiny(), RuntimeConfig())
    assert applied.config.unit_names == [f"layers.{i}" for i in range(4)] + ["root"]
    assert all(isinstance(m, FSDPModule) for m in applied.units.values())
    assert applied.units["root"] is applied.model


def test_prefetch_lists_async_unshard_and_eager_concat_are_wired():
    config = default_config([f"layers.{i}" for i in range(4)], num_microbatches=2)
    units = []
    for u in config.units:
        if u.name == "layers.0":
            u = dataclasses.replace(u, forward_prefetch=["layers.1", "layers.2"], sync="last", defer_concat=False)
        if u.name == "layers.3":
            u = dataclasses.replace(u, backward_prefetch=["layers.2"])
        units.append(u)
    applied = apply_fsdp(_tiny(), dataclasses.replace(config, units=units))
    state = {name: module._get_fsdp_state() for name, module in applied.units.items()}
    assert state["layers.0"]._states_to_forward_prefetch == [state["layers.1"], state["layers.2"]]
    assert state["layers.3"]._states_to_backward_prefetch == [state["layers.2"]]
    assert state["layers.1"]._states_to_forward_prefetch == []
    # CPU device + unshard_async "auto": all-gathers are asynchronous.
    assert all(g.unshard_async_op for g in get_param_groups(applied.units["layers.1"]))
    assert set(applied.eager_concat) == {"layers.0"}


def test_eager_concat_runs_under_its_own_labels():
    """The simulator's calibration prices FSDP1-style concat from these labels (``FSDP::eager_concat``)."""
    import torch
    from torch.profiler import profile

    from fsdp_runtime import GradAccumulator

    config = default_config([f"layers.{i}" for i in range(4)], num_microbatches=2)
    units = [
        dataclasses.replace(u, sync="last", defer_concat=False) if u.name == "layers.0" else u for u in config.units
    ]
    applied = apply_fsdp(_tiny(), dataclasses.replace(config, units=units))
    accumulator = GradAccumulator(applied)
    tokens = torch.randint(0, load_model_profile("tiny").shape.vocab_size, (1, 8))
    with profile() as prof:
        for m in range(2):
            with accumulator.microbatch(m):
                applied.model(tokens).float().pow(2).mean().backward()
    names = [event.name for event in prof.events()]
    assert names.count("FSDP::eager_concat (layers.0)") == 1 and names.count("FSDP::eager_restore (layers.0)") == 1
    assert not any(name.startswith("FSDP::eager_") and "layers.0" not in name for name in names)
    assert applied.eager_concat["layers.0"].num_eager_concats == 1


def test_unshard_async_off():
    applied = apply_fsdp(_tiny(), dataclasses.replace(RuntimeConfig(), unshard_async="off"))
    assert not any(g.unshard_async_op for g in get_param_groups(applied.units["layers.0"]))


def test_unknown_unit_names_the_field():
    config = RuntimeConfig(units=[UnitConfig(name="layers.9"), UnitConfig(name="root")])
    with pytest.raises(
        ConfigError, match=r"units\[0\]\.name: module 'layers.9' not found in Llama .*layers.0..layers.3"
    ):
        apply_fsdp(_tiny(), config)


def test_a_config_covering_fewer_blocks_than_the_model_is_refused():
    two = default_config(["layers.0", "layers.1"])
    with pytest.raises(
        ConfigError,
        match=r"^units: cover 2 of the 4 blocks of Llama: layers.2, layers.3 would be sharded with the root .*unlisted_blocks = \"root\"",
    ):
        apply_fsdp(_tiny(), two)
    # Said explicitly, the other blocks go with the root.
    applied = apply_fsdp(_tiny(), dataclasses.replace(two, unlisted_blocks="root"))
    assert applied.config.unit_names == ["layers.0", "layers.1", "root"]
    # A unit inside a block, or around all of them, covers it.
    inner = RuntimeConfig(
        units=[UnitConfig(name=f"layers.{i}.attention") for i in range(4)] + [UnitConfig(name="root")]
    )
    assert apply_fsdp(_tiny(), inner).config.unit_names[:4] == [f"layers.{i}.attention" for i in range(4)]


def test_unlisted_blocks_is_written_only_when_set(tmp_path):
    from fsdp_runtime import config_to_dict, load_config, save_config

    assert "unlisted_blocks" not in config_to_dict(
        default_config(["layers.0"])
    )  # old readers still read what does not use it
    partial = dataclasses.replace(default_config(["layers.0"]), unlisted_blocks="root")
    for suffix in ("toml", "json"):
        assert load_config(save_config(partial, tmp_path / f"c.{suffix}")) == partial
    assert 'unlisted_blocks = "root"' in (tmp_path / "c.toml").read_text()


def test_a_same_depth_config_with_other_names_resolves_by_position():
    # Searched on our Llama profile (layers.N), applied to an HF-style model (model.layers.N).
    config = default_config(["layers.0", "layers.1", "layers.2"])
    units = [dataclasses.replace(u, forward_prefetch=["layers.1"]) if u.name == "layers.0" else u for u in config.units]
    with pytest.warns(
        UserWarning,
        match=r"config units layers.0..layers.2 are not modules of _HFCausalLM: resolved by position onto its 3 blocks model.layers.0..model.layers.2",
    ):
        applied = apply_fsdp(_HFCausalLM(), dataclasses.replace(config, units=units))
    assert applied.config.unit_names == ["model.layers.0", "model.layers.1", "model.layers.2", "root"]
    assert applied.config.get_unit("model.layers.0").forward_prefetch == ["model.layers.1"]
    state = {name: module._get_fsdp_state() for name, module in applied.units.items()}
    assert state["model.layers.0"]._states_to_forward_prefetch == [state["model.layers.1"]]
    # Another depth, or names of which some exist, are not guessed.
    with pytest.raises(
        ConfigError,
        match=r"units\[0\]\.name: module 'layers.0' not found .*2 block units for 3 blocks, so none is matched by position",
    ):
        apply_fsdp(_HFCausalLM(), default_config(["layers.0", "layers.1"]))
    with pytest.raises(ConfigError, match=r"units\[1\]\.name: module 'layers.1' not found"):
        apply_fsdp(_HFCausalLM(), default_config(["model.layers.0", "layers.1", "model.layers.2"]))


def test_a_config_applied_to_a_submodule_is_refused():
    model = _HFCausalLM()
    config = default_config(["layers.0", "layers.1", "layers.2"])
    with pytest.raises(
        ConfigError,
        match=r"^units\[3\]: the root unit is _HFInner, a submodule of _HFCausalLM \(it is 'model' there\), whose parameters lm_head.weight, lm_head.bias would be in no unit: their gradients would never be synchronised",
    ):
        apply_fsdp(model.model, config)
    assert not isinstance(model.model, FSDPModule)  # refused before anything was sharded
    model.lm_head.requires_grad_(False)  # frozen parameters need no synchronisation
    assert apply_fsdp(model.model, config).config.unit_names == ["layers.0", "layers.1", "layers.2", "root"]


def test_an_hf_config_applied_to_the_inner_model_is_refused(tmp_path):
    """The mistake this refuses: a config searched on LlamaForCausalLM, applied to ``model.model`` (lm_head left out)."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        skip_unless_required("transformers is not installed: pip install 'fsdp-autotune[hf]'")

    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=32,
        )
    )
    config = default_config(["model.layers.0", "model.layers.1"])
    with (
        pytest.warns(UserWarning, match="resolved by position"),
        pytest.raises(
            ConfigError,
            match=r"submodule of LlamaForCausalLM \(it is 'model' there\), whose parameters lm_head.weight would be in no unit",
        ),
    ):
        apply_fsdp(model.model, config)
    assert apply_fsdp(model, config).config.unit_names == ["model.layers.0", "model.layers.1", "root"]


def test_mesh_must_match_world_size():
    config = RuntimeConfig(mesh=dataclasses.replace(RuntimeConfig().mesh, kind="hsdp", replicate=2, shard=2))
    with pytest.raises(ConfigError, match=r"mesh: replicate x shard = 2 x 2 does not multiply to the world size 1"):
        apply_fsdp(_tiny(), config)


_TORCH_MODULES = (
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "torch.distributed.device_mesh",
    "torch.distributed.pipelining",  # what torch's pipelining loads is torch's, not ours
)
_IMPORT_THEN_LIST = """
import importlib, json, pkgutil, sys
imported = []
for name in {names!r}:
    module = importlib.import_module(name)
    imported.append(name)
    if {walk!r}:
        imported += [importlib.import_module(info.name).__name__ for info in pkgutil.walk_packages(module.__path__, name + ".")]
top_level = {{n.split(".")[0] for n in sys.modules}} - set(sys.stdlib_module_names)
print(json.dumps({{"imported": imported, "non_stdlib": sorted(top_level)}}))
"""


def _import_in_fresh_process(names: tuple[str, ...], *, walk: bool) -> dict[str, list[str]]:
    """Import ``names`` (with ``walk``: and every submodule of each) in a fresh interpreter;
    what it imported and the top-level names of every non-stdlib module then loaded."""
    code = _IMPORT_THEN_LIST.format(names=list(names), walk=walk)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
        env={**os.environ},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fsdp_runtime_imports_with_torch_only():
    """A training script needs torch alone: fsdp_runtime and all its submodules load nothing
    beyond the stdlib, torch, what torch's own distributed stack loads, and fsdp_runtime."""
    torch_loads = set(_import_in_fresh_process(_TORCH_MODULES, walk=False)["non_stdlib"])
    assert "torch" in torch_loads
    runtime = _import_in_fresh_process(("fsdp_runtime",), walk=True)
    assert "fsdp_runtime.serialize" in runtime["imported"] and any(
        n.startswith("fsdp_runtime.consolidate.") for n in runtime["imported"]
    ), runtime["imported"]
    extra = set(runtime["non_stdlib"]) - torch_loads - {"fsdp_runtime"}
    assert not extra, f"fsdp_runtime imports more than torch: {sorted(extra)}"
    # Imports that only run when called (inside functions) are checked in the source.
    allowed = torch_loads | {"fsdp_runtime"} | set(sys.stdlib_module_names)
    static = {f"{path.name}: {name}" for path, name in _imported_top_level_names() if name not in allowed}
    assert not static, f"fsdp_runtime imports more than torch: {sorted(static)}"


def _imported_top_level_names():
    """(file, top-level module name) for every import statement anywhere in fsdp_runtime."""
    import fsdp_runtime

    for path in sorted(Path(fsdp_runtime.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                yield from ((path, alias.name.split(".")[0]) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                yield path, node.module.split(".")[0]


def _grouped_config():
    """Schema 2: two blocks per unit, checkpointing, embeddings and head as units of their own."""
    return RuntimeConfig(
        units=[
            UnitConfig(
                name="layers.0-1",
                modules=["layers.0", "layers.1"],
                activation_checkpointing="full",
                forward_prefetch=["layers.2-3"],
            ),
            UnitConfig(
                name="layers.2-3",
                modules=["layers.2", "layers.3"],
                activation_checkpointing="selective",
                backward_prefetch=["layers.0-1"],
            ),
            UnitConfig(name="tok_embeddings"),
            UnitConfig(name="norm+output", modules=["norm", "output"], reshard_after_forward=False),
            UnitConfig(name="root"),
        ]
    )


def test_grouped_units_are_one_fully_shard_call_with_the_paths_unchanged():
    names = [n for n, _ in _tiny().named_parameters()]
    applied = apply_fsdp(_tiny(), _grouped_config())
    assert [n for n, _ in applied.model.named_parameters()] == names  # no wrapper module in any path
    state = {name: module._get_fsdp_state() for name, module in applied.units.items()}
    modules = dict(applied.model.named_modules())
    assert applied.units["layers.0-1"] is modules["layers.0"]
    assert modules["layers.1"]._get_fsdp_state() is state["layers.0-1"]  # one state, one param group for both blocks
    (group,) = get_param_groups(applied.units["layers.0-1"])
    assert len(group.fsdp_params) == 2 * len(list(modules["layers.0"].parameters()))
    assert state["layers.0-1"]._states_to_forward_prefetch == [state["layers.2-3"]]
    assert state["layers.2-3"]._states_to_backward_prefetch == [state["layers.0-1"]]
    head_params = {id(p.sharded_param) for p in get_param_groups(applied.units["norm+output"])[0].fsdp_params}
    assert head_params == {id(modules["norm"].weight), id(modules["output"].weight)}
    assert not get_param_groups(applied.units["root"])  # nothing is left for the root
    assert sorted(applied.checkpointed) == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert [applied.checkpointed[f"layers.{i}"].kind for i in range(4)] == ["full", "full", "selective", "selective"]


def test_checkpointed_units_recompute_in_backward():
    import torch

    applied = apply_fsdp(_tiny(), _grouped_config())
    tokens = torch.randint(0, 512, (2, 9))
    applied.model(tokens).sum().backward()
    assert [f.num_recomputes for f in applied.checkpointed.values()] == [1, 1, 1, 1]
    # Named at FSDP2's lazy init (first forward): the trace labels of a grouped unit name both modules.
    assert get_param_groups(applied.units["layers.0-1"])[0]._module_fqn == "layers.0, layers.1"
    with torch.no_grad():  # no autograd, nothing to recompute
        applied.model(tokens)
    assert [f.num_forwards for f in applied.checkpointed.values()] == [1, 1, 1, 1]


def test_module_lists_are_checked_against_the_model():
    bad = RuntimeConfig(
        units=[
            UnitConfig(name="layers.0-1", modules=["layers.0", "layers.9"]),
            UnitConfig(name="layers.2"),
            UnitConfig(name="layers.3"),
        ]
    )
    with pytest.raises(
        ConfigError,
        match=r"^units\[0\]\.modules\[1\]: module 'layers.9' not found in Llama .*blocks in this model: layers.0..layers.3",
    ):
        apply_fsdp(_tiny(), bad)
    confusing = RuntimeConfig(
        units=[
            UnitConfig(name="layers.2", modules=["layers.0", "layers.1"]),
            UnitConfig(name="layers.2-3", modules=["layers.2", "layers.3"]),
        ]
    )
    with pytest.raises(
        ConfigError, match=r"^units\[0\]\.name: 'layers.2' is a module of Llama but not one of this unit's modules"
    ):
        apply_fsdp(_tiny(), confusing)
    partial = RuntimeConfig(units=[UnitConfig(name="layers.0-1", modules=["layers.0", "layers.1"])])
    with pytest.raises(
        ConfigError,
        match=r"^units: cover 2 of the 4 blocks of Llama: layers.2, layers.3 would be sharded with the root",
    ):
        apply_fsdp(_tiny(), partial)


def test_grouped_units_resolve_by_position():
    # Searched on our Llama (layers.N, grouped), applied to an HF-style model (model.layers.N).
    config = RuntimeConfig(
        units=[
            UnitConfig(name="layers.0-1", modules=["layers.0", "layers.1"], forward_prefetch=["layers.2"]),
            UnitConfig(name="layers.2"),
            UnitConfig(name="root"),
        ]
    )
    with pytest.warns(UserWarning, match="resolved by position"):
        applied = apply_fsdp(_HFCausalLM(), config)
    assert applied.config.get_unit("layers.0-1").modules == ["model.layers.0", "model.layers.1"]
    assert applied.config.unit_names == ["layers.0-1", "model.layers.2", "root"]
    assert applied.config.get_unit("layers.0-1").forward_prefetch == ["model.layers.2"]


def test_find_edge_modules():
    from fsdp_runtime import find_edge_modules

    assert find_edge_modules(_tiny()) == (["tok_embeddings"], ["norm", "output"])
    assert find_edge_modules(_HFCausalLM()) == (["model.embed_tokens"], ["lm_head"])
    tied = build_model(
        dataclasses.replace(
            load_model_profile("tiny"), shape=dataclasses.replace(load_model_profile("tiny").shape, tie_embeddings=True)
        ),
        seed=0,
    )
    assert find_edge_modules(tied) == ([], [])  # one parameter cannot be in two units
    assert find_edge_modules(_GPT2()) == ([], [])  # no embeddings
