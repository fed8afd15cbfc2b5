"""Guards that keep a real training job from going wrong without a sound.

An optimizer step before the accumulation cycle's last microbatch raises where a unit skipped
its reduction, all-reduce or reshard ([Note: an optimizer step mid-cycle] in
:mod:`fsdp_runtime.accumulation`); a model built on the meta device is applied with no device
type; a config measured at another world size warns; ``adopt_fsdp`` reads FSDP2's own
data-parallel mesh and refuses tensor parallelism. One rank in-process for the edges; the
README's loops as written on 2 gloo ranks (FSDP) and 4 (HSDP 2 x 2, FSDP+TP), one launch each.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import warnings

import pytest
import torch
import torch.distributed as dist
from _guard_programs import get_readme_block
from _required import skip_unless_required

from fsdp_runtime import (
    ConfigError,
    GradAccumulator,
    MeshConfig,
    Provenance,
    RuntimeConfig,
    adopt_fsdp,
    apply_fsdp,
    config_to_dict,
    default_config,
    save_config,
)
from fsdp_runtime.accumulation import AccumulationError
from fsdp_runtime.apply import WorldSizeWarning, get_default_device_type
from profiles import build_model, load_model_profile

pytestmark = pytest.mark.torch_matrix

BLOCKS = [f"layers.{i}" for i in range(4)]


def _config(*, mesh: MeshConfig | None = None, world_size: int | None = None, **unit: object) -> RuntimeConfig:
    """Two microbatches, every unit as ``unit`` says."""
    config = default_config(BLOCKS, num_microbatches=2, provenance=Provenance(world_size=world_size))
    units = [dataclasses.replace(u, **unit) for u in config.units]
    return dataclasses.replace(config, units=units, mesh=mesh or MeshConfig())


def _one_microbatch_then_step(config: RuntimeConfig, *, other_optimizer: bool = False) -> None:
    """Microbatch 0 of 2 of the tiny Llama, then an optimizer step (over another model's
    parameters where ``other_optimizer``)."""
    applied = apply_fsdp(build_model(load_model_profile("tiny"), seed=0), config)
    params = [torch.nn.Parameter(torch.zeros(2))] if other_optimizer else applied.model.parameters()
    optimizer = torch.optim.SGD(params, lr=0.1)
    accumulator = GradAccumulator(applied)
    with accumulator.microbatch(0):
        applied.model(torch.zeros(1, 8, dtype=torch.long)).float().mean().backward()
    optimizer.step()


def test_a_step_before_the_last_microbatch_raises_only_where_a_unit_skipped_something(one_rank_group):
    with pytest.raises(
        AccumulationError,
        match=r"^GradAccumulator: optimizer step after microbatch 1 of 2: units with sync='last' \(layers\.0, "
        r"layers\.1, layers\.2 and 2 more\) have not reduced their gradients; run every microbatch before the "
        r"step, or GradAccumulator\(applied, num_microbatches=1\)$",
    ):
        _one_microbatch_then_step(_config(sync="last"))
    with pytest.raises(AccumulationError, match=r"reshard_after_backward=false \(layers\.0, .*\) are still unsharded"):
        _one_microbatch_then_step(_config(reshard_after_backward=False))
    _one_microbatch_then_step(_config())  # every unit syncs and reshards every microbatch: nothing is skipped
    _one_microbatch_then_step(_config(sync="last"), other_optimizer=True)  # not this model's optimizer


def test_the_step_hook_goes_with_its_accumulator(one_rank_group):
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    before = len(_global_optimizer_pre_hooks)
    accumulator = GradAccumulator(apply_fsdp(build_model(load_model_profile("tiny"), seed=0), _config(sync="last")))
    assert len(_global_optimizer_pre_hooks) == before + 1
    accumulator.set_microbatch(0)
    optimizer = torch.optim.SGD(accumulator.applied.model.parameters(), lr=0.1)
    del accumulator
    gc.collect()
    assert len(_global_optimizer_pre_hooks) == before
    optimizer.step()  # mid-cycle when it went: nothing left to raise


@pytest.mark.parametrize(
    ("backend", "config", "device"),
    [
        ("gloo", None, "cpu"),
        ("nccl", None, "cuda"),
        ("xccl", None, "xpu"),
        ("cpu:gloo,cuda:nccl", None, "cuda"),
        ("undefined", "cpu:gloo,cuda:nccl", "cuda"),
        ("undefined", "cpu:gloo", "cpu"),
    ],
)
def test_the_device_type_of_a_meta_model_is_the_process_group_s(monkeypatch, backend, config, device):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: dist.Backend(backend))
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    assert get_default_device_type() == device


def test_a_backend_of_no_known_device_is_one_line(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "custom")
    with pytest.raises(ConfigError, match=r"^device_type: the default process group's backend 'custom' names no "):
        get_default_device_type()


def test_a_meta_model_is_applied_on_the_group_s_device_and_a_passed_mesh_s(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh

    meta = _meta_tiny()
    applied = apply_fsdp(meta, _config())
    assert applied.mesh.device_type == "cpu" and {p.device.type for p in meta.parameters()} == {"meta"}
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    assert apply_fsdp(_meta_tiny(), _config(), mesh=mesh).mesh is mesh


def _meta_tiny() -> torch.nn.Module:
    from autotune.trials.training import resolve_profile

    return resolve_profile("tiny").build(device="meta", seed=0)


def test_another_world_size_warns_in_one_line_at_the_caller_of_apply_and_adopt(one_rank_group):
    with pytest.warns(WorldSizeWarning) as caught:
        applied = apply_fsdp(build_model(load_model_profile("tiny"), seed=0), _config(world_size=2))
    (warning,) = caught
    assert str(warning.message) == (
        "this config was measured at world size 2 and is applied at world size 1: its knobs were chosen for 2 "
        "ranks (search at 1 for knobs measured there)"
    )
    assert warning.filename == __file__
    with pytest.warns(WorldSizeWarning, match=r"^this config was measured at world size 2 and") as caught:
        adopt_fsdp(applied.model, _config(world_size=2))
    assert [w.filename for w in caught] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_fsdp(build_model(load_model_profile("tiny"), seed=0), _config(world_size=1))
        apply_fsdp(build_model(load_model_profile("tiny"), seed=0), _config())  # no world size: no warning
    with pytest.raises(ConfigError, match=r"does not multiply to the world size 1"):  # still refused, as before
        apply_fsdp(build_model(load_model_profile("tiny"), seed=0), _config(mesh=MeshConfig(kind="hsdp", replicate=2)))


def test_a_data_parallel_mesh_the_schema_cannot_state_is_refused(one_rank_group, monkeypatch):
    """FSDP2's replicate (a replicate dim, no shard dim) and units over different meshes: one line
    each, never a mesh written for them (the meshes FSDP2 holds stood in for on one rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fsdp_runtime.adopt

    model = build_model(load_model_profile("tiny"), seed=0)
    for block in BLOCKS:
        fully_shard(model.get_submodule(block))
    fully_shard(model)
    shard = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    other = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    monkeypatch.setattr(fsdp_runtime.adopt, "get_dp_meshes", lambda module: [(shard, None, 0)])
    with pytest.raises(ConfigError, match=r"^mesh: the model is replicated over a \(1,\) \('shard',\) mesh without "):
        adopt_fsdp(model, default_config(BLOCKS))
    monkeypatch.setattr(
        fsdp_runtime.adopt, "get_dp_meshes", lambda module: [(other if module is model.layers[0] else shard, 0, None)]
    )
    with pytest.raises(
        ConfigError,
        match=r"^mesh: the model's units are sharded over different meshes: \(1,\) \('dp',\), \(1,\) \('shard',\)$",
    ):
        adopt_fsdp(model, default_config(BLOCKS))


def _apply_line() -> int:
    """The README plain loop's line that calls ``apply_fsdp`` (1-based, in the block)."""
    return next(
        i for i, line in enumerate(get_readme_block("plain loop example").splitlines(), 1) if "apply_fsdp(" in line
    )


@pytest.mark.multirank
def test_the_readme_loop_with_too_few_microbatches_raises_at_the_step_and_the_right_count_trains(pool2, tmp_path):
    """2 ranks, ``sync = "last"`` over 2 microbatches: one microbatch per step raises at
    ``optimizer.step()`` before anything changed; both microbatches, or one with the accumulator
    told so, change every parameter. And the Llama built on the meta device trains bitwise as the
    CPU build: the same values, sharded, and the same order of sums."""
    path = save_config(_config(sync="last", world_size=2), tmp_path / "last.toml")
    run = pool2.run("_guard_programs:run_plain_loops", {"config_path": str(path)}, timeout_s=120)
    assert run.ok, f"{run.status}: {run.reason}\n{run.stderr_tails}"
    for rank in run.results:
        assert rank["one"]["error"].startswith(
            "GradAccumulator: optimizer step after microbatch 1 of 2: units with sync='last' (layers.0, "
        )
        assert not any(rank["one"]["changed"].values())
        for trained in (rank["two"], rank["one_told"]):
            assert trained["error"] is None and trained["warnings"] == [] and all(trained["changed"].values())
    meta = {"model": "tiny", "config": config_to_dict(_config()), "num_steps": 3}
    run = pool2.run("_guard_programs:train_meta_built", meta, timeout_s=120)
    assert run.ok, f"{run.status}: {run.reason}\n{run.stderr_tails}"
    for rank in run.results:
        assert rank["meta"] == rank["full"] and (rank["mesh_device"], rank["devices"]) == ("cpu", ["cpu"])


@pytest.mark.multirank
def test_hsdp_replica_last_the_world_size_warning_and_tp_on_four_ranks(pool4, tmp_path):
    """4 ranks, one launch. HSDP 2 x 2 with ``replica_last``: one microbatch per step raises
    naming the replica all-reduce; the right count keeps the replicas of each shard equal. The
    config, measured at world 2, warns once at the README's ``apply_fsdp`` line and at
    ``adopt_fsdp``'s caller. FSDP+TP (``dp`` x ``tp``) is refused in one line, never read as
    HSDP; HSDP adopts as HSDP."""
    hsdp = MeshConfig(kind="hsdp", replicate=2)
    path = save_config(_config(sync="replica_last", mesh=hsdp, world_size=2), tmp_path / "hsdp.toml")
    run = pool4.run("_guard_programs:run_hsdp_guards", {"config_path": str(path)}, timeout_s=150)
    assert run.ok, f"{run.status}: {run.reason}\n{run.stderr_tails}"
    warned = (
        "this config was measured at world size 2 and is applied at world size 4: its knobs were chosen for 2 ranks"
    )
    for rank in run.results:
        one, two, adopt = rank["one"], rank["two"], rank["adopt"]
        assert one["error"].startswith(
            "GradAccumulator: optimizer step after microbatch 1 of 2: units with sync='replica_last' (layers.0, "
        )
        assert "have not all-reduced their gradients across replicas" in one["error"]
        assert two["error"] is None and all(two["changed"].values())
        for loop in (one, two):
            ((message, filename, line),) = loop["warnings"]
            assert (
                message.startswith(warned) and "\n" not in message and (filename, line) == ("README.md", _apply_line())
            )
        assert adopt["tp_described"] is None and "\n" not in adopt["tp_refused"]
        assert adopt["tp_refused"] == (
            "mesh: the model's parameters lie on a (2, 2) ('dp', 'tp') mesh, of which FSDP2 shards over the (2,) "
            "('dp',) part: the other dims (tensor or expert parallelism) have no field in the config schema "
            "(adopt a model sharded with fully_shard alone (FSDP or HSDP))"
        )
        assert adopt["hsdp"] == ("hsdp", 2, 2)
        ((message, filename),) = adopt["warnings"]
        assert message.startswith(warned) and filename == "_guard_programs.py"
    shards = [rank["two"]["shard_sums"] for rank in run.results]  # mesh [[0, 1], [2, 3]]: ranks 0, 2 hold shard 0
    assert shards[0] == shards[2] and shards[1] == shards[3] and shards[0] != shards[1]


@pytest.mark.multirank
def test_the_readme_torchtitan_block_on_a_meta_built_model_trains_as_on_a_cpu_built_one(pool2, tmp_path):
    """torchtitan's way for a model too large for one device: built on meta, sharded by the README's
    block (no device type given), ``to_empty``, initialised, the CPU build's values loaded; its
    losses are the CPU-built model's bitwise (the same values and the same order of sums)."""
    if importlib.util.find_spec("torchtitan") is None:
        skip_unless_required("torchtitan is not installed: pip install 'fsdp-autotune[torchtitan]' (./dev installs it)")
    from fsdp_runtime import get_torchtitan_config
    from profiles import load_model_source

    short = tmp_path / "debugmodel.toml"
    short.write_text(
        'name = "debugmodel-short"\nfactory = "torchtitan:llama3/debugmodel"\nseq_len = 32\nbatch_size = 1\n'
    )
    recipe = get_torchtitan_config(
        load_model_source(str(short)).build(device="meta"), RuntimeConfig(num_microbatches=2)
    )
    path = save_config(recipe, tmp_path / "recipe.toml")
    run = pool2.run(
        "_guard_programs:run_torchtitan_readme_on_meta", {"model": str(short), "config_path": str(path)}, timeout_s=150
    )
    assert run.ok, f"{run.status}: {run.reason}\n{run.stderr_tails}"
    for rank in run.results:
        assert rank["meta"] == rank["cpu"] and len(rank["cpu"]) == 2
