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
from typing import Any

from autotune.sim.hardware import Group, Hardware, SimError, get_dtype_bytes, get_group
from autotune.sim.knobs import Knobs
from autotune.sim.measured import LOCAL_HOOK_KEYS
from autotune.sim.model_work import ModelWork
from autotune.sim.probes import get_grouping_fault_seconds, get_mmap_threshold_bytes

ORIG_BYTES = 4
"""The trials build float32 parameters; sharded params, grads and AdamW state are float32."""


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
    microbatch_s: float = 0.0
    """Host work per microbatch outside the model and FSDP2's hooks (measured profiles)."""
    accumulate_s: list[float] = field(default_factory=list)
    """Autograd adding a microbatch's unsharded grad into the one a non-sync microbatch left on the
    parameter (same dtypes, deferred concat: ``AccumulateGrad``'s in-place add reads both, writes one);
    the anchor of a calibration, which reduces every microbatch, never shows it. Empty: free."""
    pre_hook_s: list[float] | None = None
    """A pre-forward/backward hook that finds its unit unsharded (measured profiles; None: free)."""
    post_hook_s: list[float] | None = None
    """Every post-backward hook's accumulate and reshard work (measured profiles; None: free)."""
    all_gather_cpu_s: list[float] | None = None
    """Compute an asynchronous all-gather takes from the training thread (CPU, measured: gloo's
    worker shares the cores); None: none."""
    unit_num_blocks: list[int] | None = None
    """Blocks per non-root unit (None: one each)."""
    unit_checkpointing: list[str] | None = None
    """Each non-root unit's activation checkpointing, ``none``/``selective``/``full`` (None: none)."""
    host_forward_s: list[float] | None = None
    """The host's launch path of each unit's forward (GPU device profiles with a host path; None: not priced)."""
    host_backward_s: list[float] | None = None
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


def _get_units(work: ModelWork, unit_blocks: tuple[tuple[int, ...], ...] | None) -> list[tuple[str, ...]]:
    """The modules of each unit: its blocks (one each by default), then the root."""
    groups = unit_blocks or tuple((b,) for b in range(len(work.block_names)))
    return [*(tuple(work.block_names[b] for b in group) for group in groups), ("root",)]


def _get_kinds(num_units: int, checkpointing: tuple[str, ...] | None, activation_checkpointing: bool) -> list[str]:
    """Each block unit's checkpointing: the config's, else ``full`` where the training script checkpoints every block."""
    default = "full" if activation_checkpointing else "none"
    return [(checkpointing[u] if checkpointing and checkpointing[u] != "none" else default) for u in range(num_units)]


