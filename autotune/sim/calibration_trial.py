"""The trials calibration reads (:class:`CalibrationTrial`): a finished trial dir's step time,
config, links and traces (``metrics.json``, ``config.toml``, ``trace_rank*.json.gz``), and what its
traces say each part of a step costs (:func:`load_trace_costs`). The one part of
:mod:`autotune.sim.calibrate` that reads trial dirs, through the upstream ``autotune.trials`` and
``autotune.analysis`` ([Note: calibration] in :mod:`autotune.sim.calibrate`)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from autotune.sim.model_work import ModelWork
from autotune.sim.trace_costs import CalibrationError, TraceCosts, get_trace_costs
from fsdp_runtime import RuntimeConfig, load_config, validate_for_world
from profiles import ClusterProfile, load_cluster_profile


@dataclass(kw_only=True)
class CalibrationTrial:
    """One finished trial read back for calibration."""

    path: Path
    config: RuntimeConfig
    world_size: int
    step_s: float
    """Median unprofiled step (the slowest rank per step)."""
    cluster: ClusterProfile | None
    """The cluster whose links the trial emulated; None: raw links."""
    traces: list[Path] = field(default_factory=list)
    ratio: float | None = None
    """Measured against another config in alternating pairs ([Note: paired measurement]): the
    median step-time ratio to it (None: unpaired, or paired with itself)."""
    reference_step_s: float | None = None
    """That reference's median step in the same pairs."""

    @property
    def emulated(self) -> bool:
        return self.cluster is not None and any(link.emulated for link in self.cluster.links.values())


def read_calibration_trial(path: str | Path) -> CalibrationTrial:
    """A trial dir (``metrics.json``, ``config.toml``, traces) as calibration input."""
    from autotune.trials import TrialMetrics

    path = Path(path)
    metrics = TrialMetrics.read(path / "metrics.json")
    if metrics.status != "ok" or not metrics.step_ms:
        raise CalibrationError(
            f"{path}: trial status {metrics.status} ({metrics.reason or 'no step time'}): only a finished trial calibrates"
        )
    if not metrics.traces:
        raise CalibrationError(
            f"{path}: the trial has no traces (it ran without the profiler): calibration reads FSDP2's labels from them"
        )
    cluster = load_cluster_profile(metrics.cluster) if metrics.cluster else None
    reference = metrics.reference_step_ms_per_step
    paired = (
        reference
        and metrics.paired.get("ratio") is not None
        and statistics.median(reference) != statistics.median(metrics.step_ms_per_step)
    )
    return CalibrationTrial(
        path=path,
        config=load_config(path / "config.toml"),
        world_size=metrics.world_size,
        step_s=metrics.step_ms / 1e3,
        cluster=cluster,
        traces=[path / t for t in metrics.traces],
        ratio=metrics.paired["ratio"] if paired else None,
        reference_step_s=statistics.median(reference) / 1e3 if paired else None,
    )


def load_trace_costs(trial: CalibrationTrial, work: ModelWork, *, local: bool = False) -> TraceCosts:
    from autotune.analysis import FsdpTraceAnalysis

    events = FsdpTraceAnalysis(trial.traces).events
    return get_trace_costs(
        events, block_names=work.block_names, num_microbatches=trial.config.num_microbatches, local=local
    )


def is_local(trial: CalibrationTrial) -> bool:
    """The trial ran on a shard group of one (HSDP Nx1): FSDP2 unshards and reduces by plain copies."""
    return trial.world_size > 1 and validate_for_world(trial.config, trial.world_size)[1] == 1
