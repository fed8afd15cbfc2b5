"""Rank programs for the search tests (imported by name by the ranks; see _trial_programs)."""

from __future__ import annotations

from autotune.trials.program import run_trial_rank

INJECTED = "injected failure for configs with explicit forward prefetch"


def crash_on_explicit_prefetch(rank: int, world_size: int, *, spec: dict) -> dict:
    """The real trial workload, except that configs with explicit forward prefetch crash."""
    if any(unit.get("forward_prefetch") for unit in spec["config"]["units"]):
        raise RuntimeError(INJECTED)
    return run_trial_rank(rank, world_size, spec=spec)
