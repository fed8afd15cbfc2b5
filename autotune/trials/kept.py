"""The reference's model kept warm in a rank pool's processes from one trial to the next.

[Note: a warm reference]
Every trial of a search measures its candidate against the same reference, FSDP2's defaults
([Note: paired measurement] in :mod:`autotune.trials.paired`). Where the two differ in structure
(mesh, grouping, checkpointing: most of what a search of ``small`` tries), the reference had a
model of its own on CPU, built and warmed up again in every trial: a build and ``num_warmup``
steps of the slowest config (about 1.6 s of a 10-12 s trial of the README's main command, and
the same again in every final-round trial). Nothing about it changed between trials. So a
trial with ``keep_reference`` (the search sets it on every trial it runs in its rank pool) keeps
the model of its reference config alive in each rank process when it ends, and the next trial
with the same reference (same model, config, seed, world and device) steps it where it stopped:

- *no build, no warm-up step*: it is warm, it just ran steps of its own config. The candidate
  stepped last (its own warm-up), so the pairs start with the candidate and the reference's
  first step is the first pair's settle step, as where the reference is the candidate's model
  switched in place (``get_pairs_first`` in :mod:`autotune.trials.program`). The defaults
  trial (the reference paired with itself) and the search's warm-up run step the kept model as
  their candidate: the warm-up run builds it, the defaults trial does not build it and takes one
  warm-up step, not ``num_warmup``. One, because every trial starts by returning the freed heap
  to the system (``malloc_trim``, so that its peak is its own), and the first step after that
  re-faults it: a defaults trial that measured that step took its first step 1.33x its others
  and its ratio to itself came out 0.906 (``small``, the README's main command; the reference
  side's first step is a settle step, never measured);
- *the measurement* is unchanged: ABBA blocks, a settle step after every switch, the same
  reference config. Its training goes on across trials (its losses are not recorded: only the
  candidate's are);
- *memory*: the kept model stays resident while a candidate is built and steps. On CPU the
  trial's peaks are the process's resident set, so its live tensors (``live_bytes``:
  parameters, gradients, optimizer state, buffers, counted by storage) are taken off the
  candidate's peak, and off the trial's peak where the kept model is not one of the trial's
  sides; its freed step memory was returned before the trial (``malloc_trim``). The defaults
  trial's candidate peak is the one measured when the model was built;
- *only where it is safe*: CPU only (on CUDA a second resident model is the memory a paired
  trial must not hold: [Note: models built in turn] in :mod:`autotune.trials.in_turn`); no
  pipeline stages; every rank must hold it (an all-reduce of "I have it" at the trial's start:
  a rank restarted alone, or a default group made anew, builds afresh on every rank, never on
  one while the other skips the build's collectives); a trial that raises drops it; a trial
  without ``keep_reference``, or with another reference, drops it first, so a pool holds at
  most one kept model and a trial outside a search sees none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class KeptModel:
    """The reference's model and where it stopped."""

    key: str
    training: Any
    next_step: int
    peak_bytes: int | None
    """Its peak when it was built as its trial's candidate: what a trial that steps it as its
    candidate reports; None: built as a reference, after a candidate (such a trial builds afresh)."""
    live_bytes: int
    """Its live tensors' bytes (:func:`get_live_bytes`): taken off peaks it is not part of."""
    group: Any
    """The default process group it was built on: a group made anew since means it is stale."""


_KEPT: KeptModel | None = None


def get_key(spec: dict[str, Any], device: torch.device) -> str:
    """What a kept model must match to serve a trial: its reference config (the candidate's where
    it has none), model, seed, world and device."""
    config = spec.get("reference") or spec["config"]
    return json.dumps([spec["model"], config, spec["seed"], spec["world_size"], device.type], sort_keys=True)


def can_keep(spec: dict[str, Any], device: torch.device) -> bool:
    """The trial asks for it and runs where it is safe (CPU; [Note: a warm reference])."""
    return bool(spec.get("keep_reference")) and device.type == "cpu"


def take(key: str, device: torch.device) -> KeptModel | None:
    """The kept model for ``key`` where every rank holds it (a collective: every rank calls this),
    else None; a kept model that is not used is dropped first."""
    global _KEPT
    mine = _KEPT is not None and _KEPT.key == key and _KEPT.group is dist.group.WORLD
    if not mine:
        drop()
    everyone = torch.tensor([1 if mine else 0], dtype=torch.int32, device=device)
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN)
    if not everyone.item():
        drop()
        return None
    return _KEPT


def keep(key: str, training: Any, next_step: int, peak_bytes: int | None) -> None:
    """Keep ``training`` for the next trial with the same reference (not a pipeline's)."""
    global _KEPT
    if getattr(training, "pipeline", None) is not None:
        drop()
        return
    _KEPT = KeptModel(key, training, next_step, peak_bytes, get_live_bytes(training), dist.group.WORLD)


def drop() -> None:
    """Forget the kept model (its memory is returned by the caller's release)."""
    global _KEPT
    _KEPT = None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def get_live_bytes(training: Any) -> int:
    """Bytes of the storages a trained model keeps between steps: its parameters (local shards),
    their gradients, its buffers and its optimizer's state, each storage counted once."""
    tensors = []
    for param in training.model.parameters():
        tensors.append(_local(param))
        if param.grad is not None:
            tensors.append(_local(param.grad))
    tensors += [_local(b) for b in training.model.buffers()]
    for state in training.optimizer.state.values():
        tensors += [_local(v) for v in state.values() if isinstance(v, torch.Tensor)]
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
