"""A pipeline schedule's action order per pp rank, and timing it over the stages' dependencies
(steps 1-2 of [Note: pipeline schedules] in :mod:`autotune.sim.pipeline`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from fsdp_runtime.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble")
INTERLEAVED = ("interleaved_1f1b", "interleaved_zero_bubble")

Action = tuple[int, int, str]
"""``(stage, microbatch, kind)``: kind ``F``, ``B``, ``I`` or ``W``."""


def get_pipeline_order(schedule: str, pp: int, virtual_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Each pp rank's actions in the order it runs them (torch 2.13's schedules, without their no-ops)."""
    m = num_microbatches
    if schedule == "gpipe":
        return [[(r, i, "F") for i in range(m)] + [(r, i, "B") for i in range(m)] for r in range(pp)]
    if schedule == "1f1b":
        return [_get_1f1b_order(r, pp, m) for r in range(pp)]
    if schedule in INTERLEAVED:
        return [_get_interleaved_order(r, pp, virtual_stages, m, schedule == INTERLEAVED[1]) for r in range(pp)]
    raise ConfigError("pipeline.schedule", f"unknown schedule {schedule!r}", fix=f"one of {', '.join(SCHEDULES)}")


def _get_1f1b_order(rank: int, pp: int, m: int) -> list[Action]:
    """``pp - 1 - rank`` warm-up forwards, then one forward and one backward, then the remaining backwards."""
    warmup = min(pp - 1 - rank, m)
    order: list[Action] = [(rank, i, "F") for i in range(warmup)]
    for i in range(m - warmup):
        order += [(rank, warmup + i, "F"), (rank, i, "B")]
    return order + [(rank, i, "B") for i in range(m - warmup, m)]


def _get_interleaved_order(rank: int, pp: int, v: int, m: int, zero_bubble: bool) -> list[Action]:
    """torch's ``_get_1f1b_rank_ops``: rounds of ``m / rounds`` microbatches per local stage, depth first;
    zero bubble splits each backward into I and W, W of the backward ``rank`` steps earlier."""
    per_round = m // max(1, m // pp)
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (pp - 1 - rank), m * v)

    def forward_stage(op: int) -> int:
        return ((op // per_round) % v) * pp + rank

    def backward_stage(op: int) -> int:
        return (v - 1 - ((op - warmup) // per_round) % v) * pp + rank

    count: dict[tuple[str, int], int] = defaultdict(int)

    def take(kind: str, stage: int) -> Action:
        count[kind, stage] += 1
        return stage, count[kind, stage] - 1, kind

    order: list[Action] = []
    backward_ops: list[int] = []  # the op at which each backward ran: its W follows the same stage
    num_weight = 0
    for op in range(m * v + warmup):
        if op < m * v:
            order.append(take("F", forward_stage(op)))
        if op >= warmup:
            order.append(take("I" if zero_bubble else "B", backward_stage(op)))
            backward_ops.append(op)
            if zero_bubble and op - warmup >= rank:
                order.append(take("W", backward_stage(backward_ops[num_weight])))
                num_weight += 1
    while zero_bubble and num_weight < len(backward_ops):
        order.append(take("W", backward_stage(backward_ops[num_weight])))
        num_weight += 1
    return order


# -- the event simulation -------------------------------------------------------------------

RunAction = Callable[[int, Action, float], float]
"""``(rank, action, ready)`` -> when its output is ready to send; ``ready``: when its input arrived."""


def run_order(order: list[list[Action]], run: RunAction, *, num_stages: int, p2p_s: list[float]) -> None:
    """Run every rank's actions in order, each once its input has arrived ([Note: pipeline schedules]);
    ``p2p_s[s]``: the transfer between stage s and s + 1 (either way)."""
    done: dict[tuple[str, int, int], float] = {}
    position = [0] * len(order)
    while True:
        progressed = False
        for rank, actions in enumerate(order):
            while position[rank] < len(actions):
                stage, mb, kind = actions[position[rank]]
                ready = _get_ready(done, stage, mb, kind, num_stages, p2p_s)
                if ready is None:
                    break
                end = run(rank, (stage, mb, kind), ready)
                done["B" if kind == "I" else kind, stage, mb] = end
                position[rank] += 1
                progressed = True
        if all(p == len(a) for p, a in zip(position, order)):
            return
        if not progressed:
            stuck = [actions[p] for p, actions in zip(position, order) if p < len(actions)]
            raise ValueError(f"pipeline order deadlocks: every rank waits ({stuck})")


def _get_ready(
    done: dict[tuple[str, int, int], float], stage: int, mb: int, kind: str, num_stages: int, p2p_s: list[float]
) -> float | None:
    """When an action's input is there (None: not yet produced)."""
    if kind == "F":
        if stage == 0:
            return 0.0
        end = done.get(("F", stage - 1, mb))
        return None if end is None else end + p2p_s[stage - 1]
    if kind == "W":
        return done.get(("B", stage, mb))
    if ("F", stage, mb) not in done:
        return None
    if stage == num_stages - 1:
        return 0.0
    end = done.get(("B", stage + 1, mb))
    return None if end is None else end + p2p_s[stage]


@dataclass(kw_only=True)
class OrderTiming:
    """An action order run with fixed durations (no FSDP2): the schedule alone."""

    step_s: float
    busy_s: list[float]
    """Per rank, seconds computing."""

    @property
    def bubble_fractions(self) -> list[float]:
        return [1.0 - busy / self.step_s for busy in self.busy_s]


def time_order(
    order: list[list[Action]], seconds: Callable[[int, str], float], *, num_stages: int, p2p_s: list[float]
) -> OrderTiming:
    """Run ``order`` with ``seconds(stage, kind)`` per action: the schedule's own bubble."""
    clock = [0.0] * len(order)
    busy = [0.0] * len(order)

    def run(rank: int, action: Action, ready: float) -> float:
        duration = seconds(action[0], action[2])
        clock[rank] = max(clock[rank], ready) + duration
        busy[rank] += duration
        return clock[rank]

    run_order(order, run, num_stages=num_stages, p2p_s=p2p_s)
    return OrderTiming(step_s=max(clock), busy_s=busy)


# -- FSDP2 inside each stage -----------------------------------------------------------------
