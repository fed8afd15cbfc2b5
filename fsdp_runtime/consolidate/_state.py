""":func:`consolidate_state`: the full state by any method, and the optimizer's state by FQN."""

from __future__ import annotations

import torch
from torch import nn

from fsdp_runtime.config import CONSOLIDATION_METHODS as METHODS
from fsdp_runtime.config import ConsolidationMethod as Method
from fsdp_runtime.consolidate._all_gather import DEFAULT_BUCKET_BYTES, gather_packed
from fsdp_runtime.consolidate._broadcast import gather_by_broadcast
from fsdp_runtime.consolidate._dcp import consolidate_with_dcp
from fsdp_runtime.consolidate._leaves import StateDict, copy_local, find_leaves, get_rank
from fsdp_runtime.errors import ConfigError

# Module wrappers whose attribute name appears in named_parameters() but not in the
# FQNs torch.distributed.checkpoint uses (activation checkpointing, torch.compile).
_WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod")


def consolidate_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    method: Method = "all_gather",
    to_cpu: bool = True,
    rank0_only: bool = True,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> tuple[StateDict, StateDict]:
    """Gather the full model and optimizer state of a sharded ``model``; collective.

    Every rank must call it. Returns ``(model_state_dict, optimizer_state_dict)`` with
    full tensors on rank 0 (on every rank when ``rank0_only`` is False) and ``({}, {})``
    elsewhere; the optimizer dict is ``{}`` when ``optimizer`` is None. ``to_cpu`` places
    the result in CPU memory. ``bucket_bytes`` caps one all-gather's output
    (``all_gather`` only). The returned tensors never alias the live model or optimizer.
    """
    check_method(method)
    if bucket_bytes < 1:
        raise ConfigError(
            "bucket_bytes", f"must be >= 1, got {bucket_bytes}", fix=f"the default is {DEFAULT_BUCKET_BYTES} (16 MiB)"
        )
    if method == "dcp":
        return consolidate_with_dcp(model, optimizer, to_cpu=to_cpu, rank0_only=rank0_only)
    model_sd = dict(model.state_dict())
    optim_sd = get_optimizer_state_by_fqn(model, optimizer) if optimizer is not None else {}
    leaves = find_leaves(model_sd) + (find_leaves(optim_sd["state"]) if optim_sd else [])
    keep = not rank0_only or get_rank() == 0
    sharded = [leaf for leaf in leaves if leaf.layout is not None]
    if method == "all_gather":
        gather_packed(sharded, keep=keep, rank0_only=rank0_only, to_cpu=to_cpu, bucket_bytes=bucket_bytes)
    else:
        gather_by_broadcast(sharded, keep=keep, rank0_only=rank0_only, to_cpu=to_cpu)
    if not keep:
        return {}, {}
    for leaf in leaves:
        if leaf.layout is None:
            leaf.container[leaf.key] = copy_local(leaf.value, to_cpu=to_cpu)
    return model_sd, optim_sd


def check_method(method: str) -> None:
    """Raise a one-line :class:`ConfigError` unless ``method`` is a consolidation method."""
    if method not in METHODS:
        raise ConfigError(
            "checkpoint.consolidation",
            f"unknown consolidation method {method!r}",
            fix=f"use one of {', '.join(METHODS)}",
        )


def get_optimizer_state_by_fqn(model: nn.Module, optimizer: torch.optim.Optimizer) -> StateDict:
    """The optimizer's state keyed by parameter FQN (still sharded; values are the live tensors).

    Same layout as ``get_optimizer_state_dict(..., full_state_dict=True)``: parameter
    groups keep every hyper-parameter and list their parameters by FQN.
    """
    fqn_of = {id(p): _clean_fqn(name) for name, p in model.named_parameters()}
    state: StateDict = {}
    groups = []
    for group in optimizer.param_groups:
        fqns = []
        for param in group["params"]:
            if id(param) not in fqn_of:
                raise ConfigError(
                    "optimizer",
                    "has a parameter that is not in the model",
                    fix="build the optimizer over model.parameters()",
                )
            fqn = fqn_of[id(param)]
            fqns.append(fqn)
            if param in optimizer.state:
                state[fqn] = dict(optimizer.state[param])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
    return {"state": state, "param_groups": groups}


def _clean_fqn(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)
