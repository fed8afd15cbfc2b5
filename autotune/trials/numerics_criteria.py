"""What the numerics checks assert, and with what figures ([Note: numerics checks] in
:mod:`autotune.trials.numerics`): the criteria, each with its value and limit, from the ranks'
results; the bf16 tolerance; the context-free floor of a batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "BF16_UNIT_ROUNDOFF",
    "TOLERANCE_FACTOR",
    "Criterion",
    "NumericsCheck",
    "GRAD_RTOL",
    "evaluate_comm_buffers",
    "evaluate_memorisation",
    "evaluate_switch",
    "get_bf16_tolerance",
    "get_context_free_floor",
    "get_roundings",
]

BF16_UNIT_ROUNDOFF = 2.0**-8
"""bf16's unit roundoff: 8 significant bits (7 stored), a rounding is off by at most this share."""
TOLERANCE_FACTOR = 3.0
"""Standard deviations of a sum of independent roundings the bf16 tolerance allows ([Note: numerics checks])."""


@dataclass(kw_only=True)
class Criterion:
    """One thing a check asserts, whether it held, and its figures: ``value`` against ``limit`` as
    ``detail`` says (at most it, or equal to it)."""

    name: str
    passed: bool
    value: Any = None
    limit: Any = None
    detail: str = ""


@dataclass(kw_only=True)
class NumericsCheck:
    """A check's result: passed when every criterion passed; ``failure`` when its ranks failed."""

    name: str
    criteria: list[Criterion] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    failure: str | None = None

    @property
    def passed(self) -> bool:
        return self.failure is None and bool(self.criteria) and all(c.passed for c in self.criteria)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``passed`` and every field."""
        return {"passed": self.passed, **dataclasses.asdict(self)}

    def describe(self) -> str:
        """One line per criterion: ``name: passed (value vs limit)``."""
        lines = [
            f"{self.name}: {'passed' if self.passed else 'FAILED'}" + (f" ({self.failure})" if self.failure else "")
        ]
        lines += [
            f"  {c.name}: {'ok' if c.passed else 'FAILED'} ({c.value} vs {c.limit}){' ' + c.detail if c.detail else ''}"
            for c in self.criteria
        ]
        return "\n".join(lines)


def get_context_free_floor(tokens: torch.Tensor) -> float:
    """The lowest mean next-token cross-entropy any function of the current token alone can reach
    on ``tokens``: the empirical conditional entropy ``H(next | current)`` over its rows."""
    current, following = tokens[:, :-1].flatten().tolist(), tokens[:, 1:].flatten().tolist()
    pairs, singles = Counter(zip(current, following, strict=True)), Counter(current)
    return -sum(n * math.log(n / singles[a]) for (a, _), n in pairs.items()) / len(current)


def get_roundings(num_blocks: int) -> int:
    """bf16 roundings on a value's path through a step: per block its seven matmuls, attention and
    two norms (10), plus the output and the loss's input (2); backward twice as many."""
    return 3 * (10 * num_blocks + 2)


def get_bf16_tolerance(fp32_losses: list[float], num_blocks: int) -> list[float]:
    """Per step, how far the bf16 loss may be from fp32's ([Note: numerics checks])."""
    scale = TOLERANCE_FACTOR * BF16_UNIT_ROUNDOFF * math.sqrt(get_roundings(num_blocks))
    drift = [0.0]
    for a, b in zip(fp32_losses, fp32_losses[1:]):
        drift.append(drift[-1] + abs(a - b))
    return [scale * (loss + d) for loss, d in zip(fp32_losses, drift, strict=True)]


# -- criteria --------------------------------------------------------------------------------


def _learned(name: str, ranks: list[dict[str, Any]]) -> list[Criterion]:
    """A run's two memorisation criteria over its ranks (the worst rank's figures)."""
    firsts = [r["losses"][0] for r in ranks]
    lasts = [r["losses"][-1] for r in ranks]
    halved = max(range(len(ranks)), key=lambda i: lasts[i] / firsts[i])
    floored = max(range(len(ranks)), key=lambda i: lasts[i] / ranks[i]["floor"])
    return [
        Criterion(
            name=f"{name}_fell_by_half",
            passed=all(last <= first / 2 for first, last in zip(firsts, lasts, strict=True)),
            value=lasts[halved],
            limit=firsts[halved] / 2,
            detail=f"rank {halved}: last loss vs half the first",
        ),
        Criterion(
            name=f"{name}_beat_context_free_floor",
            passed=all(last <= r["floor"] / 2 for last, r in zip(lasts, ranks, strict=True)),
            value=lasts[floored],
            limit=ranks[floored]["floor"] / 2,
            detail=f"rank {floored}: last loss vs half the floor a model blind to context reaches",
        ),
    ]


