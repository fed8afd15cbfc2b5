"""HtaOverlapAnalyzer: HTA's own comm/compute overlap, to cross-check ours on GPU traces."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd


class HtaOverlapAnalyzer:
    """Run ``hta.TraceAnalysis.get_comm_comp_overlap`` on the same files.

    HTA counts GPU kernels only, so on CPU/gloo traces its ratio is NaN (no kernels):
    that is why [Note: trace metrics] derives the same quantity from CPU events.
    """

    @staticmethod
    def get_comm_comp_overlap(trace_paths: dict[int, Path]) -> pd.DataFrame:
        """Columns ``rank, comp_comm_overlap_pctg`` (HTA's, rounded to 0.01), all profiled steps included."""
        from hta.trace_analysis import TraceAnalysis as HtaTraceAnalysis

        logging.getLogger("hta").setLevel(logging.ERROR)
        files = {rank: str(Path(p).resolve()) for rank, p in trace_paths.items()}
        trace_dir = str(Path(next(iter(files.values()))).parent)
        analysis = HtaTraceAnalysis(trace_files=files, trace_dir=trace_dir, include_last_profiler_step=True)
        result = analysis.get_comm_comp_overlap(visualize=False)
        return result[["rank", "comp_comm_overlap_pctg"]].sort_values("rank").reset_index(drop=True)
