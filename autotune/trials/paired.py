"""Paired measurement: a candidate config and a reference config, alternating on the same ranks.

[Note: paired measurement]
A search compares configs, and on a shared box the load moves by 2-3x within minutes
(measured: the defaults at 695 ms and a config that changes little at 1,945 ms in one run),
so an absolute step time says as much about the neighbours as about the config. So every
trial of a search measures its candidate *against a reference* (FSDP2's defaults) inside
one rank job:

- both are built on the same ranks (each its own FSDP state and device mesh); the
  candidate's process peak memory is sampled before the reference exists;
- after warm-up, steps alternate in ABBA order (ref, cand | cand, ref | ref, cand ...),
  each started together on all ranks (a barrier), so the two sides of a pair run within a
  second of each other under the same load, and ABBA cancels a load that drifts linearly;
- each step's time is the slowest rank's (a one-element all-reduce after the timed step,
  outside the timing), so every rank holds the same numbers and decides alike;
- pair ``i``'s ratio is ``candidate_i / reference_i``; the trial's figure is the median
  ratio, with its quartiles and extremes as the spread, and each side's own noise (median
  absolute deviation / median of its steps) recorded beside it;
- pruning (``prune_if_ratio_above``) looks at the first ``PRUNE_AFTER_PAIRS`` pairs and
  stops only if *every* one of them is above the limit: one noisy pair never prunes;
- the defaults trial pairs the defaults with themselves (one model, alternate steps):
  its ratio is 1 up to the noise, which it measures.

The search's objective is the median ratio (lower is faster); it also reruns a trial whose
spread is too wide to rank (``autotune.search.loop``) and re-measures its top configs
against the defaults at the end (``autotune.search.confirm``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

PRUNE_AFTER_PAIRS = 2
"""Pairs after which the ranks decide on pruning."""


class StepTiming(NamedTuple):
    """What :func:`autotune.trials.program.timed_step` measured of one step on this rank."""

    ms: float
    """This rank's wall time (``perf_counter``)."""
    loss: float
    cpu_ms: float
    """The training thread's CPU time (``time.thread_time``)."""
    page_faults: int
    """Minor page faults of the whole rank process (``getrusage``), gloo's threads included."""


@dataclass
class Side:
    """One side of the comparison: its training, its step counter, its link emulator, its steps."""

    training: Any
    emulator: Any = None
    next_step: int = 0
    step_ms: list[float] = field(default_factory=list)
    """Each step's slowest-rank time (the same on every rank)."""
    losses: list[float] = field(default_factory=list)
    own_ms: list[float] = field(default_factory=list)
    """Each step's time on this rank (what its profiled steps are compared with)."""
    cpu_ms: list[float] = field(default_factory=list)
    page_faults: list[int] = field(default_factory=list)

    def clear(self) -> None:
        """Forget the steps so far (warm-up steps are not measurements; their losses stay)."""
        for steps in (self.step_ms, self.own_ms, self.cpu_ms, self.page_faults):
            steps.clear()


def _slowest_ms(ms: float, device: torch.device) -> float:
    """The slowest rank's time for this step, on every rank."""
    value = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def step_side(side: Side, device: torch.device, timed_step: Any) -> float:
    """One timed step of ``side``; returns (and records) the slowest rank's milliseconds."""
    timing = timed_step(side.training, side.next_step, device, side.emulator)
    side.next_step += 1
    ms = _slowest_ms(timing.ms, device)
    side.step_ms.append(ms)
    side.losses.append(timing.loss)
    side.own_ms.append(timing.ms)
    side.cpu_ms.append(timing.cpu_ms)
    side.page_faults.append(timing.page_faults)
    return ms


def get_pair_order(index: int) -> tuple[str, str]:
    """ABBA: even pairs run the reference first, odd pairs the candidate first."""
    return ("reference", "candidate") if index % 2 == 0 else ("candidate", "reference")


def run_pairs(
    sides: dict[str, Side], *, num_pairs: int, device: torch.device, timed_step: Any, prune_if_ratio_above: float | None
) -> bool:
    """Alternate the two sides for ``num_pairs`` pairs; returns whether the trial was pruned."""
    for i in range(num_pairs):
        for name in get_pair_order(i):
            step_side(sides[name], device, timed_step)
        if prune_if_ratio_above is not None and i + 1 == PRUNE_AFTER_PAIRS:
            ratios = get_ratios(sides["candidate"].step_ms, sides["reference"].step_ms)
            if min(ratios) > prune_if_ratio_above:
                return True
    return False


def get_ratios(candidate_ms: list[float], reference_ms: list[float]) -> list[float]:
    return [c / r for c, r in zip(candidate_ms, reference_ms) if r > 0]


def _relative_mad(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    median = statistics.median(values)
    return statistics.median(abs(v - median) for v in values) / median if median > 0 else None


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def summarize_pairs(candidate_ms: list[float], reference_ms: list[float]) -> dict[str, Any]:
    """The paired figures of a trial (see [Note: paired measurement]); empty without pairs."""
    ratios = get_ratios(candidate_ms, reference_ms)
    if not ratios:
        return {}
    q25, q75 = _quartiles(ratios)
    median = statistics.median(ratios)
    return {
        "ratio": median,
        "ratio_q25": q25,
        "ratio_q75": q75,
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratio_spread": (q75 - q25) / median if median > 0 else None,
        "pair_ratios": ratios,
        "candidate_noise": _relative_mad(candidate_ms),
        "reference_noise": _relative_mad(reference_ms),
        "num_pairs": len(ratios),
    }
