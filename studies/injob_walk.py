"""Prints how often the in-job tuner's walk adopts a move that is not faster, how often it finds one that is, and how far its speedup figures lie from the truth, by Monte Carlo ([Note: final window]).

    .venv/bin/python studies/injob_walk.py [--walks 2000] [--seed 0] [--sigma 0.09] [--rho R]

Each simulated job runs :class:`~fsdp_runtime.tuning.walk.TuningWalk` with its default settings
(200 steps, 6 pairs, precision 5%, slow bound 1.5, 2 warm-up steps) over the moves
:func:`~fsdp_runtime.tuning.moves.get_moves` gives a 4-block, 2-microbatch config of FSDP2's
defaults on CUDA (21 moves, 13 of which change that config), step by step, to the end of its
final window. Every step's log time comes from ``studies/stopping_rule.py``'s noise
(:func:`stopping_rule.step_noise`: one AR(1) series over the whole job, the lag-1
autocorrelation fitted to the recorded per-step series, -0.04, pair spread ``--sigma``, the
box's 9%), plus the log of the config's true factor. A *planted* move makes a config that holds
its setting (``move.apply(config) == config``) that factor times faster; every other config runs
as the seed does. Burst model ``burst``: every measurement window (a candidate's, the final
window) gets one 1.5x slowdown of two adjacent steps at a position drawn uniformly over its full
schedule (``stopping_rule.py``'s "anywhere"; a window that stops before it escapes it); ``none``:
no burst. The walk's pooled noise is its own (estimated from its candidates' pairs, as in a job).

Printed per case: P(at least one move adopted that is not planted: a false adoption), the mean
number adopted, the share of false adoptions made at the last pair (where the interval of every
pair decides), P(the planted move measured at all, within ``max_steps``), P(it adopted: power),
the mean moves measured, the share of them a step over the slow bound ended, the mean steps run
(final window included), the geometric mean of the final window's figure and of the adopted
product over the true speedup (walks with a final window, one that ends measured), and the share of
final intervals that hold the true speedup. Shares carry binomial 95% intervals (Wilson). Pure
Python; no ranks.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "studies"))

from stopping_rule import BURST, fit_rho, recorded_series, step_noise  # noqa: E402

from fsdp_runtime.config import RuntimeConfig, default_config  # noqa: E402
from fsdp_runtime.tuning.moves import Move, get_moves  # noqa: E402
from fsdp_runtime.tuning.walk import FINAL_WINDOW, TuningWalk  # noqa: E402

BLOCKS = [f"layers.{i}" for i in range(4)]
CASES: dict[str, dict[str, float]] = {
    "null (nothing faster)": {},
    "forward_prefetch=depth1 0.95x": {"forward_prefetch=depth1": 0.95},
    "forward_prefetch=depth1 0.90x": {"forward_prefetch=depth1": 0.90},
    "reduce_scatter_max_input_buffers=2 0.90x": {"reduce_scatter_max_input_buffers=2": 0.90},
}
"""Per case: the planted moves (by name) and their true factor on the step; the first measured
move and a late one."""


def get_seed() -> RuntimeConfig:
    return default_config(BLOCKS, num_microbatches=2)


def get_factor(config: RuntimeConfig, planted: list[tuple[Move, float]]) -> float:
    """The config's true step over the seed's: the product of the planted factors whose setting it holds."""
    return math.prod(f for move, f in planted if move.apply(config) == config)


@dataclass
class WalkResult:
    """One simulated job's walk."""

    decisions: list[tuple[str, str, bool]]
    """Per move measured: its name, its outcome, whether it ran every pair (the last look decided)."""
    true_speedup: float
    """The seed's true step over the best's."""
    product: float
    speedup: float
    speedup_measured: bool
    interval: tuple[float, float] | None
    steps: int

    @property
    def adopted(self) -> list[str]:
        return [name for name, outcome, _ in self.decisions if outcome == "adopted"]


def run_walk(planted: dict[str, float], rng: random.Random, noise: tuple[float, float], burst: bool) -> WalkResult:
    """One job, to the end of its final window: the walk's default settings, every step drawn (the
    module's docstring)."""
    seed = get_seed()
    moves = get_moves(seed, device_type="cuda")
    plants = [(m, planted[m.name]) for m in moves if m.name in planted]
    walk, steps = TuningWalk(seed, moves), step_noise(rng, *noise)
    factors: dict[int, tuple[RuntimeConfig, float]] = {}  # by id: a step's config is the best, a candidate's, the seed
    window, burst_at = None, None
    while not walk.done:
        config, _ = walk.plan()
        measured = walk.candidate if walk.candidate is not None else walk.final
        if measured is not window:  # a new measurement window: its burst's place
            window = measured
            burst_at = rng.randrange(len(measured.schedule) - 1) if burst and measured is not None else None
        if id(config) not in factors:
            factors[id(config)] = (config, get_factor(config, plants))
        log_ms = next(steps) + math.log(factors[id(config)][1])
        if burst_at is not None and burst_at <= measured.position <= burst_at + 1:
            log_ms += math.log(BURST)
        walk.record(100.0 * math.exp(log_ms))
    return WalkResult(
        decisions=[
            (d.name, d.outcome, len(d.ratios) == walk.num_pairs) for d in walk.decisions if d.name != FINAL_WINDOW
        ],
        true_speedup=1.0 / get_factor(walk.best, plants),
        product=walk.adopted_product,
        speedup=walk.speedup,
        speedup_measured=walk.speedup_measured,
        interval=walk.speedup_interval,
        steps=walk.step,
    )


