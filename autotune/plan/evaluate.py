"""Every point of the space through the simulator, fast enough for a 70B model on 128 ranks.

[Note: plan speed]
``autotune plan`` simulates one step of every point; each simulation walks every unit of
every microbatch in Python (~8 ms of CPU for 81 units), and llama70b on 16 nodes has 52,650
points. Four things keep it well under a minute, each exact or checked:

1. *Shared first forward* (:meth:`autotune.sim.Simulator.simulate_knobs`): points that agree
   on the mesh, forward prefetch, async unshard and reshard-after-forward share one simulated
   forward, forked for each.
2. *Equal knobs, one simulation*: two points whose per-unit knobs are equal once FSDP2's
   implicit prefetch is spelled out (backward: the unit before in post-forward order, which
   is what ``depth1`` lists explicitly; forward: none) simulate alike; only one runs.
3. *Dominated points are not simulated*: ``defer_concat = false`` (FSDP1's eager concat) only
   adds copies to the compute stream of its deferred twin, which holds the same accumulator:
   it is never faster nor smaller, so it is counted and skipped (34% of llama70b's points).
4. *Depth extrapolation* (models deeper than ``2 x REDUCED_DEPTHS[1]`` blocks): every point is
   simulated at ``REDUCED_DEPTHS`` blocks (the same patterns over fewer blocks: halves, every
   second block and paired lists keep their shape at depths divisible by 4) and its step time,
   memory and communication figures are extrapolated linearly in depth (in the steady state
   each block adds the same time and activation memory; the ends add constants). The
   ``NUM_EXACT`` fastest by extrapolation, and the defaults, are then simulated at full depth,
   and only those exact figures are shown, ranked and emitted. ``tests/autotune/plan/test_plan.py``
   checks the extrapolation against full-depth simulations.

Workers are forked processes (``--workers``), given groups of points with a shared forward.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from autotune.search import KnobFactory, RankedPoint, SearchSpace, get_forward_key
from autotune.sim import Hardware, Knobs, ModelWork, Simulator, StepPrediction
from fsdp_runtime import ROOT_UNIT, MixedPrecisionConfig

REDUCED_DEPTHS = (8, 16)
"""Block counts the space is simulated at for deep models ([Note: plan speed])."""
NUM_EXACT = 256
"""Points re-simulated at full depth after a depth extrapolation: the fastest extrapolated, and the defaults."""
MEMORY_MARGIN = 1.1
"""An extrapolated peak this far over capacity can still fit at full depth: such points stay candidates.
(Extrapolated peaks land within 5% of full-depth ones, all of them far over capacity, on llama70b.)"""
NUM_EXACT_DROPPED = 8
"""Dropped points (the closest to fitting by extrapolation) also re-simulated at full depth, for the report."""


class PlanReporter(Protocol):
    def on_phase(self, message: str) -> None: ...
    def on_start(self, total: int) -> None: ...
    def on_advance(self, count: int) -> None: ...


@dataclass(kw_only=True)
class Evaluation:
    rows: list[RankedPoint]
    num_simulated: int
    """Distinct simulations run (at any depth)."""
    num_pruned: int
    num_exact: int


@dataclass(kw_only=True)
class Pricer:
    """The simulator and knob factory of one depth."""

    factory: KnobFactory
    simulator: Simulator

    def simulate_group(self, points: list[dict[str, Any]]) -> tuple[list[StepPrediction], int]:
        """Predictions for points sharing a first forward; points with equal knobs share one simulation."""
        knobs = [self.factory.get_knobs(p) for p in points]
        distinct: dict[Knobs, int] = {}
        index = [distinct.setdefault(get_identity(k), len(distinct)) for k in knobs]
        first = {i: k for k, i in reversed(list(zip(knobs, index)))}
        predictions = self.simulator.simulate_knobs([first[i] for i in range(len(distinct))])
        return [predictions[i] for i in index], len(distinct)


class GroupPricer(Protocol):
    """What :func:`run_groups` prices groups of points with (a :class:`Pricer`, or a pipeline's)."""

    def simulate_group(self, points: list[dict[str, Any]]) -> tuple[list[StepPrediction], int]: ...


def make_pricer(
    work: ModelWork,
    hardware: Hardware,
    space: SearchSpace,
    *,
    mixed_precision: MixedPrecisionConfig,
    activation_checkpointing: bool,
    depth: int | None = None,
) -> Pricer:
    """A pricer for ``work``, or for its first ``depth`` blocks (same per-block shapes, same root)."""
    if depth is not None:
        blocks = work.block_names[:depth]
        work = dataclasses.replace(
            work, block_names=blocks, param_shapes={u: work.param_shapes[u] for u in (*blocks, ROOT_UNIT)}
        )
        space = dataclasses.replace(space, block_names=blocks)
    factory = KnobFactory(
        space, world_size=hardware.world_size, device=hardware.cluster.device, mixed_precision=mixed_precision
    )
    return Pricer(
        factory=factory, simulator=Simulator(work, hardware, activation_checkpointing=activation_checkpointing)
    )


def get_identity(knobs: Knobs) -> Knobs:
    """``knobs`` with FSDP2's implicit prefetch spelled out: equal identities simulate alike ([Note: plan speed])."""
    n = len(knobs.backward_prefetch) - 1
    implicit = tuple(((u - 1,) if u > 0 else ()) if u < n else (n - 1,) for u in range(n + 1))
    return dataclasses.replace(
        knobs,
        backward_prefetch=tuple(i if b is None else b for b, i in zip(knobs.backward_prefetch, implicit)),
        forward_prefetch=tuple(() if f is None else f for f in knobs.forward_prefetch),
    )


def is_dominated(params: dict[str, Any]) -> bool:
    """An eager concat (``defer_concat = false``) only adds copies to its deferred twin's schedule
    and holds the same accumulator: never faster, never smaller ([Note: plan speed])."""
    return params.get("defer_concat") is False


_PRICERS: list[GroupPricer] = []  # set before forking the pool


def _simulate_task(task: tuple[int, list[dict[str, Any]]]) -> tuple[list[StepPrediction], int]:
    return _PRICERS[task[0]].simulate_group(task[1])


def run_groups(
    pricers: list[GroupPricer],
    tasks: list[tuple[int, list[dict[str, Any]]]],
    num_workers: int,
    reporter: PlanReporter,
    weight: float,
) -> tuple[list[list[StepPrediction]], int]:
    """Each task's predictions (``(pricer index, points)``), in order, and the number of distinct simulations;
    advances the reporter by ``weight`` per point."""
    global _PRICERS
    _PRICERS = pricers
    out: list[list[StepPrediction]] = []
    count, credit = 0, 0.0
    pool = None
    try:
        if num_workers <= 1 or len(tasks) < 2:
            results: Any = map(_simulate_task, tasks)
        else:  # pure-Python simulation: forked workers need nothing but the parent's objects
            pool = concurrent.futures.ProcessPoolExecutor(num_workers, mp_context=multiprocessing.get_context("fork"))
            results = pool.map(_simulate_task, tasks, chunksize=max(1, len(tasks) // (8 * num_workers)))
        for (_, group), (predictions, distinct) in zip(tasks, results):
            out.append(predictions)
            count += distinct
            credit += weight * len(group)
            reporter.on_advance(int(credit))
            credit -= int(credit)
    finally:
        if pool is not None:
            pool.shutdown()
        _PRICERS = []
    return out, count


def _group(points: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for params in points:
        groups.setdefault(get_forward_key(params), []).append(params)
    return list(groups.values())


def extrapolate(
    shallow: StepPrediction, deep: StepPrediction, factor: float, full: Simulator, num_microbatches: int
) -> StepPrediction:
    """``deep + factor x (deep - shallow)`` for every time and memory figure; throughput and MFU from the extrapolated step."""

    def line(a: float, b: float) -> float:
        return b + factor * (b - a)

    step = line(shallow.step_s, deep.step_s)
    keys = set(shallow.memory_breakdown) | set(deep.memory_breakdown)
    # Each phase's peak is linear in depth, but which phase peaks can change with depth (the optimizer's
    # sharded state overtakes a backward's buffers): the maximum of the extrapolated phase peaks.
    phase_peaks = {k: line(shallow.phase_peaks.get(k, 0.0), v) for k, v in deep.phase_peaks.items()}
    return StepPrediction(
        step_s=step,
        compute_s=line(shallow.compute_s, deep.compute_s),
        comm_s=line(shallow.comm_s, deep.comm_s),
        exposed_comm_s=line(shallow.exposed_comm_s, deep.exposed_comm_s),
        tokens_per_s_per_device=num_microbatches * full.work.tokens / step,
        mfu=num_microbatches * full.flops_per_microbatch / (step * full.peak_flops) if full.peak_flops else 0.0,
        peak_memory_bytes=max(phase_peaks.values(), default=line(shallow.peak_memory_bytes, deep.peak_memory_bytes)),
        memory_capacity_bytes=deep.memory_capacity_bytes,
        memory_edge_bytes=deep.memory_edge_bytes,
        memory_breakdown={
            k: line(shallow.memory_breakdown.get(k, 0.0), deep.memory_breakdown.get(k, 0.0)) for k in keys
        },
        phase_peaks=phase_peaks,
    )


def evaluate_space(
    points: list[dict[str, Any]],
    full: Pricer,
    *,
    default: dict[str, Any],
    reporter: PlanReporter,
    num_workers: int,
    reduced: tuple[Pricer, Pricer] | None = None,
) -> Evaluation:
    """Predictions for every point but the dominated ones: at full depth, or extrapolated from the
    ``reduced`` pricers with the fastest re-simulated at full depth ([Note: plan speed])."""
    kept = [p for p in points if not is_dominated(p)]
    groups = _group(kept)
    if reduced is None:
        reporter.on_start(len(kept))
        results, count = run_groups([full], [(0, g) for g in groups], num_workers, reporter, 1.0)
        rows = [
            RankedPoint(params=p, prediction=pred) for g, preds in zip(groups, results) for p, pred in zip(g, preds)
        ]
        return Evaluation(rows=rows, num_simulated=count, num_pruned=len(points) - len(kept), num_exact=len(rows))
    reporter.on_start(len(kept) + NUM_EXACT + NUM_EXACT_DROPPED + 1)
    results, count = run_groups(list(reduced), [(i, g) for g in groups for i in (0, 1)], num_workers, reporter, 0.5)
    d1, d2 = (len(p.simulator.work.block_names) for p in reduced)
    factor = (len(full.simulator.work.block_names) - d2) / (d2 - d1)
    m = full.factory.space.num_microbatches
    rows = [
        RankedPoint(params=p, prediction=extrapolate(a, b, factor, full.simulator, m), exact=False)
        for g, shallow, deep in zip(groups, results[0::2], results[1::2])
        for p, a, b in zip(g, shallow, deep)
    ]
    candidates = sorted(
        (r for r in rows if r.prediction.peak_memory_bytes <= MEMORY_MARGIN * r.prediction.memory_capacity_bytes),
        key=lambda r: r.prediction.step_s,
    )
    over = sorted(
        (r for r in rows if r.prediction.peak_memory_bytes > MEMORY_MARGIN * r.prediction.memory_capacity_bytes),
        key=lambda r: r.prediction.peak_memory_bytes,
    )
    chosen = {
        id(r): r
        for r in [*candidates[:NUM_EXACT], *over[:NUM_EXACT_DROPPED], *(r for r in rows if r.params == default)]
    }
    exact_groups = _group([r.params for r in chosen.values()])
    exact, exact_count = run_groups([full], [(0, g) for g in exact_groups], num_workers, reporter, 1.0)
    by_params = {
        tuple(sorted(p.items(), key=str)): pred for g, preds in zip(exact_groups, exact) for p, pred in zip(g, preds)
    }
    for row in chosen.values():
        row.prediction, row.exact = by_params[tuple(sorted(row.params.items(), key=str))], True
    return Evaluation(
        rows=rows, num_simulated=count + exact_count, num_pruned=len(points) - len(kept), num_exact=len(chosen)
    )


@dataclass(kw_only=True)
class StagedEvaluator:
    """``autotune plan``'s ``evaluate`` for :func:`autotune.search.rank_staged`: the first stage
    extrapolated in depth where ``reduced`` is given, the memory-knob variants (few) at full depth;
    counts what it simulated and the time it took."""

    full: Pricer
    reduced: tuple[Pricer, Pricer] | None
    default: dict[str, Any]
    reporter: PlanReporter
    num_workers: int
    describe: Callable[[int, bool], str]
    """The phase line of a stage: its number of points, whether it is the second."""
    num_simulated: int = 0
    num_pruned: int = 0
    num_exact: int = 0
    evaluate_s: float = 0.0

    def __call__(self, points: list[dict[str, Any]], second_stage: bool) -> list[RankedPoint]:
        self.reporter.on_phase(self.describe(len(points), second_stage))
        started = time.perf_counter()
        evaluation = evaluate_space(
            points,
            self.full,
            default=self.default,
            reporter=self.reporter,
            num_workers=self.num_workers,
            reduced=None if second_stage else self.reduced,
        )
        self.evaluate_s += time.perf_counter() - started
        self.num_simulated += evaluation.num_simulated
        self.num_pruned += evaluation.num_pruned
        self.num_exact += evaluation.num_exact
        return evaluation.rows
