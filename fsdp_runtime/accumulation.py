"""Gradient accumulation driver: per microbatch, each unit's sync/all-reduce/reshard state.

Usage in a training loop::

    accumulator = GradAccumulator(applied)
    for step in range(num_steps):
        for i, microbatch in enumerate(microbatches):
            with accumulator.microbatch(i):
                loss = loss_fn(model(microbatch)) / accumulator.num_microbatches
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()

[Note: an optimizer step mid-cycle]
The final microbatch (index ``num_microbatches - 1``) is the one every unit syncs and reshards
on. A loop that runs fewer microbatches per optimizer step than the accumulator counts never
enters it, and the step would go wrong without a sound: a ``sync = "last"`` unit never
reduce-scatters (its parameters never learn: the optimizer sees no sharded gradient), under
HSDP a ``sync = "replica_last"`` unit never all-reduces across replicas (the replicas drift
apart), and a unit with ``reshard_after_backward = false`` stays unsharded, so the next forward
runs on its parameters from before the step (FSDP2 does not all-gather a unit that is
unsharded). So each accumulator registers a global optimizer step pre-hook
(``torch.optim.optimizer.register_optimizer_step_pre_hook``; the user's plain
``optimizer.step()`` is enough, no optimizer is handed over). The hook holds the accumulator
through a weak reference and is removed when the accumulator is collected. It does nothing
unless the accumulator is mid-cycle (a non-final microbatch entered, the final one not yet):
then, if the stepping optimizer holds a parameter of the accumulator's model and some unit has
skipped something on the microbatches run, it raises :class:`AccumulationError` naming the
counts, the units and the fix. A config whose every unit syncs (and, under HSDP, all-reduces)
and reshards on every microbatch skips nothing: a step after any microbatch loses nothing, and
it passes.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp_runtime._fsdp_private import get_sharded_params
from fsdp_runtime.apply import AppliedFsdp
from fsdp_runtime.config import UnitConfig
from fsdp_runtime.errors import AutotuneError

__all__ = ["AccumulationError", "GradAccumulator"]


class AccumulationError(AutotuneError, RuntimeError):
    """An optimizer step before the accumulation cycle's final microbatch ([Note: an optimizer step mid-cycle])."""


class GradAccumulator:
    """Sets each unit's FSDP2 state before a microbatch's forward, as the config says.

    On a non-final microbatch a unit with ``sync = "every"`` reduce-scatters (and, under
    HSDP, all-reduces); ``replica_last`` reduce-scatters but skips the replica all-reduce;
    ``last`` skips both and accumulates unsharded gradients. ``reshard_after_backward``
    applies to non-final microbatches; the final microbatch always syncs and reshards. An
    optimizer step before the final microbatch that would skip any of that raises
    :class:`AccumulationError` ([Note: an optimizer step mid-cycle]).
    """

    def __init__(self, applied: AppliedFsdp, *, num_microbatches: int | None = None) -> None:
        self.applied = applied
        self.num_microbatches = num_microbatches or applied.config.num_microbatches
        self.entered: int | None = None
        """The non-final microbatch entered last in this cycle; None once the final one is entered."""
        handle = register_optimizer_step_pre_hook(functools.partial(_check_step, weakref.ref(self)))
        weakref.finalize(self, handle.remove)

    def set_microbatch(self, index: int) -> None:
        if not 0 <= index < self.num_microbatches:
            raise ValueError(f"microbatch index {index} outside 0..{self.num_microbatches - 1}")
        is_last = index == self.num_microbatches - 1
        self.entered = None if is_last else index
        for unit in self.applied.config.units:
            self.set_unit_state(unit, is_last=is_last)

    def set_unit_state(self, unit: UnitConfig, *, is_last: bool) -> None:
        """One unit's sync, replica all-reduce and reshard-after-backward for a (last or not) microbatch."""
        module = self.applied.units[unit.name]
        module.set_requires_gradient_sync(is_last or unit.sync != "last", recurse=False)
        if self.applied.config.mesh.kind == "hsdp":
            module.set_requires_all_reduce(is_last or unit.sync == "every", recurse=False)
        module.set_reshard_after_backward(is_last or unit.reshard_after_backward, recurse=False)

    @contextlib.contextmanager
    def microbatch(self, index: int) -> Iterator[None]:
        """Context for the forward and backward of microbatch ``index`` (0-based)."""
        self.set_microbatch(index)
        yield

    def get_skipped(self) -> list[str]:
        """What the units skip on a non-final microbatch, one phrase per kind (empty: nothing)."""
        config = self.applied.config
        kinds = [
            ("sync='last'", "have not reduced their gradients", [u for u in config.units if u.sync == "last"]),
            (
                "sync='replica_last'",
                "have not all-reduced their gradients across replicas",
                [u for u in config.units if u.sync == "replica_last"],  # HSDP only (validated)
            ),
            (
                "reshard_after_backward=false",
                "are still unsharded (the next forward would run on their parameters from before the step)",
                [u for u in config.units if not u.reshard_after_backward],
            ),
        ]
        return [f"units with {knob} ({_shown([u.name for u in units])}) {what}" for knob, what, units in kinds if units]

    def check_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise where ``optimizer`` steps this model mid-cycle and a unit skipped something ([Note: an
        optimizer step mid-cycle]); nothing otherwise."""
        if self.entered is None:
            return
        skipped = self.get_skipped()
        if not skipped or not self._is_stepped_by(optimizer):
            return
        raise AccumulationError(
            f"GradAccumulator: optimizer step after microbatch {self.entered + 1} of {self.num_microbatches}: "
            f"{'; '.join(skipped)}; run every microbatch before the step, "
            f"or GradAccumulator(applied, num_microbatches={self.entered + 1})"
        )

    def _is_stepped_by(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` holds one of this model's parameters (sharded, or not managed by FSDP2)."""
        ids = {id(p) for p in self.applied.model.parameters()}
        ids |= {id(p) for module in self.applied.units.values() for p in get_sharded_params(module)}
        return any(id(p) in ids for group in optimizer.param_groups for p in group["params"])


def _check_step(accumulator: weakref.ref[GradAccumulator], optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """The global step pre-hook: the accumulator's check, while the accumulator lives."""
    live = accumulator()
    if live is not None:
        live.check_step(optimizer)


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