def wilson(k: int, n: int) -> tuple[float, float]:
    """The binomial 95% interval (Wilson score) of ``k`` successes in ``n``."""
    if n == 0:
        return 0.0, 1.0
    z, p = 1.96, k / n
    center, half = (p + z * z / (2 * n)), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (center - half) / (1 + z * z / n)), min(1.0, (center + half) / (1 + z * z / n))


@dataclass
class Share:
    k: int
    n: int

    def __str__(self) -> str:
        if self.n == 0:
            return "-"
        low, high = wilson(self.k, self.n)
        return f"{100 * self.k / self.n:.1f}% ({100 * low:.1f}-{100 * high:.1f})"


@dataclass
class Summary:
    """A case's walks, counted."""

    false_adoption: Share
    """Walks that adopted at least one move not planted."""
    reached: Share
    """Walks that measured the planted move (none planted: 0 of 0)."""
    power: Share
    """Walks that adopted it."""
    false_at_last: Share
    """False adoptions made at the last pair (the interval of every pair), of all false adoptions."""
    too_slow: Share
    """Moves measured that a step over the slow bound ended."""
    mean_adopted: float
    mean_measured: float
    mean_steps: float
    final_bias: float | None
    """Geometric mean of the final figure over the true speedup, walks whose window measured."""
    product_bias: float | None
    """The same of the adopted product."""
    coverage: Share
    """Measured windows whose interval holds the true speedup."""
    results: list[WalkResult] = field(repr=False, default_factory=list)


def _geomean(values: list[float]) -> float | None:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else None


def summarize(results: list[WalkResult], planted: dict[str, float]) -> Summary:
    n, windows = len(results), [r for r in results if r.speedup_measured]
    moves = [d for r in results for d in r.decisions]
    false = [at_last for name, outcome, at_last in moves if outcome == "adopted" and name not in planted]
    held = [r for r in windows if r.interval is not None and r.interval[0] <= r.true_speedup <= r.interval[1]]
    return Summary(
        false_adoption=Share(sum(any(a not in planted for a in r.adopted) for r in results), n),
        reached=Share(sum(any(d[0] in planted for d in r.decisions) for r in results), n if planted else 0),
        power=Share(sum(any(a in planted for a in r.adopted) for r in results), n if planted else 0),
        false_at_last=Share(sum(false), len(false)),
        too_slow=Share(sum(outcome == "too slow" for _, outcome, _ in moves), len(moves)),
        mean_adopted=statistics.fmean(len(r.adopted) for r in results),
        mean_measured=len(moves) / n,
        mean_steps=statistics.fmean(r.steps for r in results),
        final_bias=_geomean([r.speedup / r.true_speedup for r in windows]),
        product_bias=_geomean([r.product / r.true_speedup for r in windows]),
        coverage=Share(len(held), sum(r.interval is not None for r in windows)),
        results=results,
    )


def run_case(planted: dict[str, float], *, walks: int, seed: int, noise: tuple[float, float], burst: bool) -> Summary:
    rng = random.Random(seed)
    return summarize([run_walk(planted, rng, noise, burst) for _ in range(walks)], planted)


def report(args: argparse.Namespace) -> None:
    head = ("case", "burst", "false adoption", "adopted", "false at last", "planted measured", "power", "moves", "too slow", "steps", "final/true", "product/true", "interval holds")  # fmt: skip
    widths = (41, 5, 17, 7, 17, 18, 18, 5, 17, 5, 10, 12, 18)
    print("  ".join(f"{h:<{w}}" for h, w in zip(head, widths)))
    for name, planted in CASES.items():
        for burst in (False, True):
            s = run_case(planted, walks=args.walks, seed=args.seed, noise=(args.sigma, args.rho), burst=burst)
            bias = [f"{x:.3f}" if x is not None else "-" for x in (s.final_bias, s.product_bias)]
            row = (name, "burst" if burst else "none", s.false_adoption, f"{s.mean_adopted:.2f}", s.false_at_last, s.reached, s.power, f"{s.mean_measured:.1f}", s.too_slow, f"{s.mean_steps:.0f}", *bias, s.coverage)  # fmt: skip
            print("  ".join(f"{str(c):<{w}}" for c, w in zip(row, widths)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--walks", type=int, default=2000, help="simulated jobs per case")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sigma", type=float, default=0.09, help="pair log-ratio spread (the box's: 9%%)")
    parser.add_argument("--rho", type=float, default=None, help="lag-1 autocorrelation (default: the recorded one)")
    args = parser.parse_args()
    fitted = fit_rho(recorded_series())
    args.rho = fitted if args.rho is None else args.rho
    moves = get_moves(get_seed(), device_type="cuda")
    changing = sum(m.apply(get_seed()) != get_seed() for m in moves)
    walk = TuningWalk(get_seed(), moves)
    print(f"moves: {len(moves)} ({changing} change the seed); walk: {walk.max_steps} steps, {walk.num_pairs} pairs")
    print(f"sigma {args.sigma}, rho {args.rho:+.3f}, burst {BURST}x over two steps, {args.walks} walks per case, seed {args.seed}")  # fmt: skip
    report(args)


if __name__ == "__main__":
    main()
