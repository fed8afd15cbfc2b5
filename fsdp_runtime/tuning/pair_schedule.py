"""The order in which a paired trial steps its two sides: the schedule ``run_pairs`` runs.

[Note: pair schedule]
:func:`autotune.trials.paired.run_pairs` does not order its steps itself: it runs
:func:`get_pair_schedule`, step by step, so that what reasons about the order (the stopping
rule's burst guard, [Note: sequential measurement] in :mod:`fsdp_runtime.tuning.sequential`;
``studies/stopping_rule.py``'s Monte Carlo) reads the very order that runs. Pairs alternate in
ABBA order, the side of the even pairs first (:func:`get_pair_order`), and a side takes an
unmeasured settle step whenever the ranks switch to it ([Note: switch cost] in
:mod:`autotune.trials.paired`). Four pairs, in each way a trial holds its reference
(:meth:`autotune.trials.sides.SideBuilder.get_reference_kind`; ``_s`` a settle step, ``w`` a
warm-up step of a model built anew)::

    in_place, kept  c0 r_s r0 r1 c_s c1 c2 r_s r2 r3 c_s c3    (the candidate stepped last)
    own             r0 c_s c0 c1 r_s r1 r2 c_s c2 c3 r_s r3    (the reference warmed up last)
    in_turn         r_w r_w r0 c_w c_w c_s c0 c1 r_w r_w r_s r1 r2 c_w c_w c_s c2 c3 r_w r_w r_s r3
    self            r0 c0 c1 r1 r2 c2 c3 r3                    (one model: no switch, no settle)

Measured steps of one side stand next to each other once per block boundary or block: ``r0 r1``
and ``c1 c2`` where the candidate leads, ``c0 c1`` and ``r1 r2`` where the reference does. One
burst of load over two adjacent steps moves the ratios of both their pairs the same way
(:func:`get_burst_windows`). Models built in turn warm up inside the step that activates them
(``ModelsInTurn.activate``): ``run_pairs`` runs the schedule without them (``warmup=0``) and
the warm-ups come with the side's next step.
"""

from __future__ import annotations

import math
import statistics
from typing import NamedTuple

CANDIDATE, REFERENCE = "candidate", "reference"

ORDERS: dict[str, dict[str, object]] = {
    "in_place": {"first": CANDIDATE},
    "kept": {"first": CANDIDATE},
    "own": {"first": REFERENCE},
    "in_turn": {"first": REFERENCE, "in_turn": True},
    "self": {"first": REFERENCE, "self_paired": True},
}
"""Per reference kind (``SideBuilder.get_reference_kind``): the order ``run_pairs`` is handed
(``first`` is ``program.get_pairs_first``'s, ``last`` the same side)."""


class ScheduledStep(NamedTuple):
    """One step of a paired trial."""

    side: str
    """``candidate`` or ``reference``."""
    pair: int
    """The pair it belongs to (a settle or warm-up step: the pair whose measured step follows)."""
    kind: str = "measured"
    """``measured``, ``settle`` (the first step after a switch) or ``warmup`` (a model built in turn)."""
    ends_pair: bool = False
    """Its pair's second measured step: the pair's ratio is known after it."""

    @property
    def label(self) -> str:
        """``c0``, ``r_s``, ``c_w``: as the Notes write the schedule."""
        return self.side[0] + {"measured": str(self.pair), "settle": "_s", "warmup": "_w"}[self.kind]


def get_pair_order(index: int, first: str = REFERENCE) -> tuple[str, str]:
    """ABBA: even pairs run ``first`` first (the reference unless the candidate stepped last: its
    model switched in place), odd pairs the other side."""
    order = (REFERENCE, CANDIDATE) if first == REFERENCE else (CANDIDATE, REFERENCE)
    return order if index % 2 == 0 else order[::-1]


def get_pair_schedule(
    num_pairs: int,
    *,
    first: str = REFERENCE,
    last: str | None = None,
    settle: bool = True,
    self_paired: bool = False,
    in_turn: bool = False,
    warmup: int = 0,
) -> list[ScheduledStep]:
    """The steps of ``num_pairs`` pairs in the order ``run_pairs`` takes them. ``last``: the side
    that stepped before the first pair (default ``first``); ``settle=False``: no settle steps;
    ``self_paired``: one model for both sides (never a switch); ``in_turn``: models built in turn,
    the candidate's held at the start, each build followed by ``warmup`` warm-up steps."""
    last = first if last is None else last
    held = CANDIDATE
    steps: list[ScheduledStep] = []
    for i in range(num_pairs):
        for k, side in enumerate(get_pair_order(i, first)):
            if in_turn and side != held:
                steps += [ScheduledStep(side, i, "warmup")] * warmup
                held = side
            if settle and not self_paired and side != last:
                steps.append(ScheduledStep(side, i, "settle"))
            steps.append(ScheduledStep(side, i, ends_pair=k == 1))
            last = side
    return steps


def get_order_schedule(kind: str, num_pairs: int, *, warmup: int = 0) -> list[ScheduledStep]:
    """The schedule of a trial whose reference is held as ``kind`` (:data:`ORDERS`)."""
    order = dict(ORDERS[kind])
    return get_pair_schedule(num_pairs, warmup=warmup if order.get("in_turn") else 0, **order)


Window = tuple[frozenset[int], frozenset[int]]
"""A two-step burst's reach: the pairs whose candidate step it slows, those whose reference step it slows."""


def get_burst_windows(schedule: list[ScheduledStep]) -> list[Window]:
    """For every two adjacent steps of ``schedule``, the pairs a burst of load over both would
    make look slower (their candidate step slowed) and faster (their reference step slowed); a
    pair with both its steps slowed keeps its ratio. Distinct windows that reach a pair."""
    windows: list[Window] = []
    for a, b in zip(schedule, schedule[1:]):
        hit = {CANDIDATE: set(), REFERENCE: set()}
        for step in (a, b):
            if step.kind == "measured":
                hit[step.side].add(step.pair)
        both = hit[CANDIDATE] & hit[REFERENCE]
        window = (frozenset(hit[CANDIDATE] - both), frozenset(hit[REFERENCE] - both))
        if (window[0] or window[1]) and window not in windows:
            windows.append(window)
    return windows


def get_burst_proof_mean(pair_ratios: list[float], first: str = REFERENCE) -> float:
    """The geometric mean of ``pair_ratios`` (a window that ran ``first`` first in its even pairs)
    that no single burst can have lowered: the highest of it over all the pairs and over those left
    once each burst window's "faster" pairs (their reference step slowed) are left out in turn. A
    leader's figure a finalist is pruned against: a burst over the leader's reference steps makes
    it look faster, and a finalist faster than the true leader would be pruned against that
    (``studies/decisions.py``'s ``lose`` rows: docs/search.md)."""
    logs = [math.log(r) for r in pair_ratios]
    means = [statistics.fmean(logs)]
    for _, faster in get_burst_windows(get_pair_schedule(len(logs), first=first)):
        kept = [x for i, x in enumerate(logs) if i not in faster]
        if faster and kept:
            means.append(statistics.fmean(kept))
    return math.exp(max(means))
