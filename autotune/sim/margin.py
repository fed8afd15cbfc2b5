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
   ``predicted / measured - 1`` of the peak over the trials that measured one on a GPU
   (:func:`autotune.sim.gpu_calibrate.compare_trial_peak`).
3. *Allocator fragmentation* (``ALLOCATOR_FRAGMENTATION``): the caching allocator reserves
   whole segments and keeps freed blocks cached, so at the allocation peak it holds more
   than the tensors do: reserved / allocated - 1 at the peak. Measurable from a trace that
   has the profiler's ``[memory]`` events (``FsdpTraceAnalysis.get_allocator_peaks``), but
   ``tests/data/gpu_traces`` has none (trials profile without ``profile_memory``), so this part
   is a published figure, not a measurement of ours.

Parts 2 and 3 are shares of the peak, so a predicted peak ``p`` is *safe* when
``p x (1 + sum of shares) <= usable``, and *at the edge* when it fits the usable memory
but not with the margin: ``usable / (1 + sum of shares) < p <= usable``. The margin is
``usable`` less that edge; each part's GiB is its share of the edge peak. ``autotune plan``
flags configs at the edge and does not emit one while a safe config fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_GIB = 2**30

SIMULATOR_MEMORY_ERROR = 0.0084
"""Measured (``tests/data/gpu_traces``, one H200, bf16 params, fp32 reduce, 2 microbatches of
8192 tokens, FSDP2's defaults): predicted peak / ``metrics.json`` ``process_peak_bytes``
(CUDA max allocated) - 1 is +0.84% for ``h200-llama1b-defaults`` (47.32 GiB predicted,
50,389,473,792 B = 46.93 GiB measured) and +0.24% for ``h200-l8b4-defaults`` (50.43 vs
54,015,212,032 B = 50.31 GiB). Both over-predict, but two trials cannot bound the sign:
the larger magnitude (``tests/autotune/plan/test_memory_margin.py`` recomputes both)."""

ALLOCATOR_FRAGMENTATION = 0.20
"""Not measured here (``tests/data/gpu_traces`` has no ``[memory]`` events). Published:
pytorch/torchtitan#165 (FSDP2 eager, 8x H100, local batch 8, seq 2048, bf16 params, fp32
reduce-scatter): selective checkpointing peaked at 52.13% active and 62.51% reserved of
95.04 GiB, +19.9% reserved over active. Full checkpointing there: 23.92% vs 32.64%, +36%,
but over a peak half as large (the cache beyond it was a similar 8-10 GiB); configs near the
edge have large peaks, like the selective run. A peak reservation without memory pressure:
before an OOM the allocator frees its cached blocks and retries, so this bounds from above
what fragmentation costs at the edge."""


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
        source="measured: predicted vs CUDA max allocated, 2 H200 trials (tests/data/gpu_traces): +0.24%, +0.84%",
    ),
    MarginPart(
        name="allocator_fragmentation",
        share=ALLOCATOR_FRAGMENTATION,
        source="assumption: peak reserved / active - 1 of FSDP2 with selective checkpointing on 8x H100 "
        "(pytorch/torchtitan#165: 62.51% vs 52.13%); tests/data/gpu_traces has no [memory] events to measure it",
    ),
)


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
