"""Rank program of tests/profiles/test_sources.py: a config in a plain training loop vs ``fully_shard`` by hand."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from fsdp_runtime import config_from_dict

REL_TOL = 1e-5  # sync = "last" / HSDP sum in another order (docs/config.md, "Math")


def order_preserving(config) -> bool:
    return config.mesh.kind == "fsdp" and all(u.sync == "every" for u in config.units)


def without_order_changes(config):
    """The config with every knob that reorders sums (HSDP, sync on the last microbatch only) set back."""
    units = [dataclasses.replace(u, sync="every", defer_concat=True) for u in config.units]
    return dataclasses.replace(
        config, mesh=dataclasses.replace(config.mesh, kind="fsdp", replicate=1, shard=None), units=units
    )


def _loss(module: nn.Module, batch, hf: bool) -> torch.Tensor:
    from profiles.factory import compute_loss

    if hf:  # as an HF training loop has it: the model's own shifted loss
        return module(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
    return compute_loss(module, batch)


def _train(source, rank: int, configure, num_microbatches: int, num_steps: int) -> list[float]:
    from autotune.trials.training import make_microbatch
    from profiles.hf import HFModel

    module = source.build(seed=0)
    step_context = configure(module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    hf = isinstance(source, HFModel)
    losses = []
    for step in range(num_steps):
        total = 0.0
        for m in range(num_microbatches):
            batch = make_microbatch(source, seed=0, step=step, microbatch=m, dp_rank=rank, model=module)
            with step_context(m):
                loss = _loss(module, batch, hf) / num_microbatches
                loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


def compare_with_fully_shard(
    rank: int, world_size: int, *, model: str, configs: dict[str, dict], num_steps: int = 2
) -> dict[str, list[float]]:
    """Per config (applied with apply_fsdp + GradAccumulator) and for ``fully_shard`` by hand
    (each block, then the root, FSDP2 defaults, syncing every microbatch): this rank's losses."""
    import warnings

    from torch.distributed.fsdp import fully_shard

    from fsdp_runtime import GradAccumulator, apply_fsdp
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
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a config resolved by position says so
                accumulator = GradAccumulator(apply_fsdp(module, config_from_dict(config)))
            return accumulator.microbatch

        return configure

    out = {"fully_shard": _train(source, rank, by_hand, num_microbatches, num_steps)}
    for name, config in configs.items():
        out[name] = _train(source, rank, by_config(config), num_microbatches, num_steps)
    return out
