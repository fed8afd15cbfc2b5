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


def get_tuner_example() -> str:
    """docs/in-job.md's code block that adds the in-job tuner to torchtitan's trainer."""
    text = (README.parent / "docs" / "in-job.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- torchtitan tuner -->\s*```python\n(.*?)```", text, re.S)
    assert match, "docs/in-job.md has no <!-- torchtitan tuner --> code block"
    return match.group(1)


def _stand_in_trainer(model: str, world_size: int) -> type:
    """A stand-in for ``torchtitan.train.Trainer`` (whose data, metrics and checkpoint packages
    are not installed): torchtitan 0.2.2's llama3 sharded by torchtitan's own ``apply_fsdp``, and
    a train step of ``Trainer.train_step``'s shape (the loss summed over tokens and divided by the
    global token count, FSDP2's gradient division off, 2 microbatches, no sync knob). Gloo has no
    ``PREMUL_SUM``, FSDP2's reduction without division, so the units reduce with a plain sum."""
    from torch.distributed.device_mesh import init_device_mesh

    from profiles.sources import load_model_source

    source = load_model_source(model)
    source.build(device="meta")  # first: torchtitan's packages entered without its trainer's imports
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.models.llama3.infra.parallelize import apply_fsdp

    class Trainer:
        def __init__(self) -> None:
            module = source.build(seed=0)
            mesh = init_device_mesh("cpu", (world_size,))
            apply_fsdp(module, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)
            for unit in module.modules():  # no division, as torchtitan has it, in a sum gloo can do (no PREMUL_SUM)
                if hasattr(unit, "set_force_sum_reduction_for_comms"):
                    unit.set_force_sum_reduction_for_comms(True)
            self.model_parts = [module]
            self.optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
            self.losses: list[float] = []

        def train_step(self, data_iterator) -> None:
            self.optimizer.zero_grad()
            microbatches = next(data_iterator)
            global_tokens = sum(b[:, 1:].numel() for b in microbatches) * world_size
            total = 0.0
            for batch in microbatches:
                loss = cross_entropy_loss(self.model_parts[0](batch[:, :-1]), batch[:, 1:]) / global_tokens
                loss.backward()
                total += loss.item()
            self.optimizer.step()
            self.losses.append(total)

    return Trainer


def run_tuned_trainer(
    rank: int, world_size: int, *, model: str, num_steps: int, tuner: dict[str, Any] | None, out: str
) -> dict[str, Any]:
    """docs/in-job.md's ``TunedTrainer`` executed as written (on CPU, ``out`` for its path) over the
    stand-in trainer, or the stand-in untuned where ``tuner`` is None: this rank's losses, the
    tuner's decisions, and what ``adopt_fsdp`` says of a config that is not torchtitan's sharding."""
    import functools
    import sys
    import types

    from fsdp_runtime import ConfigError, adopt_fsdp, default_config
    from profiles.sources import load_model_source

    stand_in = types.ModuleType("torchtitan.train")
    stand_in.Trainer = _stand_in_trainer(model, world_size)
    sys.modules["torchtitan.train"] = stand_in
    scope: dict[str, Any] = {}
    code = get_tuner_example().replace('device_type="cuda"', 'device_type="cpu"').replace('"tuned.toml"', repr(out))
    exec(compile(code, "docs/in-job.md", "exec"), scope)
    trainer = (scope["TunedTrainer"] if tuner is not None else stand_in.Trainer)()
    refused = None
    try:  # FSDP2's defaults name the blocks and the root only: torchtitan also shards the edges
        adopt_fsdp(trainer.model_parts[0], default_config([f"layers.{i}" for i in range(6)]))
    except ConfigError as e:
        refused = str(e)
    if tuner is not None:  # the block's own line builds the tuner, with the test's window
        scope["InJobTuner"] = functools.partial(scope["InJobTuner"], **tuner)
    source = load_model_source(model)
    batches = iter([_batches(source, rank, step, 2) for step in range(num_steps)])
    for _ in range(num_steps):
        trainer.train_step(batches)
    out_dict: dict[str, Any] = {"losses": trainer.losses, "refused": refused}
    if tuner is not None:
        out_dict |= {
            "decisions": [(d.name, d.outcome) for d in trainer.tuner.decisions],
            "finished": trainer.tuner.finished,
        }
    return out_dict
