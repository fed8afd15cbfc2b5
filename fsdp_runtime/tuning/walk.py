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
slower than ``slow_bound`` times the best's median step ends the candidate at once, and the walk
stops after ``max_steps`` steps (a candidate cut short there is not adopted: it was not shown
faster; the final window that follows adds its own steps: [Note: final window]). A candidate
that fails (its switch raises, or its step) is dropped and never tried again.

[Note: final window]
The ratios that adopted the best were selected for lying below 1 (a candidate whose pairs happened
to run fast is called faster, one whose pairs happened to run slow is not), so their product
overstates the speedup (the winner's curse), and nothing re-measures it. So once no move is left
or ``max_steps`` is spent, and the best is not the seed, the walk runs one fresh window of the
best against the seed: the same ABBA schedule, ``num_pairs`` pairs, the seed on the candidate's
side (first, with its settle steps) and the best on the reference's, every pair run (no look, no
slow bound: a fixed window, whose figure is not selected). Its figure is the speedup reported:
the geometric mean of its pair ratios (seed step over best step) and their 90% interval, taken
as a decision takes its interval (:func:`~fsdp_runtime.tuning.sequential.get_rule_interval`: the
window's own pairs pooled with the box's noise of the candidates before it, unless they spread
wider); it covers this one window's noise, not a change of load or data after it. The product of
the adopted ratios stays, as ``adopted_product``, for the log. The window adds its steps to
``max_steps`` (which bounds the walk, not the window); the seed's steps are planned under the
name :data:`FINAL_WINDOW`, so that the tuner guards them as it guards a candidate's. A failed
step of the window (or its switch) ends it without a figure: the speedup is then the product,
flagged unmeasured (``speedup_measured`` false). Where the window's interval lies wholly below 1
(the best measured slower than the seed, as a walk of false adoptions can end: every adoption's
error adds up), the walk goes back to the seed: outcome ``reverted``, the seed's config the best,
speedup 1.0. Where nothing was adopted no window runs: the speedup is 1.0 by definition
(unmeasured, no interval).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from fsdp_runtime.config import RuntimeConfig
from fsdp_runtime.tuning.moves import Move
from fsdp_runtime.tuning.pair_schedule import CANDIDATE, REFERENCE, ScheduledStep, get_burst_windows, get_pair_schedule
from fsdp_runtime.tuning.sequential import PairNoise, StoppingRule, get_rule_interval, is_faster, look

BEST_WINDOW = 8
"""The best config's recent measured steps whose median is the slow bound's yardstick."""
FINAL_WINDOW = "the seed (final window)"
"""What :meth:`TuningWalk.plan` names the seed's steps of the final window ([Note: final window])."""


@dataclass
class Candidate:
    """One move's config measured against the best (in the final window: the seed's)."""

    name: str
    config: RuntimeConfig
    schedule: list[ScheduledStep]
    position: int = 0
    steps: dict[tuple[str, int], float] = field(default_factory=dict)
    ratios: list[float] = field(default_factory=list)

    @property
    def next_step(self) -> ScheduledStep:
        return self.schedule[self.position]

    def measure(self, scheduled: ScheduledStep, step_ms: float) -> None:
        """A step of the schedule took ``step_ms``: kept where measured, a pair's ratio after its second."""
        if scheduled.kind == "measured":
            self.steps[scheduled.side, scheduled.pair] = step_ms
        if scheduled.ends_pair:
            self.ratios.append(self.steps[CANDIDATE, scheduled.pair] / self.steps[REFERENCE, scheduled.pair])


