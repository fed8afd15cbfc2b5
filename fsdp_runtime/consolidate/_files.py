"""Consolidated checkpoint files: save on rank 0 atomically, load into a sharded model.

Both are collective, and every rank agrees on the outcome: when rank 0 fails (to write,
or to read), it re-raises its error and every other rank raises :class:`CheckpointError`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor

from fsdp_runtime.config import ConsolidationMethod
from fsdp_runtime.consolidate._all_gather import DEFAULT_BUCKET_BYTES
from fsdp_runtime.consolidate._leaves import StateDict, get_rank
from fsdp_runtime.consolidate._state import consolidate_state
from fsdp_runtime.errors import AutotuneError
from fsdp_runtime.files import atomic_path

CHECKPOINT_FORMAT = "fsdp_runtime.consolidated_checkpoint"
CHECKPOINT_VERSION = 1


class CheckpointError(AutotuneError):
    """A consolidated checkpoint could not be written or read; the message says why."""


def save_consolidated_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    method: ConsolidationMethod = "all_gather",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Consolidate onto rank 0 and write one file there, atomically; collective.

    Rank 0 writes a hidden temporary file next to ``path`` and renames it to ``path``
    only once it is complete, so a failure at any point (a rank dying mid-consolidation,
    rank 0 dying mid-write, a full disk) never leaves a partial file at ``path``. All
    ranks then agree on the outcome: if rank 0's write failed it re-raises its error and
    every other rank raises :class:`CheckpointError`. ``metadata`` (plain data) is stored
    alongside the state. Returns ``path``.
    """
    path = Path(path)
    model_sd, optim_sd = consolidate_state(
        model, optimizer, method=method, to_cpu=True, rank0_only=True, bucket_bytes=bucket_bytes
    )
    error: BaseException | None = None
    if get_rank() == 0:
        payload = {
            "format": CHECKPOINT_FORMAT,
            "schema_version": CHECKPOINT_VERSION,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "metadata": dict(metadata or {}),
            "model": model_sd,
            "optimizer": optim_sd,
        }
        try:
            _write_atomically(payload, path)
        except Exception as e:  # re-raised below, after the other ranks were told
            error = e
    _agree_on_outcome(error, f"rank 0 failed to write the checkpoint {path}; nothing was written at that path")
    return path


def load_consolidated_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    source: str | Path | tuple[StateDict, StateDict] | None,
) -> None:
    """Load a full state into a freshly sharded ``model`` (and ``optimizer``); collective.

    ``source`` is a checkpoint path or a ``(model_sd, optim_sd)`` pair from
    :func:`consolidate_state`; only rank 0's ``source`` is used (only rank 0 needs the
    file), so other ranks may pass ``None``. Rank 0 broadcasts every tensor and each rank
    keeps its shard. Build the model with :func:`~fsdp_runtime.apply_fsdp` and the
    optimizer over its parameters first, exactly as for training.
    """
    model_sd: StateDict = {}
    optim_sd: StateDict = {}
    error: BaseException | None = None
    if get_rank() == 0:
        try:
            model_sd, optim_sd = _read_source(source)
            if optimizer is not None and not optim_sd:
                raise CheckpointError(
                    "the checkpoint holds no optimizer state (load the model alone with optimizer=None)"
                )
        except Exception as e:  # re-raised below, after the other ranks were told
            error = e
    _agree_on_outcome(error, "rank 0 could not read the checkpoint to load")
    # DCP writes the sharded values into the dicts it is given: pass copies, so that the
    # caller's state (e.g. straight from consolidate_state) stays full.
    model_sd, optim_sd = _copy_containers(model_sd), _copy_containers(optim_sd)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, model_sd, options=options)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, optim_sd, options=options)
        _restore_param_group_options(optimizer, optim_sd)
        _unshare_replicated_state(optimizer)


def _unshare_replicated_state(optimizer: torch.optim.Optimizer) -> None:
    """Give the optimizer its own copy of every unsharded state tensor.

    DCP hands rank 0's unsharded values (AdamW's ``step``) to the optimizer as they are,
    so ``optimizer.step()`` would increment the caller's tensor (or the memory-mapped
    file's pages) in place.
    """
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                state[key] = value.clone()


def _restore_param_group_options(optimizer: torch.optim.Optimizer, optim_sd: StateDict) -> None:
    """Set each group's hyper-parameters to rank 0's, exactly (types included).

    DCP's full-state load flattens the state dict and rebuilds it, which turns tuples
    in ``param_groups`` into lists (AdamW's ``betas``).
    """
    options = [[{k: v for k, v in g.items() if k != "params"} for g in optim_sd.get("param_groups", [])]]
    if dist.is_initialized():
        dist.broadcast_object_list(options, src=0)
    if len(options[0]) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint has {len(options[0])} optimizer param groups, the optimizer {len(optimizer.param_groups)}"
        )
    for group, saved in zip(optimizer.param_groups, options[0]):
        group.update(saved)


def _copy_containers(value: Any) -> Any:
    """Copy the dicts and lists of a state dict; the tensors and other values are shared."""
    if isinstance(value, dict):
        return {k: _copy_containers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_containers(v) for v in value]
    return value


def _write_atomically(payload: dict[str, Any], path: Path) -> None:
    """``torch.save`` to a hidden temporary name, fsync, then rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())


def _read_source(source: str | Path | tuple[StateDict, StateDict] | None) -> tuple[StateDict, StateDict]:
    if isinstance(source, tuple) and len(source) == 2:
        return source
    if not isinstance(source, (str, Path)):
        raise CheckpointError(
            f"cannot load from {type(source).__name__} (pass a checkpoint path or a (model_sd, optim_sd) pair on rank 0)"
        )
    try:
        payload = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(
            f"{source}: not a readable checkpoint ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{source}: not a consolidated checkpoint written by save_consolidated_checkpoint")
    if payload.get("schema_version") != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{source}: checkpoint schema_version {payload.get('schema_version')} is not {CHECKPOINT_VERSION}"
        )
    return payload["model"], payload["optimizer"]


def _agree_on_outcome(error: BaseException | None, message: str) -> None:
    """Tell every rank whether rank 0 failed; rank 0 re-raises, the others raise CheckpointError."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    outcome = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(outcome, src=0)
    if error is not None:
        raise error
    if outcome[0] is not None:
        raise CheckpointError(f"{message} ({outcome[0]})")
