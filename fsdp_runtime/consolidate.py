"""Consolidate an FSDP2-sharded model and optimizer into one full state on rank 0.

    from fsdp_runtime import consolidate_state, save_consolidated_checkpoint
    model_sd, optim_sd = consolidate_state(model, optimizer, method="all_gather")
    save_consolidated_checkpoint("ckpt/step100.pt", model, optimizer)

The full state has the layout of ``torch.distributed.checkpoint.state_dict`` with
``full_state_dict=True``: the model state dict maps FQNs to full tensors; the optimizer
state dict is ``{"state": {fqn: {"step": ..., "exp_avg": ..., ...}}, "param_groups":
[{..., "params": [fqn, ...]}]}``. Three methods produce it (``CheckpointConfig.consolidation``):

- ``all_gather``: every sharded tensor is packed into a few flat buffers and gathered with
  one ``all_gather_into_tensor`` per buffer. See [Note: all_gather consolidation]
The seed (fairscale #595) replaced per-rank broadcasts of optimizer state with
all-gathers and measured 10x faster consolidation on GPUs. Here the idea is pushed one
step further: instead of one collective per tensor, each rank packs its local shards of
many tensors into one flat byte buffer (a "bucket", at most ``bucket_bytes`` of gathered
output) and the bucket is gathered with a single all-gather.

Packing. FSDP2 splits dim 0 like ``torch.chunk``: with ``n`` rows on ``W`` ranks every
rank gets ``c = ceil(n / W)`` rows except the last ones, which get fewer or none. In the
bucket each tensor gets a slot of ``c`` rows' bytes on every rank at the same offset, so
all ranks contribute equal-sized buffers (the collective's contract) and the gathered
output is ``W`` copies of the bucket layout, rank-major. Rank 0 unpacks each tensor by
copying rank ``r``'s ``rows_r`` rows of the slot into rows ``[r * c, r * c + rows_r)`` of
the full tensor (dim-0 shards of a contiguous tensor are contiguous). Padding costs at
most ``W - 1`` rows per tensor. Shards are packed as bytes, so any mix of dtypes shares a
bucket. The layout (global shape, mesh, placements) is known on every rank: no metadata
is exchanged. A tensor that fills a bucket alone and is evenly sharded skips packing: its
shard is the input and the full tensor itself is the output. Buckets are formed in a
fixed order, so every rank issues the same collectives in the same order; one input and
one output buffer, sized for the largest bucket, serve every bucket.

Why it beats broadcast, and when it does not. Broadcast issues one collective per tensor
*per source rank* (``T * W``; 117 * 4 for the 4-block "small" model at world 4), each
paying a fixed cost (Python and c10d dispatch, a rendezvous of all ranks, the backend's
per-op setup) whatever its size, and only one rank sends at a time. The packed
all-gather issues ``ceil(bytes / bucket_bytes)`` collectives with every rank sending at
once. The bytes received per rank are the same (every rank of a broadcast receives every
shard too). What the all-gather costs extra is memory and copies: ``bucket_bytes`` of
output plus ``bucket_bytes / W`` of input on *every* rank of the group, and a pack and
an unpack copy. The baseline here is a fair one: it receives each shard in place, into
the rows of the full tensor. So the all-gather wins where per-collective latency
dominates (many small tensors, more ranks) and not where memory bandwidth does. On CPU
gloo the balance tips further: gloo's all-gather allocates its own flat output and
copies it into ours on every call (``ProcessGroupGloo``'s ``AsyncAllgatherWork``), while
its broadcast writes in place. Measured on the 2-core box (benchmarks/consolidation.py):
a 60 KB all-gather beats 4 broadcasts 3x at world 4, a 64 MB one loses 3x; packed
consolidation of the 4.3M-param model is ~2x faster than broadcast, of the 55M-param
model (12 MB tensors) ~2x slower. Buckets above ~32 MiB also lose on CPU because glibc
then serves gloo's per-call output with fresh pages; hence ``DEFAULT_BUCKET_BYTES`` of
16 MiB rather than the hundreds of MiB that suit NCCL.

HSDP. Replicas hold identical shards, so the gather runs over the shard dimension's
group only; with ``rank0_only`` the replica groups that do not contain rank 0 do no work.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_runtime.config import CONSOLIDATION_METHODS as METHODS
from fsdp_runtime.errors import AutotuneError, ConfigError
from fsdp_runtime.files import atomic_path

Method = Literal["all_gather", "broadcast", "dcp"]
DEFAULT_BUCKET_BYTES = 16 * 2**20
"""Cap on one all-gather's output; see [Note: all_gather consolidation] for why 16 MiB."""
CHECKPOINT_FORMAT = "fsdp_runtime.consolidated_checkpoint"
CHECKPOINT_VERSION = 1
# Module wrappers whose attribute name appears in named_parameters() but not in the
# FQNs torch.distributed.checkpoint uses (activation checkpointing, torch.compile).
_WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod")

