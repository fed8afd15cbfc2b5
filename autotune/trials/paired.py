"""Paired measurement: a candidate config and a reference config, alternating on the same ranks.

[Note: paired measurement]
A search compares configs, and on a shared box the load moves by 2-3x within minutes, so an
absolute step time says as much about the neighbours as about the config. So every
trial of a search measures its candidate *against a reference* (FSDP2's defaults) inside
one rank job:

- both run on the same ranks, on one model where they can ([Note: one model for both
  sides]); the candidate's peak memory is sampled before the reference exists;
- after warm-up, steps alternate in ABBA order (ref, cand | cand, ref | ref, cand ...),
  each started together on all ranks (a barrier), so the two sides of a pair run within a
  second of each other under the same load;
- *a step that follows a step of the other config is not measured* ([Note: switch cost]):
  each side runs one unmeasured *settle* step first whenever the ranks switch to it (its
  loss is kept: it is a training step like any other), so every measured step follows a
  step of its own config, as every step of real training does. In ABBA order the ranks
  switch once per pair, so a pair costs three steps, not two;
- each step's time is the slowest rank's (a one-element all-reduce after the timed step,
  outside the timing), so every rank holds the same numbers and decides alike;
- pair ``i``'s ratio is ``candidate_i / reference_i``; two consecutive pairs form an ABBA
  *block* (ref, cand, cand, ref), whose ratio ``(c_2j + c_2j+1) / (r_2j + r_2j+1)`` holds
  both orders, so a linear drift of the load and any order effect left cancel inside it.
  The trial's figure is the median block ratio, with the blocks' quartiles and extremes as
  the spread (an odd last pair is a block of its own; a trial of one block takes the spread
  of its two pairs); each side's own noise (median
  absolute deviation / median of its steps), the median pair ratio of each order and each
  side's switch cost (its settle steps' median over its measured steps' median, minus one)
  are recorded beside it, so a report can show whether the order still matters;
- pruning: with a stopping rule ([Note: sequential measurement]) after every block, from the
  second on, or on a third pair confirming a slow first block ([Note: pooled noise]), where no
  burst over two adjacent steps of the schedule can have made the call ([Note: burst
  windows]; the order itself: [Note: pair schedule] in :mod:`fsdp_runtime.tuning.pair_schedule`); without
  one (``prune_if_ratio_above``, trials outside a search), after the first
  ``PRUNE_AFTER_PAIRS`` pairs (one block), only if *every* one of them is above the limit;
- the defaults trial pairs the defaults with themselves (one model, alternate steps, no
  switch and so no settle steps): its ratio is 1 up to the noise, which it measures.

[Note: one model for both sides]
A trial that held the candidate's and the reference's models at once needed two models'
memory: 71.8-73.4 GiB on one H200 against 50.3 GiB for one (one H200, 2026-11-27), so a job
sized to its GPUs could not be searched. Where the two configs differ only in knobs FSDP2
switches on a sharded model ([Note: knobs switched in place] in :mod:`fsdp_runtime.switch`:
prefetch lists, reshard after forward as a bool, sync level, reshard after backward, concat
deferral, async unshard, reduce-scatter buffers), the reference's side shares the
candidate's training and each side switches the model to its own knobs before each of its
steps, outside the timed step. What one model changes and what it keeps:

- memory: one model, its parameters, gradients and optimizer state; a step's transient
  memory is whichever config's step is running. What a switch keeps is what the allocator
  caches for the other config's shapes: on CUDA reserved, not allocated, memory (the
  counter ``trial_peak_bytes`` reads is the larger config's peak, not the sum); on CPU
  heap pages glibc keeps mapped ([Note: what a trial measures]);
- the measurement: unchanged. ABBA order, the settle step after every switch (the switch
  costs a step of the other config's allocation pattern, exactly as between two models:
  [Note: switch cost]), block ratios and their spread. The reference takes no warm-up
  step of its own on the warm model (the candidate's warm-up built and warmed it): the
  candidate stepped last, so the pairs start with it (``first``: its even pairs run it
  first, no switch before the first step) and the reference's first step is the first
  pair's settle step, which a warm-up step of its own would only have preceded (one step
  fewer per trial; ``metrics.json`` v10 records the order, ``pairs_first``);
- the training: one trajectory. Both sides update the same parameters in turn, so the
  candidate's losses are those of the steps it ran, not of a run of its own; none of the
  in-place knobs changes the math (bitwise on CPU, ``tests/fsdp_runtime/test_switch.py``),
  so the trajectory is the one either config alone would follow, up to ``sync = "last"``'s
  reordered sums.

A structural difference (mesh, grouping, checkpointing, precision, an int reshard, pipeline
stages) gives the reference a model of its own on CPU (in a search's rank pool the one kept warm
from the last trial: [Note: a warm reference] in :mod:`autotune.trials.kept`); on CUDA the two models are built in
turn, one at a time ([Note: models built in turn] in :mod:`autotune.trials.in_turn`).
``AUTOTUNE_PAIRED_MODELS`` (``two``, ``turn``) overrides both for benchmarks and tests.
Measured (``benchmarks/trial_overhead.py --paired``, pooled, 2 ranks, no reshard after forward
+ prefetch against the defaults, 2 warm-up steps, at load 1.2-2.9): a trial's fixed cost
(wall minus its steps) 11.27 s with two models and 8.19 s with one on ``wide1024`` (4 pairs
per trial; 1.38x, per pair 1.27-1.49), 2.83 and 2.30 s on ``small`` (2 pairs; 1.23x).

[Note: switch cost]
Two configs trained in alternation on the same ranks do not leave each other alone: the first
step of a config after a step of the other is slower than its next ones. Measured by
``studies/switch_cost.py`` (2 ranks, a wide and shallow Llama, dim 512, 2 blocks, batch 1, 4
microbatches, links emulated as ``cpu-emulated-ib``; the defaults against ``sync = "last"``
with reshard after backward, in runs of 3 steps): the step right after a switch took 8-10%
longer than the settled steps of the same config on *both* sides, and most of it was CPU time
of the training thread (+95 ms of 1,140 ms), not waiting; its size varies from run to run and
with the configs (0-10% of a step in docs/studies.md's table, 40% on a communication-heavy
search's finalists). Two controls locate it: the same config against a second model of the
*same* config (``--gap twin``) pays nothing, and one config alone with an idle pause as long as
the other side's run in its place (``--gap sleep``) pays nothing. So it is neither the second
model's presence nor idleness (sockets, threads, CPU frequency) but the *other config's* state:
its allocations have another shape (sizes and lifetimes of unsharded parameters, gradient
buffers, reduce-scatter inputs), so the heap hands the first step after a switch other, colder
memory than its own previous step left (page faults stay few: 0-2,900 per step, under 6 ms;
this box has no hardware counters to show the cache misses themselves). With one measured step
per side per pair, ABBA puts the switched step on the candidate in even pairs and on the
reference in odd ones, so pair ratios alternate with their position (0.975 vs 0.818 in the run
above; 0.55 vs 0.36 on that communication-heavy search's finalists) and their median lands
anywhere between the modes. Real training never switches configs, so the settle step is the
right fix, not a correction: the cost is paid but not measured, and the block ratio cancels
what order effect remains.

The search's objective is the median ratio (lower is faster), chained to the defaults where the
reference is the search's best so far ([Note: measured against the best] in
:mod:`autotune.search.reference`); a search trial stops its pairs as soon as its ratio is known
([Note: sequential measurement] in :mod:`fsdp_runtime.tuning.sequential`), and the search
re-measures its top configs against the defaults at the end (``autotune.search.confirm``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fsdp_runtime.tuning.pair_schedule import get_burst_windows, get_pair_order, get_pair_schedule
from fsdp_runtime.tuning.sequential import StoppingRule, look

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
    settle_ms: list[float] = field(default_factory=list)
    """Slowest-rank times of the settle steps: the steps right after a switch, not measured."""
    config: dict[str, Any] | None = None
    """With a training shared by both sides: this side's config, switched to in place before each
    of its steps ([Note: one model for both sides]); None: the training is this side's own."""
    in_turn: Any = None
    """With models built in turn (:class:`~autotune.trials.in_turn.ModelsInTurn`): what builds this
    side's model when it steps (``training`` is None while the other side's is held)."""
    host_path_ms: dict[str, float] | None = None
    """The host's path per block pass, timed on its last warm-up step ([Note: host path probe])."""
    kept: bool = False
    """Its model is the kept warm reference ([Note: a warm reference] in :mod:`autotune.trials.kept`):
    built and warmed up by an earlier trial of the pool."""

    def clear(self) -> None:
        """Forget the steps so far (warm-up steps are not measurements; their losses stay)."""
        for steps in (self.step_ms, self.own_ms, self.cpu_ms, self.page_faults, self.settle_ms):
            steps.clear()


