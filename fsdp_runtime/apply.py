"""Apply a :class:`RuntimeConfig` to a model: ``fully_shard`` per unit and every runtime knob."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from fsdp_runtime._fsdp_private import EagerConcat, set_unshard_async
from fsdp_runtime.config import ROOT_UNIT, RuntimeConfig, UnitConfig, validate_config, validate_for_world
from fsdp_runtime.errors import ConfigError

# Where the repeated blocks of common decoder implementations live.
_BLOCK_CONTAINERS = ("layers", "model.layers", "transformer.h", "model.decoder.layers", "transformer.layers", "h", "blocks")


@dataclass(kw_only=True)
class AppliedFsdp:
    """What ``apply_fsdp`` did: the resolved config, the mesh, and each unit's module."""

    model: nn.Module
    config: RuntimeConfig
    """The config with its units resolved against the model."""
    mesh: DeviceMesh
    units: dict[str, FSDPModule] = field(default_factory=dict)
    eager_concat: dict[str, EagerConcat] = field(default_factory=dict)

    def get_module(self, name: str) -> FSDPModule:
        return self.units[name]


def find_block_names(model: nn.Module) -> list[str]:
    """FQNs of the transformer blocks of a Llama-style decoder (ours, HF, torchtitan, GPT-2)."""
    modules = dict(model.named_modules())
    for path in _BLOCK_CONTAINERS:
        container = modules.get(path)
        if isinstance(container, (nn.ModuleList, nn.ModuleDict)) and len(container) > 0:
            return [f"{path}.{name}" for name, _ in container.named_children()]
    # Fallback: the largest ModuleList whose children all share one class.
    best: tuple[int, str] | None = None
    for path, module in modules.items():
        if isinstance(module, nn.ModuleList) and len(module) > 1 and len({type(c) for c in module}) == 1:
            if best is None or len(module) > best[0]:
                best = (len(module), path)
    if best is None:
        raise ConfigError(
            "units",
            f"no transformer blocks found in {type(model).__name__} (looked for {', '.join(_BLOCK_CONTAINERS)} and any homogeneous ModuleList)",
            fix="list the units explicitly in the config's [[units]] tables",
        )
    path = best[1]
    return [f"{path}.{name}" for name, _ in modules[path].named_children()]


def resolve_units(model: nn.Module, config: RuntimeConfig) -> RuntimeConfig:
    """Fill in default units (one per block + root) and check every unit names a module."""
    if not config.units:
        units = [UnitConfig(name=n) for n in find_block_names(model)] + [UnitConfig(name=ROOT_UNIT)]
        config = dataclasses.replace(config, units=units)
        validate_config(config)
    modules = dict(model.named_modules())
    for i, unit in enumerate(config.units):
        if unit.name != ROOT_UNIT and unit.name not in modules:
            blocks = find_block_names(model)
            hint = f"{blocks[0]}..{blocks[-1]}" if blocks else "none"
            raise ConfigError(f"units[{i}].name", f"module {unit.name!r} not found in {type(model).__name__}", fix=f"blocks in this model: {hint}; the model itself is {ROOT_UNIT!r}")
    if ROOT_UNIT not in config.unit_names:
        config = dataclasses.replace(config, units=[*config.units, UnitConfig(name=ROOT_UNIT)])
    return config


def build_mesh(config: RuntimeConfig, device_type: str) -> DeviceMesh:
    """The 1-D (FSDP) or 2-D ``(replicate, shard)`` (HSDP) mesh over the default group."""
    replicate, shard = validate_for_world(config, dist.get_world_size())
    if config.mesh.kind == "hsdp":
        return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (shard,), mesh_dim_names=("shard",))


def _get_dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def _depth(name: str) -> int:
    return -1 if name == ROOT_UNIT else name.count(".") + 1


def apply_fsdp(model: nn.Module, config: RuntimeConfig, *, mesh: DeviceMesh | None = None, device_type: str | None = None) -> AppliedFsdp:
    """Shard ``model`` in place as ``config`` says and wire every runtime knob.

    Call after ``torch.distributed.init_process_group`` and before building the
    optimizer. Units are sharded innermost first, the root last. Returns the handle that
    :class:`~fsdp_runtime.GradAccumulator` needs.
    """
    validate_config(config)
    config = resolve_units(model, config)
    if device_type is None:
        device_type = next((p.device.type for p in model.parameters()), "cpu")
    if mesh is None:
        mesh = build_mesh(config, device_type)
    else:
        validate_for_world(config, mesh.size())
    mp_policy = MixedPrecisionPolicy(
        param_dtype=_get_dtype(config.mixed_precision.param_dtype),
        reduce_dtype=_get_dtype(config.mixed_precision.reduce_dtype),
    )
    modules = dict(model.named_modules())
    applied = AppliedFsdp(model=model, config=config, mesh=mesh)
    for unit in sorted(config.units, key=lambda u: -_depth(u.name)):
        module = model if unit.name == ROOT_UNIT else modules[unit.name]
        fully_shard(module, mesh=mesh, reshard_after_forward=unit.reshard_after_forward, mp_policy=mp_policy)
        applied.units[unit.name] = module  # type: ignore[assignment]
    _apply_runtime_knobs(applied, device_type)
    return applied


def _apply_runtime_knobs(applied: AppliedFsdp, device_type: str) -> None:
    config = applied.config
    unshard_async = config.unshard_async == "on" or (config.unshard_async == "auto" and device_type == "cpu")
    for unit in config.units:
        module = applied.units[unit.name]
        if unit.forward_prefetch is not None:
            module.set_modules_to_forward_prefetch([applied.units[n] for n in unit.forward_prefetch])
        if unit.backward_prefetch is not None:
            module.set_modules_to_backward_prefetch([applied.units[n] for n in unit.backward_prefetch])
        set_unshard_async(module, unshard_async)
        if config.reduce_scatter_max_input_buffers is not None:
            if hasattr(module, "set_reduce_scatter_max_input_buffers"):
                module.set_reduce_scatter_max_input_buffers(config.reduce_scatter_max_input_buffers, recurse=False)
            else:
                warnings.warn(f"reduce_scatter_max_input_buffers ignored: torch {torch.__version__} has no such FSDP2 setter", stacklevel=3)
        if not unit.defer_concat:
            applied.eager_concat[unit.name] = EagerConcat(module)
