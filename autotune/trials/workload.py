"""The training workload that trials and multi-rank tests run on every rank.

Data is synthetic and deterministic: microbatch ``m`` of step ``s`` on data-parallel rank
``r`` is drawn from a generator seeded by ``(seed, s, m, r)``, so a single-process
reference can rebuild the exact global batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_runtime import AppliedFsdp, GradAccumulator, apply_fsdp, config_from_dict
from profiles import ModelProfile, build_model, load_model_profile

LEARNING_RATE = 1e-3


def make_microbatch(profile: ModelProfile, *, seed: int, step: int, microbatch: int, dp_rank: int) -> torch.Tensor:
    """Token ids ``(batch_size, seq_len + 1)``: inputs are ``[:, :-1]``, targets ``[:, 1:]``."""
    key = ((seed * 1_000_003 + step) * 1_000_003 + microbatch) * 1_000_003 + dp_rank
    gen = torch.Generator().manual_seed(key % (2**62))
    return torch.randint(0, profile.shape.vocab_size, (profile.batch_size, profile.seq_len + 1), generator=gen)


def compute_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


@dataclass(kw_only=True)
class Training:
    """A sharded model, its optimizer and accumulation driver, ready to step."""

    profile: ModelProfile
    applied: AppliedFsdp
    optimizer: torch.optim.Optimizer
    accumulator: GradAccumulator
    seed: int
    dp_rank: int
    device: torch.device = torch.device("cpu")

    @property
    def model(self) -> nn.Module:
        return self.applied.model

    def step(self, step: int) -> float:
        """One optimizer step over all microbatches; returns this rank's loss (sum of microbatch losses)."""
        total = torch.zeros((), device=self.device)
        num = self.accumulator.num_microbatches
        for m in range(num):
            tokens = make_microbatch(self.profile, seed=self.seed, step=step, microbatch=m, dp_rank=self.dp_rank).to(self.device)
            with self.accumulator.microbatch(m):
                loss = compute_loss(self.model, tokens) / num
                loss.backward()
            total += loss.detach()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total.item()


def resolve_profile(model: str | dict[str, Any]) -> ModelProfile:
    """A profile name/path, or ``{"name": ..., **overrides}`` for a resized proxy."""
    if isinstance(model, str):
        return load_model_profile(model)
    overrides = dict(model)
    return load_model_profile(overrides.pop("name")).with_overrides(**overrides)


def build_training(
    rank: int, world_size: int, *, model: str | dict[str, Any], config: dict[str, Any], seed: int = 0, device: str | torch.device = "cpu"
) -> Training:
    """Build the profile's model on ``device``, shard it as ``config`` says, and add AdamW."""
    profile = resolve_profile(model)
    runtime_config = config_from_dict(config)
    torch.manual_seed(seed)
    module = build_model(profile, device=str(device), seed=seed)
    applied = apply_fsdp(module, runtime_config)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE)
    return Training(
        profile=profile, applied=applied, optimizer=optimizer, accumulator=GradAccumulator(applied), seed=seed, dp_rank=rank, device=torch.device(device)
    )