def evaluate_memorisation(fp32: list[dict[str, Any]], bf16: list[dict[str, Any]], num_blocks: int) -> NumericsCheck:
    """The memorisation check's criteria ([Note: numerics checks]) from each run's rank results."""
    check = NumericsCheck(name="memorisation")
    check.criteria += _learned("fp32", fp32) + _learned("bf16", bf16)
    worst: tuple[float, int, int, float, float] | None = None  # (share of tol, rank, step, diff, tol)
    for rank, (a, b) in enumerate(zip(fp32, bf16, strict=True)):
        tolerance = get_bf16_tolerance(a["losses"], num_blocks)
        for step, (x, y, tol) in enumerate(zip(a["losses"], b["losses"], tolerance, strict=True)):
            share = abs(y - x) / tol if tol > 0 else math.inf
            share = share if math.isfinite(share) else math.inf  # a NaN loss is the worst
            if worst is None or share > worst[0]:
                worst = (share, rank, step, abs(y - x), tol)
    assert worst is not None
    check.criteria.append(
        Criterion(
            name="bf16_tracks_fp32",
            passed=worst[0] <= 1.0,
            value=worst[3],
            limit=worst[4],
            detail=f"rank {worst[1]} step {worst[2]}: |bf16 - fp32| vs tolerance ({worst[0]:.2f} of it)",
        )
    )
    check.figures = {
        "fp32": [r["losses"] for r in fp32],
        "bf16": [r["losses"] for r in bf16],
        "floor": [r["floor"] for r in fp32],
        "tolerance": [get_bf16_tolerance(r["losses"], num_blocks) for r in fp32],
        "tolerance_use": worst[0],
    }
    return check


def _counts(step: dict[str, int]) -> dict[str, int]:
    return {kind: step.get(kind, 0) for kind in ("all_gather", "reduce_scatter")}


def evaluate_switch(ranks: list[dict[str, Any]]) -> NumericsCheck:
    """The switch check's criteria ([Note: numerics checks]) from each rank's :func:`switch_ranks` result."""
    fresh = [r["fresh"] for r in ranks]
    switched = [r["switched"] for r in ranks]
    diffs = [
        abs(a - b) for f, s in zip(fresh, switched, strict=True) for a, b in zip(f["losses"], s["losses"], strict=True)
    ]
    after = [
        ([_counts(c) for c in s["collectives"][1:]], [_counts(c) for c in f["collectives"][1:]])
        for f, s in zip(fresh, switched, strict=True)
    ]
    first = [(_counts(s["collectives"][0]), _counts(f["collectives"][0])) for f, s in zip(fresh, switched, strict=True)]
    criteria = [
        Criterion(
            name="losses_bitwise",
            passed=all(f["losses"] == s["losses"] for f, s in zip(fresh, switched, strict=True)),
            value=max(diffs),
            limit=0.0,
            detail="largest |switched - fresh| loss over ranks and steps (fp32)",
        ),
        Criterion(
            name="collectives_after_switch_equal",
            passed=all(s == f for s, f in after),
            value=after[0][0],
            limit=after[0][1],
            detail="rank 0's per-step all-gathers and reduce-scatters after the switch vs the fresh build's",
        ),
        Criterion(
            name="configs_differ_in_collectives",
            passed=all(a != b for a, b in first),
            value=first[0][0],
            limit=first[0][1],
            detail="rank 0's first step in A vs in B: must differ, or the switch is not seen",
        ),
    ]
    figures = {"fresh": fresh, "switched": switched}
    return NumericsCheck(name="switch", criteria=criteria, figures=figures)


GRAD_RTOL = 1e-4
"""How far the first step's squared gradient norm (of a rank's shard) may be from the defaults'
with sum-only reductions (the divide by the world size outside the collective changes each reduced
value in its last fp32 bits): a missing or doubled divide is off by the world size squared."""


def _first_gradient(knob: str, base: list[dict[str, Any]], ranks: list[dict[str, Any]]) -> Criterion:
    diffs = [abs(r["grad_sq"][0] - b["grad_sq"][0]) / b["grad_sq"][0] for b, r in zip(base, ranks, strict=True)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    return Criterion(
        name=f"{knob}_first_gradient",
        passed=all(d <= GRAD_RTOL for d in diffs),
        value=diffs[worst],
        limit=GRAD_RTOL,
        detail=f"rank {worst}: the first step's squared gradient norm, relative to the defaults'",
    )


def evaluate_comm_buffers(runs: dict[str, list[dict[str, Any]]], num_blocks: int) -> NumericsCheck:
    """The communication-buffer knobs against FSDP2's defaults, all in fp32 (``runs``: ``defaults``
    and one run per knob, each its ranks' :func:`~autotune.trials.numerics.memorise_ranks` results):
    each knob's run learns the batch, its first gradient is the defaults' (:data:`GRAD_RTOL`; AdamW
    is blind to a gradient's scale, so the losses alone would not see a divide gone wrong), and its
    losses stay within the bf16 tolerance of the defaults' at every step (a loose bound: one fp32
    rounding per reduced value is 2**16 times smaller than bf16's, room for chaotic growth)."""
    check = NumericsCheck(name="comm_buffers")
    base = runs["defaults"]
    for knob, ranks in runs.items():
        if knob == "defaults":
            continue
        check.criteria += [*_learned(knob, ranks), _first_gradient(knob, base, ranks)]
        worst = (0.0, 0, 0, 0.0, 0.0)
        for rank, (a, b) in enumerate(zip(base, ranks, strict=True)):
            tolerance = get_bf16_tolerance(a["losses"], num_blocks)
            for step, (x, y, tol) in enumerate(zip(a["losses"], b["losses"], tolerance, strict=True)):
                share = abs(y - x) / tol if tol > 0 else math.inf
                if not math.isfinite(share) or share > worst[0]:
                    worst = (share if math.isfinite(share) else math.inf, rank, step, abs(y - x), tol)
        check.criteria.append(
            Criterion(
                name=f"{knob}_tracks_defaults",
                passed=worst[0] <= 1.0,
                value=worst[3],
                limit=worst[4],
                detail=f"rank {worst[1]} step {worst[2]}: |{knob} - defaults| vs the bf16 tolerance",
            )
        )
    check.figures = {name: [r["losses"] for r in ranks] for name, ranks in runs.items()}
    return check
