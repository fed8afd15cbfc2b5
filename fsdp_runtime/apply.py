"""Apply a :class:`RuntimeConfig` to a model: ``fully_shard`` per unit and every runtime knob."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from fsdp_runtime._fsdp_private import EagerConcat
from fsdp_runtime.blocks import find_block_names, find_parameters_outside, resolve_units
from fsdp_runtime.checkpointing import CheckpointedForward, apply_checkpointing
from fsdp_runtime.config import ROOT_UNIT, RuntimeConfig, UnitConfig
from fsdp_runtime.errors import ConfigError
from fsdp_runtime.knob_checks import check_device_supports, check_torch_supports
from fsdp_runtime.knobs import set_method_knobs
from fsdp_runtime.validation import validate_config, validate_for_world

__all__ = [
    "AppliedFsdp",
    "WorldSizeWarning",
    "apply_fsdp",
    "build_mesh",
    "find_block_names",
    "get_default_device_type",
    "resolve_units",
    "warn_if_other_world",
]


class WorldSizeWarning(UserWarning):
    """A config applied at another world size than the one it was measured at."""


@dataclass(kw_only=True)
class AppliedFsdp:
    """What ``apply_fsdp`` did: the resolved config, the mesh, and each unit's module."""

    model: nn.Module
    config: RuntimeConfig
    """The config with its units resolved against the model."""
    mesh: DeviceMesh
    units: dict[str, FSDPModule] = field(default_factory=dict)
    """Each unit's module (a grouped unit's first module: its FSDP state is the group's)."""
    eager_concat: dict[str, EagerConcat] = field(default_factory=dict)
    checkpointed: dict[str, CheckpointedForward] = field(default_factory=dict)
    """Checkpointed modules by module path (see ``fsdp_runtime.checkpointing``)."""

    def get_module(self, name: str) -> FSDPModule:
        return self.units[name]


def build_mesh(config: RuntimeConfig, device_type: str) -> DeviceMesh:
    """The 1-D (FSDP) or 2-D ``(replicate, shard)`` (HSDP) mesh over the default group."""
    replicate, shard = validate_for_world(config, dist.get_world_size())
    if config.mesh.kind == "hsdp":
        return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (shard,), mesh_dim_names=("shard",))


def _get_dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def _depth(unit: UnitConfig) -> int:
    return -1 if unit.name == ROOT_UNIT else max(m.count(".") + 1 for m in unit.get_modules())


def apply_fsdp(
    model: nn.Module, config: RuntimeConfig, *, mesh: DeviceMesh | None = None, device_type: str | None = None
) -> AppliedFsdp:
    """Shard ``model`` in place as ``config`` says and wire every runtime knob.

    Call after ``torch.distributed.init_process_group`` and before building the
    optimizer. Activation checkpointing is applied first (module paths unchanged), then
    units are sharded innermost first, the root last; a unit with a ``modules`` list is one
    ``fully_shard`` call on those modules. Returns the handle that
    :class:`~fsdp_runtime.GradAccumulator` needs. Pass the whole model: a submodule whose
    parent has parameters outside it is refused, as is a config naming unknown units or
    covering fewer blocks than the model has ([Note: unit names] in :mod:`fsdp_runtime.blocks`),
    and a knob the installed torch cannot set ([Note: the knob registry] in :mod:`fsdp_runtime.knobs`).
    ``device_type`` defaults to the mesh's, else to the parameters' device, else, for a model
    built on the meta device, to the default process group's (:func:`get_default_device_type`);
    such a model is then given memory (``to_empty``) and initialised after this call. A config
    measured at another world size is applied with a :class:`WorldSizeWarning`.
    """
    validate_config(config)
    check_torch_supports(config)
    config = resolve_units(model, config)
    _check_whole_model(model, config)
    if device_type is None:
        device_type = mesh.device_type if mesh is not None else _get_params_device_type(model)
    check_device_supports(config, device_type)
    if mesh is None:
        mesh = build_mesh(config, device_type)
    else:
        validate_for_world(config, mesh.size())
    warn_if_other_world(config, dist.get_world_size())
    mp_policy = MixedPrecisionPolicy(
        param_dtype=_get_dtype(config.mixed_precision.param_dtype),
        reduce_dtype=_get_dtype(config.mixed_precision.reduce_dtype),
    )
    modules = dict(model.named_modules())
    applied = AppliedFsdp(model=model, config=config, mesh=mesh)
    for unit in config.units:
        for path in unit.get_modules() if unit.name != ROOT_UNIT else []:
            forward = apply_checkpointing(modules[path], unit.activation_checkpointing)
            if forward is not None:
                applied.checkpointed[path] = forward
    for unit in sorted(config.units, key=lambda u: -_depth(u)):
        targets = [model] if unit.name == ROOT_UNIT else [modules[path] for path in unit.get_modules()]
        fully_shard(
            targets if len(targets) > 1 else targets[0],
            mesh=mesh,
            reshard_after_forward=unit.reshard_after_forward,
            mp_policy=mp_policy,
        )
        applied.units[unit.name] = targets[0]  # type: ignore[assignment]
    _apply_runtime_knobs(applied, device_type)
    return applied


