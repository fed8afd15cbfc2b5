"""A :class:`RuntimeConfig` resolved against the model's units: per-unit knob lists by unit index.

Unit ``i`` is the ``i``-th unit of blocks in the model's block order (one block each by
default; several with a schema-2 ``modules`` list) for ``i < n`` and the root for ``i = n``.
Blocks no config unit holds get a default unit of their own. Defaults resolve as FSDP2
resolves them: ``reshard_after_forward = None`` is True for a block and False for the root
(``FSDPState._lazy_init``); an int equal to the shard size is True and 1 is False
(``_get_post_forward_mesh_info``); ``unshard_async = "auto"`` is on for CPU only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fsdp_runtime import (
    ROOT_UNIT,
    RuntimeConfig,
    UnitConfig,
    get_knob,
    get_sim_values,
    validate_config,
    validate_for_world,
)
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
    unit_blocks: tuple[tuple[int, ...], ...] | None = None
    """Per non-root unit, the indices of the blocks it shards together; None: one block per unit."""
    checkpointing: tuple[str, ...] | None = None
    """Per unit (root included), its activation checkpointing: ``none``, ``selective``, ``full``; None: none."""
    method_values: tuple[tuple[str, Any], ...] = ()
    """The values of the registry's method knobs with no field here, by config field
    (``fsdp_runtime.knobs.get_sim_values``: [Note: the knob registry]); read with :meth:`get_method`."""

    def get_method(self, name: str) -> Any:
        """A method knob's value (``method_values``); ``KeyError`` where the registry has no such knob."""
        return dict(self.method_values)[name] if self.method_values else get_knob(name).fsdp_default


def _get_units(config: RuntimeConfig, block_names: tuple[str, ...]) -> tuple[list[UnitConfig], list[tuple[int, ...]]]:
    """The config's units in block order with the blocks each holds (blocks in no unit get a default
    unit), then the root."""
    block_index = {name: i for i, name in enumerate(block_names)}
    owned: dict[int, tuple[int, UnitConfig]] = {}
    root = UnitConfig(name=ROOT_UNIT)
    for i, unit in enumerate(config.units):
        if unit.name == ROOT_UNIT:
            root = unit
            continue
        modules = unit.get_modules() if hasattr(unit, "get_modules") else [unit.name]
        for module in modules:
            if module not in block_index:
                known = (
                    f"units: {block_names[0]}..{block_names[-1]}, {ROOT_UNIT}" if block_names else f"units: {ROOT_UNIT}"
                )
                if getattr(unit, "modules", None) is None:
                    raise ConfigError(f"units[{i}].name", f"unit {unit.name!r} is not a unit of this model", fix=known)
                raise ConfigError(
                    f"units[{i}].modules",
                    f"{module!r} is not a block of this model (the simulator models units of blocks and the root)",
                    fix=known,
                )
            owned[block_index[module]] = (i, unit)
    units: list[UnitConfig] = []
    blocks: list[tuple[int, ...]] = []
    seen: dict[int, int] = {}
    for b, name in enumerate(block_names):
        if b not in owned:
            units.append(UnitConfig(name=name))
            blocks.append((b,))
        elif owned[b][0] in seen:
            u = seen[owned[b][0]]
            if blocks[u][-1] != b - 1:
                raise ConfigError(
                    f"units[{owned[b][0]}].modules",
                    f"unit {owned[b][1].name!r} holds blocks that are not consecutive",
                    fix="group consecutive blocks",
                )
            blocks[u] += (b,)
        else:
            seen[owned[b][0]] = len(units)
            units.append(owned[b][1])
            blocks.append((b,))
    return [*units, root], blocks


def resolve_knobs(config: RuntimeConfig, block_names: tuple[str, ...], *, world_size: int, device: str) -> Knobs:
    """Check ``config`` against the model and world size and index its knobs by unit."""
    validate_config(config)
    replicate, shard = validate_for_world(config, world_size)
    units, blocks = _get_units(config, block_names)
    index = {unit.name: i for i, unit in enumerate(units)}
    for i, unit in enumerate(config.units):
        if unit.name not in index:
            raise ConfigError(
                f"units[{i}].name",
                f"unit {unit.name!r} is not a unit of this model",
                fix=f"units: {units[0].name}..{units[-2].name}, {ROOT_UNIT}",
            )

    def targets(names_: list[str] | None) -> tuple[int, ...] | None:
        return None if names_ is None else tuple(index[name] for name in names_)

    mp = config.mixed_precision
    param_dtype = mp.param_dtype or "float32"
    grouped = any(len(b) > 1 for b in blocks)
    checkpointing = tuple(getattr(u, "activation_checkpointing", "none") for u in units)
    return Knobs(
        num_microbatches=config.num_microbatches,
        hsdp=config.mesh.kind == "hsdp",
        replicate=replicate,
        shard=shard,
        unshard_async=config.unshard_async == "on" or (config.unshard_async == "auto" and device == "cpu"),
        max_rs_buffers=config.reduce_scatter_max_input_buffers or 1,
        method_values=get_sim_values(config, device),
        param_dtype=param_dtype,
        reduce_dtype=mp.reduce_dtype or param_dtype,
        reshard_after_forward=tuple(
            _resolve_reshard(u.reshard_after_forward, u.name == ROOT_UNIT, shard) for u in units
        ),
        forward_prefetch=tuple(targets(u.forward_prefetch) for u in units),
        backward_prefetch=tuple(targets(u.backward_prefetch) for u in units),
        sync=tuple(u.sync for u in units),
        reshard_after_backward=tuple(u.reshard_after_backward for u in units),
        defer_concat=tuple(u.defer_concat for u in units),
        unit_blocks=tuple(blocks) if grouped else None,
        checkpointing=checkpointing if any(c != "none" for c in checkpointing) else None,
    )


def _resolve_reshard(value: bool | int | None, is_root: bool, shard: int) -> bool | int:
    if value is None:
        return not is_root
    if isinstance(value, bool):
        return value
    if value == shard:
        return True
    return False if value == 1 else value
