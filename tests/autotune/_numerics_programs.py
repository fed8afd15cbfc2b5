"""Rank programs that plant a failure the numerics checks must catch ([Note: numerics checks] in
:mod:`autotune.trials.numerics`): a decoder whose blocks are skipped, and a ``switch_config`` that
does nothing. Each patches for its job only and restores what it patched (pooled ranks run on).

Ranks import this module by name (``_numerics_programs:...``): pytest puts this folder on
``sys.path`` and the launchers pass ``sys.path`` on to the ranks.
"""

from __future__ import annotations

from typing import Any

from autotune.trials import numerics, training
from profiles.llama import Llama


def _forward_without_blocks(self: Llama, tokens):
    """Llama's forward, its blocks skipped: embedding, norm, output."""
    return self.output(self.norm(self.tok_embeddings(tokens)))


def memorise_without_blocks(rank: int, world_size: int, **kwargs: Any) -> dict[str, Any]:
    """:func:`~autotune.trials.numerics.memorise_ranks` on a Llama whose forward skips its blocks."""
    original = Llama.forward
    Llama.forward = _forward_without_blocks
    try:
        return numerics.memorise_ranks(rank, world_size, **kwargs)
    finally:
        Llama.forward = original


def switch_doing_nothing(rank: int, world_size: int, **kwargs: Any) -> dict[str, Any]:
    """:func:`~autotune.trials.numerics.switch_ranks` with ``switch_config`` a no-op."""
    original = training.switch_config
    training.switch_config = lambda *args, **kw: None
    try:
        return numerics.switch_ranks(rank, world_size, **kwargs)
    finally:
        training.switch_config = original


def memorise_with_summed_gradients(rank: int, world_size: int, **kwargs: Any) -> dict[str, Any]:
    """:func:`~autotune.trials.numerics.memorise_ranks` with every unit's gradients summed over the
    ranks instead of averaged (sum-only reductions with ``set_gradient_divide_factor(1.0)``): the
    divide a sum-only reduction must still apply, gone."""
    original = numerics._build

    def build(*args: Any, **kw: Any) -> training.Training:
        built = original(*args, **kw)
        for module in built.applied.units.values():
            module.set_force_sum_reduction_for_comms(True)  # gloo has no premultiplied sum
            module.set_gradient_divide_factor(1.0)
        return built

    numerics._build = build
    try:
        return numerics.memorise_ranks(rank, world_size, **kwargs)
    finally:
        numerics._build = original
