"""What a search's rounds cost: the most builds and steps each may run, what each ran, and an ETA over all of them.

[Note: round costs]
A search runs its ranks in rounds, in this order (:data:`ROUNDS`):

- ``warm-up``: one unrecorded defaults run (:func:`autotune.search.loop.warm_up`);
- ``trials``: the study's trials (the defaults' self-paired one, the presearch's calibration
  trials, sampled and refined ones; with ``--reference best`` their anchors too);
- ``final round``: each finalist against the defaults (``num_finalists`` and the refinement's last
  base, at most one per non-default trial), a contested one once more
  (:mod:`autotune.search.confirm`);
- ``verdict``: the chosen finalist in a window of its own (:mod:`autotune.search.verdict`);
- ``recipe``: the config to emit against torchtitan's recipe, profiled there where it runs
  (:mod:`autotune.search.recipe`);
- ``consolidation``: the emitted config's checkpoint consolidation timed (one build, one step).

:func:`estimate_search_cost` counts each round's most steps and builds from the settings with the
trials' own counts (:func:`autotune.search.timeouts.count_steps`, ``count_builds``): every pair
of every window, every contested second window, every build of models built in turn. A search
runs less: a trial stops once its ratio is known, a final round is contested or not, the verdict
runs only for a finalist faster than the defaults.

:class:`RoundLedger` is what a search ran. Each round's entry point sets ``ctx.round``; every run
through :meth:`autotune.search.context.SearchContext.run` is observed under it: steps
(:func:`~autotune.search.timeouts.count_steps_run`), builds (``metrics.num_builds``), wall
seconds, and the most steps and builds its spec allowed. ``search.json`` keeps the summary
(``rounds``): by round and in total, with each run's figures.

The ETA (:meth:`RoundLedger.estimate_remaining_s`), from the first trial on: what is left of
every round (the trials not yet measured, then every round after; of the final round its first
windows, a contested round's second windows once they run: on the README's main search an
uncontested final round ran 60 of its 176 most steps), its most steps and builds scaled by the
share of their most steps and builds the runs so far ran, priced at the median recorded step so
far and the median seconds per build so far (:func:`~autotune.search.timeouts.get_build_s`; the
warm-up's cold steps and start left out of both once another run finished), times the search's
wall over its runs' wall (what the loop, Optuna and the presearch's simulation add).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.search.timeouts import count_builds, count_steps, count_steps_run, get_build_s

if TYPE_CHECKING:
    from autotune.trials import TrialResult, TrialSpec

ROUNDS = ("warm-up", "trials", "final round", "verdict", "recipe", "consolidation")
"""A search's rounds, in the order they run ([Note: round costs])."""
CONSOLIDATION_STEPS = 1
"""Steps consolidation timing trains before it gathers (AdamW's state must exist)."""
MAX_OVERHEAD = 2.0
"""The most the search's wall over its runs' wall may scale an ETA (a stall between runs is not a rate)."""


@dataclass
class RoundCost:
    """One round's most runs, pairs per run, steps and builds ([Note: round costs])."""

    name: str
    num_trials: int
    """Runs of the round at most (trials, finalist windows, ...)."""
    max_pairs: int
    """Most pairs of one run (a warm-up's or consolidation's steps are unpaired)."""
    steps: int
    builds: int
    expected_runs: int | None = None
    """The runs a search usually makes of it, which the ETA counts (None: ``num_trials``): the final
    round's first windows, without a contested round's second windows or the refinement's base."""


