"""The leaves of a state dict, and how each sharded one is split over its shard group.

Shared by every consolidation method: a :class:`Leaf` is one value of the (nested) state
dict and the place its consolidated value goes; a :class:`ShardLayout` says which rows of
a ``Shard(0)`` DTensor each rank of its group holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_runtime.errors import ConfigError

StateDict = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """How a ``Shard(0)`` DTensor is split over its shard group (``torch.chunk`` rows)."""

    group: dist.ProcessGroup
    group_rank: int
    num_rows: list[int]
    """Rows held by each group rank (uneven or zero for the last ranks)."""
    chunk_rows: int
    """``ceil(rows / group size)``: the rows of every non-final shard, and the padded slot."""

    @property
    def group_size(self) -> int:
        return len(self.num_rows)

    @property
    def is_even(self) -> bool:
        return all(rows == self.chunk_rows for rows in self.num_rows)

    def get_row_start(self, group_rank: int) -> int:
        return group_rank * self.chunk_rows


def get_shard_layout(tensor: DTensor) -> ShardLayout | None:
    """The dim-0 shard layout of an FSDP2 DTensor; None if it is replicated everywhere."""
    shard_dims = []
    for mesh_dim, placement in enumerate(tensor.placements):
        if type(placement) is Shard and placement.dim == 0:  # not _StridedShard (FSDP + TP)
            shard_dims.append(mesh_dim)
        elif not isinstance(placement, Replicate):
            raise ConfigError(
                "model",
                f"parameter placement {tensor.placements} is not supported by consolidation",
                fix="only FSDP2 shardings (Shard(0) on one mesh dim, Replicate() on the others) are; use method 'dcp'",
            )
    if not shard_dims:
        return None
    if len(shard_dims) > 1:
        raise ConfigError(
            "model", f"parameter placement {tensor.placements} shards dim 0 twice", fix="use method 'dcp'"
        )
    mesh, mesh_dim = tensor.device_mesh, shard_dims[0]
    size = mesh.size(mesh_dim)
    rows = tensor.shape[0]
    chunk = math.ceil(rows / size)
    num_rows = [max(0, min(chunk, rows - r * chunk)) for r in range(size)]
    layout = ShardLayout(
        group=mesh.get_group(mesh_dim), group_rank=mesh.get_local_rank(mesh_dim), num_rows=num_rows, chunk_rows=chunk
    )
    local_rows = tensor.to_local().shape[0]
    assert local_rows == num_rows[layout.group_rank], (
        f"local shard has {local_rows} rows, expected {num_rows[layout.group_rank]} (torch.chunk layout)"
    )
    return layout


@dataclass(slots=True)
class Leaf:
    """One tensor (or other value) of the state, and where its consolidated value goes."""

    container: dict[str, Any]
    key: str
    value: Any
    layout: ShardLayout | None

    @property
    def local(self) -> torch.Tensor:
        return self.value.to_local()

    @property
    def row_bytes(self) -> int:
        return math.prod(self.value.shape[1:]) * self.local.element_size()

    @property
    def slot_bytes(self) -> int:
        """Bytes this tensor occupies in every rank's bucket buffer (its padded shard)."""
        return self.layout.chunk_rows * self.row_bytes

    def new_full(self, *, to_cpu: bool) -> torch.Tensor:
        local = self.local
        return torch.empty(self.value.shape, dtype=local.dtype, device="cpu" if to_cpu else local.device)


def find_leaves(state: dict[str, Any]) -> list[Leaf]:
    """Every value in a (nested) state dict, in insertion order; DTensors get their layout."""
    leaves = []
    for key, value in state.items():
        if isinstance(value, dict):
            state[key] = value = dict(value)  # never write into the caller's dicts
            leaves += find_leaves(value)
        elif isinstance(value, torch.Tensor):
            layout = get_shard_layout(value) if isinstance(value, DTensor) else None
            leaves.append(Leaf(container=state, key=key, value=value, layout=layout))
    return leaves


def copy_local(value: torch.Tensor, *, to_cpu: bool) -> torch.Tensor:
    """A detached copy of a replicated tensor (step counters, buffers)."""
    local = value.to_local() if isinstance(value, DTensor) else value
    return local.detach().to("cpu" if to_cpu else local.device, copy=True)


def joins(group: dist.ProcessGroup, rank0_only: bool) -> bool:
    """Whether this rank's shard group must gather (with rank0_only: only rank 0's group)."""
    return not rank0_only or 0 in dist.get_process_group_ranks(group)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor (bit-exact for every dtype)."""
    return tensor.reshape(-1).view(torch.uint8)


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