def get_mesh_costs(
    work: ModelWork,
    hardware: Hardware,
    *,
    replicate: int,
    shard: int,
    param_dtype: str,
    reduce_dtype: str,
    activation_checkpointing: bool,
    unit_blocks: tuple[tuple[int, ...], ...] | None = None,
    checkpointing: tuple[str, ...] | None = None,
) -> MeshCosts:
    """Price every unit of ``work`` on ``hardware`` under a (replicate, shard) mesh; a unit holding
    several blocks (``unit_blocks``) gathers, reduces and computes them together, and a checkpointed
    unit recomputes (all, or the non-matmul part of) its blocks' forward in its backward."""
    shard_group, replicate_group = hardware.get_mesh_groups(replicate, shard)
    pb, rb = get_dtype_bytes(param_dtype), get_dtype_bytes(reduce_dtype)
    units = _get_units(work, unit_blocks)
    padded = [sum(get_padded_numel(work.param_shapes[m], shard) for m in modules) for modules in units]
    sharded = [p // shard for p in padded]
    counts = [len(modules) for modules in units[:-1]]
    kinds = _get_kinds(len(counts), checkpointing, activation_checkpointing)
    return MeshCosts(
        replicate=replicate,
        shard=shard,
        shard_group=shard_group,
        replicate_group=replicate_group,
        param_bytes=pb,
        reduce_bytes=rb,
        padded=padded,
        sharded=sharded,
        **_get_compute_costs(work, hardware, counts, kinds),
        **_get_collective_costs(hardware, padded, sharded, pb, rb, shard_group, replicate_group),
        **_get_copy_and_hook_costs(hardware, counts, padded, sharded, pb, rb, local=shard == 1),
        **_get_optimizer_and_host_costs(hardware, sharded),
        unit_num_blocks=counts,
        unit_checkpointing=kinds,
    )


class MeshCostCache:
    """:func:`get_mesh_costs` of one model on one cluster, computed once per mesh, dtypes, unit grouping
    and checkpointing (what a config's knobs change about the prices); the simulator of a step and
    each pipeline stage hold one."""

    def __init__(self, work: ModelWork, hardware: Hardware, *, activation_checkpointing: bool = False) -> None:
        self.work, self.hardware, self.ac = work, hardware, activation_checkpointing
        self._costs: dict[tuple[Any, ...], MeshCosts] = {}

    def get(self, knobs: Knobs) -> MeshCosts:
        """The prices of ``knobs``' mesh; a param dtype other than the one the work was traced in is refused."""
        if knobs.param_dtype != self.work.dtype:
            raise SimError(
                f"mixed_precision.param_dtype is {knobs.param_dtype} but the workload was traced in {self.work.dtype}",
                field="mixed_precision.param_dtype",
            )
        key = (
            knobs.replicate,
            knobs.shard,
            knobs.param_dtype,
            knobs.reduce_dtype,
            knobs.unit_blocks,
            knobs.checkpointing,
        )
        if key not in self._costs:
            self._costs[key] = get_mesh_costs(
                self.work,
                self.hardware,
                replicate=knobs.replicate,
                shard=knobs.shard,
                param_dtype=knobs.param_dtype,
                reduce_dtype=knobs.reduce_dtype,
                activation_checkpointing=self.ac,
                unit_blocks=knobs.unit_blocks,
                checkpointing=knobs.checkpointing,
            )
        return self._costs[key]


def _get_compute_costs(work: ModelWork, hardware: Hardware, counts: list[int], kinds: list[str]) -> dict[str, Any]:
    """Model compute per unit (its blocks' forward, backward and checkpointing's recompute; the root's
    tail) and the root's head (embeddings), per microbatch."""
    seg = _get_segment_seconds(work, hardware)
    # the host's launch floor per block pass (GPU; 0 on CPU, whose measured segments hold their host time);
    # a recomputed forward launches its kernels again
    fwd_floor, bwd_floor = hardware.get_host_floor_s("block_forward"), hardware.get_host_floor_s("block_backward")
    recompute = {
        "none": 0.0,
        "full": seg["block.forward"] + fwd_floor,
        "selective": seg["block.forward.memory"] + fwd_floor,
    }
    host = hardware.get_host_path_s
    host_forward = {"none": "block_forward", "full": "checkpoint_forward", "selective": "selective_forward"}
    host_recompute = {"none": 0.0, "full": host("recompute_full"), "selective": host("recompute_selective")}
    return {
        "forward_s": [c * (seg["block.forward"] + fwd_floor) for c in counts] + [seg["tail.forward"]],
        "backward_s": [c * (seg["block.backward"] + recompute[k] + bwd_floor) for c, k in zip(counts, kinds)]
        + [seg["tail.backward"]],
        "host_forward_s": [c * host(host_forward[k]) for c, k in zip(counts, kinds)] + [0.0],
        "host_backward_s": [c * (host("block_backward") + host_recompute[k]) for c, k in zip(counts, kinds)] + [0.0],
        "head_forward_s": seg["head.forward"],
        "head_backward_s": seg["head.backward"],
    }


def _get_collective_costs(
    hardware: Hardware,
    padded: list[int],
    sharded: list[int],
    pb: int,
    rb: int,
    shard_group: Group,
    replicate_group: Group,
) -> dict[str, Any]:
    """Each unit's all-gather, reduce-scatter and all-reduce, and the compute an asynchronous
    all-gather takes from the training thread (measured profiles)."""
    mem, coll, measured = hardware.get_memory_seconds, hardware.get_collective_seconds, hardware.measured
    cpu_share = measured.cpu_share if measured is not None else 0.0
    # reduce-scatter + the post-reduce ops on its stream (divide, cast, accumulate the sharded grad); measured profiles have them in the reduce hook
    post_reduce = [0.0 if measured else mem(3 * s * ORIG_BYTES) for s in sharded]
    real = hardware.get_real_collective_seconds
    return {
        "all_gather_s": [coll("all_gather", p * pb, shard_group) for p in padded],
        "reduce_scatter_s": [
            coll("reduce_scatter", p * rb, shard_group) + extra for p, extra in zip(padded, post_reduce)
        ],
        "all_reduce_s": [coll("all_reduce", s * rb, replicate_group) for s in sharded],
        "all_gather_cpu_s": [cpu_share * real("all_gather", p * pb, shard_group) for p in padded] if measured else None,
    }


def _get_copy_and_hook_costs(
    hardware: Hardware, counts: list[int], padded: list[int], sharded: list[int], pb: int, rb: int, *, local: bool
) -> dict[str, Any]:
    """FSDP2's copies around the collectives and its hooks' own work, per unit: measured per call
    where a profile has them, else the bytes they move at the memory speed."""
    mem, measured = hardware.get_memory_seconds, hardware.measured

    def hooks(name: str, default: list[float] | None) -> list[float] | None:
        if measured is None:
            return default
        return [c * measured.get_hook_seconds(f"{name}.block") for c in counts] + [
            measured.get_hook_seconds(f"{name}.root")
        ]

    def optional(name: str, default: list[float]) -> list[float]:
        """Measured per call where a calibration trial showed the hook (``OPTIONAL_HOOK_KEYS``), else ``default``."""
        if measured is None or f"{name}.block" not in measured.hooks:
            return default
        root = measured.get_hook_seconds(f"{name}.root") if f"{name}.root" in measured.hooks else default[-1]
        return [c * measured.get_hook_seconds(f"{name}.block") for c in counts] + [root]

    # A shard group of one unshards and reduces by plain copies (no all-gather, no reduce-scatter):
    # priced from a trial on such a mesh where calibration had one (LOCAL_HOOK_KEYS), else like the anchor's.
    suffix = (
        "_local" if local and measured is not None and all(key in measured.hooks for key in LOCAL_HOOK_KEYS) else ""
    )
    # Unshard: the sharded float32 params cast to the param dtype into the all-gather input
    # (copy-in), then split out of the gathered buffer (copy-out); a shard group of one casts
    # each whole param into its unsharded buffer instead.
    unshard = [
        mem(p * (ORIG_BYTES + pb)) if local else mem(2 * p * pb + s * (ORIG_BYTES + pb))
        for p, s in zip(padded, sharded)
    ]
    faults = _get_fault_costs(hardware, counts, padded, sharded, pb, rb, local=local)
    return {
        "copy_out_s": _add(hooks(f"unshard{suffix}", unshard), faults[0]),
        "copy_in_s": _add(hooks(f"reduce{suffix}", [mem(p * (pb + rb)) for p in padded]), faults[1]),
        "upcast_s": [mem(p * (pb + 2 * rb)) if pb != rb else 0.0 for p in padded],
        # cat (read + write) and flat += (2 reads + write)
        "concat_s": optional("concat", [mem(5 * p * rb) for p in padded]),
        "restore_s": optional("restore", [mem(3 * p * rb) for p in padded]),
        "accumulate_s": [measured.get_add_seconds(3 * p * pb) if measured else mem(3 * p * pb) for p in padded],
        "pre_hook_s": hooks("pre_hook", None),
        "post_hook_s": hooks("post_hook", None),
    }


def _add(a: list[float], b: list[float]) -> list[float]:
    return [x + y for x, y in zip(a, b)]


def _get_fault_costs(
    hardware: Hardware, counts: list[int], padded: list[int], sharded: list[int], pb: int, rb: int, *, local: bool
) -> tuple[list[float], list[float]]:
    """Per unit, the page faults a grouped unit's per-call buffers cost beyond its blocks' own, at
    unshard and at reduce ([Note: page faults of large buffers]; measured CPU profiles only)."""
    measured = hardware.measured
    zeros = [0.0] * len(padded)
    if measured is None or measured.page_fault_s <= 0:
        return zeros, zeros
    threshold, fault = get_mmap_threshold_bytes(), measured.page_fault_s
    unshard, reduce = list(zeros), list(zeros)
    for u, c in enumerate(counts):
        block, shard = padded[u] / c, sharded[u] / c  # one block's padded parameters, and its shard
        # all-gather output + gloo's flat copy (none on a shard group of one); reduce input, gloo's copy, output
        gathered = [] if local else [block * pb, block * pb]
        reduced = [block * rb, block * rb, shard * rb]
        unshard[u] = get_grouping_fault_seconds(gathered, c, fault, threshold)
        reduce[u] = get_grouping_fault_seconds(reduced, c, fault, threshold)
    return unshard, reduce


def _get_optimizer_and_host_costs(hardware: Hardware, sharded: list[int]) -> dict[str, Any]:
    """The optimizer step over the rank's shards, and host work per microbatch outside the model (measured profiles)."""
    measured = hardware.measured
    if measured:
        return {
            "optimizer_s": measured.compute_scale * measured.optimizer_s_per_element * sum(sharded),
            "microbatch_s": measured.compute_scale * measured.microbatch_s,
        }
    return {
        "optimizer_s": hardware.get_optimizer_seconds(sum(sharded)) + hardware.get_host_floor_s("step"),
        "microbatch_s": hardware.get_host_floor_s("microbatch"),
    }


NOMINAL_CPU_FLOPS_PER_BYTE = 10.0
"""Measured profiles time a block's forward whole; its non-matmul share (what selective checkpointing
recomputes) is estimated from the traced work at this many FLOPs per byte moved (a core's ~25 GFLOP/s
of matmul over ~2.5 GB/s of element-wise traffic): an assumption, not a measurement."""


def _get_segment_seconds(work: ModelWork, hardware: Hardware) -> dict[str, float]:
    """Seconds per microbatch of each segment and pass, and ``block.forward.memory``: the part of a
    block's forward that is neither matmul nor attention."""
    block = work.work["block", "forward"]
    if hardware.measured is not None:
        seconds = {key: hardware.measured.get_segment_seconds(key) for key in hardware.measured.segments}
        flops = block.gemm_flops + block.attention_flops
        share = (
            block.memory_bytes / (block.memory_bytes + flops / NOMINAL_CPU_FLOPS_PER_BYTE)
            if block.memory_bytes
            else 0.0
        )
        return {**seconds, "block.forward.memory": share * seconds["block.forward"]}

    seconds = {
        f"{segment}.{phase}": hardware.get_pass_seconds(
            work.work[segment, phase],
            part="block" if segment == "block" else "root",
            phase=phase,
            head_dim=work.attention_head_dim,
            dtype=work.dtype,
        )
        for segment in ("head", "block", "tail")
        for phase in ("forward", "backward")
    }
    memory = block.memory_bytes / hardware.get_elementwise_bytes_per_s("block", "forward")
    return {**seconds, "block.forward.memory": memory}