StateDict = dict[str, Any]


class CheckpointError(AutotuneError):
    """A consolidated checkpoint could not be written or read; the message says why."""


# ---------------------------------------------------------------------------
# Public API


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
        raise ConfigError("bucket_bytes", f"must be >= 1, got {bucket_bytes}", fix=f"the default is {DEFAULT_BUCKET_BYTES} (16 MiB)")
    if method == "dcp":
        return _consolidate_with_dcp(model, optimizer, to_cpu=to_cpu, rank0_only=rank0_only)
    model_sd = dict(model.state_dict())
    optim_sd = get_optimizer_state_by_fqn(model, optimizer) if optimizer is not None else {}
    leaves = _find_leaves(model_sd) + (_find_leaves(optim_sd["state"]) if optim_sd else [])
    keep = not rank0_only or _get_rank() == 0
    sharded = [leaf for leaf in leaves if leaf.layout is not None]
    if method == "all_gather":
        _gather_packed(sharded, keep=keep, rank0_only=rank0_only, to_cpu=to_cpu, bucket_bytes=bucket_bytes)
    else:
        _gather_by_broadcast(sharded, keep=keep, rank0_only=rank0_only, to_cpu=to_cpu)
    if not keep:
        return {}, {}
    for leaf in leaves:
        if leaf.layout is None:
            leaf.container[leaf.key] = _copy_local(leaf.value, to_cpu=to_cpu)
    return model_sd, optim_sd


def save_consolidated_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    method: Method = "all_gather",
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
    model_sd, optim_sd = consolidate_state(model, optimizer, method=method, to_cpu=True, rank0_only=True, bucket_bytes=bucket_bytes)
    error: BaseException | None = None
    if _get_rank() == 0:
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
    if _get_rank() == 0:
        try:
            model_sd, optim_sd = _read_source(source)
            if optimizer is not None and not optim_sd:
                raise CheckpointError("the checkpoint holds no optimizer state (load the model alone with optimizer=None)")
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
        raise CheckpointError(f"the checkpoint has {len(options[0])} optimizer param groups, the optimizer {len(optimizer.param_groups)}")
    for group, saved in zip(optimizer.param_groups, options[0]):
        group.update(saved)


def check_method(method: str) -> None:
    """Raise a one-line :class:`ConfigError` unless ``method`` is a consolidation method."""
    if method not in METHODS:
        raise ConfigError("checkpoint.consolidation", f"unknown consolidation method {method!r}", fix=f"use one of {', '.join(METHODS)}")


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
                raise ConfigError("optimizer", "has a parameter that is not in the model", fix="build the optimizer over model.parameters()")
            fqn = fqn_of[id(param)]
            fqns.append(fqn)
            if param in optimizer.state:
                state[fqn] = dict(optimizer.state[param])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------------------
# Sharding layout


@dataclass(frozen=True, slots=True)
class _ShardLayout:
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


def _get_shard_layout(tensor: DTensor) -> _ShardLayout | None:
    """The dim-0 shard layout of an FSDP2 DTensor; None if it is replicated everywhere."""
    shard_dims = []
    for mesh_dim, placement in enumerate(tensor.placements):
        if type(placement) is Shard and placement.dim == 0:  # not _StridedShard (FSDP + TP)
            shard_dims.append(mesh_dim)
        elif not isinstance(placement, Replicate):
            raise ConfigError("model", f"parameter placement {tensor.placements} is not supported by consolidation", fix="only FSDP2 shardings (Shard(0) on one mesh dim, Replicate() on the others) are; use method 'dcp'")
    if not shard_dims:
        return None
    if len(shard_dims) > 1:
        raise ConfigError("model", f"parameter placement {tensor.placements} shards dim 0 twice", fix="use method 'dcp'")
    mesh, mesh_dim = tensor.device_mesh, shard_dims[0]
    size = mesh.size(mesh_dim)
    rows = tensor.shape[0]
    chunk = math.ceil(rows / size)
    num_rows = [max(0, min(chunk, rows - r * chunk)) for r in range(size)]
    layout = _ShardLayout(group=mesh.get_group(mesh_dim), group_rank=mesh.get_local_rank(mesh_dim), num_rows=num_rows, chunk_rows=chunk)
    local_rows = tensor.to_local().shape[0]
    assert local_rows == num_rows[layout.group_rank], f"local shard has {local_rows} rows, expected {num_rows[layout.group_rank]} (torch.chunk layout)"
    return layout


@dataclass(slots=True)
class _Leaf:
    """One tensor (or other value) of the state, and where its consolidated value goes."""

    container: dict[str, Any]
    key: str
    value: Any
    layout: _ShardLayout | None

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


