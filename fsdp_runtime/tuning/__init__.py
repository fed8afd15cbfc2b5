"""Measuring configs against each other, shared by ``autotune search`` and the in-job tuner.

The order a pair of configs steps in (:mod:`~fsdp_runtime.tuning.pair_schedule`), the rule that
says when a ratio is known (:mod:`~fsdp_runtime.tuning.sequential`) and the block patterns
(:mod:`~fsdp_runtime.tuning.patterns`) are the search's own, standard library only; the in-job
tuner (:mod:`~fsdp_runtime.tuning.injob`) walks the in-place knobs
(:mod:`~fsdp_runtime.tuning.moves`) with them (:mod:`~fsdp_runtime.tuning.walk`), so a training
job measures exactly as the search does."""

from fsdp_runtime.tuning.injob import TUNER_ENV, InJobTuner, PeerStepError, TunerError, is_tuner_enabled
from fsdp_runtime.tuning.moves import Move, get_moves
from fsdp_runtime.tuning.pair_schedule import (
    CANDIDATE,
    REFERENCE,
    get_burst_proof_mean,
    get_burst_windows,
    get_pair_order,
    get_pair_schedule,
)
from fsdp_runtime.tuning.patterns import get_prefetch_lists, select_blocks
from fsdp_runtime.tuning.sequential import (
    Interval,
    PairNoise,
    StoppingRule,
    decide,
    get_interval,
    get_rule_interval,
    is_faster,
    look,
)
from fsdp_runtime.tuning.walk import Decision, TuningWalk

__all__ = [
    "CANDIDATE",
    "REFERENCE",
    "TUNER_ENV",
    "Decision",
    "InJobTuner",
    "Move",
    "TunerError",
    "PeerStepError",
    "TuningWalk",
    "get_moves",
    "is_faster",
    "is_tuner_enabled",
    "Interval",
    "PairNoise",
    "StoppingRule",
    "decide",
    "get_burst_proof_mean",
    "get_burst_windows",
    "get_interval",
    "get_pair_order",
    "get_pair_schedule",
    "get_prefetch_lists",
    "get_rule_interval",
    "look",
    "select_blocks",
]
