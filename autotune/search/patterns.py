"""Block patterns of the search space: how a pattern parameter expands over units, and the
one-line description of a point (see [Note: search-space parametrization] in
:mod:`autotune.search.space`)."""

from __future__ import annotations

from typing import Any

from fsdp_runtime import UnitConfig


def get_mesh_key(pp: int) -> str:
    """The mesh parameter of a pipeline degree (one choice list per name: [Note: search-space parametrization])."""
    return "mesh" if pp == 1 else f"mesh_pp{pp}"


def split_even(blocks: list[str], num_stages: int) -> list[list[str]]:
    size = len(blocks) // num_stages
    return [blocks[i * size : (i + 1) * size] for i in range(num_stages)]


def group_unit(modules: list[str]) -> UnitConfig:
    """One unit for ``modules``: the module itself, or a labelled group (``layers.0-1``, ``norm+output``)."""
    if len(modules) == 1:
        return UnitConfig(name=modules[0])
    split = [m.rpartition(".") for m in modules]
    indices = [index for _, _, index in split]
    if len({prefix for prefix, _, _ in split}) == 1 and split[0][0] and all(i.isdecimal() for i in indices):
        return UnitConfig(name=f"{split[0][0]}.{indices[0]}-{indices[-1]}", modules=modules)
    return UnitConfig(name="+".join(modules), modules=modules)


def group_blocks(blocks: list[str], per_unit: int) -> list[tuple[str, list[str] | None]]:
    """``(unit name, modules)`` for consecutive groups of ``per_unit`` blocks (the last may be smaller)."""
    units = [group_unit(blocks[i : i + per_unit]) for i in range(0, len(blocks), per_unit)]
    return [(u.name, u.modules) for u in units]


def get_prefetch_lists(order: list[str], choice: str) -> dict[str, list[str]]:
    """Per unit, the units it prefetches, following ``order`` (execution order)."""
    if choice == "implicit":
        return {}
    if choice == "paired":
        return {name: (order[i + 1 : i + 3] if i % 2 == 0 else []) for i, name in enumerate(order)}
    depth = int(choice.removeprefix("depth"))
    return {name: order[i + 1 : i + 1 + depth] for i, name in enumerate(order)}


def select_blocks(blocks: list[str], pattern: str) -> set[str]:
    half = len(blocks) // 2
    match pattern:
        case "none":
            return set()
        case "all":
            return set(blocks)
        case "all_but_last":
            return set(blocks[:-1])
        case "every_2nd":
            return set(blocks[::2])
        case "first_half":
            return set(blocks[:half])
        case "second_half":
            return set(blocks[half:])
    raise ValueError(f"unknown block pattern {pattern!r}")


def get_reshard_value(choice: str, index: int, num_blocks: int, shard: int) -> bool | int | None:
    if choice == "true":
        return None  # FSDP2's default for inner units (True); keeps the defaults trial exact
    if choice == "false":
        return False
    if choice == "last_block_false":
        return False if index == num_blocks - 1 else None
    divisor = int(choice.removeprefix("int:"))
    if not (1 < divisor < shard and shard % divisor == 0):
        raise ValueError(f"reshard_after_forward {choice!r} needs a proper divisor of the shard size {shard}")
    return divisor


_SHORT = {
    "forward_prefetch": "fwd",
    "backward_prefetch": "bwd",
    "reshard_after_forward": "raf",
    "reduce_scatter_buffers": "rsbuf",
    "unshard_async": "async",
    "nosync_blocks": "nosync",
    "nosync_level_fsdp": "level",
    "nosync_level_hsdp": "level",
    "keep_unsharded": "keep",
    "defer_concat": "defer",
    "blocks_per_unit": "group",
    "ac_units": "ac",
    "ac_kind": "ackind",
    "root_reshard_after_forward": "rootraf",
    "root_sync_fsdp": "rootsync",
    "root_sync_hsdp": "rootsync",
    "root_keep_unsharded": "rootkeep",
    "root_split": "split",
    "reduce_dtype": "reduce",
    "pp": "pp",
    "pp_schedule": "sched",
    "pp_virtual": "v",
    "every_keep_unsharded": "everykeep",
}


def describe_params(params: dict[str, Any]) -> str:
    """A compact one-line description of a trial's knobs, for tables."""
    pp = params.get("pp", 1)
    parts = [str(params.get(get_mesh_key(pp), params.get("mesh", "?")))]
    for key, value in params.items():
        if key not in ("mesh", get_mesh_key(pp)) and not (key == "pp" and value == 1):
            short = "raf" if key.startswith("reshard_after_forward") else _SHORT.get(key, key)
            short = "sched" if key.endswith("_schedule") else short
            parts.append(f"{short}={str(value).lower() if isinstance(value, bool) else value}")
    return " ".join(parts)