def estimate_search_cost(
    settings: Any, *, in_turn: bool, min_verdict_pairs: int, num_calibration_changes: int, recipe: bool = True
) -> list[RoundCost]:
    """The most steps and builds each round of a search with ``settings`` may run ([Note: round
    costs]); ``in_turn``: a structurally different pair's models are built in turn (CUDA/NCCL:
    :func:`autotune.search.context.may_build_in_turn`); ``recipe``: the recipe round runs (a
    model with embeddings or a head outside its blocks), so search trials skip their profiled
    windows ([Note: the emitted config's trace]) and the recipe's window profiles instead;
    ``min_verdict_pairs`` (:data:`autotune.search.verdict.MIN_PAIRS`) and ``num_calibration_changes``
    (:data:`autotune.search.calibration_trials.CALIBRATION_CHANGES`) as the rounds read them
    (:func:`autotune.search.search_plan.get_rounds`)."""
    s = settings
    w, m, p = s.num_warmup, s.num_measured, s.num_profiled

    def trial(num_pairs: int, *, paired: bool = True, self_paired: bool = False, profiled: int = 0) -> tuple[int, int]:
        counts = {
            "num_pairs": num_pairs,
            "paired": paired,
            "self_paired": self_paired,
            "profiled": profiled,
            "in_turn": in_turn and paired and not self_paired,
        }
        return count_steps(num_warmup=w, **counts), count_builds(**counts)

    rounds = [RoundCost("warm-up", 1, m, *trial(m, paired=False))]
    final = s.num_confirm_pairs > 0
    with_recipe = recipe and final
    calibration = (
        num_calibration_changes if s.presearch is not None and s.num_trials - 1 - num_calibration_changes >= 2 else 0
    )
    defaults = trial(m, self_paired=True, profiled=p)
    profiled = trial(m, profiled=p)
    plain = profiled if not with_recipe else trial(m)
    others = max(0, s.num_trials - 1)
    n_profiled = min(others, calibration)
    steps = defaults[0] + n_profiled * profiled[0] + (others - n_profiled) * plain[0]
    builds = defaults[1] + n_profiled * profiled[1] + (others - n_profiled) * plain[1]
    rounds.append(RoundCost("trials", s.num_trials, m, steps, builds))
    if final and others:
        pairs = 2 * s.num_confirm_pairs
        windows = 2 * min(s.num_finalists + 1, others)  # the refinement's base may join; a contested one twice
        steps, builds = trial(pairs)
        first = min(s.num_finalists, others)
        rounds.append(RoundCost("final round", windows, pairs, windows * steps, windows * builds, expected_runs=first))
        verdict_pairs = max(min_verdict_pairs, pairs)
        rounds.append(RoundCost("verdict", 1, verdict_pairs, *trial(verdict_pairs)))
        if with_recipe:
            rounds.append(RoundCost("recipe", 1, verdict_pairs, *trial(verdict_pairs, profiled=p)))
    rounds.append(RoundCost("consolidation", 1, 0, CONSOLIDATION_STEPS, 1))
    return rounds


def estimate_round_s(r: RoundCost, *, step_s: float, build_s: float) -> float:
    """One round's most wall seconds at ``step_s`` per step and ``build_s`` per build."""
    return r.steps * step_s + r.builds * build_s


def estimate_wall_s(rounds: list[RoundCost], *, step_s: float, build_s: float) -> float:
    """The rounds' most wall seconds at ``step_s`` per step and ``build_s`` per build."""
    return sum(estimate_round_s(r, step_s=step_s, build_s=build_s) for r in rounds)


def get_spec_limits(spec: TrialSpec) -> tuple[int, int]:
    """The most steps and builds a trial of ``spec`` may run (as its time limit counts them)."""
    from autotune.search.timeouts import builds_in_turn

    reference = spec.reference
    paired = reference is not None
    self_paired = paired and reference == spec.config
    counts = {
        "num_pairs": spec.num_measured,
        "paired": paired,
        "self_paired": self_paired,
        "profiled": spec.num_profiled if spec.profile else 0,
        "in_turn": paired and not self_paired and builds_in_turn(spec.config, reference),
    }
    return count_steps(num_warmup=spec.num_warmup, **counts), count_builds(**counts)


@dataclass
class RunCost:
    """One run of a round: what it ran, and the most its spec allowed (None: not known)."""

    round: str
    name: str
    """The run's directory name (``trial_0003``, ``trial_0003_window1``, ``vs_torchtitan``, ...)."""
    status: str
    steps: int
    builds: int
    wall_s: float
    max_steps: int | None = None
    max_builds: int | None = None
    build_s: float | None = None
    """Seconds per model it built (:func:`~autotune.search.timeouts.get_build_s`); None: not known."""