def _slowest_ms(ms: float, device: torch.device) -> float:
    """The slowest rank's time for this step, on every rank."""
    value = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def activate(side: Side) -> Any:
    """Make ``side``'s model what the ranks hold, outside any timed step: its knobs switched in
    place on a shared model ([Note: one model for both sides]; a no-op when it has them), or its
    build made in turn ([Note: models built in turn] in :mod:`autotune.trials.in_turn`)."""
    if side.in_turn is not None:
        side.in_turn.activate(side)
    elif side.config is not None:
        side.training.use_config(side.config)
    return side.training


def step_side(side: Side, device: torch.device, timed_step: Any, *, settle: bool = False) -> float:
    """One timed step of ``side``; returns (and records) the slowest rank's milliseconds. A
    ``settle`` step (the first after a switch, [Note: switch cost]) keeps its loss and its time
    in ``settle_ms`` only."""
    activate(side)
    timing = timed_step(side.training, side.next_step, device, side.emulator)
    side.next_step += 1
    ms = _slowest_ms(timing.ms, device)
    side.losses.append(timing.loss)
    if settle:
        side.settle_ms.append(ms)
        return ms
    side.step_ms.append(ms)
    side.own_ms.append(timing.ms)
    side.cpu_ms.append(timing.cpu_ms)
    side.page_faults.append(timing.page_faults)
    return ms


