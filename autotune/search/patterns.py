"""Block patterns of the search space: how a pattern parameter expands over units, and the
one-line description of a point, whole or as its change from the defaults (see [Note: search-space
parametrization] in :mod:`autotune.search.space`)."""

from __future__ import annotations

from typing import Any

from fsdp_runtime import KNOBS, UnitConfig


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


def get_reshard_choices(shard: int, ranks_per_node: int | None = None) -> list[str]:
    """Reshard after forward: true, false, all but the last block, and an int group. On one node every
    proper divisor of the shard size; where the shard group spans nodes (``ranks_per_node`` below the
    shard size and dividing it) the node's size only: an int group of consecutive shard ranks is one
    node there, so the backward all-gathers of a unit resharded to it stay on the node's links."""
    ints = [d for d in range(2, shard) if shard % d == 0]
    if ranks_per_node is not None and 1 < ranks_per_node < shard and shard % ranks_per_node == 0:
        ints = [ranks_per_node]
    return ["true", "false", "last_block_false", *(f"int:{d}" for d in ints)]


def get_reshard_key(shard: int, ranks_per_node: int | None = None) -> str:
    """One parameter name per choice list ([Note: search-space parametrization]): a study keeps one
    list per name, so a shard group across nodes has its own."""
    choices = get_reshard_choices(shard, ranks_per_node)
    if len(choices) == 3:
        return "reshard_after_forward"
    node = ranks_per_node is not None and choices != get_reshard_choices(shard)
    return f"reshard_after_forward_shard{shard}" + (f"_node{ranks_per_node}" if node else "")


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


_OWN_SHORT = {  # the parameters of no registry knob (those of a knob are printed by its ``short``)
    "pp": "pp",
    "pp_schedule": "sched",
    "pp_virtual": "v",
    "nosync_level_fsdp": "level",
    "nosync_level_hsdp": "level",
    "every_keep_unsharded": "everykeep",
    "ac_kind": "ackind",
    "root_reshard_after_forward": "rootraf",
    "root_sync_fsdp": "rootsync",
    "root_sync_hsdp": "rootsync",
    "root_keep_unsharded": "rootkeep",
    "root_split": "split",
}
_KNOB_SHORT = {param: knob.short for knob in KNOBS for param in knob.params}
_PARAM_ORDER = (  # the space's order (SearchSpace.suggest asks them in it); the mesh comes first, unnamed
    "pp",
    "forward_prefetch",
    "backward_prefetch",
    "reshard_after_forward",
    "reduce_scatter_buffers",
    "reduce_dtype",
    "unshard_async",
    "pp_schedule",
    "pp_virtual",
    "nosync_blocks",
    "nosync_level_fsdp",
    "nosync_level_hsdp",
    "keep_unsharded",
    "defer_concat",
    "every_keep_unsharded",
    "blocks_per_unit",
    "ac_units",
    "ac_kind",
    "root_reshard_after_forward",
    "root_sync_fsdp",
    "root_sync_hsdp",
    "root_keep_unsharded",
    "root_split",
)
_SHORT = {p: _KNOB_SHORT.get(p) or _OWN_SHORT[p] for p in _PARAM_ORDER} | {
    p: short for p, short in _KNOB_SHORT.items() if p not in _PARAM_ORDER
}  # a knob added to the registry is printed after the others, by its own short name
_ORDER = {short: i for i, short in enumerate(["mesh", *dict.fromkeys(_SHORT.values())])}
DEFAULTS_DESCRIPTION = "defaults"
"""What :func:`describe_params_diff` says of a point equal to the defaults."""


def _get_knobs(params: dict[str, Any]) -> dict[str, str]:
    """Short name -> shown value, in the space's order (names it does not know last, as given). A
    parameter named per mesh or degree (``mesh_pp2``, ``reshard_after_forward_shard4``,
    ``pp2_schedule``, ``root_sync_hsdp``) takes its knob's name, so that points compare knob by knob."""
    knobs = {}
    for key, value in params.items():
        if key == "mesh" or key.startswith("mesh_pp"):
            short = "mesh"
        elif key.startswith("reshard_after_forward"):
            short = "raf"
        else:
            short = "sched" if key.endswith("_schedule") else _SHORT.get(key, key)
        knobs[short] = str(value).lower() if isinstance(value, bool) else str(value)
    return dict(sorted(knobs.items(), key=lambda item: _ORDER.get(item[0], len(_ORDER))))


def _join(knobs: dict[str, str]) -> str:
    return " ".join(value if short == "mesh" else f"{short}={value}" for short, value in knobs.items())


def describe_params(params: dict[str, Any]) -> str:
    """A compact one-line description of a point's every knob, for tables: the mesh, then
    ``short=value`` in the space's order (``pp=1`` left out)."""
    knobs = _get_knobs(params)
    if knobs.get("pp") == "1":
        del knobs["pp"]
    return _join({"mesh": knobs.pop("mesh", "?"), **knobs})


def describe_params_diff(params: dict[str, Any], defaults: dict[str, Any]) -> str:
    """Only the knobs where ``params`` differs from ``defaults`` (the defaults trial's params), as
    :func:`describe_params` writes them: ``hsdp:2x1 fwd=depth2 nosync=all level=last``; a knob the
    defaults do not set (one asked only under another's choice) counts as changed, one that
    ``params`` leaves out as the defaults'. :data:`DEFAULTS_DESCRIPTION` when nothing differs."""
    knobs, base = _get_knobs(params), _get_knobs(defaults)
    base.setdefault("pp", "1")
    changed = {short: value for short, value in knobs.items() if base.get(short) != value}
    return _join(changed) if changed else DEFAULTS_DESCRIPTION