@dataclass
class RoundLedger:
    """What each round of a search ran, fed by :meth:`autotune.search.context.SearchContext.run`
    ([Note: round costs]), and the ETA of what is left."""

    rounds: list[RoundCost] | None = None
    """The planned rounds (:func:`estimate_search_cost`); None until planned: no ETA."""
    clock: Callable[[], float] = time.monotonic
    runs: list[RunCost] = field(default_factory=list)
    current: str | None = None
    trials_done: int = 0
    """Trials the study has measured (a resumed study's included), as the loop last counted them."""
    eta_after_first_trial_s: float | None = None
    """The ETA once the first trial finished: the seconds left then, as estimated."""
    first_trial_at_s: float | None = None
    """Seconds into the search when the first trial finished."""
    started: float = field(init=False)
    _entered: dict[str, float] = field(default_factory=dict, init=False, repr=False)
    _elapsed: dict[str, float] = field(default_factory=dict, init=False, repr=False)
    _step_ms: list[float] = field(default_factory=list, init=False, repr=False)
    _cold_step_ms: list[float] = field(default_factory=list, init=False, repr=False)
    """The warm-up's steps: a fresh process's, priced only until another run recorded some."""
    _estimate: tuple[float, float] | None = field(default=None, init=False, repr=False)
    """(clock time, seconds left) of the last estimate."""

    def __post_init__(self) -> None:
        self.started = self.clock()

    # ------------------------------------------------------------------ feeding

    def enter(self, name: str) -> None:
        """The search entered round ``name`` (the rounds before it in the plan are over)."""
        if name == self.current:
            return
        now = self.clock()
        self._close(now)
        self.current = name
        self._entered[name] = now
        self._refresh()

    def _close(self, now: float) -> None:
        if self.current is not None:
            self._elapsed[self.current] = self._elapsed.get(self.current, 0.0) + now - self._entered[self.current]
            self._entered[self.current] = now

    def observe(self, name: str | None, result: TrialResult, spec: TrialSpec | None = None) -> RunCost:
        """A finished run of round ``name`` (None: outside any round, counted as ``trials``)."""
        metrics = result.metrics
        steps = count_steps_run(metrics) if metrics is not None else 0
        builds = (metrics.num_builds or (1 if metrics.ranks else 0)) if metrics is not None else 0
        build_s, step_ms = None, []
        if metrics is not None and metrics.ranks and steps:
            build_s, step_ms = get_build_s(metrics, result.wall_s, steps), _recorded_step_ms(metrics)
        limits = get_spec_limits(spec) if spec is not None else (None, None)
        run = RunCost(
            round=name or "trials",
            name=result.out_dir.name,
            status=result.status,
            steps=steps,
            builds=builds,
            wall_s=result.wall_s,
            max_steps=limits[0],
            max_builds=limits[1],
            build_s=build_s,
        )
        return self.add(run, step_ms=step_ms)

    def add(self, run: RunCost, *, step_ms: list[float] | None = None) -> RunCost:
        """Record ``run`` (and, where given, its recorded step times), and estimate what is left."""
        self.runs.append(run)
        (self._cold_step_ms if run.round == "warm-up" else self._step_ms).extend(step_ms or [])
        if run.round == "trials":
            self.trials_done = max(self.trials_done, sum(r.round == "trials" for r in self.runs))
        self._refresh()
        return run

    def set_trials_done(self, count: int) -> None:
        """The study holds ``count`` measured trials (the loop's count: duplicates and a resumed study's included)."""
        if count != self.trials_done:
            self.trials_done = max(self.trials_done, count)
            self._refresh()

    def _refresh(self) -> None:
        now = self.clock()
        left = self.estimate_remaining_s()
        self._estimate = (now, left) if left is not None else None
        if left is not None and self.eta_after_first_trial_s is None and self.trials_done >= 1:
            self.eta_after_first_trial_s, self.first_trial_at_s = left, now - self.started

    # ------------------------------------------------------------------ rates

    def get_step_s(self) -> float | None:
        """The median recorded step so far, in seconds, the warm-up's left out once another run
        recorded steps (None before any)."""
        values = self._step_ms or self._cold_step_ms
        return statistics.median(values) / 1e3 if values else None

    def get_build_s(self) -> float | None:
        """The median seconds per build so far, the warm-up's cold start left out once another run gave one."""
        known = [r for r in self.runs if r.build_s is not None]
        warm = [r.build_s for r in known if r.round != "warm-up"]
        values = warm or [r.build_s for r in known]
        return statistics.median(values) if values else None

    def get_fill(self) -> tuple[float, float]:
        """The share of their most steps and of their most builds that the runs so far ran (1.0 without any)."""
        known = [r for r in self.runs if r.max_steps and r.round != "warm-up"]
        steps = sum(r.max_steps for r in known)
        builds = sum(r.max_builds or 0 for r in known)
        step_fill = min(1.0, sum(r.steps for r in known) / steps) if steps else 1.0
        build_fill = min(1.0, sum(r.builds for r in known) / builds) if builds else 1.0
        return step_fill, build_fill

    def get_overhead(self) -> float:
        """The search's wall so far over its runs' wall (1 to :data:`MAX_OVERHEAD`)."""
        ran = sum(r.wall_s for r in self.runs)
        if ran <= 0:
            return 1.0
        return min(MAX_OVERHEAD, max(1.0, (self.clock() - self.started) / ran))

    # ------------------------------------------------------------------ the ETA

    def get_remaining(self) -> list[tuple[RoundCost, float]]:
        """Each planned round with the share of its most steps and builds left: the rounds before the
        current one are over; of the current one and those after it, the runs it usually makes
        (``expected_runs``) less those it ran (the trials round: less the trials the study measured)."""
        if self.rounds is None:
            return []
        names = [r.name for r in self.rounds]
        at = names.index(self.current) if self.current in names else 0
        left = []
        for r in self.rounds[at:]:
            done = sum(run.round == r.name for run in self.runs)
            if r.name == "trials":
                done = max(done, self.trials_done)
            runs = r.num_trials if r.expected_runs is None else r.expected_runs
            share = max(0, runs - done) / r.num_trials if r.num_trials else 0.0
            if share > 0:
                left.append((r, share))
        return left

    def estimate_remaining_s(self) -> float | None:
        """Seconds left of the search ([Note: round costs]); None before the first trial finished."""
        step_s, build_s = self.get_step_s(), self.get_build_s()
        if self.rounds is None or self.trials_done < 1 or step_s is None or build_s is None:
            return None
        step_fill, build_fill = self.get_fill()
        runs_s = sum(
            share * (r.steps * step_fill * step_s + r.builds * build_fill * build_s)
            for r, share in self.get_remaining()
        )
        return runs_s * self.get_overhead()

    def get_eta_s(self) -> float | None:
        """Seconds left as last estimated, counting down since (None: no estimate yet)."""
        if self._estimate is None:
            return None
        at, left = self._estimate
        return max(0.0, left - (self.clock() - at))

    # ------------------------------------------------------------------ the record

    def to_dict(self) -> dict[str, Any]:
        """``search.json``'s ``rounds``: by round (in the order they ran) and in total, each run's figures."""
        now = self.clock()
        self._close(now)
        by_round: dict[str, dict[str, Any]] = {}
        for name in [*(n for n in ROUNDS if n in self._elapsed), *(n for n in self._elapsed if n not in ROUNDS)]:
            runs = [r for r in self.runs if r.round == name]
            by_round[name] = {
                "runs": len(runs),
                "steps": sum(r.steps for r in runs),
                "builds": sum(r.builds for r in runs),
                "run_s": sum(r.wall_s for r in runs),
                "seconds": self._elapsed.get(name, 0.0),
            }
        planned = {r.name: dataclasses.asdict(r) for r in self.rounds or []}
        for name, figures in by_round.items():
            if name in planned:
                figures["max_steps"], figures["max_builds"] = planned[name]["steps"], planned[name]["builds"]
        return {
            "by_round": by_round,
            "total": {
                key: sum(r[key] for r in by_round.values()) for key in ("runs", "steps", "builds", "run_s", "seconds")
            }
            | {"elapsed_s": now - self.started},
            "planned": list(planned.values()),
            "step_s": self.get_step_s(),
            "build_s": self.get_build_s(),
            "eta_after_first_trial_s": self.eta_after_first_trial_s,
            "first_trial_at_s": self.first_trial_at_s,
            "runs": [dataclasses.asdict(r) for r in self.runs],
        }


def _recorded_step_ms(metrics: Any) -> list[float]:
    """A finished run's recorded step times (slowest rank per step; settle and profiled steps too)."""
    r = metrics.ranks[0]
    return [
        *metrics.step_ms_per_step,
        *metrics.reference_step_ms_per_step,
        *r.settle_step_ms,
        *r.reference_settle_step_ms,
        *r.profiled_step_ms,
    ]