def _get_params_device_type(model: nn.Module) -> str:
    """The parameters' device type; the default group's where they are on meta (or there are none)."""
    found = next((p.device.type for p in model.parameters()), "meta")
    return get_default_device_type() if found == "meta" else found


def get_default_device_type() -> str:
    """The device type the default process group communicates on: its backend's device
    (``torch.distributed.Backend.default_device_backend_map`` read backwards: nccl -> cuda,
    gloo -> cpu), the accelerator of a ``"cpu:gloo,cuda:nccl"`` backend string."""
    backend = str(dist.get_backend())
    if backend == dist.Backend.UNDEFINED:
        backend = str(dist.get_backend_config())
    if ":" in backend:  # "device:backend" pairs: the accelerator's device, else the CPU
        devices = [pair.split(":")[0] for pair in backend.split(",")]
        return next((d for d in devices if d != "cpu"), "cpu")
    by_backend: dict[str, str] = {}
    for device, name in dist.Backend.default_device_backend_map.items():  # cpu before mps for gloo
        by_backend.setdefault(name, device)
    if backend not in by_backend:
        raise ConfigError(
            "device_type",
            f"the default process group's backend {backend!r} names no device type",
            fix="pass apply_fsdp(..., device_type=...) or a mesh",
        )
    return by_backend[backend]


def warn_if_other_world(config: RuntimeConfig, world_size: int, *, stacklevel: int = 2) -> None:
    """One :class:`WorldSizeWarning` where ``config`` was measured at another world size than
    ``world_size`` (the job's: the default group's, pipeline stages included); ``stacklevel`` as
    ``warnings.warn``'s, counted from this function's caller (2: the caller's caller)."""
    measured = config.provenance.world_size
    if measured is not None and measured != world_size:
        warnings.warn(
            f"this config was measured at world size {measured} and is applied at world size {world_size}: "
            f"its knobs were chosen for {measured} ranks (search at {world_size} for knobs measured there)",
            WorldSizeWarning,
            stacklevel=stacklevel + 1,
        )


def _check_whole_model(model: nn.Module, config: RuntimeConfig) -> None:
    """Refuse a submodule whose parent holds trainable parameters no unit would cover (see [Note: unit names])."""
    parent, outside = find_parameters_outside(model)
    if outside:
        shown = ", ".join(outside[:3]) + (f" and {len(outside) - 3} more" if len(outside) > 3 else "")
        raise ConfigError(
            f"units[{config.unit_names.index(ROOT_UNIT)}]",
            f"the root unit is {type(model).__name__}, a submodule of {parent}, whose parameters {shown} would be in no unit: "
            "their gradients would never be synchronised across ranks",
            fix=f"call apply_fsdp on the whole model (the {parent.split(' ')[0]})",
        )


def _apply_runtime_knobs(applied: AppliedFsdp, device_type: str) -> None:
    config = applied.config
    for unit in config.units:
        module = applied.units[unit.name]
        if unit.forward_prefetch is not None:
            module.set_modules_to_forward_prefetch([applied.units[n] for n in unit.forward_prefetch])
        if unit.backward_prefetch is not None:
            module.set_modules_to_backward_prefetch([applied.units[n] for n in unit.backward_prefetch])
        set_method_knobs(module, config, device_type)  # those not at FSDP2's own value ([Note: the knob registry])
        if not unit.defer_concat:
            applied.eager_concat[unit.name] = EagerConcat(module)
