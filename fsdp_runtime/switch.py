"""Switch an already sharded model from one runtime config to another, in place.

[Note: knobs switched in place]
A paired trial compares two configs on the same ranks ([Note: paired measurement] in
``autotune.trials.paired``). Where they differ only in knobs FSDP2 can change on a sharded
model, one model serves both sides and the pair alternates its knobs, so a trial holds one
model's memory, not two. Which knob is which, read from ``FSDPModule``'s setters and the
state they write in the ``torch/distributed/fsdp/_fully_shard/`` of torch 2.13 (the setters
of 2.11 were not read here: ``set_reshard_after_forward`` is probed, and without it a difference
in ``reshard_after_forward`` counts as structural; the others are in [Note: torch versions]):

- *In place* (:data:`UNIT_KNOBS_IN_PLACE`, :data:`CONFIG_KNOBS_IN_PLACE`):
  - ``forward_prefetch`` / ``backward_prefetch``: ``set_modules_to_{forward,backward}_prefetch``
    replace the state's lists; a fresh ``fully_shard`` starts them empty, so ``None`` (FSDP2's
    own prefetch) is the empty list again.
  - ``reshard_after_forward`` as a bool or ``None``: ``set_reshard_after_forward(bool,
    recurse=False)`` rewrites each param group's ``post_forward_mesh_info``, which is all the
    flag sets. ``None`` ("auto") is what a fresh build resolves at its first forward: False for
    the root, True for every other unit.
  - ``sync`` and ``reshard_after_backward``: per microbatch, from the config
    (:class:`~fsdp_runtime.GradAccumulator` reads ``applied.config``).
  - ``defer_concat``: :class:`~fsdp_runtime._fsdp_private.EagerConcat` wraps the param groups'
    ``post_backward`` per instance; removing the wrapper restores FSDP2's own.
  - ``unshard_async`` (``_set_unshard_async_op``) and ``reduce_scatter_max_input_buffers``
    (its setter; ``None`` is FSDP2's 1): plain setters, the registry's method knobs
    ([Note: the knob registry] in :mod:`fsdp_runtime.knobs`).
- *Structural* (a rebuild): the mesh and pipeline (other process groups and DTensor
  placements), the units and their ``modules`` (other ``fully_shard`` calls: other param
  groups and flat buffers), ``activation_checkpointing`` (wraps forwards before sharding),
  ``mixed_precision`` (fixed in each param group at ``fully_shard``), ``reshard_after_forward``
  as an int (a second, smaller mesh per unit), ``num_microbatches`` (another batch) and
  ``unlisted_blocks`` (another wrapping).
- *Neither*: ``checkpoint`` and ``provenance`` do not touch training.

Switch between optimizer steps only: no gradient, all-gather or eager-concat buffer is then in
flight. None of the in-place knobs changes what is computed, only when and where; a model
switched to a config trains exactly as a fresh build of it from the same weights (losses
bitwise on CPU where the knobs keep the order of the sums: tests/fsdp_runtime/test_switch.py).
"""

from __future__ import annotations

import dataclasses

from torch.distributed.fsdp import FSDPModule

from fsdp_runtime._fsdp_private import EagerConcat
from fsdp_runtime.apply import AppliedFsdp, resolve_units
from fsdp_runtime.config import ROOT_UNIT, RuntimeConfig, UnitConfig
from fsdp_runtime.knobs import KNOBS, set_method_knobs
from fsdp_runtime.validation import validate_config

__all__ = [
    "CONFIG_KNOBS_IN_PLACE",
    "UNIT_KNOBS_IN_PLACE",
    "get_structural_differences",
    "resolve_reshard_after_forward",
    "set_knobs_in_place",
    "switch_config",
]

UNIT_KNOBS_IN_PLACE = tuple(k.name for k in KNOBS if k.scope == "unit" and k.in_place)
""":class:`~fsdp_runtime.UnitConfig` fields a sharded model switches in place ([Note: knobs switched in
place]; read from the registry, [Note: the knob registry]); ``reshard_after_forward`` as a bool or
None, an int is structural."""
CONFIG_KNOBS_IN_PLACE = tuple(k.name for k in KNOBS if k.scope == "config" and k.in_place)
""":class:`~fsdp_runtime.RuntimeConfig` fields a sharded model switches in place."""
_CONFIG_NEITHER = ("units", "checkpoint", "provenance", "schema_version")


def _is_structural_reshard(value: bool | int | None) -> bool:
    can_set = hasattr(FSDPModule, "set_reshard_after_forward")
    return not can_set or (value is not None and not isinstance(value, bool))


