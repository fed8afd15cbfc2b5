"""TimelineAnalyzer: the intervals behind the step metrics, for plotting."""

from __future__ import annotations

import numpy as np
import pandas as pd

from autotune.analysis import _intervals as iv
from autotune.analysis._comm_metrics import US_PER_MS
from autotune.analysis._events import COMM_KINDS, RankEvents
from autotune.analysis._steps import get_step_slices, get_window_compute

TIMELINE_COLUMNS = ["rank", "step", "lane", "start_ms", "end_ms"]
LANES = ("compute", *COMM_KINDS, "exposed")
"""``compute``, one lane per collective kind (``send_recv`` also holds a pipeline's P2P transfers), and
``exposed`` (collectives while not computing: not the P2P, whose wait is the bubble)."""


class TimelineAnalyzer:
    """Merged intervals per (rank, step, lane), in ms from the rank's first profiled step."""

    @classmethod
    def get_timeline(cls, events: RankEvents) -> pd.DataFrame:
        origin = events.steps["start"].min()
        hiding = get_window_compute(events)
        frames = []
        for s in get_step_slices(events):
            lanes = {"compute": s.compute}
            for kind in COMM_KINDS:
                lanes[kind] = iv.union(s.comm[s.kinds == kind])
            lanes["send_recv"] = iv.union(np.concatenate([s.comm[s.kinds == "send_recv"], s.p2p]))  # with pipeline P2P
            lanes["exposed"] = iv.subtract(iv.union(s.comm), hiding)
            for lane, spans in lanes.items():
                if len(spans) == 0:
                    continue
                frames.append(
                    pd.DataFrame(
                        {
                            "rank": events.rank,
                            "step": s.step,
                            "lane": lane,
                            "start_ms": (spans[:, 0] - origin) / US_PER_MS,
                            "end_ms": (spans[:, 1] - origin) / US_PER_MS,
                        }
                    )
                )
        if not frames:
            return pd.DataFrame(
                {c: np.array([], dtype=float if c.endswith("_ms") else object) for c in TIMELINE_COLUMNS}
            )
        return pd.concat(frames, ignore_index=True)[TIMELINE_COLUMNS]
