"""Rank program of tests/profiles/test_torchtitan.py: a torchtitan model in a training loop of
torchtitan's shape (its model, its loss on its output), sharded by a config, by hand, or not at all;
and the README's torchtitan example, run as written."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any

import torch

README = Path(__file__).resolve().parents[2] / "README.md"
UNSHARDED_REL_TOL = 1e-4  # FSDP vs a single process without it (docs/config.md, "Math")


def get_readme_example() -> str:
    """The README's code block that applies an emitted config inside a torchtitan job."""
    text = README.read_text(encoding="utf-8")
    match = re.search(r"<!-- torchtitan example -->\s*```python\n(.*?)```", text, re.S)
    assert match, "README.md has no <!-- torchtitan example --> code block"
    return match.group(1)


def _batches(source, rank: int, step: int, num_microbatches: int) -> list[torch.Tensor]:
    from autotune.trials.training import make_microbatch

    return [make_microbatch(source, seed=0, step=step, microbatch=m, dp_rank=rank) for m in range(num_microbatches)]


def _train(source, rank: int, configure, num_microbatches: int, num_steps: int) -> list[float]:
    """torchtitan's train step: per microbatch ``cross_entropy_loss(model(inputs), labels)`` over
    the tokens, backward; then one optimizer step."""
    from torchtitan.components.loss import cross_entropy_loss

    model = source.build(seed=0)
    step_context = configure(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(num_steps):
        total = 0.0
        for m, batch in enumerate(_batches(source, rank, step, num_microbatches)):
            inputs, labels = batch[:, :-1], batch[:, 1:]
            with step_context(m):
                loss = cross_entropy_loss(model(inputs), labels) / labels.numel() / num_microbatches
                loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


def _unsharded(source, world_size: int, num_microbatches: int, num_steps: int) -> list[list[float]]:
    """One process, no FSDP, every rank's microbatches: each rank's losses as it would see them."""
    from torchtitan.components.loss import cross_entropy_loss

    model = source.build(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per_rank: list[list[float]] = [[] for _ in range(world_size)]
    for step in range(num_steps):
        totals = [0.0] * world_size
        for m in range(num_microbatches):
            batches = [_batches(source, r, step, num_microbatches)[m] for r in range(world_size)]
            losses = [
                cross_entropy_loss(model(b[:, :-1]), b[:, 1:]) / b[:, 1:].numel() / num_microbatches for b in batches
            ]
            torch.stack(losses).mean().backward()  # FSDP averages gradients over ranks
            for r, loss in enumerate(losses):
                totals[r] += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        for r in range(world_size):
            per_rank[r].append(totals[r])
    return per_rank


def train_torchtitan(
    rank: int, world_size: int, *, model: str, configs: dict[str, dict[str, Any]], num_steps: int = 2
) -> dict[str, list[float]]:
    """This rank's losses per config (apply_fsdp + GradAccumulator), for ``fully_shard`` by hand
    (each block, then the root, FSDP2's defaults), without FSDP, and for the README's example."""
    from torch.distributed.fsdp import fully_shard

    from fsdp_runtime import GradAccumulator, apply_fsdp, config_from_dict
    from profiles.sources import load_model_source

    source = load_model_source(model)
    num_microbatches = next(iter(configs.values()))["num_microbatches"]

    def by_hand(module):
        for name in source.block_names:
            fully_shard(module.get_submodule(name))
        fully_shard(module)
        return lambda m: contextlib.nullcontext()

    def by_config(config):
        def configure(module):
            return GradAccumulator(apply_fsdp(module, config_from_dict(config))).microbatch

        return configure

    out = {
        "unsharded": _unsharded(source, world_size, num_microbatches, num_steps)[rank],
        "fully_shard": _train(source, rank, by_hand, num_microbatches, num_steps),
    }
    for name, config in configs.items():
        out[name] = _train(source, rank, by_config(config), num_microbatches, num_steps)
    return out


def run_readme_example(rank: int, world_size: int, *, model: str, config_path: str, num_steps: int = 2) -> list[float]:
    """The README's torchtitan example, executed as written on a fresh torchtitan model: its block
    applies the config (the path replaced by ``config_path``), then ``train_step`` runs each step."""
    from fsdp_runtime import load_config
    from profiles.sources import load_model_source

    source = load_model_source(model)
    scope: dict[str, Any] = {"model": source.build(seed=0)}
    code = get_readme_example().replace('"runs/search/best.toml"', repr(config_path))
    exec(compile(code, "README.md", "exec"), scope)
    optimizer = torch.optim.AdamW(scope["model"].parameters(), lr=1e-3)  # built after sharding, as torchtitan does
    num_microbatches = load_config(config_path).num_microbatches
    return [
        scope["train_step"]([(b[:, :-1], b[:, 1:]) for b in _batches(source, rank, step, num_microbatches)], optimizer)
        for step in range(num_steps)
    ]
