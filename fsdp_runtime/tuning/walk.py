"""The in-job tuner's decisions, as a pure state machine: which config the next step runs, and what each step's time decides.

[Note: in-job measurement]
The tuner measures a candidate as the search measures a trial ([Note: paired measurement] in
``autotune.trials.paired``): its steps alternate with the best config's in the schedule
:func:`~fsdp_runtime.tuning.pair_schedule.get_pair_schedule` gives (ABBA pairs, an unmeasured
settle step after every switch, the candidate first since the best stepped last), each pair's
ratio is candidate step over best step (each the slowest rank's), and after every pair the
search's own rule says whether the ratio is known (:func:`~fsdp_runtime.tuning.sequential.look`:
clearly faster, clearly slower, settled, unlikely to end faster, or out of pairs), with the box's
noise pooled over the candidates so far (:class:`~fsdp_runtime.tuning.sequential.PairNoise`).
Only a "faster" call adopts the candidate: the 90% interval of its ratio below 1, and no single
two-step burst of load able to have made the call ([Note: burst windows]).

Every step is a real training step of the job, the settle steps too; the maths of each is the
config's, and the knobs the tuner moves do not change it ([Note: in-job moves]). What tuning
costs is the steps run on candidates slower than the best, bounded two ways: a candidate step
slower than ``slow_bound`` times the best's median step ends the candidate at once, and tuning
stops after ``max_steps`` steps (a candidate cut short there is not adopted: it was not shown
faster). A candidate that fails (its switch raises, or its step) is dropped and never tried again.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from fsdp_runtime.config import RuntimeConfig
from fsdp_runtime.tuning.moves import Move
from fsdp_runtime.tuning.pair_schedule import CANDIDATE, ScheduledStep, get_burst_windows, get_pair_schedule
from fsdp_runtime.tuning.sequential import PairNoise, StoppingRule, get_rule_interval, is_faster, look

BEST_WINDOW = 8
"""The best config's recent measured steps whose median is the slow bound's yardstick."""


@dataclass
class Candidate:
    """One move's config, measured against the best."""

    name: str
    config: RuntimeConfig
    schedule: list[ScheduledStep]
    position: int = 0
    steps: dict[tuple[str, int], float] = field(default_factory=dict)
    ratios: list[float] = field(default_factory=list)

    @property
    def next_step(self) -> ScheduledStep:
        return self.schedule[self.position]


@dataclass
class Decision:
    """What the tuner decided of a candidate, one line of its log."""

    step: int
    name: str
    outcome: str
    """``adopted``, or why not: ``slower``, ``settled``, ``unlikely``, ``max_blocks``, ``failed``,
    ``too slow`` (a step over the slow bound), ``out of steps``."""
    ratios: list[float]

    @property
    def ratio(self) -> float | None:
        return math.exp(statistics.fmean(math.log(r) for r in self.ratios)) if self.ratios else None

    def describe(self) -> str:
        figure = f"{self.ratio:.3f}x the best's step over {len(self.ratios)} pairs" if self.ratios else "no pair"
        return f"step {self.step}: {self.name} {self.outcome} ({figure})"


