"""What a search trial is paired with: the best config so far, its ratio to the defaults chained, anchors on drift.

[Note: measured against the best]
Every trial used to be paired with FSDP2's defaults ([Note: paired measurement]). The defaults
are the slowest config of most searches (6.4 s a step against 2.2 s for the winner on issue
39's communication-heavy workload), so re-measuring them in every trial was the largest single
cost of a search, and the question a trial must answer is not "how much faster than the
defaults?" but "is this faster than the best so far?". So:

- the defaults trial pairs the defaults with themselves (their noise), and the presearch's
  calibration trials pair with the defaults (the calibration reads the defaults' steps beside
  them); every other trial pairs with the *reference*: the search's best trial so far
  (``pick_best``), or the defaults while no trial has beaten them;
- the pair is formed as before (same ranks, ABBA blocks, a settle step after each switch), and
  the sequential rule ([Note: sequential measurement]) stops the trial as soon as it is clearly
  faster than the reference (the new best), clearly slower (pruned) or settled;
- the trial's objective stays its ratio to the defaults: its ratio to the reference times the
  reference's own ratio to the defaults (``chain``). The row keeps both (``ratio_to_reference``,
  ``reference_trial``, ``reference_ratio``). The chained interval is the trial's own spread
  scaled, without the reference's uncertainty: the final round measures the finalists against
  the defaults directly, and that measurement is what the emitted speedup reports;
- *drift*: the reference's steps in each trial are compared with its steps when its ratio was
  measured. A paired ratio cancels a change of load within the trial, but the reference's ratio
  to the defaults was measured under the load of its own time, and load does not slow every
  config alike (a communication-bound config waits; a compute-bound one competes for cores).
  When the reference's median step moved by more than ``DRIFT_LIMIT`` (15%), the search measures
  the reference against the defaults again, now (an *anchor*, ``anchors/anchor_NNNN`` in the run
  dir, kept in the study's ``anchors`` attribute so a resumed study chains the same way), and
  chains this trial and the following ones through the anchor's ratio.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsdp_runtime import RuntimeConfig

if TYPE_CHECKING:
    from autotune.search.context import SearchContext
    from autotune.search.results import TrialRow
    from autotune.trials import TrialResult

DRIFT_LIMIT = 0.15
"""Relative change of the reference's median step beyond which its ratio to the defaults is measured again."""
ANCHORS_ATTR = "anchors"


@dataclass(frozen=True)
class Reference:
    """The config a trial is paired with and what is known of it."""

    config: RuntimeConfig
    trial: int | None
    """Its trial number; None: FSDP2's defaults."""
    ratio: float
    """Its step-time ratio to the defaults (1.0 for the defaults; an anchor's where one was measured)."""
    step_ms: float | None
    """Its median step where that ratio was measured: the baseline drift is measured from."""

    @property
    def is_defaults(self) -> bool:
        return self.trial is None


def get_anchors(ctx: SearchContext) -> dict[str, Any]:
    return dict(ctx.study.user_attrs.get(ANCHORS_ATTR, {}))


def get_defaults_reference(ctx: SearchContext, rows: list[TrialRow]) -> Reference:
    default = next((r for r in rows if r.is_default and r.state == "COMPLETE"), None)
    return Reference(config=ctx.default_config, trial=None, ratio=1.0, step_ms=default.step_ms if default else None)


def choose_reference(ctx: SearchContext, rows: list[TrialRow], best: TrialRow | None) -> Reference:
    """The best trial so far (with its latest anchor's ratio), or the defaults when none beat them."""
    if best is None or best.is_default or best.ratio is None or best.ratio >= 1.0 or not best.feasible:
        return get_defaults_reference(ctx, rows)
    anchor = get_anchors(ctx).get(str(best.number))
    return Reference(
        config=ctx.space.build_config(best.params),
        trial=best.number,
        ratio=anchor["ratio"] if anchor else best.ratio,
        step_ms=anchor["step_ms"] if anchor else best.step_ms,
    )


def get_drift(reference: Reference, result: TrialResult) -> float | None:
    """How far the reference's median step in this trial moved from its baseline (relative), or None."""
    steps = result.metrics.reference_step_ms_per_step if result.metrics else []
    if not steps or not reference.step_ms:
        return None
    return statistics.median(steps) / reference.step_ms - 1.0


def measure_anchor(ctx: SearchContext, reference: Reference, *, at_trial: int, drift: float) -> Reference:
    """The reference measured against the defaults now; kept in the study, returned as the reference to chain through."""
    rule = ctx.get_stopping_rule(prune=False, faster_below=None)
    spec = ctx.trial_spec(
        reference.config,
        ctx.settings.out_dir / "anchors" / f"anchor_{at_trial:04d}",
        profile=False,
        num_pairs=ctx.settings.num_measured,
        stopping=rule,
    )
    result = ctx.run(spec)
    paired = result.metrics.paired if result.metrics and result.ok else {}
    if paired.get("ratio") is None:
        ctx.reporter.on_phase(
            f"anchor: trial {reference.trial} against the defaults failed ({result.status}: {result.reason[:120]}); "
            "chaining through its earlier ratio"
        )
        return reference
    anchor = {
        "ratio": paired["ratio"],
        "ratio_spread": paired.get("ratio_spread"),
        "step_ms": result.step_ms,
        "reference_step_ms": statistics.median(result.metrics.reference_step_ms_per_step),
        "at_trial": at_trial,
        "drift": drift,
        "previous_ratio": reference.ratio,
        "dir": str(spec.out_dir.relative_to(ctx.settings.out_dir)),
    }
    anchors = get_anchors(ctx) | {str(reference.trial): anchor}
    ctx.study.set_user_attr(ANCHORS_ATTR, anchors)
    ctx.reporter.on_phase(
        f"anchor: the reference's step moved {drift:+.0%} since its ratio was measured; trial {reference.trial} "
        f"against the defaults now: {paired['ratio']:.3f}x (was {reference.ratio:.3f}x)"
    )
    return Reference(config=reference.config, trial=reference.trial, ratio=paired["ratio"], step_ms=result.step_ms)


def chain(paired: dict[str, Any], reference: Reference) -> dict[str, Any]:
    """A trial's figures against the defaults: its ratio to the reference times the reference's ratio."""
    chained = {k: paired[k] * reference.ratio for k in ("ratio", "ratio_q25", "ratio_q75") if paired.get(k) is not None}
    if paired.get("ratio_spread") is not None:
        chained["ratio_spread"] = paired["ratio_spread"]
    return chained
