"""Search test fixtures: fast settings of a real search, knob params, trial rows as the search records them."""

from __future__ import annotations

from typing import Any

from autotune.search import TrialRow

FAST = {
    "model": "tiny",
    "world_size": 2,
    "num_warmup": 1,
    "num_measured": 2,
    "num_profiled": 1,
    "trial_timeout_s": 90.0,
    "patience": None,
}
"""``SearchSettings`` fields of a search on the tiny model that takes seconds per trial."""


def nosync_params(
    params: dict[str, Any], blocks: str = "all", *, keep_unsharded: bool, defer_concat: bool, **more: Any
) -> dict[str, Any]:
    """``params`` with gradient sync skipped on ``blocks`` (synced on the last microbatch, FSDP level), then ``more``."""
    return {
        **params,
        "nosync_blocks": blocks,
        "nosync_level_fsdp": "last",
        "keep_unsharded": keep_unsharded,
        "defer_concat": defer_concat,
        **more,
    }


def complete_row(number: int, step_ms: float, **fields: Any) -> TrialRow:
    """The row of a trial that ran and was measured (``COMPLETE``, ``ok``)."""
    return TrialRow(number=number, state="COMPLETE", status="ok", step_ms=step_ms, **fields)
