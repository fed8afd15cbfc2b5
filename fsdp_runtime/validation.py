"""The runtime config's checks (:mod:`fsdp_runtime.config` is the schema): :func:`validate_config`,
the structural ones that need neither the model nor the world size (a config is checked when it
is read), and :func:`validate_for_world`, those that need the world size; the checks against the
model are ``apply_fsdp``'s. Every error is a :class:`~fsdp_runtime.errors.ConfigError` naming the
exact field path, e.g. ``units[3].forward_prefetch[0]``, and a fix."""

from __future__ import annotations

import typing

from fsdp_runtime.config import (
    DTYPE_NAMES,
    INTERLEAVED_SCHEDULES,
    ROOT_UNIT,
    SCHEMA_VERSION,
    PipelineConfig,
    RuntimeConfig,
    UnitConfig,
)
from fsdp_runtime.errors import ConfigError


def validate_config(config: RuntimeConfig, *, source: str | None = None) -> RuntimeConfig:
    """Structural checks that need neither the model nor the world size."""

    def fail(path: str, problem: str, fix: str | None = None) -> typing.NoReturn:
        raise ConfigError(path, problem, fix=fix, source=source)

    if config.schema_version != SCHEMA_VERSION:
        fail(
            "schema_version",
            f"unsupported version {config.schema_version}",
            f"this fsdp-autotune reads version {SCHEMA_VERSION}",
        )
    mesh = config.mesh
    if mesh.replicate < 1:
        fail("mesh.replicate", f"must be >= 1, got {mesh.replicate}")
    if mesh.shard is not None and mesh.shard < 1:
        fail("mesh.shard", f"must be >= 1, got {mesh.shard}")
    if mesh.kind == "fsdp" and mesh.replicate != 1:
        fail(
            "mesh.replicate",
            f"is {mesh.replicate} but mesh.kind is 'fsdp'",
            "set mesh.kind = 'hsdp' or mesh.replicate = 1",
        )
    if mesh.kind == "hsdp" and mesh.replicate < 2:
        fail("mesh.replicate", "HSDP needs replicate >= 2", "use mesh.kind = 'fsdp' for a 1-D mesh")
    if config.num_microbatches < 1:
        fail("num_microbatches", f"must be >= 1, got {config.num_microbatches}")
    _validate_pipeline(config, fail)
    if config.reduce_scatter_max_input_buffers is not None and config.reduce_scatter_max_input_buffers < 1:
        fail("reduce_scatter_max_input_buffers", "must be >= 1 or unset")
    for key in ("param_dtype", "reduce_dtype"):
        value = getattr(config.mixed_precision, key)
        if value is not None and value not in DTYPE_NAMES:
            fail(f"mixed_precision.{key}", f"unknown dtype {value!r}", f"use one of {', '.join(DTYPE_NAMES)}")
    names = config.unit_names
    seen: set[str] = set()
    for i, name in enumerate(names):
        if not name:
            fail(f"units[{i}].name", "is empty", f"use a module FQN such as 'layers.0', or '{ROOT_UNIT}' for the model")
        if name in seen:
            fail(f"units[{i}].name", f"unit {name!r} is listed twice")
        seen.add(name)
    for i, unit in enumerate(config.units):
        _validate_unit(unit, f"units[{i}]", seen, config, fail)
    _validate_modules(config, fail)
    return config


def _validate_pipeline(config: RuntimeConfig, fail) -> None:
    """The pipeline table against ``mesh.pp`` (the split against the model: ``fsdp_runtime.pipeline``)."""
    pp, pipeline = config.mesh.pp, config.pipeline
    if pp < 1:
        fail("mesh.pp", f"must be >= 1, got {pp}")
    if pp == 1:
        if pipeline != PipelineConfig():
            fail("pipeline", "is set but mesh.pp is 1 (no pipeline)", "set mesh.pp > 1, or remove the pipeline table")
        return
    if pipeline.virtual_stages < 1:
        fail("pipeline.virtual_stages", f"must be >= 1, got {pipeline.virtual_stages}")
    interleaved = pipeline.schedule in INTERLEAVED_SCHEDULES
    if interleaved and pipeline.virtual_stages < 2:
        fail(
            "pipeline.virtual_stages",
            f"schedule {pipeline.schedule!r} needs >= 2 stages per pipeline rank, got {pipeline.virtual_stages}",
            "set virtual_stages >= 2, or use schedule '1f1b'",
        )
    if not interleaved and pipeline.virtual_stages != 1:
        fail(
            "pipeline.virtual_stages",
            f"schedule {pipeline.schedule!r} holds one stage per pipeline rank, got {pipeline.virtual_stages}",
            "set virtual_stages = 1, or use schedule 'interleaved_1f1b'",
        )
    stages = pipeline.get_num_stages(pp)
    if pipeline.blocks_per_stage is not None:
        if len(pipeline.blocks_per_stage) != stages:
            fail(
                "pipeline.blocks_per_stage",
                f"has {len(pipeline.blocks_per_stage)} entries for {stages} stages (mesh.pp x pipeline.virtual_stages)",
                f"list {stages} block counts",
            )
        for i, count in enumerate(pipeline.blocks_per_stage):
            if count < 1:
                fail(f"pipeline.blocks_per_stage[{i}]", f"must be >= 1, got {count}")
    if pipeline.schedule == "1f1b" and config.num_microbatches < pp:
        fail(
            "num_microbatches",
            f"{config.num_microbatches} is fewer than the {pp} stages, which schedule '1f1b' needs at least",
            f"use >= {pp} microbatches, or schedule 'gpipe'",
        )
    if interleaved and config.num_microbatches % pp:
        fail(
            "num_microbatches",
            f"{config.num_microbatches} is not a multiple of mesh.pp = {pp}, which {pipeline.schedule!r} needs",
            f"use a multiple of {pp}",
        )


