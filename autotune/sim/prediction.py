"""What the simulator predicts: a step (:class:`StepPrediction`, its units' communication in
:class:`UnitPrediction`) and a pipeline's step (:class:`PipelinePrediction`, per stage
:class:`StagePrediction`). Plain data: :mod:`autotune.sim.predict` and :mod:`autotune.sim.pipeline`
fill them, the plan and the search read them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autotune.sim.pipeline_stages import PipelineSpec


@dataclass(kw_only=True)
class UnitPrediction:
    name: str
    comm_s: float
    """Seconds of this unit's collectives (all-gathers, reduce-scatters, all-reduces) per step."""
    exposed_s: float
    """Seconds the compute stream waited for them."""

    @property
    def overlap(self) -> float | None:
        return None if self.comm_s <= 0 else max(0.0, 1.0 - self.exposed_s / self.comm_s)


@dataclass(kw_only=True)
class StepPrediction:
    """What the simulator predicts for one optimizer step on one rank."""

    step_s: float
    compute_s: float
    """Seconds the compute stream was busy (kernels, copies, the optimizer)."""
    comm_s: float
    exposed_comm_s: float
    tokens_per_s_per_device: float
    mfu: float
    """Model FLOPs (as FlopCounterMode counts them) per second / the device's dense peak (0 without one: a measured CPU profile)."""
    peak_memory_bytes: float
    memory_capacity_bytes: float
    memory_breakdown: dict[str, float] = field(default_factory=dict)
    units: list[UnitPrediction] = field(default_factory=list)
    phase_peaks: dict[str, float] = field(default_factory=dict)
    """Peak memory in each phase (``forward``, ``backward``, ``optimizer``)."""
    memory_edge_bytes: float | None = None
    """The largest safe peak: ``memory_capacity_bytes`` less the margin ([Note: memory margin]); None: no margin (CPU)."""

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.memory_capacity_bytes

    @property
    def at_edge(self) -> bool:
        """Fits the usable memory, but not with the margin: it may still run out of memory."""
        return self.fits and self.memory_edge_bytes is not None and self.peak_memory_bytes > self.memory_edge_bytes

    @property
    def is_safe(self) -> bool:
        return self.fits and not self.at_edge

    @property
    def memory_headroom_bytes(self) -> float:
        return self.memory_capacity_bytes - self.peak_memory_bytes

    def describe_memory(self) -> str:
        """``peak 91.2 GiB > 77.6 GiB usable (activations 71.0, ...)``."""
        parts = ", ".join(
            f"{k.replace('_', ' ')} {v / 2**30:.1f}"
            for k, v in sorted(self.memory_breakdown.items(), key=lambda kv: -kv[1])[:4]
        )
        relation = "<=" if self.fits else ">"
        edge = (
            f", at the edge (safe below {self.memory_edge_bytes / 2**30:.1f} GiB)"
            if self.at_edge and self.memory_edge_bytes is not None
            else ""
        )
        return f"peak {self.peak_memory_bytes / 2**30:.1f} GiB {relation} {self.memory_capacity_bytes / 2**30:.1f} GiB usable{edge} ({parts})"

    def to_metrics(self) -> dict[str, float]:
        return {
            "predicted_step_ms": 1e3 * self.step_s,
            "predicted_tokens_per_s_per_device": self.tokens_per_s_per_device,
            "predicted_mfu": self.mfu,
            "predicted_exposed_comm_ms": 1e3 * self.exposed_comm_s,
            "predicted_peak_memory_gib": self.peak_memory_bytes / 2**30,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.to_metrics(),
            "fits": self.fits,
            "at_edge": self.at_edge,
            "memory_breakdown_gib": {k: v / 2**30 for k, v in self.memory_breakdown.items()},
            "units": [{"name": u.name, "comm_ms": 1e3 * u.comm_s, "exposed_ms": 1e3 * u.exposed_s} for u in self.units],
        }


@dataclass(kw_only=True)
class StagePrediction:
    """One pipeline stage over a step (its pp rank's figures where the rank's stages share them)."""

    stage: int
    rank: int
    """The pp rank holding it."""
    blocks: str
    """Its blocks (``layers.0-9``)."""
    compute_s: float
    """Its forwards' and backwards' compute over the step."""
    comm_s: float
    """Its FSDP2 collectives over the step."""
    exposed_comm_s: float
    """What its compute waited for them."""
    optimizer_s: float
    max_in_flight: int
    """The most microbatches whose activations it held at once."""
    bubble_fraction: float
    """Of its rank: the share of the step the rank's compute stream idled."""
    peak_memory_bytes: float
    """Of its rank."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "rank": self.rank,
            "blocks": self.blocks,
            "compute_ms": 1e3 * self.compute_s,
            "comm_ms": 1e3 * self.comm_s,
            "exposed_comm_ms": 1e3 * self.exposed_comm_s,
            "optimizer_ms": 1e3 * self.optimizer_s,
            "max_in_flight": self.max_in_flight,
            "bubble_fraction": self.bubble_fraction,
            "peak_memory_gib": self.peak_memory_bytes / 2**30,
        }


@dataclass(kw_only=True)
class PipelinePrediction(StepPrediction):
    """A step of a pipeline: the slowest rank's step, the largest rank's peak and exposed communication;
    ``units`` are the stages."""

    pipeline: PipelineSpec
    bubble_fraction: float
    """The mean over pp ranks of the share of the step a rank idled."""
    p2p_s: float
    """Seconds of one point-to-point transfer between two stages (the slowest boundary)."""
    stages: list[StagePrediction] = field(default_factory=list)

    def to_metrics(self) -> dict[str, float]:
        return {**super().to_metrics(), "predicted_bubble_fraction": self.bubble_fraction}

    def to_dict(self) -> dict[str, Any]:
        return {
            **super().to_dict(),
            "pipeline": self.pipeline.to_dict(),
            "bubble_fraction": self.bubble_fraction,
            "p2p_ms": 1e3 * self.p2p_s,
            "stages": [s.to_dict() for s in self.stages],
        }


def get_group_name(first: str, last: str) -> str:
    """A grouped unit's name as the search space writes it: ``layers.0-1`` (else ``first-last``)."""
    prefix, _, start = first.rpartition(".")
    other, _, end = last.rpartition(".")
    return (
        f"{prefix}.{start}-{end}"
        if prefix and prefix == other and start.isdecimal() and end.isdecimal()
        else f"{first}-{last}"
    )