@dataclass
class Decision:
    """What the tuner decided of a candidate, one line of its log."""

    step: int
    name: str
    outcome: str
    """``adopted``, or why not: ``slower``, ``settled``, ``unlikely``, ``max_blocks``, ``failed``,
    ``too slow`` (a step over the slow bound), ``out of steps``, or what the tuner refused it for
    (:meth:`TuningWalk.fail_switch`: ``no headroom``); ``final`` for the final window
    (name :data:`FINAL_WINDOW`), ``failed`` (or the refusal) where it ended early ([Note: final window])."""
    ratios: list[float]
    """Per pair: the candidate's step over the best's (the final window: the seed's over the best's)."""
    interval: tuple[float, float] | None = None
    """The final window's 90% interval of its ratio, the speedup: (low, high)."""

    @property
    def ratio(self) -> float | None:
        return math.exp(statistics.fmean(math.log(r) for r in self.ratios)) if self.ratios else None

    def describe(self) -> str:
        if self.name == FINAL_WINDOW:
            return f"step {self.step}: final window, the best against the seed: {self._describe_final()}"
        figure = f"{self.ratio:.3f}x the best's step over {len(self.ratios)} pairs" if self.ratios else "no pair"
        return f"step {self.step}: {self.name} {self.outcome} ({figure})"

    def _describe_final(self) -> str:
        if self.outcome == "reverted":
            low, high = self.interval
            return (
                f"{self.ratio:.3f}x the seed's speed over {len(self.ratios)} pairs (90% interval {low:.3f}-{high:.3f}): "
                "slower than the seed, so the seed runs on"
            )
        if self.outcome != "final":
            return f"{self.outcome} after {len(self.ratios)} pairs, the speedup is not measured"
        spread = f"90% interval {self.interval[0]:.3f}-{self.interval[1]:.3f}" if self.interval else "no interval"
        return f"{self.ratio:.3f}x the seed's speed over {len(self.ratios)} pairs ({spread}, this window's noise)"