class TuningWalk:
    """Which config each step runs and what its time decides ([Note: in-job measurement]); no torch."""

    def __init__(
        self,
        seed: RuntimeConfig,
        moves: list[Move],
        *,
        max_steps: int = 200,
        num_pairs: int = 6,
        precision: float = 0.05,
        slow_bound: float = 1.5,
        warmup_steps: int = 2,
    ) -> None:
        self.best, self.moves = seed, list(moves)
        self.max_steps, self.num_pairs, self.precision = max_steps, num_pairs, precision
        self.slow_bound, self.warmup_steps = slow_bound, warmup_steps
        self.step = 0
        """Steps recorded so far (warm-up included)."""
        self.tried: list[RuntimeConfig] = [seed]
        self.failed: list[str] = []
        self.decisions: list[Decision] = []
        self.noise = PairNoise()
        self.best_ms: deque[float] = deque(maxlen=BEST_WINDOW)
        self.speedup = 1.0
        """Over the seed: the product of the adopted candidates' speedups over the best they replaced."""
        self.candidate: Candidate | None = None
        self.done = False

    def plan(self) -> tuple[RuntimeConfig, str | None]:
        """The config the next step runs and the candidate's name (None: the best's step)."""
        if self.candidate is None and not self.done and self.step >= self.warmup_steps:
            self.candidate = self._next_candidate()
        if self.candidate is None:
            return self.best, None
        on_candidate = self.candidate.next_step.side == CANDIDATE
        return (self.candidate.config, self.candidate.name) if on_candidate else (self.best, None)

    def record(self, step_ms: float, *, failed: bool = False) -> Decision | None:
        """The planned step took ``step_ms`` (the slowest rank's), or failed on the candidate."""
        self.step += 1
        candidate = self.candidate
        if candidate is None:
            return None
        scheduled = candidate.next_step
        candidate.position += 1
        if failed:
            self.failed.append(candidate.name)
            return self._end("failed")
        on_candidate = scheduled.side == CANDIDATE
        if not on_candidate and scheduled.kind == "measured":
            self.best_ms.append(step_ms)
        if on_candidate and self.best_ms and step_ms > self.slow_bound * statistics.median(self.best_ms):
            return self._end("too slow")
        if scheduled.kind == "measured":
            candidate.steps[scheduled.side, scheduled.pair] = step_ms
        if scheduled.ends_pair:
            pair = scheduled.pair
            candidate.ratios.append(candidate.steps[CANDIDATE, pair] / candidate.steps["reference", pair])
            windows, rule = get_burst_windows(candidate.schedule), self._rule()
            called = look(rule, candidate.ratios, windows, self.num_pairs)
            if called is not None:
                faster = is_faster(called, get_rule_interval(rule, candidate.ratios))
                return self._end("adopted" if faster else called)
        if self.step - self.warmup_steps >= self.max_steps:
            return self._end("out of steps")
        return None

    def fail_switch(self) -> Decision | None:
        """The switch to the planned candidate raised: dropped, never tried again."""
        if self.candidate is None:
            return None
        self.failed.append(self.candidate.name)
        return self._end("failed")

    def _rule(self) -> StoppingRule:
        noise = self.noise.get()
        return StoppingRule(
            max_blocks=(self.num_pairs + 1) // 2,
            precision=self.precision,
            faster_below=1.0,
            prune_above=1.0,
            noise_sd=noise[0] if noise else None,
            noise_df=noise[1] if noise else 0,
            futile_above=1.0,
        )

    def _next_candidate(self) -> Candidate | None:
        """The next move from the best that gives a config not measured yet; None (done) when no move does."""
        while self.moves and self.step - self.warmup_steps < self.max_steps:
            move = self.moves.pop(0)
            config = move.apply(self.best)
            if config in self.tried:  # measured already, or failed: never again
                continue
            self.tried.append(config)
            schedule = get_pair_schedule(self.num_pairs, first=CANDIDATE, last="reference")
            return Candidate(move.name, config, schedule)
        self.done = True
        return None

    def _end(self, outcome: str) -> Decision:
        candidate = self.candidate
        if candidate is None:
            raise RuntimeError("no candidate is being measured")
        decision = Decision(self.step, candidate.name, outcome, list(candidate.ratios))
        self.decisions.append(decision)
        self.noise.observe(candidate.ratios)
        if outcome == "adopted":
            self.best, self.speedup = candidate.config, self.speedup / decision.ratio
            self.best_ms = deque((v for (side, _), v in candidate.steps.items() if side == CANDIDATE), BEST_WINDOW)
        self.candidate = None
        if self.step - self.warmup_steps >= self.max_steps:
            self.done = True
        return decision
