"""What measuring configs against each other needs, shared by ``autotune search`` and the in-job
tuner: the order a pair of configs steps in (:mod:`~fsdp_runtime.tuning.pair_schedule`) and the
rule that says when a ratio is known (:mod:`~fsdp_runtime.tuning.sequential`). Standard library
only, so that a training job that imports ``fsdp_runtime`` measures exactly as the search does."""

from fsdp_runtime.tuning.pair_schedule import get_burst_windows, get_pair_order, get_pair_schedule
from fsdp_runtime.tuning.sequential import (
    Interval,
    PairNoise,
    StoppingRule,
    decide,
    get_interval,
    get_rule_interval,
    look,
)

__all__ = [
    "Interval",
    "PairNoise",
    "StoppingRule",
    "decide",
    "get_burst_windows",
    "get_interval",
    "get_pair_order",
    "get_pair_schedule",
    "get_rule_interval",
    "look",
]
