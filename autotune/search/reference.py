"""What a search trial is paired with: the best config so far, its ratio to the defaults chained, anchors on drift.

[Note: measured against the best]
Every trial is paired with a reference ([Note: paired measurement]). The defaults are the
slowest config of most searches (6.4 s a step against 2.2 s for the winner on a
communication-heavy workload on 2 CPU ranks, the kind ``benchmarks/models/wide1024.toml`` is), so
re-measuring them in every trial is the largest single cost of a search; and the question a trial
must answer is "is this faster than the best so far?". Two ways to pair, ``--reference``:

- ``defaults`` (the default): every trial against FSDP2's defaults, its ratio measured directly.
  The best so far still decides: the stopping rule ([Note: sequential measurement]) stops a trial
  once it is clearly faster than the best's ratio (a new best), prunes it once it is clearly
  slower than that times ``prune_ratio``, and only a new best runs its profiled window (none
  where the config to emit is profiled at the end: [Note: the emitted config's trace]);
- ``best``: every trial but the defaults trial and the presearch's calibration trials (whose
  steps the calibration reads beside the defaults') against the best trial so far, or the
  defaults while no trial has beaten them; its objective is its ratio to the best times the
  best's ratio to the defaults (``chain``), and the row keeps both (``ratio_to_reference``,
  ``reference_trial``, ``reference_ratio``). Fewer of the defaults' slow steps.

*Why ``best`` is not the default.* A chain multiplies two measurements taken at different times
with different partners, and on this box a config's step does not keep its proportion to the
defaults' between them. Measured (``benchmarks/search_time.py``, ``wide1024``, 8 trials,
``--presearch sim``, a quiet box at load 0.2-2.1): trial 4 chained through trial 2 at 0.584 and
trial 6 through trial 4 at 0.463, where the final round measured them against the defaults at
0.674 and 0.621 (without chains, on ``wide``, the emitted trial measured 0.614 in the search and
0.667 in its final round: 8% apart, where these are 14% and 25%). Trial 2's config
stepped 1,287 ms as a candidate against the defaults, 1,640 ms as trial 4's reference and
1,498 ms in its anchor a minute later, while the defaults' step moved 4%. The final round still
measures the finalists against the defaults directly, so the emitted speedup is honest either
way, but a chain that is 15-25% off misleads the sampler and the choice of finalists.

*Drift*, either way: the reference's steps in each trial are compared with its steps where its
ratio was measured (the defaults trial's, or the best's own trial's) and recorded on the row
(``reference_drift``). With ``best``, when the reference's median step moved by more than
``DRIFT_LIMIT`` (25%), the search measures the reference against the defaults again, now (an
*anchor*, ``anchors/anchor_NNNN`` in the run dir, kept in the study's ``anchors`` attribute so a
resumed study chains the same way, and in ``search.json``), and chains this trial and the
following ones through the anchor's ratio. With ``defaults`` a trial's ratio is measured within
the trial, so drift needs no correction; the record shows it.
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

DRIFT_LIMIT = 0.25
"""Relative change of the reference's median step beyond which its ratio to the defaults is measured
again. Not lower: on a quiet box (load 0.3-2.6, ``benchmarks/search_time.py`` on ``wide``) a
reference's step moved 18% between two trials with the load unchanged (997 ms as a candidate,
1,202 ms as the next trial's reference, 1,040 ms in its anchor), where one core kept busy moved
that communication-heavy workload's defaults step 73% (6.4 to 11.1 s)."""
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
    """With ``--reference best``, the best trial so far (with its latest anchor's ratio), or the
    defaults when none beat them; with ``--reference defaults`` (the default), the defaults."""
    if (
        ctx.settings.reference != "best"
        or best is None
        or best.is_default
        or best.ratio is None
        or best.ratio >= 1.0
        or not best.feasible
    ):
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
