"""HtaOverlapAnalyzer: HTA's own comm/compute overlap, to cross-check ours on GPU traces."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd


def open_hta_analysis(trace_paths: dict[int, Path]):  # -> hta.trace_analysis.TraceAnalysis (imported lazily)
    """HTA's ``TraceAnalysis`` of these traces (one per rank, all profiled steps), parsed in this process.

    ``TraceAnalysis(...)`` parses several ranks in a ``multiprocessing`` pool whose context is
    ``fork`` (hta/common/trace.py), and its constructor does not let a caller turn that off.
    A fork of a process that runs other threads (a rank pool's, torch's, a report's) copies
    their locks held, and the child can wait on one forever: the suite hung that way in
    ``test_gpu_traces_get_hta_analyses`` (a forked child asleep on a futex, its parent in
    ``waitpid``). So the object is built without its constructor and the traces are loaded the
    way the constructor would, with ``use_multiprocessing=False``; a few ranks parse in
    seconds.
    """
    from hta.common.trace import Trace
    from hta.trace_analysis import TraceAnalysis

    logging.getLogger("hta").setLevel(logging.ERROR)
    files = {rank: str(Path(p).resolve()) for rank, p in trace_paths.items()}
    analysis = TraceAnalysis.__new__(TraceAnalysis)
    analysis.t = Trace(files, str(Path(next(iter(files.values()))).parent))
    analysis.t.load_traces(include_last_profiler_step=True, use_multiprocessing=False)
    return analysis


class HtaOverlapAnalyzer:
    """Run ``hta.TraceAnalysis.get_comm_comp_overlap`` on the same files.

    HTA counts GPU kernels only, so on CPU/gloo traces its ratio is NaN (no kernels):
    that is why [Note: trace metrics] derives the same quantity from CPU events.
    """

    @staticmethod
    def get_comm_comp_overlap(trace_paths: dict[int, Path]) -> pd.DataFrame:
        """Columns ``rank, comp_comm_overlap_pctg`` (HTA's, rounded to 0.01), all profiled steps included."""
        result = open_hta_analysis(trace_paths).get_comm_comp_overlap(visualize=False)
        return result[["rank", "comp_comm_overlap_pctg"]].sort_values("rank").reset_index(drop=True)