class TuningWalk:
    """Which config each step runs and what its time decides ([Note: in-job measurement]), then the
    final window that measures the best against the seed ([Note: final window]); no torch."""

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
        self.seed, self.best, self.moves = seed, seed, list(moves)
        self.max_steps, self.num_pairs, self.precision = max_steps, num_pairs, precision
        self.slow_bound, self.warmup_steps = slow_bound, warmup_steps
        self.step = 0
        """Steps recorded so far (warm-up and final window included)."""
        self.tried: list[RuntimeConfig] = [seed]
        self.failed: list[str] = []
        self.decisions: list[Decision] = []
        self.noise = PairNoise()
        self.best_ms: deque[float] = deque(maxlen=BEST_WINDOW)
        self.adopted_product = 1.0
        """Over the seed: the product of the adopted candidates' speedups over the best each replaced;
        selected ratios, so biased upward and never re-measured ([Note: final window])."""
        self.speedup_measured = False
        """Whether :attr:`speedup` is the final window's figure."""
        self.speedup_interval: tuple[float, float] | None = None
        """The final window's 90% interval of the speedup, (low, high): the noise of that one window;
        None where no window was measured."""
        self.candidate: Candidate | None = None
        self.final: Candidate | None = None
        """The final window while it runs: the seed on the candidate's side, the best on the reference's."""
        self.done = False
        """No move left (or ``max_steps`` spent) and the final window, if any, over."""
        self._measured_speedup = 1.0

    @property
    def speedup(self) -> float:
        """Over the seed: the final window's figure where it was measured (:attr:`speedup_measured`),
        else :attr:`adopted_product` (1.0 where nothing was adopted)."""
        return self._measured_speedup if self.speedup_measured else self.adopted_product

    def plan(self) -> tuple[RuntimeConfig, str | None]:
        """The config the next step runs and the candidate's name (None: the best's step; in the final
        window the seed's steps are named :data:`FINAL_WINDOW`)."""
        if self.candidate is None and self.final is None and not self.done and self.step >= self.warmup_steps:
            self.candidate = self._next_candidate()
        measured = self.candidate if self.candidate is not None else self.final
        if measured is None or measured.next_step.side != CANDIDATE:
            return self.best, None
        return measured.config, measured.name

    def record(self, step_ms: float, *, failed: bool = False) -> Decision | None:
        """The planned step took ``step_ms`` (the slowest rank's), or failed on the candidate (or the
        final window's seed)."""
        self.step += 1
        if self.final is not None:
            return self._record_final(step_ms, failed)
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
        candidate.measure(scheduled, step_ms)
        if scheduled.ends_pair:
            windows, rule = get_burst_windows(candidate.schedule), self._rule()
            called = look(rule, candidate.ratios, windows, self.num_pairs)
            if called is not None:
                interval = get_rule_interval(rule, candidate.ratios)
                faster = is_faster(called, interval, pair_ratios=candidate.ratios)
                return self._end("adopted" if faster else called)
        if self.step - self.warmup_steps >= self.max_steps:
            return self._end("out of steps")
        return None

    def fail_switch(self, outcome: str = "failed") -> Decision | None:
        """The planned candidate did not run: its switch raised (``failed``) or the tuner refused it
        (``outcome``, e.g. ``no headroom``); dropped, never tried again. The final window's switch to
        the seed: the window ends without a figure."""
        if self.final is not None:
            return self._end_final(outcome)
        if self.candidate is None:
            return None
        if outcome == "failed":
            self.failed.append(self.candidate.name)
        return self._end(outcome)

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

    def _schedule(self) -> list[ScheduledStep]:
        return get_pair_schedule(self.num_pairs, first=CANDIDATE, last=REFERENCE)

    def _next_candidate(self) -> Candidate | None:
        """The next move from the best that gives a config not measured yet; None when no move does
        (then the final window, or done)."""
        while self.moves and self.step - self.warmup_steps < self.max_steps:
            move = self.moves.pop(0)
            config = move.apply(self.best)
            if config in self.tried:  # measured already, or failed: never again
                continue
            self.tried.append(config)
            return Candidate(move.name, config, self._schedule())
        self._close()
        return None

    def _end(self, outcome: str) -> Decision:
        candidate = self.candidate
        if candidate is None:
            raise RuntimeError("no candidate is being measured")
        decision = Decision(self.step, candidate.name, outcome, list(candidate.ratios))
        self.decisions.append(decision)
        self.noise.observe(candidate.ratios)
        if outcome == "adopted":
            self.best, self.adopted_product = candidate.config, self.adopted_product / decision.ratio
            self.best_ms = deque((v for (side, _), v in candidate.steps.items() if side == CANDIDATE), BEST_WINDOW)
        self.candidate = None
        if self.step - self.warmup_steps >= self.max_steps:
            self._close()
        return decision

    def _close(self) -> None:
        """The walk is over: the final window where the best is not the seed, else done."""
        if self.best == self.seed:
            self.done = True
        else:
            self.final = Candidate(FINAL_WINDOW, self.seed, self._schedule())

    def _record_final(self, step_ms: float, failed: bool) -> Decision | None:
        """A step of the final window: every pair measured, no look, no slow bound ([Note: final window])."""
        window = self.final
        scheduled = window.next_step
        window.position += 1
        if failed:
            return self._end_final("failed")
        window.measure(scheduled, step_ms)
        return self._end_final("final") if window.position == len(window.schedule) else None

    def _end_final(self, outcome: str) -> Decision:
        """The final window over: ``final`` with its figure, or ``failed`` without one."""
        window, interval = self.final, None
        if outcome == "final":
            spread = get_rule_interval(self._rule(), window.ratios)
            interval = (spread.low, spread.high) if spread is not None else None
        if interval is not None and interval[1] < 1.0:
            outcome = "reverted"  # the best measured slower than the seed: the seed runs on
        decision = Decision(self.step, FINAL_WINDOW, outcome, list(window.ratios), interval)
        if outcome == "final":
            self._measured_speedup, self.speedup_measured, self.speedup_interval = decision.ratio, True, interval
        elif outcome == "reverted":
            self.best, self.adopted_product = self.seed, 1.0
        self.decisions.append(decision)
        self.final, self.done = None, True
        return decision