def get_structural_differences(a: RuntimeConfig, b: RuntimeConfig) -> list[str]:
    """The fields of two *resolved* configs (units filled in, as ``AppliedFsdp.config``) that
    differ and need a rebuild; empty: ``b`` can be switched to in place on a model sharded as ``a``."""
    differences = [
        f.name
        for f in dataclasses.fields(RuntimeConfig)
        if f.name not in (*CONFIG_KNOBS_IN_PLACE, *_CONFIG_NEITHER) and getattr(a, f.name) != getattr(b, f.name)
    ]
    if a.mesh.pp > 1 and "mesh" not in differences:
        differences.append("mesh.pp")  # stages: switching is not wired for pipelines
    if [(u.name, u.get_modules()) for u in a.units] != [(u.name, u.get_modules()) for u in b.units]:
        return [*differences, "units"]
    for i, (ua, ub) in enumerate(zip(a.units, b.units, strict=True)):
        if ua.activation_checkpointing != ub.activation_checkpointing:
            differences.append(f"units[{i}].activation_checkpointing")
        if ua.reshard_after_forward != ub.reshard_after_forward and (
            _is_structural_reshard(ua.reshard_after_forward) or _is_structural_reshard(ub.reshard_after_forward)
        ):
            differences.append(f"units[{i}].reshard_after_forward")
    return differences


def switch_config(applied: AppliedFsdp, config: RuntimeConfig, *, device_type: str) -> None:
    """Set every in-place knob of ``config`` on the model ``applied`` holds, and make ``config``
    (resolved against the model) its config; a structural difference raises ``ValueError``
    naming the fields. Call between optimizer steps."""
    validate_config(config)
    config = resolve_units(applied.model, config)
    structural = get_structural_differences(applied.config, config)
    if structural:
        raise ValueError(f"cannot switch in place, these fields need a rebuild: {', '.join(structural)}")
    set_knobs_in_place(applied, config, device_type=device_type)


def set_knobs_in_place(applied: AppliedFsdp, config: RuntimeConfig, *, device_type: str, every: bool = False) -> None:
    """Set every in-place knob of ``config`` (resolved, same structure) on ``applied``'s units and make it
    ``applied.config``. A method knob both configs leave at FSDP2's own value is not called (a torch
    without its method never turned it on); ``every``: each one this torch can set is
    (:func:`fsdp_runtime.knobs.set_method_knobs`).

    Unit by unit; where a setter raises, every unit set so far (and the one that raised) is set
    back to ``applied.config``'s knobs before the error is raised on, so a failed switch leaves the
    model on the config before it. Where setting one back raises too, ``RuntimeError`` says the
    model is left between the two."""
    done: list[str] = []
    try:
        for unit in config.units:
            done.append(unit.name)
            _set_unit(applied, config, unit, device_type=device_type, before=applied.config, every=every)
    except Exception as error:
        _roll_back(applied, config, done, device_type=device_type, every=every, error=error)
        raise
    applied.config = config


def _set_unit(
    applied: AppliedFsdp,
    config: RuntimeConfig,
    unit: UnitConfig,
    *,
    device_type: str,
    before: RuntimeConfig,
    every: bool,
) -> None:
    module = applied.units[unit.name]
    _set_prefetch(applied, unit)
    module.set_reshard_after_forward(resolve_reshard_after_forward(unit), recurse=False)
    set_method_knobs(module, config, device_type, before=before, every=every)
    _set_eager_concat(applied, unit)


def _roll_back(
    applied: AppliedFsdp, target: RuntimeConfig, names: list[str], *, device_type: str, every: bool, error: Exception
) -> None:
    """Set the units ``names`` back to ``applied.config``'s knobs after a switch to ``target`` failed at the last of them."""
    before = {unit.name: unit for unit in applied.config.units}
    for name in names:
        try:
            _set_unit(applied, applied.config, before[name], device_type=device_type, before=target, every=every)
        except Exception as again:
            raise RuntimeError(
                f"switching configs failed at unit {names[-1]} ({error}) and setting unit {name} back failed "
                f"too ({again}): the model is left between the two configs"
            ) from error


def _set_prefetch(applied: AppliedFsdp, unit: UnitConfig) -> None:
    module = applied.units[unit.name]
    module.set_modules_to_forward_prefetch([applied.units[n] for n in unit.forward_prefetch or []])
    module.set_modules_to_backward_prefetch([applied.units[n] for n in unit.backward_prefetch or []])


def resolve_reshard_after_forward(unit: UnitConfig) -> bool:
    """A bool or None (auto: what a fresh build resolves, False for the root and True elsewhere)."""
    if unit.reshard_after_forward is None:
        return unit.name != ROOT_UNIT
    return bool(unit.reshard_after_forward)


def _set_eager_concat(applied: AppliedFsdp, unit: UnitConfig) -> None:
    installed = applied.eager_concat.get(unit.name)
    if unit.defer_concat and installed is not None:
        installed.remove()
        del applied.eager_concat[unit.name]
    elif not unit.defer_concat and installed is None:
        applied.eager_concat[unit.name] = EagerConcat(applied.units[unit.name])
