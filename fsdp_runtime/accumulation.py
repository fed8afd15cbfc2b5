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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from fsdp_runtime.apply import AppliedFsdp
from fsdp_runtime.config import UnitConfig


class GradAccumulator:
    """Sets each unit's FSDP2 state before a microbatch's forward, as the config says.

    On a non-final microbatch a unit with ``sync = "every"`` reduce-scatters (and, under
    HSDP, all-reduces); ``replica_last`` reduce-scatters but skips the replica all-reduce;
    ``last`` skips both and accumulates unsharded gradients. ``reshard_after_backward``
    applies to non-final microbatches; the final microbatch always syncs and reshards.
    """

    def __init__(self, applied: AppliedFsdp, *, num_microbatches: int | None = None) -> None:
        self.applied = applied
        self.num_microbatches = num_microbatches or applied.config.num_microbatches

    def set_microbatch(self, index: int) -> None:
        if not 0 <= index < self.num_microbatches:
            raise ValueError(f"microbatch index {index} outside 0..{self.num_microbatches - 1}")
        is_last = index == self.num_microbatches - 1
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
