"""The in-job tuner's space: one-knob moves from a config, over the knobs a sharded model switches in place.

[Note: in-job moves]
A training job can only try what :func:`fsdp_runtime.switch_config` sets on the running model
between optimizer steps ([Note: knobs switched in place] in :mod:`fsdp_runtime.switch`): the
prefetch lists, reshard after forward as a bool, and under gradient accumulation the sync level,
reshard after backward and concat deferral per unit, plus async unshard and the reduce-scatter
buffers. Mesh, units, activation checkpointing, precision and microbatches change what is built
and stay the search's (``autotune search``, ``autotune plan``).

A move sets one knob on the blocks a pattern selects, as the search's space does (the same
patterns: :mod:`fsdp_runtime.tuning.patterns`), on the units of the config in their execution
order; the root stays as it is. The tuner walks the moves in the order :func:`get_moves` gives
them, from the config it is seeded with, taking each move from the best config so far (a
coordinate walk: what a move found stays while the next knob is tried). Moves whose config equals
one already measured are skipped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

from fsdp_runtime.config import ROOT_UNIT, RuntimeConfig, UnitConfig
from fsdp_runtime.knobs import get_method_knobs
from fsdp_runtime.tuning.patterns import get_prefetch_lists, select_blocks

PREFETCH_CHOICES = ("implicit", "depth1", "depth2")
PATTERNS = ("all", "all_but_last", "none")


class Move(NamedTuple):
    """One knob set on some blocks: ``name`` as the tuner's log says it (``forward_prefetch=depth2``)."""

    name: str
    apply: Callable[[RuntimeConfig], RuntimeConfig]


def get_blocks(config: RuntimeConfig) -> list[str]:
    """The units a move sets, in execution order: every unit but the root."""
    return [u.name for u in config.units if u.name != ROOT_UNIT]


def _set_units(config: RuntimeConfig, values: Callable[[UnitConfig, int], dict]) -> RuntimeConfig:
    """``config`` with each non-root unit replaced by ``values(unit, index)``'s fields set."""
    blocks = get_blocks(config)
    units = [dataclasses.replace(u, **values(u, blocks.index(u.name))) if u.name in blocks else u for u in config.units]
    return dataclasses.replace(config, units=units)


def _prefetch(direction: str, choice: str) -> Move:
    def apply(config: RuntimeConfig) -> RuntimeConfig:
        order = get_blocks(config)
        lists = get_prefetch_lists(order if direction == "forward" else order[::-1], choice)
        return _set_units(config, lambda u, i: {f"{direction}_prefetch": lists.get(u.name) if lists else None})

    return Move(f"{direction}_prefetch={choice}", apply)


def _on_blocks(field: str, pattern: str, on: object, off: object) -> Move:
    """``field`` = ``on`` on the blocks ``pattern`` selects, ``off`` on the others."""

    def apply(config: RuntimeConfig) -> RuntimeConfig:
        chosen = select_blocks(get_blocks(config), pattern)
        return _set_units(config, lambda u, i: {field: on if u.name in chosen else off})

    return Move(f"{field}={on}@{pattern}", apply)


def _when_some_sync_last(move: Move) -> Move:
    """``move`` where some unit skips sync (concat deferral only matters there), else no change (skipped)."""

    def apply(config: RuntimeConfig) -> RuntimeConfig:
        return move.apply(config) if any(u.sync == "last" for u in config.units) else config

    return Move(move.name, apply)


def _config_field(field: str, value: object) -> Move:
    return Move(f"{field}={value}", lambda config: dataclasses.replace(config, **{field: value}))


def get_moves(config: RuntimeConfig, *, device_type: str) -> list[Move]:
    """The moves the tuner tries, in order ([Note: in-job moves]): prefetch forward and backward,
    reshard after forward, then under accumulation the sync level, reshard after backward and
    concat deferral; then the method knobs the registry lists, each on the devices it names (async
    unshard on CUDA, the reduce-scatter buffers)."""
    moves = [_prefetch(direction, c) for direction in ("forward", "backward") for c in PREFETCH_CHOICES]
    moves += [_on_blocks("reshard_after_forward", p, False, None) for p in PATTERNS]
    if config.num_microbatches > 1:
        levels = ["last", "replica_last"] if config.mesh.kind == "hsdp" else ["last"]
        moves += [_on_blocks("sync", p, level, "every") for level in levels for p in PATTERNS]
        moves += [_on_blocks("reshard_after_backward", p, False, True) for p in PATTERNS]
        moves += [_when_some_sync_last(_on_blocks("defer_concat", p, False, True)) for p in ("all", "none")]
    for knob in get_method_knobs():  # the registry's, in its order ([Note: the knob registry])
        if device_type in knob.move_devices:
            moves += [_config_field(knob.name, value) for value in knob.moves]
    return moves
