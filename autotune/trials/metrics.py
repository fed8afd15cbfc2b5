"""``metrics.json``: what one trial measured (an artifact, see [Note: artifacts]).

Three different peaks exist in this project and each has its own name:

- ``process_peak_bytes`` (here): the trial process's peak, sampled RSS on CPU or
  ``torch.cuda.max_memory_allocated`` on GPU (``memory_source`` says which), over build,
  warm-up and measured steps; see [Note: what a trial measures] in
  :mod:`autotune.trials.program`.
- ``profiler_peak_allocated_bytes`` (trace metrics): the largest ``Total Allocated`` the
  profiler saw in the profiled window (:mod:`autotune.analysis`).
- ``consolidation_rise_bytes`` (:mod:`autotune.search.consolidation`): how far rank 0's
  peak RSS rose while consolidating a checkpoint.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from autotune.analysis import check_summary
from autotune.artifacts import (
    ArtifactError,
    build_dataclass,
    get_added_field_migrations,
    read_artifact,
    write_artifact,
)
from autotune.trials.paired import summarize_pairs

TrialStatus = Literal["ok", "pruned", "timeout", "crash", "oom", "invalid_config"]


def median_or_none(values: list[float]) -> float | None:
    """The median of ``values``; None for an empty list (the one step-median rule)."""
    return statistics.median(values) if values else None


@dataclass(kw_only=True)
class RankMetrics:
    """One rank's measurements."""

    rank: int
    step_ms: list[float]
    """Unprofiled, timed steps (in a paired trial: the candidate's; each the slowest rank's)."""
    reference_step_ms: list[float] = field(default_factory=list)
    """A paired trial's reference steps, interleaved with ``step_ms`` (see [Note: paired measurement])."""
    settle_step_ms: list[float] = field(default_factory=list)
    """A paired trial's candidate steps right after a switch, not measured (slowest rank; v5,
    see [Note: switch cost])."""
    reference_settle_step_ms: list[float] = field(default_factory=list)
    """The same for the reference (v5)."""
    profiled_step_ms: list[float] = field(default_factory=list)
    """This rank's own time of each traced step (see [Note: what a trial measures])."""
    losses: list[float] = field(default_factory=list)
    process_peak_bytes: int | None = None
    process_baseline_bytes: int | None = None
    """RSS before the model was built (0 on GPU)."""
    trial_peak_bytes: int | None = None
    """The whole trial's peak up to its last measured step, the reference included (same source
    as ``process_peak_bytes``; v8): [Note: one model for both sides]."""
    reserved_peak_bytes: int | None = None
    """On CUDA ``torch.cuda.max_memory_reserved`` over the same span: what the caching allocator
    held, fragments included (None on CPU; v8)."""
    num_models: int | None = None
    """Models this rank held at once for the trial's two sides: 1 (shared, self-paired or built in
    turn) or 2 (v8)."""
    num_builds: int | None = None
    """Models this rank built for the trial (more than ``num_models``: built in turn; v8)."""
    shard_inits: list[list[int]] = field(default_factory=list)
    """Per sharded build of the trial, in build order, ``[drawn, restored]``: the parameters whose
    rows it drew and those it restored from the rank's shard cache ([Note: shard cache] in
    :mod:`profiles.chunked_init`); empty: none built sharded (full builds, older trials; v12)."""
    host_path_ms: dict[str, float] | None = None
    """The host's path per block pass (``block_forward``, ``block_backward``), timed on the candidate's
    last warm-up step ([Note: host path probe]; CUDA only, None elsewhere; v9)."""
    trace: str | None = None
    """File name of this rank's trace in the trial dir."""
    link_emulation: dict[str, Any] | None = None
    own_step_ms: list[float] = field(default_factory=list)
    """This rank's own time of each unprofiled step in ``step_ms`` (which holds the slowest rank's)."""
    step_cpu_ms: list[float] = field(default_factory=list)
    """Training-thread CPU time (``time.thread_time``) of each unprofiled step in ``step_ms``."""
    step_page_faults: list[int] = field(default_factory=list)
    """Minor page faults of the rank process during each unprofiled step in ``step_ms``."""
    profiled_cpu_ms: list[float] = field(default_factory=list)
    """Training-thread CPU time of each traced step."""
    profiled_page_faults: list[int] = field(default_factory=list)
    """Minor page faults of the rank process during each traced step."""
    pairs_first: str = "reference"
    """The side that stepped first in the even pairs: ``candidate`` where the reference is its
    model switched in place (v10; [Note: one model for both sides]); older trials: ``reference``."""
    candidate_warmup: int | None = None
    """Warm-up steps the candidate took (v11): ``num_warmup``, one fewer on CPU where its first
    measured step leads the pairs ([Note: the leading step] in :mod:`autotune.trials.program`),
    one for a kept warm model ([Note: a warm reference]); None: an older trial (``num_warmup``)."""

    @property
    def median_step_ms(self) -> float | None:
        return median_or_none(self.step_ms)

    @property
    def median_profiled_step_ms(self) -> float | None:
        return median_or_none(self.profiled_step_ms)

    def get_profiler_figures(self) -> dict[str, Any] | None:
        """This rank's profiled vs unprofiled medians (own wall, thread CPU, page faults), their
        ratios, and ``trace_scale`` (unprofiled / profiled own step: what the report scales this
        rank's trace times by); None without both kinds of steps (older metrics, pruned trials)."""
        step, profiled = median_or_none(self.own_step_ms), median_or_none(self.profiled_step_ms)
        if not step or not profiled:
            return None
        cpu, profiled_cpu = median_or_none(self.step_cpu_ms), median_or_none(self.profiled_cpu_ms)
        faults, profiled_faults = median_or_none(self.step_page_faults), median_or_none(self.profiled_page_faults)
        return {
            "rank": self.rank,
            "step_ms": step,
            "profiled_step_ms": profiled,
            "wall": profiled / step,
            "trace_scale": step / profiled,
            "cpu_ms": cpu,
            "profiled_cpu_ms": profiled_cpu,
            "cpu": _ratio(profiled_cpu, cpu),
            "page_faults": faults,
            "profiled_page_faults": profiled_faults,
            "page_fault_ratio": _ratio(profiled_faults, faults),
        }


