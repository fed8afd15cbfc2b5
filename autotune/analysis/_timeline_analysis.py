"""TimelineAnalyzer: the intervals behind the step metrics, for plotting."""

from __future__ import annotations

import pandas as pd

from autotune.analysis import _intervals as iv
from autotune.analysis._comm_metrics import US_PER_MS
from autotune.analysis._events import COMM_KINDS, RankEvents, get_step_comm, get_step_compute

TIMELINE_COLUMNS = ["rank", "step", "lane", "start_ms", "end_ms"]
LANES = ("compute", *COMM_KINDS, "exposed")
"""``compute``, one lane per collective kind, and ``exposed`` (communication while not computing)."""


class TimelineAnalyzer:
    """Merged intervals per (rank, step, lane), in ms from the rank's first profiled step."""

    @classmethod
    def get_timeline(cls, events: RankEvents) -> pd.DataFrame:
        origin = events.steps["start"].min()
        frames = []
        for step, start, end in events.steps.itertuples(index=False):
            compute = get_step_compute(events, start, end)
            comm = get_step_comm(events, start, end)
            lanes = {"compute": compute}
            for kind in COMM_KINDS:
                lanes[kind] = iv.union(comm.loc[comm["kind"] == kind, ["start", "end"]].to_numpy())
            lanes["exposed"] = iv.subtract(iv.union(comm[["start", "end"]].to_numpy()), compute)
            for lane, spans in lanes.items():
                frames.append(pd.DataFrame({
                    "rank": events.rank, "step": step, "lane": lane,
                    "start_ms": (spans[:, 0] - origin) / US_PER_MS, "end_ms": (spans[:, 1] - origin) / US_PER_MS,
                }))  # fmt: skip
        return pd.concat(frames, ignore_index=True)[TIMELINE_COLUMNS] if frames else pd.DataFrame(columns=TIMELINE_COLUMNS)