def _find_leaves(state: dict[str, Any]) -> list[_Leaf]:
    """Every value in a (nested) state dict, in insertion order; DTensors get their layout."""
    leaves = []
    for key, value in state.items():
        if isinstance(value, dict):
            state[key] = value = dict(value)  # never write into the caller's dicts
            leaves += _find_leaves(value)
        elif isinstance(value, torch.Tensor):
            layout = _get_shard_layout(value) if isinstance(value, DTensor) else None
            leaves.append(_Leaf(container=state, key=key, value=value, layout=layout))
    return leaves


def _copy_local(value: torch.Tensor, *, to_cpu: bool) -> torch.Tensor:
    """A detached copy of a replicated tensor (step counters, buffers)."""
    local = value.to_local() if isinstance(value, DTensor) else value
    return local.detach().to("cpu" if to_cpu else local.device, copy=True)


def _joins(group: dist.ProcessGroup, rank0_only: bool) -> bool:
    """Whether this rank's shard group must gather (with rank0_only: only rank 0's group)."""
    return not rank0_only or 0 in dist.get_process_group_ranks(group)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor (bit-exact for every dtype)."""
    return tensor.reshape(-1).view(torch.uint8)


# ---------------------------------------------------------------------------
# all_gather: packed buckets. See [Note: all_gather consolidation].


@dataclass(slots=True)
class _Bucket:
    group: dist.ProcessGroup
    device: torch.device
    leaves: list[_Leaf] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    """Byte offset of each leaf's slot in every rank's buffer."""
    bytes_per_rank: int = 0

    @property
    def group_size(self) -> int:
        return self.leaves[0].layout.group_size

    @property
    def is_direct(self) -> bool:
        """One evenly sharded tensor: its shard is the input and the output is the full
        tensor itself (dim-0 shards in rank order), with no packing copies."""
        return len(self.leaves) == 1 and self.leaves[0].layout.is_even


def _plan_buckets(leaves: list[_Leaf], bucket_bytes: int) -> list[_Bucket]:
    """Group sharded tensors into buckets of at most ``bucket_bytes`` of gathered output.

    Shards are packed as bytes, so tensors of any dtype share a bucket; a tensor larger
    than the cap gets a bucket of its own. Buckets are per (process group, device) and
    closed in an order that is the same on every rank.
    """
    open_buckets: dict[tuple[int, torch.device], _Bucket] = {}
    closed: list[_Bucket] = []
    for leaf in leaves:
        device = leaf.local.device
        key = (id(leaf.layout.group), device)
        bucket = open_buckets.get(key)
        if bucket is not None and (bucket.bytes_per_rank + leaf.slot_bytes) * leaf.layout.group_size > bucket_bytes:
            closed.append(bucket)
            bucket = None
        if bucket is None:
            bucket = open_buckets[key] = _Bucket(group=leaf.layout.group, device=device)
        bucket.leaves.append(leaf)
        bucket.offsets.append(bucket.bytes_per_rank)
        bucket.bytes_per_rank += leaf.slot_bytes
    return closed + list(open_buckets.values())


def _pack(bucket: _Bucket, flat: torch.Tensor) -> torch.Tensor:
    """Fill this rank's input: each local shard's bytes at its slot's offset."""
    flat = flat[: bucket.bytes_per_rank]
    for leaf, offset in zip(bucket.leaves, bucket.offsets):
        shard = _as_bytes(leaf.local.contiguous())
        flat[offset : offset + shard.numel()].copy_(shard)
    return flat


def _unpack(bucket: _Bucket, gathered: torch.Tensor, *, to_cpu: bool) -> None:
    """Assemble each full tensor from the ``(group size, bytes_per_rank)`` gathered buffer."""
    per_rank = gathered.view(bucket.group_size, bucket.bytes_per_rank)
    for leaf, offset in zip(bucket.leaves, bucket.offsets):
        full = leaf.new_full(to_cpu=to_cpu)
        full_bytes = _as_bytes(full)
        layout, row_bytes = leaf.layout, leaf.row_bytes
        for group_rank, rows in enumerate(layout.num_rows):
            size = rows * row_bytes
            start = layout.get_row_start(group_rank) * row_bytes
            full_bytes[start : start + size].copy_(per_rank[group_rank, offset : offset + size])
        leaf.container[leaf.key] = full


