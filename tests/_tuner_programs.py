"""Rank programs for the in-job tuner's multi-rank tests (``fsdp_runtime.tuning.injob``): a job
trained with the tuner around each optimizer step, as a user's loop has it."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from autotune.trials import build_training
from fsdp_runtime.tuning import InJobTuner, get_moves


def _checksum(training) -> float:
    """A sum of this rank's parameter shards and optimizer state: changed by any step that updated them."""
    plain = [n for n, p in training.model.named_parameters() if not hasattr(p, "to_local")]
    if plain:
        raise AssertionError(f"parameters left unsharded: {plain}")
    total = sum(float(p.detach().to_local().double().sum()) for p in training.model.parameters())
    for state in training.optimizer.state.values():
        total += sum(float(v.to_local().double().sum()) for v in state.values() if hasattr(v, "to_local"))
    return total


def train_tuned(
    rank: int,
    world_size: int,
    *,
    model: str,
    config: dict[str, Any],
    num_steps: int,
    moves: list[str],
    tuner: dict[str, Any],
    fail: dict[str, Any] | None = None,
    headroom: dict[str, int] | None = None,
    disagree: bool = False,
    env: dict[str, str] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Train ``num_steps`` steps with an in-job tuner over the moves named ``moves`` (in that
    order; on rank 1 the first two swapped where ``disagree``). ``fail``: the step under candidate
    ``fail["name"]`` raises ``fail["error"]`` (``oom``: ``torch.OutOfMemoryError``, else
    ``ValueError``) on rank ``fail["rank"]`` (every rank where absent), ``where`` ``start`` (before
    its forward: before the step's first collective) or ``forward`` (inside the last block's
    forward: mid-step). ``headroom``: rank ``headroom["rank"]`` reports ``headroom["bytes"]`` of
    headroom. Per step this rank's loss (None where the step raised), the candidate it ran, and the
    parameter/optimizer checksum after it; the decisions, the best config, the error where one
    stopped the job (its type, and whether the model was then on the best config)."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        job = (num_steps, moves, tuner, fail or {}, headroom, disagree)
        return _train_tuned(rank, world_size, model, config, job, seed)
    finally:  # the pool's ranks outlive this job
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _planted(fail: dict[str, Any], rank: int, where: str, running: str | None) -> None:
    if fail.get("where") == where and running == fail["name"] and fail.get("rank", rank) == rank:
        if fail.get("error") == "oom":
            raise torch.OutOfMemoryError(f"planted: CUDA out of memory ({where})")
        raise ValueError(f"planted: the job's own error ({where})")


def _train_tuned(rank, world_size, model, config, job, seed) -> dict[str, Any]:
    num_steps, moves, tuner, fail, headroom, disagree = job
    training = build_training(rank, world_size, model=model, config=config, seed=seed)
    by_name = {m.name: m for m in get_moves(training.applied.config, device_type="cpu")}
    if disagree and rank == 1:  # the first two moves swapped: prefetch depths, alike in their collectives
        moves = [moves[1], moves[0], *moves[2:]]
    chosen = [by_name[n] for n in moves]
    if headroom is not None and headroom["rank"] == rank:
        tuner = tuner | {"get_headroom": lambda: headroom["bytes"]}
    tuned = InJobTuner(training.applied, device_type="cpu", moves=chosen, **tuner)
    last = training.model.get_submodule(training.applied.config.units[-2].name)
    last.register_forward_hook(lambda module, args, output: _planted(fail, rank, "forward", tuned.running))
    losses, ran, checksums, error = [], [], [], None
    try:
        for s in range(num_steps):
            loss = None
            with tuned.step():
                ran.append(tuned.running)
                _planted(fail, rank, "start", tuned.running)
                loss = training.step(s)
            losses.append(loss)
            checksums.append(_checksum(training))
    except Exception as e:  # what stopped the job, as the job's own loop would see it
        print(f"rank {rank} stopped: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        error = {"type": type(e).__name__, "message": str(e), "on_best": training.applied.config == tuned.best}
    return {
        "losses": losses,
        "ran": ran,
        "checksums": checksums,
        "decisions": [(d.name, d.outcome) for d in tuned.decisions],
        "refused": tuned.refused,
        "best": tuned.best.units[0].forward_prefetch,
        "finished": tuned.finished,
        "error": error,
    }


def train_skipping(
    rank: int, world_size: int, *, model: str, config: dict[str, Any], num_steps: int, skip: list[int], seed: int = 0
) -> list[float | None]:
    """The untuned job, its steps ``skip`` left out (their batches never trained): per step this rank's loss or None."""
    training = build_training(rank, world_size, model=model, config=config, seed=seed)
    return [None if s in skip else training.step(s) for s in range(num_steps)]