def run_pairs(
    sides: dict[str, Side],
    *,
    num_pairs: int,
    device: torch.device,
    timed_step: Any,
    prune_if_ratio_above: float | None,
    last: str = "reference",
    settle: bool = True,
    stopping: StoppingRule | None = None,
    first: str = "reference",
    on_first_step: Any = None,
) -> str | None:
    """Alternate the two sides for ``num_pairs`` pairs in the order of :func:`get_pair_schedule`
    ([Note: pair schedule]), a settle step first wherever the ranks switch from one model to the
    other (``last``: the side that stepped before the first pair; ``settle=False``: the
    measurement before [Note: switch cost], for tests and benchmarks that compare the two;
    ``first``: the side of the even pairs that steps first; ``on_first_step``: called after the
    first pair's first measured step). With ``stopping``, after every pair the rule looks
    (:func:`fsdp_runtime.tuning.sequential.look`: after every ABBA block, and on the pair confirming
    the first; [Note: sequential measurement]), knowing where a burst over two adjacent steps
    reaches ([Note: burst windows]); ``num_pairs`` is then the most it runs. Returns why it
    stopped early (``pruned``; with ``stopping``, the rule's reason; None: it ran every pair)."""
    self_paired = sides["reference"] is sides["candidate"]
    schedule = get_pair_schedule(num_pairs, first=first, last=last, settle=settle, self_paired=self_paired)
    windows = get_burst_windows(schedule)
    for step in schedule:
        step_side(sides[step.side], device, timed_step, settle=step.kind == "settle")
        if on_first_step is not None and step.pair == 0 and step.kind == "measured" and step.side == first:
            on_first_step()
        if not step.ends_pair:
            continue
        ratios = get_ratios(*get_pair_steps(sides))
        if stopping is not None:
            reason = look(stopping, ratios, windows, num_pairs)
            if reason is not None:
                return reason
        elif (
            prune_if_ratio_above is not None
            and step.pair + 1 == PRUNE_AFTER_PAIRS
            and min(ratios) > prune_if_ratio_above
        ):
            return "pruned"
    return None