def _validate_modules(config: RuntimeConfig, fail) -> None:
    """Each module in one unit at most; a module list neither empty nor nested; checkpointing
    only where the unit's forward holds no other unit."""
    owner: dict[str, str] = {}
    for i, unit in enumerate(config.units):
        path = f"units[{i}]"
        if unit.modules is not None:
            if unit.name == ROOT_UNIT:
                fail(
                    f"{path}.modules",
                    "the root unit is the model itself and takes no module list",
                    "remove modules, or give the unit another name",
                )
            if not unit.modules:
                fail(
                    f"{path}.modules",
                    "is empty",
                    f"list the modules to shard together, or remove it to shard the module {unit.name!r}",
                )
        if unit.name == ROOT_UNIT:
            if unit.activation_checkpointing != "none":
                fail(
                    f"{path}.activation_checkpointing",
                    "the root unit cannot be checkpointed (its forward runs every other unit)",
                    "checkpoint the blocks' units instead",
                )
            continue
        field_path = f"{path}.modules" if unit.modules is not None else f"{path}.name"
        modules = unit.get_modules()
        for j, module in enumerate(modules):
            where = f"{field_path}[{j}]" if unit.modules is not None else field_path
            if not module:
                fail(where, "is empty", "use a module FQN such as 'layers.0'")
            if module in modules[:j]:
                fail(where, f"lists module {module!r} twice")
            if module in owner:
                fail(where, f"module {module!r} is already in {owner[module]}", "put each module in one unit")
            inner = next((m for m in modules if m.startswith(module + ".")), None)
            if inner is not None:
                fail(where, f"{inner!r} is inside {module!r} in the same unit", f"list only {module!r}")
            owner[module] = path
    for i, unit in enumerate(config.units):
        if unit.activation_checkpointing == "none" or unit.name == ROOT_UNIT:
            continue
        mine = unit.get_modules()
        for module, other in owner.items():
            if other != f"units[{i}]" and any(module.startswith(m + ".") for m in mine):
                fail(
                    f"units[{i}].activation_checkpointing",
                    f"the unit holds {other} ({module!r}); checkpointing around another unit is not supported",
                    f"checkpoint {other} instead",
                )


def _validate_unit(unit: UnitConfig, path: str, names: set[str], config: RuntimeConfig, fail) -> None:
    raf = unit.reshard_after_forward
    if isinstance(raf, int) and not isinstance(raf, bool) and raf < 2:
        fail(
            f"{path}.reshard_after_forward",
            f"integer value must be >= 2 (a divisor of the shard size), got {raf}",
            "use true/false for full reshard/no reshard",
        )
    for key in ("forward_prefetch", "backward_prefetch"):
        targets = getattr(unit, key)
        for j, target in enumerate(targets or []):
            if target not in names:
                known = _summarize_names(sorted(names))
                fail(f"{path}.{key}[{j}]", f"unit {target!r} does not exist", f"known units: {known}")
            if target == unit.name:
                fail(f"{path}.{key}[{j}]", f"unit {target!r} prefetches itself", "remove it from the list")
            if target == ROOT_UNIT:
                fail(f"{path}.{key}[{j}]", "the root unit cannot be prefetched", "remove it from the list")
        if targets is not None and len(set(targets)) != len(targets):
            fail(f"{path}.{key}", "lists a unit twice")
    if unit.sync == "replica_last" and config.mesh.kind != "hsdp":
        fail(
            f"{path}.sync", "'replica_last' needs an HSDP mesh", "set mesh.kind = 'hsdp' or use sync = 'every' / 'last'"
        )
    if not unit.defer_concat and unit.sync != "last":
        fail(
            f"{path}.defer_concat",
            f"false only applies with sync = 'last' (this unit syncs {unit.sync!r})",
            "set defer_concat = true",
        )


def _summarize_names(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 8 else ", ".join(names[:4] + ["..."] + names[-3:])


def validate_for_world(config: RuntimeConfig, world_size: int, *, source: str | None = None) -> tuple[int, int]:
    """Checks that need the world size; returns each stage's data-parallel mesh shape ``(replicate, shard)``."""
    if world_size % config.mesh.pp:
        raise ConfigError(
            "mesh.pp",
            f"{config.mesh.pp} does not divide the world size {world_size}",
            fix="choose pp x replicate x shard = world size",
            source=source,
        )
    dp_world = world_size // config.mesh.pp
    replicate, shard = config.mesh.get_shape(world_size)
    if config.mesh.kind == "fsdp" and config.mesh.shard not in (None, dp_world):
        raise ConfigError(
            "mesh.shard",
            f"is {config.mesh.shard} but the data-parallel world size is {dp_world}",
            fix="leave mesh.shard unset for FSDP",
            source=source,
        )
    if replicate * shard != dp_world or dp_world % config.mesh.replicate:
        pp = "pp x " if config.mesh.pp > 1 else ""
        pp_n = f"{config.mesh.pp} x " if config.mesh.pp > 1 else ""
        raise ConfigError(
            "mesh",
            f"{pp}replicate x shard = {pp_n}{config.mesh.replicate} x {config.mesh.shard if config.mesh.shard is not None else '?'} does not multiply to the world size {world_size}",
            fix="choose factors whose product is the world size",
            source=source,
        )
    for i, unit in enumerate(config.units):
        raf = unit.reshard_after_forward
        if isinstance(raf, int) and not isinstance(raf, bool) and (shard % raf or raf >= shard):
            raise ConfigError(
                f"units[{i}].reshard_after_forward",
                f"{raf} is not a proper divisor of the shard size {shard}",
                fix="use true, false, or a divisor d with 1 < d < shard size",
                source=source,
            )
    return replicate, shard