def _gather_packed(leaves: list[_Leaf], *, keep: bool, rank0_only: bool, to_cpu: bool, bucket_bytes: int) -> None:
    buckets = [b for b in _plan_buckets(leaves, bucket_bytes) if _joins(b.group, rank0_only)]
    buffers = _allocate_buffers(buckets)
    for bucket in buckets:
        inputs, outputs = buffers[bucket.device]
        if bucket.is_direct:
            _gather_direct(bucket.leaves[0], outputs, keep=keep, to_cpu=to_cpu)
            continue
        packed = _pack(bucket, inputs)
        gathered = outputs[: packed.numel() * bucket.group_size]
        _all_gather_single(gathered, packed, group=bucket.group)
        if keep:
            _unpack(bucket, gathered, to_cpu=to_cpu)


def _gather_direct(leaf: _Leaf, outputs: torch.Tensor, *, keep: bool, to_cpu: bool) -> None:
    """All-gather one evenly sharded tensor straight into its full tensor (when on its device)."""
    local = leaf.local.contiguous()
    full = leaf.new_full(to_cpu=to_cpu) if keep else None
    in_place = full is not None and full.device == local.device
    gathered = _as_bytes(full) if in_place else outputs[: local.numel() * local.element_size() * leaf.layout.group_size]
    _all_gather_single(gathered, _as_bytes(local), group=leaf.layout.group)
    if full is not None:
        if not in_place:
            _as_bytes(full).copy_(gathered)
        leaf.container[leaf.key] = full


def _allocate_buffers(buckets: list[_Bucket]) -> dict[torch.device, tuple[torch.Tensor, torch.Tensor]]:
    """One (input, output) byte buffer pair per device, sized for its largest bucket.

    Reused by every bucket: fresh pages cost more than the copies into them (a page
    fault per 4 KiB on CPU). Direct buckets need no input buffer; their output buffer
    is only used where the full tensor is not kept or lives on another device.
    """
    sizes: dict[torch.device, tuple[int, int]] = {}
    for b in buckets:
        num_in, num_out = sizes.get(b.device, (0, 0))
        sizes[b.device] = (num_in if b.is_direct else max(num_in, b.bytes_per_rank), max(num_out, b.bytes_per_rank * b.group_size))
    return {d: (torch.zeros(i, dtype=torch.uint8, device=d), torch.empty(o, dtype=torch.uint8, device=d)) for d, (i, o) in sizes.items()}


def _all_gather_single(output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup) -> None:
    # torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(output, input, group=group)


# ---------------------------------------------------------------------------
# broadcast: the baseline, one collective per tensor per source rank.


def _gather_by_broadcast(leaves: list[_Leaf], *, keep: bool, rank0_only: bool, to_cpu: bool) -> None:
    for leaf in leaves:
        layout = leaf.layout
        if not _joins(layout.group, rank0_only):
            continue
        local = leaf.local
        full = leaf.new_full(to_cpu=to_cpu) if keep else None
        for group_rank, rows in enumerate(layout.num_rows):
            if rows == 0:
                continue
            start = layout.get_row_start(group_rank)
            target = full[start : start + rows] if full is not None else None
            if group_rank == layout.group_rank:
                shard = local.contiguous()
            elif target is not None and target.device == local.device:
                shard = target  # receive in place: dim-0 rows of a contiguous tensor are contiguous
            else:
                shard = local.new_empty((rows, *local.shape[1:]))
            dist.broadcast(shard, group=layout.group, group_src=group_rank)
            if target is not None and shard is not target:
                target.copy_(shard)
        if full is not None:
            leaf.container[leaf.key] = full


# ---------------------------------------------------------------------------
# dcp: torch.distributed.checkpoint.state_dict, the reference.


def _consolidate_with_dcp(model: nn.Module, optimizer: torch.optim.Optimizer | None, *, to_cpu: bool, rank0_only: bool) -> tuple[StateDict, StateDict]:
    # DCP's cpu_offload with full_state_dict already returns the state on rank 0 only.
    options = StateDictOptions(full_state_dict=True, cpu_offload=to_cpu and rank0_only)
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=options) if optimizer is not None else {}
    if rank0_only and _get_rank() != 0:
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


def _copy_containers(value: Any) -> Any:
    """Copy the dicts and lists of a state dict; the tensors and other values are shared."""
    if isinstance(value, dict):
        return {k: _copy_containers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_containers(v) for v in value]
    return value


def _map_tensors(value: Any, fn) -> Any:
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    return fn(value) if isinstance(value, torch.Tensor) else value


# ---------------------------------------------------------------------------
# Files and agreement between ranks


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
        raise CheckpointError(f"cannot load from {type(source).__name__} (pass a checkpoint path or a (model_sd, optim_sd) pair on rank 0)")
    try:
        payload = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(f"{source}: not a readable checkpoint ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{source}: not a consolidated checkpoint written by save_consolidated_checkpoint")
    if payload.get("schema_version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{source}: checkpoint schema_version {payload.get('schema_version')} is not {CHECKPOINT_VERSION}")
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


def _get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _clean_fqn(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)
