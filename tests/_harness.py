"""Test-only multi-rank harness: rank programs and a single-process reference.

Ranks import this module by name (``_harness:train_configs``): ``tests/conftest.py`` puts
``tests/`` on ``sys.path`` and the launchers pass ``sys.path`` on to the ranks.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from autotune.trials.workload import LEARNING_RATE, build_training, compute_loss, make_microbatch, resolve_profile
from profiles import build_model


def train_losses(rank: int, world_size: int, *, model: str | dict[str, Any], config: dict[str, Any], num_steps: int, seed: int = 0) -> list[float]:
    """Rank program: train ``num_steps`` steps and return this rank's per-step losses."""
    training = build_training(rank, world_size, model=model, config=config, seed=seed)
    return [training.step(s) for s in range(num_steps)]


def reference_losses(*, model: str | dict[str, Any], world_size: int, num_microbatches: int, num_steps: int, seed: int = 0) -> list[list[float]]:
    """Single-process, non-FSDP run on the combined batch; per-step losses as each rank would see them."""
    profile = resolve_profile(model)
    torch.manual_seed(seed)
    module = build_model(profile, seed=seed)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE)
    per_rank: list[list[float]] = [[] for _ in range(world_size)]
    for s in range(num_steps):
        totals = [0.0] * world_size
        for m in range(num_microbatches):
            batches = [make_microbatch(profile, seed=seed, step=s, microbatch=m, dp_rank=r) for r in range(world_size)]
            losses = [compute_loss(module, b) / num_microbatches for b in batches]
            # FSDP averages gradients over ranks: the global loss is the mean of rank losses.
            (torch.stack(losses).mean()).backward()
            for r, loss in enumerate(losses):
                totals[r] += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for r in range(world_size):
            per_rank[r].append(totals[r])
    return per_rank


_COLLECTIVES = {
    "all_gather": ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"),
    "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"),
    "all_reduce": ("all_reduce",),
}


@contextlib.contextmanager
def count_collectives() -> Iterator[dict[str, int]]:
    """Count calls of the ``torch.distributed`` collectives FSDP2 issues (by kind) while active."""
    import torch.distributed as dist

    counts = {kind: 0 for kind in _COLLECTIVES}
    originals: dict[str, Any] = {}

    def wrap(kind: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[kind] += 1
            return fn(*args, **kwargs)

        return counted

    for kind, names in _COLLECTIVES.items():
        for name in names:
            if hasattr(dist, name):
                originals[name] = getattr(dist, name)
                setattr(dist, name, wrap(kind, originals[name]))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def train_configs(rank: int, world_size: int, *, model: str | dict[str, Any], configs: list[dict[str, Any]], num_steps: int, seed: int = 0) -> list[dict[str, Any]]:
    """Rank program: train each config from the same init in turn (one launch, many configs).

    Returns per config this rank's losses, the collectives it issued, and how many eager
    concats ran (diagnostics that prove a knob did something).
    """
    results = []
    for config in configs:
        with count_collectives() as counts:
            training = build_training(rank, world_size, model=model, config=config, seed=seed)
            losses = [training.step(s) for s in range(num_steps)]
        eager = sum(e.num_eager_concats for e in training.applied.eager_concat.values())
        results.append({"losses": losses, "collectives": dict(counts), "eager_concats": eager})
        del training
    return results
