"""A cluster and workload as measured on this machine: what :mod:`autotune.sim.calibrate` fits.

A :class:`MeasuredProfile` replaces the datasheet prices of a cluster profile (device FLOP/s,
link bandwidths) with seconds taken from trials' traces, for one workload (model, training
shape) on one box: per-microbatch compute of the model's segments, FSDP2's hook work per unit,
the optimizer, and each collective's real transfer cost. :class:`autotune.sim.Hardware` with a
``measured`` profile prices a mesh from it (:func:`autotune.sim.costs.get_mesh_costs`); see
[Note: calibration] in :mod:`autotune.sim.calibrate` for what is fitted from what.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

SEGMENT_KEYS = ("head.forward", "block.forward", "tail.forward", "tail.backward", "block.backward", "head.backward")
"""Model compute per microbatch: ``head`` (embeddings), one ``block``, ``tail`` (norm, output, loss)."""
HOOK_KEYS = (
    "unshard.block",
    "unshard.root",
    "pre_hook.block",
    "pre_hook.root",
    "post_hook.block",
    "post_hook.root",
    "reduce.block",
    "reduce.root",
)
"""FSDP2's own work per unit and call: ``unshard`` (a pre-forward/backward hook that copies an
all-gather out), ``pre_hook`` (one that finds the unit unsharded), ``post_hook`` (post-backward
accumulate and reshard), ``reduce`` (copy-in and post-reduce of a reducing post-backward)."""
LOCAL_HOOK_KEYS = ("unshard_local.block", "unshard_local.root", "reduce_local.block", "reduce_local.root")
"""The same hooks on a shard group of one (HSDP Nx1: replication), where FSDP2 issues no
all-gather or reduce-scatter (``FSDPParamGroup.unshard``/``wait_for_unshard`` with a world of
one): ``unshard_local`` copies each sharded parameter into its unsharded buffer
(``tensor.copy_``), ``reduce_local`` copies the gradients in and into the reduce output
(``foreach_reduce``). Optional: measured from a calibration trial on such a mesh; without
one the simulator prices them like the anchor's ``unshard``/``reduce``."""
CONCAT_HOOK_KEYS = ("concat.block", "concat.root", "restore.block", "restore.root")
"""FSDP1-style eager concat (``defer_concat = false``): ``concat`` per non-sync microbatch
(``flat += cat(grads)``), ``restore`` on the sync one (the flat accumulator added back), read
from ``fsdp_runtime``'s ``FSDP::eager_concat``/``eager_restore`` labels. Optional: measured
from a calibration trial that concatenates eagerly; without one priced as memory traffic."""
OPTIONAL_HOOK_KEYS = (*LOCAL_HOOK_KEYS, *CONCAT_HOOK_KEYS)


@dataclass(frozen=True, slots=True)
class CollectiveFit:
    """Real transfer seconds of one collective kind: ``latency + bytes x seconds_per_byte``,
    fitted at ``group_size`` ranks and scaled to ``n`` ranks by the ring factor (n-1)/n."""

    latency_s: float
    seconds_per_byte: float
    group_size: int
    num_points: int = 0
    """Collectives the fit saw."""

    def get_seconds(self, num_bytes: float, group_size: int) -> float:
        if group_size <= 1:
            return 0.0
        scale = (
            ((group_size - 1) / group_size) / ((self.group_size - 1) / self.group_size) if self.group_size > 1 else 1.0
        )
        return self.latency_s + num_bytes * self.seconds_per_byte * scale