def split_self_pairs(steps: list[Any]) -> tuple[list[Any], list[Any]]:
    """Steps of a side paired with itself, in pair order (ref, cand | cand, ref ...): (candidate, reference)."""
    candidate, reference = [], []
    for i in range(0, len(steps) - 1, 2):
        first, second = get_pair_order(i // 2)
        by_name = {first: steps[i], second: steps[i + 1]}
        candidate.append(by_name["candidate"])
        reference.append(by_name["reference"])
    return candidate, reference


def get_pair_steps(sides: dict[str, Side]) -> tuple[list[float], list[float]]:
    """The candidate's and the reference's measured steps, pair by pair (one model paired with
    itself, the defaults trial: its steps split by pair order)."""
    candidate, reference = sides["candidate"], sides["reference"]
    if reference is candidate:
        return split_self_pairs(candidate.step_ms)
    return candidate.step_ms, reference.step_ms


def get_ratios(candidate_ms: list[float], reference_ms: list[float]) -> list[float]:
    return [c / r for c, r in zip(candidate_ms, reference_ms) if r > 0]


def _get_order_ratios(ratios: list[float], first: str) -> dict[str, float | None]:
    """The median pair ratio of each order: the reference stepping first, the candidate first."""
    even, odd = ratios[0::2], ratios[1::2]
    by_first = {first: even, ("candidate" if first == "reference" else "reference"): odd}
    return {f"{side}_first": statistics.median(r) if r else None for side, r in sorted(by_first.items(), reverse=True)}


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


def get_block_ratios(candidate_ms: list[float], reference_ms: list[float]) -> list[float]:
    """Per ABBA block (pairs ``2j`` and ``2j+1``: both orders), candidate time over reference
    time; an odd last pair is a block of its own."""
    pairs = [(c, r) for c, r in zip(candidate_ms, reference_ms) if r > 0]
    blocks = [pairs[k : k + 2] for k in range(0, len(pairs), 2)]
    return [sum(c for c, _ in b) / sum(r for _, r in b) for b in blocks]


def _switch_cost(settle_ms: list[float], step_ms: list[float]) -> float | None:
    if not settle_ms or not step_ms:
        return None
    return statistics.median(settle_ms) / statistics.median(step_ms) - 1.0


def summarize_pairs(
    candidate_ms: list[float],
    reference_ms: list[float],
    candidate_settle_ms: list[float] | None = None,
    reference_settle_ms: list[float] | None = None,
    first: str = "reference",
) -> dict[str, Any]:
    """The paired figures of a trial (see [Note: paired measurement]); empty without pairs.
    ``first``: the side that stepped first in the even pairs."""
    ratios = get_ratios(candidate_ms, reference_ms)
    if not ratios:
        return {}
    blocks = get_block_ratios(candidate_ms, reference_ms)
    # One block has no spread of its own: its two pairs (each measured after settling) stand in.
    spread_of = blocks if len(blocks) > 1 else ratios
    q25, q75 = _quartiles(spread_of)
    median = statistics.median(blocks)
    return {
        "estimator": "blocks",
        "ratio": median,
        "ratio_q25": q25,
        "ratio_q75": q75,
        "ratio_min": min(spread_of),
        "ratio_max": max(spread_of),
        "ratio_spread": (q75 - q25) / median if median > 0 else None,
        "block_ratios": blocks,
        "num_blocks": len(blocks),
        "pair_ratios": ratios,
        "first": first,
        "order_ratios": _get_order_ratios(ratios, first),
        "switch_cost": {
            "candidate": _switch_cost(candidate_settle_ms or [], candidate_ms),
            "reference": _switch_cost(reference_settle_ms or [], reference_ms),
        },
        "candidate_noise": _relative_mad(candidate_ms),
        "reference_noise": _relative_mad(reference_ms),
        "num_pairs": len(ratios),
    }
