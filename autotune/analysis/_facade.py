"""The facade: load a set of rank traces once, then ask it for each analysis."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from autotune.analysis._errors import TraceError
from autotune.analysis._events import RankEvents, classify_events
from autotune.analysis._host_analysis import HostAnalyzer
from autotune.analysis._hta_overlap import HtaOverlapAnalyzer
from autotune.analysis._load import RankTrace, load_trace
from autotune.analysis._pipeline import PipelineLayout, assign_stages
from autotune.analysis._pipeline_analysis import STAGE_COLUMNS, PipelineAnalyzer
from autotune.analysis._step_analysis import ALLOCATOR_COLUMNS, WINDOW_COLUMNS, StepAnalyzer, get_allocator_peak
from autotune.analysis._summary import build_summary
from autotune.analysis._timeline_analysis import TimelineAnalyzer
from autotune.analysis._unit_analysis import UnitAnalyzer


class FsdpTraceAnalysis:
    """Trace metrics of one trial: one torch.profiler chrome trace per rank.

    Every quantity is defined once, in [Note: trace metrics] (``autotune.analysis``).
    Times in the returned DataFrames are milliseconds; ratios are fractions in [0, 1]
    (``overlap_ratio``) or >= 1 (``bound_ratio``); None where undefined (no comm).

    Args:
        trace_paths: ``.json`` or ``.json.gz`` chrome traces, one per rank (any order, any
            names; the rank comes from the trace's ``distributedInfo``, else ``rank<N>`` in
            the file name; traces that say neither take the smallest ranks no other trace
            claims, in list order).
        pipeline: the trial's pipeline layout (:meth:`PipelineLayout.from_config`), None when
            it has none: then P2P transfers are ``send_recv`` collectives and no stage figures
            are computed; with one, see [Note: pipeline bubble].

    Raises:
        TraceError: a file is missing, empty, truncated, not a chrome trace, has no
            ``ProfilerStep#N`` spans, two files claim the same rank, or the ranks do not
            split into the layout's pipeline ranks.
    """

    def __init__(self, trace_paths: Sequence[str | Path], *, pipeline: PipelineLayout | None = None):
        if not trace_paths:
            raise TraceError("<trace list>", "no trace files given (expected one trace_rank<N>.json[.gz] per rank)")
        self.traces: dict[int, RankTrace] = {}
        anonymous: list[RankTrace] = []
        for path in trace_paths:
            trace = load_trace(path, default_rank=-1)
            if trace.rank_source == "position":
                anonymous.append(trace)
            elif trace.rank in self.traces:
                raise TraceError(path, f"rank {trace.rank} already loaded from {self.traces[trace.rank].path}")
            else:
                self.traces[trace.rank] = trace
        free = (r for r in range(len(self.traces) + len(anonymous)) if r not in self.traces)
        for trace, rank in zip(anonymous, free):
            trace.rank = rank
            self.traces[rank] = trace
        self.traces = dict(sorted(self.traces.items()))
        self.events: dict[int, RankEvents] = {rank: classify_events(t) for rank, t in self.traces.items()}
        self.pipeline = pipeline if pipeline is not None and pipeline.pp > 1 else None
        if self.pipeline is not None:
            assign_stages(self.events, self.pipeline)

    @property
    def device(self) -> str:
        """``gpu`` if any rank's trace has device kernels, else ``cpu``."""
        return "gpu" if any(t.device == "gpu" for t in self.traces.values()) else "cpu"

    @property
    def num_bytes(self) -> int:
        """Total size of the trace files as stored."""
        return sum(t.num_bytes for t in self.traces.values())

    def get_step_metrics(self) -> pd.DataFrame:
        """One row per (rank, profiled step); columns ``_step_analysis.STEP_COLUMNS``."""
        return pd.concat([StepAnalyzer.get_step_metrics(e) for e in self.events.values()], ignore_index=True)

    def get_unit_metrics(self) -> pd.DataFrame:
        """One row per (rank, profiled step, FSDP unit); columns ``_unit_analysis.UNIT_COLUMNS``."""
        return pd.concat([UnitAnalyzer.get_unit_metrics(e) for e in self.events.values()], ignore_index=True)

    def get_host_metrics(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """FSDP2's own host work ([Note: host-bound steps] in ``_host_analysis``): one row per (rank,
        profiled step), columns ``HOST_COLUMNS``, and one per (rank, step, FSDP unit), ``UNIT_HOST_COLUMNS``."""
        pairs = [HostAnalyzer.get_host_metrics(e) for e in self.events.values()]
        return pd.concat([p[0] for p in pairs], ignore_index=True), pd.concat([p[1] for p in pairs], ignore_index=True)

    def get_stage_metrics(self) -> pd.DataFrame:
        """One row per (rank, profiled step, pipeline stage the rank holds); columns
        ``_pipeline_analysis.STAGE_COLUMNS``; empty without a pipeline layout."""
        frames = [PipelineAnalyzer.get_stage_metrics(e) for e in self.events.values()]
        frames = [f for f in frames if len(f)]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=STAGE_COLUMNS)

    def get_window_metrics(self) -> pd.DataFrame:
        """One row per rank over all its profiled steps; columns ``_step_analysis.WINDOW_COLUMNS``:
        ``comm_ms`` and ``exposed_comm_ms`` of the union of every step's collectives, and
        ``overlap_ratio_time_weighted`` (HTA's ``comp_comm_overlap_ratio``)."""
        return pd.DataFrame([StepAnalyzer.get_window_metrics(e) for e in self.events.values()], columns=WINDOW_COLUMNS)

    def get_allocator_peaks(self) -> pd.DataFrame:
        """One row per rank whose trace has ``[memory]`` events with ``Total Reserved`` (recorded with
        ``profile_memory=True``); columns ``_step_analysis.ALLOCATOR_COLUMNS``: at the largest ``Total
        Allocated``, what the caching allocator reserved, and ``fragmentation`` = reserved / allocated - 1."""
        peaks = {rank: get_allocator_peak(e.memory) for rank, e in self.events.items()}
        rows = [(rank, a, r, r / a - 1 if a else None) for rank, peak in peaks.items() if peak for a, r in (peak,)]
        return pd.DataFrame(rows, columns=ALLOCATOR_COLUMNS)

    def get_timeline(self) -> pd.DataFrame:
        """Merged compute / per-kind comm / exposed intervals per (rank, step), ms from each rank's first step."""
        return pd.concat([TimelineAnalyzer.get_timeline(e) for e in self.events.values()], ignore_index=True)

    def get_hta_comm_comp_overlap(self) -> pd.DataFrame:
        """HTA's ``get_comm_comp_overlap`` on the same files (meaningful for GPU traces only)."""
        return HtaOverlapAnalyzer.get_comm_comp_overlap({rank: t.path for rank, t in self.traces.items()})

    def summarize(self) -> dict:
        """The JSON-able summary documented in ``autotune.analysis._summary``."""
        return build_summary(
            self.events,
            self.get_step_metrics(),
            self.get_unit_metrics(),
            self.get_window_metrics(),
            self.get_stage_metrics(),
            device=self.device,
            pipeline=self.pipeline,
        )
