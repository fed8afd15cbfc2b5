"""How far below the usable memory a predicted peak must stay to be called safe.

[Note: memory margin]
A GPU's memory is spent in three places the simulator's peak (the tensors FSDP2 and the
model hold, as FSDPMemTracker counts them) does not see. Each part has its source:

1. *Outside the caching allocator* (CUDA context, NCCL's channel buffers, cuBLAS
   workspaces): the cluster profile's ``[accelerator] reserved_gib``, an assumption (2 GiB
   on every GPU profile), taken off before anything else: ``Hardware.usable_memory_bytes``
   is the device memory less it. Nothing measured here checks it: the H200 trials in
   ``tests/data/gpu_traces`` recorded ``torch.cuda.max_memory_allocated`` only, not what
   ``nvidia-smi`` saw.
2. *The simulator's memory error* (``SIMULATOR_MEMORY_ERROR``): the largest
   ``|predicted / measured - 1|`` of the peak over the trials that measured one on a GPU
   (:func:`autotune.sim.gpu_calibrate.compare_trial_peak`), with and without activation
   checkpointing.
3. *Allocator fragmentation*: the caching allocator reserves whole segments and keeps freed
   blocks cached, so at the allocation peak it holds more than the tensors do:
   ``max_memory_reserved / max_memory_allocated - 1``. Every GPU trial records both
   (``metrics.json`` v8 ``reserved_peak_bytes`` and ``trial_peak_bytes``); ``autotune
   calibrate`` takes the largest over its trials into the device profile
   (``allocator_fragmentation``, :func:`get_allocator_fragmentation`), and a plan priced with
   that profile uses it, naming the trials. Without one, ``ALLOCATOR_FRAGMENTATION``: the
   largest of our own H200 measurements.

Parts 2 and 3 are shares of the peak, so a predicted peak ``p`` is *safe* when
``p x (1 + sum of shares) <= usable``, and *at the edge* when it fits the usable memory
but not with the margin: ``usable / (1 + sum of shares) < p <= usable``. The margin is
``usable`` less that edge; each part's GiB is its share of the edge peak. ``autotune plan``
flags configs at the edge and does not emit one while a safe config fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.sim.fitted import (
    GPU_MEMORY,
    GSA_CASE,
    H200_L8B4,
    H200_LLAMA1B,
    H200_LLAMA1B_FULL,
    H200_LLAMA1B_GSA,
    H200_LLAMA1B_SELECTIVE,
    Fitted,
)

_GIB = 2**30

SIMULATOR_MEMORY_ERROR = 0.0084
"""Measured (``tests/data/gpu_traces``, one H200, llama1b and l8b4, bf16 params, fp32 reduce, 2 microbatches
of 8192 tokens): predicted peak / ``metrics.json`` ``process_peak_bytes`` (CUDA max allocated) - 1 on every
trial dir. FSDP2's defaults: +0.84% for ``h200-llama1b-defaults`` (47.32 GiB predicted, 50,389,473,792 B =
46.93 GiB measured; ``h200-llama1b-gsa-defaults``, the same config rerun, allocated the same bytes) and
+0.24% for ``h200-l8b4-defaults`` (50.43 vs 54,015,212,032 B = 50.31 GiB). Checkpointing on every block:
-0.29% for ``h200-llama1b-selective-ac`` (37.57 vs 40,457,361,920 B = 37.68 GiB) and -0.35% for
``h200-llama1b-full-ac`` (31.30 vs 33,730,730,496 B = 31.41 GiB). The sign differs (over without
checkpointing, under with it), so the share is the largest magnitude, the llama1b defaults'
(``tests/autotune/plan/test_memory_margin.py`` and ``tests/autotune/sim/test_gpu_peak_memory.py`` recompute them)."""

ALLOCATOR_FRAGMENTATION = 0.081
"""Measured (``benchmarks/gpu_sim_accuracy.py`` on one H200, torch 2.11, llama1b, seq 8192, bf16
params, fp32 reduce, world 1, 2026-11-27; ``tests/data/gpu_traces/README.md``):
``max_memory_reserved / max_memory_allocated`` at a trial's end 1.081 with full checkpointing
(36.47 / 33.73 GB) and 1.058 with selective (42.79 / 40.46 GB): the larger. It was 20% before,
a published figure (pytorch/torchtitan#165, 8x H100, selective checkpointing: 62.51% reserved
over 52.13% active, +19.9%); that run had 8 ranks and their NCCL traffic through the allocator,
which one GPU does not show, so a device profile measured on the cluster's own trials (with
``reserved_peak_bytes``) takes precedence. A peak reservation without memory pressure: before
an OOM the allocator frees its cached blocks and retries, so it bounds from above what
fragmentation costs at the edge."""
ALLOCATOR_FRAGMENTATION_SOURCE = (
    "measured: max reserved / max allocated - 1 on one H200 (gpu_sim_accuracy.py, 2026-11-27; "
    "tests/data/gpu_traces/README.md): 8.1% with full checkpointing, 5.8% with selective"
)
SIMULATOR_MEMORY_ERROR_FIT = Fitted(
    name="margin.SIMULATOR_MEMORY_ERROR",
    value=SIMULATOR_MEMORY_ERROR,
    fit_on=(H200_LLAMA1B, H200_L8B4, H200_LLAMA1B_GSA, H200_LLAMA1B_SELECTIVE, H200_LLAMA1B_FULL),
    how="the largest |predicted peak / CUDA max allocated - 1| of the five H200 trial dirs",
    figure=GPU_MEMORY,
)
ALLOCATOR_FRAGMENTATION_FIT = Fitted(
    name="margin.ALLOCATOR_FRAGMENTATION",
    value=ALLOCATOR_FRAGMENTATION,
    fit_on=(f"{GSA_CASE}full checkpointing", f"{GSA_CASE}selective checkpointing"),
    how="the larger max_memory_reserved / max_memory_allocated - 1 at the two trials' end",
    figure=GPU_MEMORY,
)


@dataclass(frozen=True, kw_only=True)
class MarginPart:
    """One part of the margin: a share of the predicted peak, with where it comes from."""

    name: str
    share: float
    source: str


MARGIN_PARTS = (
    MarginPart(
        name="simulator_error",
        share=SIMULATOR_MEMORY_ERROR,
        source="measured: predicted vs CUDA max allocated, 5 H200 trials (tests/data/gpu_traces): "
        "+0.84% and +0.24% with FSDP2's defaults, -0.29% selective and -0.35% full checkpointing",
    ),
    MarginPart(name="allocator_fragmentation", share=ALLOCATOR_FRAGMENTATION, source=ALLOCATOR_FRAGMENTATION_SOURCE),
)


def get_margin_parts(fragmentation: float | None = None, source: str = "") -> tuple[MarginPart, ...]:
    """The margin's shares: the measured default, or a device profile's own fragmentation (with its source)."""
    if fragmentation is None:
        return MARGIN_PARTS
    return (MARGIN_PARTS[0], MarginPart(name="allocator_fragmentation", share=fragmentation, source=source))


def get_allocator_fragmentation(peaks: dict[str, tuple[float, float]]) -> tuple[float, str] | None:
    """The largest ``reserved / allocated - 1`` over GPU trials' CUDA peaks (trial -> ``(max_memory_reserved,
    max_memory_allocated)``, ``metrics.json`` v8) and a line naming them; None where there are none."""
    shares = {name: reserved / allocated - 1.0 for name, (reserved, allocated) in peaks.items() if allocated > 0}
    if not shares:
        return None
    figures = ", ".join(f"{name} {100 * share:.1f}%" for name, share in shares.items())
    return max(
        0.0, *shares.values()
    ), f"measured: max reserved / max allocated - 1 on the device profile's trials: {figures}"


@dataclass(frozen=True, kw_only=True)
class MemoryMargin:
    """The margin below one device's usable memory ([Note: memory margin])."""

    capacity_bytes: float
    """The device's memory (the cluster profile's ``memory_per_rank_gib``)."""
    outside_allocator_bytes: float
    """Taken off before the margin (``[accelerator] reserved_gib``)."""
    parts: tuple[MarginPart, ...] = MARGIN_PARTS

    @property
    def usable_bytes(self) -> float:
        return self.capacity_bytes - self.outside_allocator_bytes

    @property
    def edge_bytes(self) -> float:
        """The largest safe predicted peak."""
        return self.usable_bytes / (1.0 + sum(p.share for p in self.parts))

    @property
    def margin_bytes(self) -> float:
        return self.usable_bytes - self.edge_bytes

    def is_at_edge(self, peak_bytes: float) -> bool:
        return self.edge_bytes < peak_bytes <= self.usable_bytes

    def describe(self) -> str:
        """``safe below 64.2 GiB: 77.6 GiB usable less a 13.4 GiB margin (...)``."""
        parts = " + ".join(f"{p.name.replace('_', ' ')} {p.share:.1%}" for p in self.parts)
        return (
            f"safe below {self.edge_bytes / _GIB:.1f} GiB: {self.usable_bytes / _GIB:.1f} GiB usable "
            f"({self.capacity_bytes / _GIB:.1f} GiB less {self.outside_allocator_bytes / _GIB:.1f} GiB outside the allocator, assumed) "
            f"less a {self.margin_bytes / _GIB:.1f} GiB margin ({parts} of the peak)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "capacity_gib": self.capacity_bytes / _GIB,
            "outside_allocator_gib": self.outside_allocator_bytes / _GIB,
            "outside_allocator_source": "assumption: the cluster profile's [accelerator] reserved_gib "
            "(CUDA context, NCCL buffers, workspaces)",
            "usable_gib": self.usable_bytes / _GIB,
            "margin_gib": self.margin_bytes / _GIB,
            "edge_gib": self.edge_bytes / _GIB,
            "parts": [
                {"name": p.name, "share": p.share, "gib": p.share * self.edge_bytes / _GIB, "source": p.source}
                for p in self.parts
            ],
        }


@dataclass(frozen=True, kw_only=True)
class PeakComparison:
    """A GPU trial's measured peak (CUDA max allocated) beside the simulator's prediction for it."""

    name: str
    predicted_bytes: float
    measured_bytes: float

    @property
    def error(self) -> float:
        """predicted / measured - 1."""
        return self.predicted_bytes / self.measured_bytes - 1.0
