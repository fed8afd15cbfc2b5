"""Take over a model that other code sharded (torchtitan's parallelize, a user's own ``fully_shard`` calls).

[Note: adopting a sharded model]
``apply_fsdp`` shards a model itself. A trainer that shards its model with its own
``fully_shard`` calls (torchtitan: ``parallelize_llama`` and its ``apply_fsdp``) would have to be
edited to use it. :func:`adopt_fsdp` instead describes the model already sharded as a runtime
config and returns the same handle, so what works on ``apply_fsdp``'s handle (the in-job tuner,
``switch_config``, ``GradAccumulator``) works on that model unchanged.

What FSDP2 fixed at ``fully_shard`` time is *checked* against the config, never changed:

- the units: each unit's modules are ``FSDPModule`` s, a grouped unit's modules share one FSDP
  state (one ``fully_shard`` call), no two units share one, and no module is sharded that no unit
  names (its parameters would be in a param group the config does not know);
- the mesh, read from FSDP2's own data-parallel mesh of each unit's param groups (its
  ``mesh_info``): a shard dim alone is FSDP, a replicate and a shard dim HSDP
  ``(replicate, shard)``. Not from a parameter's ``DTensor.device_mesh``: with tensor parallelism
  FSDP2 concatenates the data-parallel and TP meshes there, so FSDP+TP would read as HSDP and
  HSDP+TP as something else again. A model whose parameters' mesh spans more ranks than the
  data-parallel one (TP, EP) is refused in one line: the config schema has no field for them;
- the mixed precision, read from each unit's FSDP state (its ``MixedPrecisionPolicy``).

The config's mesh and mixed precision may be left at their defaults: they are then read from the
model, so the handle's config (and a config the tuner writes from it) states what the model
runs. Where the config states them otherwise it is refused. Activation checkpointing cannot be
read back from a model and is taken from the config as it is.

What can be set on a sharded model (:data:`~fsdp_runtime.UNIT_KNOBS_IN_PLACE`,
:data:`~fsdp_runtime.CONFIG_KNOBS_IN_PLACE`) is *set* as the config says, overwriting what the
other code set: from then on the config is the truth about the model.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_runtime._fsdp_private import get_dp_meshes, get_fsdp_state, get_mp_policy
from fsdp_runtime.apply import AppliedFsdp, resolve_units, warn_if_other_world
from fsdp_runtime.config import ROOT_UNIT, MeshConfig, MixedPrecisionConfig, RuntimeConfig
from fsdp_runtime.errors import ConfigError
from fsdp_runtime.switch import set_knobs_in_place
from fsdp_runtime.validation import validate_config, validate_for_world

__all__ = ["adopt_fsdp"]


def adopt_fsdp(model: nn.Module, config: RuntimeConfig, *, device_type: str | None = None) -> AppliedFsdp:
    """The handle :func:`~fsdp_runtime.apply_fsdp` returns, for a ``model`` already sharded by other
    code's ``fully_shard`` calls ([Note: adopting a sharded model]): its units, mesh and precision
    checked against ``config``, every in-place knob of ``config`` set on it. Call between
    optimizer steps (before the first, as a rule); :class:`~fsdp_runtime.ConfigError` names the
    unit or field that does not match the model."""
    validate_config(config)
    if config.mesh.pp > 1:
        raise ConfigError("mesh.pp", "a pipeline's stages cannot be adopted", fix="shard them with apply_pipeline")
    config = resolve_units(model, config)
    units = _get_units(model, config)
    mesh, read = _get_mesh(model, units)
    config = dataclasses.replace(
        config, mesh=_read_mesh(config.mesh, read, mesh), mixed_precision=_read_precision(config, units)
    )
    validate_for_world(config, mesh.size())
    warn_if_other_world(config, dist.get_world_size())
    if device_type is None:
        device_type = mesh.device_type
    applied = AppliedFsdp(model=model, config=config, mesh=mesh, units=units)
    # every method knob this torch can set, FSDP2's own value included: the other code may have set any
    set_knobs_in_place(applied, config, device_type=device_type, every=True)
    return applied


def _get_units(model: nn.Module, config: RuntimeConfig) -> dict[str, FSDPModule]:
    """Each unit's first module, every module of every unit checked as sharded by that unit alone."""
    modules = dict(model.named_modules())
    units: dict[str, FSDPModule] = {}
    states: dict[int, str] = {}
    for i, unit in enumerate(config.units):
        paths = [""] if unit.name == ROOT_UNIT else unit.get_modules()
        for path in paths:
            if not isinstance(modules[path], FSDPModule):
                raise ConfigError(
                    f"units[{i}]",
                    f"{path or 'the root'} ({type(modules[path]).__name__}) is not sharded: the model was sharded "
                    "with other units than the config's",
                    fix="name the modules the model's fully_shard calls were given",
                )
            owner = states.setdefault(id(get_fsdp_state(modules[path])), unit.name)
            if owner != unit.name:
                raise ConfigError(
                    f"units[{i}]", f"{path} was sharded in one fully_shard call with unit {owner}", fix="group them"
                )
        if len({id(get_fsdp_state(modules[p])) for p in paths}) > 1:
            raise ConfigError(f"units[{i}]", f"{', '.join(paths)} were sharded by separate fully_shard calls")
        units[unit.name] = modules[paths[0]]  # type: ignore[assignment]
    named = {path for unit in config.units for path in ([""] if unit.name == ROOT_UNIT else unit.get_modules())}
    stray = [path for path, m in modules.items() if isinstance(m, FSDPModule) and path not in named]
    if stray:
        raise ConfigError("units", f"{stray[0]} is sharded but in no unit of the config", fix="add a unit for it")
    return units


