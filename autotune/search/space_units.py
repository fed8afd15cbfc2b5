"""The units of a point of the search space (:mod:`autotune.search.space`): the block units of each
stage with every pattern expanded, the split-off edge units and the root."""

from __future__ import annotations

import dataclasses
from typing import Any

from autotune.search.patterns import get_reshard_value, group_unit
from fsdp_runtime import ROOT_UNIT, UnitConfig
from fsdp_runtime.tuning import select_blocks

__all__ = ["build_block_units", "build_root_units", "get_edge_units"]


def get_edge_units(embedding_names: tuple[str, ...], head_names: tuple[str, ...]) -> list[UnitConfig]:
    """The embeddings unit and the head unit. The head is kept after forward: its backward runs first,
    so resharding it after forward only all-gathers it again at once (accelerate PR #4015 measured
    the slowdown); no point of the space reshards it."""
    embeddings = group_unit(list(embedding_names))
    head = group_unit(list(head_names))
    return [embeddings, dataclasses.replace(head, reshard_after_forward=False)]


def build_root_units(
    params: dict[str, Any], edges: list[UnitConfig], fwd: dict[str, list[str]], bwd: dict[str, list[str]]
) -> list[UnitConfig]:
    """The split-off edge units (if any) and the root, with the root's sync level and reshard."""
    sync = params.get("root_sync_fsdp", params.get("root_sync_hsdp", "every"))
    keep = sync != "every" and params.get("root_keep_unsharded", False)
    state = {"sync": sync, "reshard_after_backward": not keep}
    out = [
        dataclasses.replace(u, forward_prefetch=fwd.get(u.name), backward_prefetch=bwd.get(u.name), **state)
        for u in edges
    ]
    root_reshard = True if params.get("root_reshard_after_forward", "false") == "true" else None
    out.append(UnitConfig(name=ROOT_UNIT, reshard_after_forward=root_reshard, **state))  # None: FSDP2's (False)
    return out


def build_block_units(
    params: dict[str, Any],
    stage_groups: list[list[tuple[str, list[str] | None]]],
    names: list[str],
    fwd: dict[str, list[str]],
    bwd: dict[str, list[str]],
    reshard: str,
    shard: int,
) -> list[UnitConfig]:
    """The block units of each stage (one stage without a pipeline), every pattern expanded."""
    nosync = select_blocks(names, params.get("nosync_blocks", "none"))
    checkpointed = select_blocks(names, params.get("ac_units", "none"))
    units = []
    for stage in stage_groups:
        for i, (name, modules) in enumerate(stage):
            unit = UnitConfig(
                name=name,
                modules=modules,
                reshard_after_forward=get_reshard_value(reshard, i, len(stage), shard),
                forward_prefetch=fwd.get(name),
                backward_prefetch=bwd.get(name),
                activation_checkpointing=params["ac_kind"] if name in checkpointed else "none",
            )
            if name in nosync:
                unit = dataclasses.replace(
                    unit,
                    sync=params["nosync_level"],
                    reshard_after_backward=not params.get("keep_unsharded", False),
                    defer_concat=params.get("defer_concat", True),
                )
            units.append(unit)
    return units
