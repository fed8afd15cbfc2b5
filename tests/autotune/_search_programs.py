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
a reference step once took 7x its usual time)."""


class _SleepyTraining:
    """A training whose ``step`` sleeps after stepping, inside the rank's timed interval."""

    def __init__(self, training, *, factor: float = NOISE_FACTOR, min_s: float = NOISE_MIN_S) -> None:
        self.training, self.factor, self.min_s = training, factor, min_s

    def step(self, step: int) -> float:
        import time

        start = time.perf_counter()
        loss = self.training.step(step)
        time.sleep(max(self.factor * (time.perf_counter() - start), self.min_s))
        return loss


def _with_slow_steps(rank: int, world_size: int, spec: dict, slow) -> dict:
    """The real trial with rank 1's steps slowed where ``slow(is_candidate, step)`` says."""
    from autotune.trials import program

    original = program.timed_step

    def timed_step(training, step, device, emulator=None):
        # The candidate's knobs are on the model (its own, or the one both sides share: [Note: one model for both sides]).
        result = slow(training.active_config == spec["config"], step)
        if result:
            training = _SleepyTraining(training, **result) if isinstance(result, dict) else _SleepyTraining(training)
        return original(training, step, device, emulator)

    program.timed_step = timed_step  # pooled ranks live on: restored below
    try:
        return program.run_trial_rank(rank, world_size, spec=spec)
    finally:
        program.timed_step = original


def burst_or_slow(rank: int, world_size: int, *, spec: dict) -> dict:
    """The real trial workload, except that rank 1 sleeps inside some candidate steps: trial 1
    in every one (a config far slower than the defaults: pruned), trial 2 in its first block's
    only (the warm-up and the two pairs after it: a burst of load that must not prune it)."""
    from pathlib import Path

    trial = Path(spec["out_dir"]).name
    if rank != 1 or spec["reference"] == spec["config"] or trial not in ("trial_0001", "trial_0002"):
        return run_trial_rank(rank, world_size, spec=spec)
    first_block = range(spec["num_warmup"], spec["num_warmup"] + 3)  # settle + 2 measured candidate steps
    if trial == "trial_0001":
        return _with_slow_steps(rank, world_size, spec, lambda is_candidate, step: is_candidate)
    return _with_slow_steps(rank, world_size, spec, lambda is_candidate, step: is_candidate and step in first_block)


SLOW_RANK_S = 0.5
"""How long rank 1 sleeps in every step of a slowed trial: several times a tiny step."""


def slowed_then_hung(rank: int, world_size: int, *, spec: dict) -> dict:
    """The real trial workload, except that in trial 1 rank 1 is slow (it sleeps ``SLOW_RANK_S``
    in every step: a busy box, not a hang) and in trial 2 it hangs in its first step after warm-up."""
    import time
    from pathlib import Path

    trial = Path(spec["out_dir"]).name
    if rank == 1 and trial == "trial_0001":
        return _with_slow_steps(rank, world_size, spec, lambda is_candidate, step: {"factor": 0, "min_s": SLOW_RANK_S})
    if rank == 1 and trial == "trial_0002":

        def hang(is_candidate, step):
            if step >= spec["num_warmup"]:
                time.sleep(3600)
            return False

        return _with_slow_steps(rank, world_size, spec, hang)
    return run_trial_rank(rank, world_size, spec=spec)