def _get_mesh(model: nn.Module, units: dict[str, FSDPModule]) -> tuple[DeviceMesh, MeshConfig]:
    """FSDP2's data-parallel mesh of every unit (one for all) and what it is; a model whose
    parameters lie on a larger mesh (tensor parallelism) refused ([Note: adopting a sharded model])."""
    meshes = {  # by ranks and dims: one mesh object or equal ones
        (_describe(mesh), tuple(mesh.mesh.flatten().tolist()), shard, replicate): (mesh, shard, replicate)
        for m in units.values()
        for mesh, shard, replicate in get_dp_meshes(m)
    }
    if not meshes:
        raise ConfigError("model", f"{type(model).__name__} has no sharded parameter", fix="use apply_fsdp")
    if len(meshes) > 1:
        raise ConfigError(
            "mesh", f"the model's units are sharded over different meshes: {', '.join(sorted({k[0] for k in meshes}))}"
        )
    mesh, shard, replicate = next(iter(meshes.values()))
    if shard is None:
        raise ConfigError(
            "mesh",
            f"the model is replicated over a {_describe(mesh)} mesh without sharding (FSDP2's replicate)",
            fix="the config schema describes FSDP and HSDP meshes only",
        )
    spmd = next(
        (p.device_mesh for p in model.parameters() if isinstance(p, DTensor) and p.device_mesh.size() > mesh.size()),
        None,
    )
    if spmd is not None:
        raise ConfigError(
            "mesh",
            f"the model's parameters lie on a {_describe(spmd)} mesh, of which FSDP2 shards over the {_describe(mesh)} "
            "part: the other dims (tensor or expert parallelism) have no field in the config schema",
            fix="adopt a model sharded with fully_shard alone (FSDP or HSDP)",
        )
    if replicate is None:
        return mesh, MeshConfig()  # FSDP over all ranks
    return mesh, MeshConfig(kind="hsdp", replicate=mesh.size(replicate), shard=mesh.size(shard))


def _describe(mesh: DeviceMesh) -> str:
    """``(2, 2) ('dp', 'tp')``: the mesh's shape and dim names."""
    names = f" {tuple(mesh.mesh_dim_names)}" if mesh.mesh_dim_names else ""
    return f"{tuple(mesh.mesh.shape)}{names}"


def _read_mesh(stated: MeshConfig, read: MeshConfig, mesh: DeviceMesh) -> MeshConfig:
    """The mesh the model is sharded over; the config's where it states one of that shape."""
    if stated == MeshConfig():
        return read
    if stated.kind != read.kind or stated.get_shape(mesh.size()) != read.get_shape(mesh.size()):
        raise ConfigError("mesh", f"the model is sharded over a {_describe(mesh)} mesh, the config says {stated}")
    return stated


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _read_precision(config: RuntimeConfig, units: dict[str, FSDPModule]) -> MixedPrecisionConfig:
    """The one precision of every unit; the config's where it states the same."""
    policies = [get_mp_policy(module) for module in units.values()]
    read = {(_dtype_name(p.param_dtype), _dtype_name(p.reduce_dtype)) for p in policies}
    if len(read) > 1:
        raise ConfigError("mixed_precision", f"the model's units differ in precision: {sorted(map(str, read))}")
    param, reduce = next(iter(read), (None, None))
    found = MixedPrecisionConfig(param_dtype=param, reduce_dtype=reduce)
    stated = config.mixed_precision
    if stated != MixedPrecisionConfig() and (stated.param_dtype, stated.reduce_dtype or stated.param_dtype) != (
        param,
        reduce or param,
    ):
        raise ConfigError("mixed_precision", f"the model's units run {found}, the config says {stated}")
    return stated if stated != MixedPrecisionConfig() else found
