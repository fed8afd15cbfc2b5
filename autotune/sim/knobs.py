"""A :class:`RuntimeConfig` resolved against the model's units: per-unit knob lists by unit index.

Unit ``i`` is block ``i`` (in the model's block order) for ``i < n`` and the root for ``i = n``.
Defaults resolve as FSDP2 resolves them: ``reshard_after_forward = None`` is True for a block
and False for the root (``FSDPState._lazy_init``); an int equal to the shard size is True and
1 is False (``_get_post_forward_mesh_info``); ``unshard_async = "auto"`` is on for CPU only.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_runtime import ROOT_UNIT, RuntimeConfig, UnitConfig, validate_config, validate_for_world
from fsdp_runtime.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Knobs:
    num_microbatches: int
    hsdp: bool
    replicate: int
    shard: int
    unshard_async: bool
    max_rs_buffers: int
    param_dtype: str
    reduce_dtype: str
    reshard_after_forward: tuple[bool | int, ...]
    forward_prefetch: tuple[tuple[int, ...] | None, ...]
    backward_prefetch: tuple[tuple[int, ...] | None, ...]
    sync: tuple[str, ...]
    reshard_after_backward: tuple[bool, ...]
    defer_concat: tuple[bool, ...]


def resolve_knobs(config: RuntimeConfig, block_names: tuple[str, ...], *, world_size: int, device: str) -> Knobs:
    """Check ``config`` against the model and world size and index its knobs by unit."""
    validate_config(config)
    replicate, shard = validate_for_world(config, world_size)
    names = [*block_names, ROOT_UNIT]
    index = {name: i for i, name in enumerate(names)}
    units: list[UnitConfig] = [UnitConfig(name=name) for name in names]
    for i, unit in enumerate(config.units):
        if unit.name not in index:
            raise ConfigError(f"units[{i}].name", f"unit {unit.name!r} is not a unit of this model", fix=f"units: {names[0]}..{names[-2]}, {ROOT_UNIT}")
        units[index[unit.name]] = unit

    def targets(names_: list[str] | None) -> tuple[int, ...] | None:
        return None if names_ is None else tuple(index[name] for name in names_)

    mp = config.mixed_precision
    param_dtype = mp.param_dtype or "float32"
    return Knobs(
        num_microbatches=config.num_microbatches,
        hsdp=config.mesh.kind == "hsdp",
        replicate=replicate,
        shard=shard,
        unshard_async=config.unshard_async == "on" or (config.unshard_async == "auto" and device == "cpu"),
        max_rs_buffers=config.reduce_scatter_max_input_buffers or 1,
        param_dtype=param_dtype,
        reduce_dtype=mp.reduce_dtype or param_dtype,
        reshard_after_forward=tuple(_resolve_reshard(u.reshard_after_forward, u.name == ROOT_UNIT, shard) for u in units),
        forward_prefetch=tuple(targets(u.forward_prefetch) for u in units),
        backward_prefetch=tuple(targets(u.backward_prefetch) for u in units),
        sync=tuple(u.sync for u in units),
        reshard_after_backward=tuple(u.reshard_after_backward for u in units),
        defer_concat=tuple(u.defer_concat for u in units),
    )


def _resolve_reshard(value: bool | int | None, is_root: bool, shard: int) -> bool | int:
    if value is None:
        return not is_root
    if isinstance(value, bool):
        return value
    if value == shard:
        return True
    return False if value == 1 else value