def _slowest(per_rank: Any) -> list[float]:
    """Per step, the slowest rank's time."""
    return [max(steps) for steps in zip(*per_rank)]


def _max_or_none(values: Any) -> Any:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def _summed_median(per_rank: Any) -> float | None:
    """Median over steps of the ranks' sum (CPU time, page faults: the trial's total per step)."""
    return median_or_none([sum(steps) for steps in zip(*per_rank)])


def summarize_profiler(ranks: list[RankMetrics]) -> dict[str, Any]:
    """What profiling cost the trial (the ``profiler`` field of :class:`TrialMetrics`); empty
    without profiled and unprofiled steps with CPU times on every rank (metrics before v4)."""
    per_rank = [r.get_profiler_figures() for r in ranks]
    if not per_rank or any(f is None or f["cpu"] is None for f in per_rank):
        return {}
    cpu = _summed_median(r.step_cpu_ms for r in ranks)
    faults, profiled_faults = (
        _summed_median(r.step_page_faults for r in ranks),
        _summed_median(r.profiled_page_faults for r in ranks),
    )
    return {
        "cpu_ms": cpu,
        "profiled_cpu_ms": _summed_median(r.profiled_cpu_ms for r in ranks),
        "page_faults": faults,
        "profiled_page_faults": profiled_faults,
        "page_fault_ratio": _ratio(profiled_faults, faults),
        "per_rank": per_rank,
    }


def _migrate_v1(data: dict[str, Any]) -> dict[str, Any]:
    """v1 -> v2: the process peak got its own name (``peak_memory_bytes`` was ambiguous)."""
    data = dict(data)
    data["process_peak_bytes"] = data.pop("peak_memory_bytes", None)
    ranks = []
    for r in data.get("ranks", []):
        if not isinstance(r, dict):
            return data  # left for from_dict to refuse
        r = dict(r)
        r["process_peak_bytes"] = r.pop("peak_memory_bytes", None)
        r["process_baseline_bytes"] = r.pop("baseline_memory_bytes", None)
        ranks.append(r)
    data["ranks"] = ranks
    return data


