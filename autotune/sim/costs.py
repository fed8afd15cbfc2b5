"""Per-unit durations and sizes for one model on one cluster under one mesh and mixed precision.

Unit ``i`` is block ``i`` for ``i < n`` and the root for ``i = n``. Sizes follow FSDP2's
layout: each parameter is padded on dim 0 to a multiple of the shard size and split
(``FSDPParam``), so a unit's all-gather output is ``padded`` elements and each rank keeps
``padded / shard``. Parameters are float32 (the trials' model), gathered in the param dtype
and reduced in the reduce dtype (``MixedPrecisionPolicy``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from autotune.sim.hardware import Group, Hardware, get_dtype_bytes, get_group
from autotune.sim.workload import ModelWork

ORIG_BYTES = 4
"""The trials build float32 parameters; sharded params, grads and AdamW state are float32."""
ADAMW_BYTES_PER_ELEMENT = 36
"""Bytes AdamW (foreach) moves per parameter element: reads param, grad, exp_avg, exp_avg_sq
(16), writes param, exp_avg, exp_avg_sq (12), and about 8 for its intermediates."""


def get_padded_numel(shapes: tuple[tuple[int, ...], ...], shard: int) -> int:
    """Elements of a unit's all-gather output: every parameter padded on dim 0 to a multiple of ``shard``."""
    total = 0
    for shape in shapes:
        rest = math.prod(shape[1:])
        total += math.ceil(shape[0] / shard) * shard * rest if shape else shard
    return total


@dataclass(frozen=True)
class MeshCosts:
    """Everything the schedule charges, per unit, for one (model, cluster, mesh, dtypes)."""

    replicate: int
    shard: int
    shard_group: Group
    replicate_group: Group
    param_bytes: int
    reduce_bytes: int
    padded: list[int]
    """All-gather output elements per unit."""
    sharded: list[int]
    """Elements per rank per unit."""
    forward_s: list[float]
    """Forward compute per unit; the root's is its tail (norm, output, loss)."""
    backward_s: list[float]
    head_forward_s: float
    head_backward_s: float
    all_gather_s: list[float]
    copy_out_s: list[float]
    reduce_scatter_s: list[float]
    copy_in_s: list[float]
    """Packing grads into the reduce-scatter input (``chunk_cat``, compute stream)."""
    all_reduce_s: list[float]
    upcast_s: list[float]
    """Unsharded grad to the reduce dtype (first non-sync microbatch) or accumulated into it."""
    concat_s: list[float]
    """FSDP1-style eager concat of one unit's grads into a flat accumulator (defer_concat = False)."""
    restore_s: list[float]
    """Adding that flat accumulator back into the grads on the sync microbatch."""
    optimizer_s: float
    post_forward: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    """``(unit, d)`` -> (reshard copy seconds, all-gather seconds over d ranks), for int reshard."""

    def get_post_forward(self, unit: int, d: int, hardware: Hardware) -> tuple[float, float]:
        key = (unit, d)
        if key not in self.post_forward:
            shard_bytes = self.padded[unit] // d * self.param_bytes
            group = get_group(d, 1, hardware.cluster.ranks_per_node)
            ag = hardware.get_collective_seconds("all_gather", self.padded[unit] * self.param_bytes, group)
            self.post_forward[key] = (hardware.get_memory_seconds(2 * shard_bytes), ag)
        return self.post_forward[key]


def get_mesh_costs(work: ModelWork, hardware: Hardware, *, replicate: int, shard: int, param_dtype: str, reduce_dtype: str, activation_checkpointing: bool) -> MeshCosts:
    """Price every unit of ``work`` on ``hardware`` under a (replicate, shard) mesh."""
    shard_group, replicate_group = hardware.get_mesh_groups(replicate, shard)
    pb, rb = get_dtype_bytes(param_dtype), get_dtype_bytes(reduce_dtype)
    units = [*work.block_names, "root"]
    padded = [get_padded_numel(work.param_shapes[u], shard) for u in units]
    sharded = [p // shard for p in padded]

    def compute(segment: str, phase: str) -> float:
        w = work.work[segment, phase]
        return hardware.get_compute_seconds(gemm_flops=w.gemm_flops, attention_flops=w.attention_flops, memory_bytes=w.memory_bytes, dtype=work.dtype)

    block_fwd, block_bwd = compute("block", "forward"), compute("block", "backward")
    if activation_checkpointing:
        block_bwd += block_fwd  # the block's forward runs again inside its backward
    n = len(work.block_names)
    mem = hardware.get_memory_seconds
    coll = hardware.get_collective_seconds
    return MeshCosts(
        replicate=replicate,
        shard=shard,
        shard_group=shard_group,
        replicate_group=replicate_group,
        param_bytes=pb,
        reduce_bytes=rb,
        padded=padded,
        sharded=sharded,
        forward_s=[block_fwd] * n + [compute("tail", "forward")],
        backward_s=[block_bwd] * n + [compute("tail", "backward")],
        head_forward_s=compute("head", "forward"),
        head_backward_s=compute("head", "backward"),
        all_gather_s=[coll("all_gather", p * pb, shard_group) for p in padded],
        copy_out_s=[mem(2 * p * pb) for p in padded],
        # reduce-scatter + the post-reduce ops on its stream (divide, cast, accumulate the sharded grad)
        reduce_scatter_s=[coll("reduce_scatter", p * rb, shard_group) + mem(3 * s * ORIG_BYTES) for p, s in zip(padded, sharded)],
        copy_in_s=[mem(p * (pb + rb)) for p in padded],
        all_reduce_s=[coll("all_reduce", s * rb, replicate_group) for s in sharded],
        upcast_s=[mem(p * (pb + 2 * rb)) if pb != rb else 0.0 for p in padded],
        concat_s=[mem(5 * p * rb) for p in padded],  # cat (read + write) and flat += (2 reads + write)
        restore_s=[mem(3 * p * rb) for p in padded],
        optimizer_s=mem(ADAMW_BYTES_PER_ELEMENT * sum(sharded)),
    )
