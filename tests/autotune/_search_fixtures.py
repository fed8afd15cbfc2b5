"""Search test fixtures: fast settings of a real search, knob params, trial rows as the search records them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from autotune.search import SearchSpace, TrialRow, run_search

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


def start_search(settings: Any, monkeypatch: Any) -> tuple[SearchSpace, list[str]]:
    """``run_search`` up to where its rank pool would open: the space it built and the lines it said."""
    import autotune.search.run as search_run

    spaces, phases = [], []
    make_space = search_run.make_space
    monkeypatch.setattr(search_run, "make_space", lambda *a, **k: spaces.append(make_space(*a, **k)) or spaces[-1])

    class Stop(Exception):
        pass

    def no_pool(settings: Any) -> None:
        raise Stop

    monkeypatch.setattr(search_run, "open_pool", no_pool)
    reporter = SimpleNamespace(on_phase=phases.append, on_start=lambda *a: None)
    with pytest.raises(Stop):
        run_search(settings, reporter=reporter)
    return spaces[0], phases