@dataclass(kw_only=True)
class TrialMetrics:
    """The body of ``metrics.json``."""

    KIND: ClassVar[str] = "trial_metrics"
    SCHEMA_VERSION: ClassVar[int] = 13
    MIGRATIONS: ClassVar[dict] = {1: _migrate_v1, **get_added_field_migrations(2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)}
    # v3, v4 added fields, all with defaults; v5 the settle steps (their ``paired`` figures
    # stay as measured: before v5 a ratio is the median pair, without ``estimator``); v6 embeds
    # trace summary v4 (pipeline figures; ``check_summary`` upgrades an older one); v7 adds the
    # stopping rule and why the pairs stopped (defaults: none, every pair ran); v8 the trial's
    # peak with the reference, the allocator's reserved peak, the models held and built (None: unknown);
    # v9 the host's path per block pass (None: not timed); v10 which side stepped first in the
    # even pairs (``RankMetrics.pairs_first``, ``paired["first"]``; before: the reference); v11
    # the candidate's warm-up steps per rank (``RankMetrics.candidate_warmup``; before: None); v12
    # each sharded build's shard-cache counts per rank (``RankMetrics.shard_inits``; before: empty); v13
    # the traces left on their nodes (``kept_traces``; before: empty)

    status: TrialStatus
    reason: str = ""
    model: str | dict[str, Any]
    world_size: int
    backend: str
    cluster: str | None = None
    mesh: dict[str, Any] = field(default_factory=dict)
    num_warmup: int = 0
    num_measured: int = 0
    num_profiled: int = 0
    step_ms_per_step: list[float] = field(default_factory=list)
    """Per measured step, the slowest rank's time."""
    step_ms: float | None = None
    """Median of ``step_ms_per_step``: the trial's step time."""
    process_peak_bytes: int | None = None
    """Largest process peak over ranks (see the module docstring)."""
    memory_source: str | None = None
    """``peak_rss`` (CPU) or ``cuda_max_allocated`` (GPU)."""
    trial_peak_bytes: int | None = None
    """Largest whole-trial peak over ranks, the reference included (v8; see :class:`RankMetrics`)."""
    reserved_peak_bytes: int | None = None
    """Largest CUDA reserved peak over ranks (v8; None on CPU)."""
    num_models: int | None = None
    """Models per rank held at once for the trial's two sides (v8)."""
    num_builds: int | None = None
    """Models per rank built for the trial (v8)."""
    host_path_ms: dict[str, float] | None = None
    """The slowest rank's host path per block pass (v9; see :class:`RankMetrics`)."""
    ranks: list[RankMetrics] = field(default_factory=list)
    traces: list[str] = field(default_factory=list)
    kept_traces: list[dict[str, Any]] = field(default_factory=list)
    """Traces left on the ranks' nodes, over the cap of what a rank sends ([Note: node-local files] in
    :mod:`autotune.trials.gather`): each one's rank, host, path and bytes (v13)."""
    wall_s: float = 0.0
    trace_metrics: dict[str, Any] | None = None
    """``autotune.analysis.summarize_traces`` of the traces (its own versioned schema)."""
    analysis_error: str | None = None
    reference_step_ms_per_step: list[float] = field(default_factory=list)
    """A paired trial's reference steps (slowest rank), pair by pair with ``step_ms_per_step``."""
    paired: dict[str, Any] = field(default_factory=dict)
    """A paired trial's comparison: ``ratio`` (median candidate/reference), quartiles, extremes,
    ``ratio_spread``, each side's noise (``autotune.trials.paired.summarize_pairs``); empty unpaired."""
    stopping: dict[str, Any] | None = None
    """The trial's stopping rule ([Note: sequential measurement]; None: a fixed number of pairs, v7)."""
    stopped: str | None = None
    """Why its pairs stopped before ``num_measured`` ran: ``faster``, ``slower``, ``settled``, ``unlikely`` ([Note: futility]),
    ``max_blocks`` (the rule's reasons) or ``pruned``; None: every pair ran (v7)."""
    profiled_step_ms: float | None = None
    """Median step time inside the profiled window (slowest rank per step)."""
    profiler_overhead: float | None = None
    """``profiled_step_ms / step_ms``: how much the profiler slowed the steps its traces show."""
    profiler_cpu_overhead: float | None = None
    """``profiler["profiled_cpu_ms"] / profiler["cpu_ms"]``: the same for the training threads' CPU time."""
    profiler: dict[str, Any] = field(default_factory=dict)
    """What profiling cost (``summarize_profiler``): per step, the ranks' summed training-thread
    CPU ms and minor page faults, unprofiled and profiled, and ``per_rank`` figures (own wall,
    CPU, faults, ratios, ``trace_scale``); empty before v4 and for unprofiled trials."""

    @classmethod
    def from_ranks(cls, ranks: list[RankMetrics], **fields: Any) -> TrialMetrics:
        """Metrics whose step figures are derived from the ranks' (the one place they are)."""
        per_step = _slowest(r.step_ms for r in ranks)
        reference = _slowest(r.reference_step_ms for r in ranks)
        profiled = median_or_none(_slowest(r.profiled_step_ms for r in ranks))
        step_ms = median_or_none(per_step)
        peaks = [r.process_peak_bytes for r in ranks if r.process_peak_bytes is not None]
        profiler = summarize_profiler(ranks)
        return cls(
            ranks=ranks,
            step_ms_per_step=per_step,
            step_ms=step_ms,
            process_peak_bytes=max(peaks) if peaks else None,
            trial_peak_bytes=_max_or_none(r.trial_peak_bytes for r in ranks),
            reserved_peak_bytes=_max_or_none(r.reserved_peak_bytes for r in ranks),
            num_models=_max_or_none(r.num_models for r in ranks),
            num_builds=_max_or_none(r.num_builds for r in ranks),
            host_path_ms=_get_slowest_host_path(ranks),
            traces=[r.trace for r in ranks if r.trace],
            reference_step_ms_per_step=reference,
            paired=summarize_pairs(
                per_step,
                reference,
                _slowest(r.settle_step_ms for r in ranks),
                _slowest(r.reference_settle_step_ms for r in ranks),
                first=ranks[0].pairs_first if ranks else "reference",
            ),
            profiled_step_ms=profiled,
            profiler_overhead=profiled / step_ms if profiled and step_ms else None,
            profiler_cpu_overhead=_ratio(profiler.get("profiled_cpu_ms"), profiler.get("cpu_ms")),
            profiler=profiler,
            **fields,
        )

    @property
    def ratio(self) -> float | None:
        """A paired trial's median candidate/reference step-time ratio (lower: faster than the reference)."""
        return self.paired.get("ratio")

    def to_dict(self) -> dict[str, Any]:
        body = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {
            "schema_version": self.SCHEMA_VERSION,
            "kind": self.KIND,
            **body,
            "ranks": [dataclasses.asdict(r) for r in self.ranks],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "metrics") -> TrialMetrics:
        body = {k: v for k, v in data.items() if k not in ("schema_version", "kind")}
        ranks = body.get("ranks", [])
        if not isinstance(ranks, list):
            raise ArtifactError(f"{source}: ranks must be a list, got {type(ranks).__name__}")
        body["ranks"] = [
            build_dataclass(RankMetrics, r, source=source, what=f"ranks[{i}]") for i, r in enumerate(ranks)
        ]
        if body.get("trace_metrics") is not None:
            body["trace_metrics"] = check_summary(body["trace_metrics"], source=f"{source}: trace_metrics")
        return build_dataclass(cls, body, source=source, what="trial metrics")

    @classmethod
    def read(cls, path: str | Path) -> TrialMetrics:
        data = read_artifact(path, kind=cls.KIND, version=cls.SCHEMA_VERSION, migrations=cls.MIGRATIONS)
        return cls.from_dict(data, source=str(path))

    def write(self, path: str | Path) -> Path:
        return write_artifact(path, self.to_dict())


