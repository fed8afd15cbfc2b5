"""Rank programs for the search tests (imported by name by the ranks; see _trial_programs)."""

from __future__ import annotations

from autotune.trials.program import run_trial_rank

INJECTED = "injected failure for configs with explicit forward prefetch"


def crash_on_explicit_prefetch(rank: int, world_size: int, *, spec: dict) -> dict:
    """The real trial workload, except that configs with explicit forward prefetch crash."""
    if any(unit.get("forward_prefetch") for unit in spec["config"]["units"]):
        raise RuntimeError(INJECTED)
    return run_trial_rank(rank, world_size, spec=spec)


NOISE_FACTOR = 4.0
NOISE_MIN_S = 2.5
"""Rank 1 sleeps this many times the step's own duration, and at least ``NOISE_MIN_S``: the step
looks several times slower than a clean one even when a load spike stalls the clean one (at load 9
a reference step once took 7x its usual time). The prune limit widens with the defaults trial's
own spread (``get_prune_limit``): at load 6-8 in CI a 1 s minimum gave first pairs of 2.6-3.4x
against a limit of ~3.4x, and the slowed trial was not pruned."""


class _SleepyTraining:
    """A training whose ``step`` sleeps after stepping, inside the rank's timed interval."""

    def __init__(self, training) -> None:
        self.training = training

    def step(self, step: int) -> float:
        import time

        start = time.perf_counter()
        loss = self.training.step(step)
        time.sleep(max(NOISE_FACTOR * (time.perf_counter() - start), NOISE_MIN_S))
        return loss


def noisy_first_window(rank: int, world_size: int, *, spec: dict) -> dict:
    """The real trial workload, except that in a non-default trial's first window rank 1
    sleeps inside some steps: trial 1 in every candidate step (as if a burst of load hit only
    the candidate: it would be pruned), trial 2 in the *reference's* first measured step (its
    pairs, or blocks, spread too wide to rank, and the fast-looking first pair keeps it from
    being pruned whatever the best is; a slowdown in every other step would cancel inside the
    ABBA blocks, [Note: paired measurement]). Re-measured windows (``.../remeasured``) run clean."""
    from pathlib import Path

    from autotune.trials import program

    out_dir = Path(spec["out_dir"])
    trial = out_dir.name
    if rank != 1 or spec["reference"] == spec["config"] or trial not in ("trial_0001", "trial_0002"):
        return program.run_trial_rank(rank, world_size, spec=spec)
    original, seen = program.timed_step, []

    def timed_step(training, step, device, emulator=None):
        if not seen:
            seen.append(training)  # the candidate is built, and stepped, first
        is_candidate = training is seen[0]
        first_measured = step == spec["num_warmup"]  # the reference's first measured step
        if (trial == "trial_0001" and is_candidate) or (trial == "trial_0002" and not is_candidate and first_measured):
            training = _SleepyTraining(training)
        return original(training, step, device, emulator)

    program.timed_step = timed_step  # pooled ranks live on: restored below
    try:
        return program.run_trial_rank(rank, world_size, spec=spec)
    finally:
        program.timed_step = original
