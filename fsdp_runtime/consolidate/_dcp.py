"""``dcp`` consolidation: ``torch.distributed.checkpoint.state_dict``, the reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from fsdp_runtime.consolidate._leaves import StateDict, get_rank


def consolidate_with_dcp(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, *, to_cpu: bool, rank0_only: bool
) -> tuple[StateDict, StateDict]:
    # DCP's cpu_offload with full_state_dict already returns the state on rank 0 only.
    options = StateDictOptions(full_state_dict=True, cpu_offload=to_cpu and rank0_only)
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=options) if optimizer is not None else {}
    if rank0_only and get_rank() != 0:
        return {}, {}
    # DCP returns unsharded tensors that are already on the target device as they are:
    # e.g. AdamW's live ``step``, which the next optimizer.step() increments in place.
    live = _get_live_storages(model, optimizer)
    target = "cpu" if to_cpu else None

    def copy_if_live(t: torch.Tensor) -> torch.Tensor:
        t = t.to(target) if target else t
        return t.clone() if t.untyped_storage().data_ptr() in live else t

    return _map_tensors(model_sd, copy_if_live), _map_tensors(optim_sd, copy_if_live)


def _get_live_storages(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> set[int]:
    tensors = list(model.parameters()) + list(model.buffers())
    if optimizer is not None:
        tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    locals_ = (t.to_local() if isinstance(t, DTensor) else t for t in tensors)
    return {t.untyped_storage().data_ptr() for t in locals_}


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    return fn(value) if isinstance(value, torch.Tensor) else value
