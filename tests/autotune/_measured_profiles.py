"""A hand-priced measured profile for the simulator tests (no trial behind it)."""

from __future__ import annotations

import dataclasses
from typing import Any

from autotune.sim.measured import HOOK_KEYS, SEGMENT_KEYS, CollectiveFit, MeasuredProfile


def get_measured_profile(**changes: Any) -> MeasuredProfile:
    """4 ranks, one microbatch: every segment 1 ms, every hook 0.1 ms, an all-gather fitted at
    0.1 ms + 1 ns per byte on 2 ranks; ``changes`` replace fields."""
    base = MeasuredProfile(
        name="test",
        world_size=4,
        num_microbatches=1,
        segments=dict.fromkeys(SEGMENT_KEYS, 1e-3),
        hooks=dict.fromkeys(HOOK_KEYS, 1e-4),
        microbatch_s=1e-4,
        optimizer_s_per_element=1e-9,
        memory_bytes_per_s=1e9,
        collectives={"all_gather": CollectiveFit(latency_s=1e-4, seconds_per_byte=1e-9, group_size=2)},
    )
    return dataclasses.replace(base, **changes)