def _get_slowest_host_path(ranks: list[RankMetrics]) -> dict[str, float] | None:
    """Per block pass, the slowest rank's host path (None: no rank timed it)."""
    timed = [r.host_path_ms for r in ranks if r.host_path_ms]
    return {key: max(t[key] for t in timed) for key in timed[0]} if timed else None


@dataclass(kw_only=True)
class TrialResult:
    """Outcome of one trial; ``metrics`` is the trial dir's ``metrics.json``."""

    status: TrialStatus
    reason: str = ""
    out_dir: Path
    metrics: TrialMetrics | None = None
    wall_s: float = 0.0
    rank_pids: list[int] = field(default_factory=list)
    """Process ids of the ranks that ran it (process-group leaders), for leak checks."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def step_ms(self) -> float | None:
        """Median unprofiled step time (slowest rank per step), or None without measurements."""
        return self.metrics.step_ms if self.metrics else None

    @property
    def process_peak_bytes(self) -> int | None:
        """Largest process peak over ranks (see ``metrics.memory_source`` for its meaning)."""
        return self.metrics.process_peak_bytes if self.metrics else None

    @classmethod
    def load(cls, out_dir: str | Path) -> TrialResult:
        """Read a finished trial dir back."""
        out_dir = Path(out_dir)
        metrics = TrialMetrics.read(out_dir / "metrics.json")
        return cls(
            status=metrics.status, reason=metrics.reason, out_dir=out_dir, metrics=metrics, wall_s=metrics.wall_s
        )