@dataclass(frozen=True)
class MeasuredProfile:
    """Measured prices of one workload on one machine (see [Note: calibration])."""

    SCHEMA_VERSION: ClassVar[int] = 3
    """2 added ``sync_s`` (a version-1 profile reads with 0: no wait beyond the traced transfers);
    3 added ``page_fault_s`` and ``add_bytes_per_s`` (older profiles read with 0: large buffers cost
    nothing extra, accumulation is priced at the hooks' memory speed)."""

    name: str
    world_size: int
    num_microbatches: int
    segments: dict[str, float]
    """``SEGMENT_KEYS`` -> seconds per microbatch (a block's: one block)."""
    hooks: dict[str, float]
    """``HOOK_KEYS`` (and those of ``OPTIONAL_HOOK_KEYS`` a calibration trial showed) -> seconds per call."""
    microbatch_s: float
    """Per microbatch outside the model and FSDP2's hooks: the batch, the loss's bookkeeping."""
    optimizer_s_per_element: float
    """AdamW, ``zero_grad`` and the step's end, per sharded parameter element on a rank."""
    memory_bytes_per_s: float
    """Copies the traces do not show apart (FSDP1-style concat, int-reshard clones, up-casts)."""
    collectives: dict[str, CollectiveFit]
    """``all_gather``, ``reduce_scatter`` (gloo runs it as an all-reduce of the full buffer),
    ``all_reduce``: the real transfer on this machine's links."""
    cpu_share: float = 1.0
    """Of an asynchronous collective's real transfer, the share the training thread loses to it
    (gloo's worker thread takes a core from compute: 1 = no overlap gain on raw loopback)."""
    sync_s: float = 0.0
    """Per collective, what a step loses beyond the collective's traced span and its hooks: the
    ranks' wait for each other at the rendezvous, which the traces of a synchronous gloo
    collective do not show apart (fitted from a trial that skips gradient sync; see
    [Note: calibration]). Added to every collective; not scaled."""
    page_fault_s: float = 0.0
    """Seconds per page fault on this machine (measured by a probe at calibration): what a grouped
    unit's buffers above glibc's mmap threshold cost per call ([Note: page faults of large buffers]
    in ``autotune.sim.probes``). Not scaled."""
    add_bytes_per_s: float = 0.0
    """An in-place add's speed on this machine (a probe at calibration): autograd accumulating a
    microbatch's grad into the one a non-sync microbatch left; 0: priced at ``memory_bytes_per_s``."""
    compute_scale: float = 1.0
    """Applied to every figure of work done on this machine's cores (compute, hooks, copies, the
    optimizer and the collectives' real transfers, not an emulated link's hold) so that the
    anchor is predicted exactly: the traced window runs slower than unprofiled steps, and load
    on the machine slows all of that work alike."""
    sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What was fitted from what, with residuals (for the record)."""

    def get_real_seconds(self, kind: str, num_bytes: float, group_size: int) -> float:
        """A collective's real transfer (CPU work too: scaled like compute); gloo runs reduce-scatter and
        all-reduce alike, so either fit prices both."""
        fit = self.collectives.get(kind) or self.collectives.get(
            {"reduce_scatter": "all_reduce", "all_reduce": "reduce_scatter"}.get(kind, "")
        )
        return 0.0 if fit is None else self.compute_scale * fit.get_seconds(num_bytes, group_size)

    def get_segment_seconds(self, key: str) -> float:
        return self.compute_scale * self.segments[key]

    def get_hook_seconds(self, key: str) -> float:
        return self.compute_scale * self.hooks[key]

    def get_memory_seconds(self, num_bytes: float) -> float:
        return self.compute_scale * num_bytes / self.memory_bytes_per_s

    def get_add_seconds(self, num_bytes: float) -> float:
        """An in-place add moving ``num_bytes`` (the probe's speed where measured)."""
        if self.add_bytes_per_s <= 0:
            return self.get_memory_seconds(num_bytes)
        return self.compute_scale * num_bytes / self.add_bytes_per_s

    def replace(self, **changes: Any) -> MeasuredProfile:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": self.SCHEMA_VERSION, "kind": "measured_profile", **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MeasuredProfile:
        body = {k: v for k, v in data.items() if k not in ("schema_version", "kind")}
        body["collectives"] = {k: CollectiveFit(**v) for k, v in body["collectives"].items()}
        return cls(**body)
