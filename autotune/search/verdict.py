"""The last word on a config to emit: measured once more against a baseline, in a window that did not choose it.

[Note: emitted on an interval]
The final round chooses the config to emit as the fastest of a few finalists, each measured
against the defaults ([Note: paired measurement] in :mod:`autotune.trials.paired`). That choice
is a minimum of noisy medians: the chosen figure is optimistic by about one standard error where
the finalists tie (the winner's curse; :func:`autotune.search.confirm.get_contested`), and a
median below 1 is no evidence of a speedup when the pairs spread wider than the gap. So the
chosen config is measured against each baseline once more, in a window that played no part in
choosing it, and is emitted over that baseline only where this window calls it faster:

- against the defaults, a trial of the chosen config of its own (:func:`measure_verdict`), after
  the final round; against torchtitan's recipe, the recipe round
  (:mod:`autotune.search.recipe`), which runs after the choice too;
- the call: the 90% interval of the mean log pair ratio, pooled with the box's noise where there
  is enough of it, lies wholly below 1 over the window's pairs, at least two blocks of them
  (:func:`fsdp_runtime.tuning.sequential.is_faster`): the window runs two blocks before it may
  settle, since one block led by the candidate, whose two reference steps one burst slows alike,
  shows a tie with no spread and a settled interval ([Note: burst windows]);
- the window runs every one of its pairs (``2 * num_confirm_pairs``, at least :data:`MIN_PAIRS`)
  unless the config proves clearly slower (no speedup to report) or its ratio settles within the
  precision; it never stops as clearly faster. A window stopped once it looked clearly faster
  reports the figure of the pairs that looked fastest: measured (``benchmarks/realized_speedup.py``,
  five searches each of ``small`` and ``wide1024``, 2026-11-29), windows so stopped after three
  pairs, and the one config that realized less than 0.95 of its claim alone (0.926, ``wide1024``)
  was claimed from three pairs at 1.69x after the round that chose it had it at 1.63x;
- where the window does not call it faster, the baseline is emitted, and the record
  (``verdict``), the terminal and the emitted config's notes say so in one line;
- the speedup the search reports for the emitted config is this window's, with its interval
  (``speedup_low``, ``speedup_high``); the final round's figure of the chosen config stays in its
  finalists' rows (``selection_speedup`` names it).

The window decides between the config and the baseline, so the figure it reports is read only
where it called the config faster; for a config whose speedup is near the noise this leans
high, as any figure reported past a threshold does. How far, measured:
``benchmarks/realized_speedup.py`` runs searches and then each emitted config alone against the
defaults with ``autotune compare``, and prints realized over claimed (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from autotune.trials import StoppingRule, TrialResult, get_rule_interval, median_or_none
from fsdp_runtime.tuning import is_faster

if TYPE_CHECKING:
    from pathlib import Path

    from autotune.search.context import SearchContext
    from fsdp_runtime import RuntimeConfig

CONFIDENCE = 0.90
"""The two-sided confidence of the interval a config must lie wholly below 1 in to be emitted."""
MIN_PAIRS = 4
"""The fewest pairs a verdict window may run, whatever ``--confirm-pairs`` says: the rule calls a
config faster only where the pairs no single two-step burst reached agree ([Note: burst windows]),
and in one block of two pairs a burst reaches both, so a window of two could never call it."""


def get_verdict_pairs(ctx: SearchContext) -> int:
    """The most pairs a verdict window runs: as a finalist's (``2 * num_confirm_pairs``), at least :data:`MIN_PAIRS`."""
    return max(MIN_PAIRS, 2 * ctx.settings.num_confirm_pairs)


def get_verdict_rule(ctx: SearchContext, num_pairs: int) -> StoppingRule:
    """Every pair, unless the config is clearly slower than the baseline (an interval above 1,
    whatever ``--prune-ratio`` says: no speedup to report) or its ratio settles within the
    precision; never stopped as clearly faster, nor for futility: the window's figure is the
    speedup reported, and a window stopped where its ratio looked fastest reports it fastest."""
    rule = ctx.get_stopping_rule(prune=True, faster_below=None, num_pairs=num_pairs, futility=False)
    return dataclasses.replace(rule, prune_above=1.0, min_blocks=2)  # one block never calls it: is_faster


def measure_verdict(
    ctx: SearchContext,
    config: RuntimeConfig,
    out_dir: Path,
    *,
    reference: RuntimeConfig | None = None,
    profile: bool = False,
) -> dict[str, Any]:
    """``config`` against ``reference`` (default: the defaults) under :func:`get_verdict_rule`;
    its figures and whether the window called it faster (``faster``)."""
    num_pairs = get_verdict_pairs(ctx)
    rule = get_verdict_rule(ctx, num_pairs)
    spec = ctx.trial_spec(config, out_dir, profile=profile, num_pairs=num_pairs, stopping=rule, reference=reference)
    return get_verdict_figures(ctx.run(spec), rule) | {"dir": str(out_dir)}


def get_verdict_figures(result: TrialResult, rule: StoppingRule) -> dict[str, Any]:
    """A verdict window's record: status, step times, the pair figures, the 90% interval of the
    ratio under ``rule`` (``ratio_low``, ``ratio_high``) and ``faster``: the rule called it so."""
    ok = result.metrics is not None and result.status in ("ok", "pruned")
    paired = result.metrics.paired if ok else {}
    interval = get_rule_interval(rule, paired["pair_ratios"]) if paired.get("pair_ratios") else None
    return {
        "status": result.status,
        "reason": result.reason,
        "step_ms": result.step_ms,
        "reference_step_ms": median_or_none(result.metrics.reference_step_ms_per_step) if result.metrics else None,
        "stopped": result.metrics.stopped if result.metrics else None,
        "profiled": bool(result.metrics and result.metrics.traces),
        **paired,
        "ratio_low": interval.low if interval else None,
        "ratio_high": interval.high if interval else None,
        "confidence": CONFIDENCE,
        "faster": ok and is_faster(result.metrics.stopped, interval, pair_ratios=paired.get("pair_ratios") or []),
    }


INTERVAL_COVERS = "the noise of this window's pairs, not a run alone"
"""What a printed interval covers: one paired window's noise, not the pairing's bias against the
config run on its own (``benchmarks/realized_speedup.py`` measures that: docs/benchmarks.md)."""


def get_speedups(figures: dict[str, Any] | None) -> dict[str, Any]:
    """Speedup over the baseline (baseline / config time): the inverse of the ratios of
    ``figures`` (a window's or a finalist's; None: none), per block, with its quartiles, extremes
    and, where the figures have one, its 90% interval."""
    if not figures or figures.get("ratio") is None:
        return {"speedup_median": None, "speedup_min": None, "speedup_max": None, "speedups": []}
    interval = (
        {
            "speedup_low": 1.0 / figures["ratio_high"],
            "speedup_high": 1.0 / figures["ratio_low"],
            "interval_covers": INTERVAL_COVERS,
        }
        if figures.get("ratio_low")
        else {}
    )
    return {
        "speedup_median": 1.0 / figures["ratio"],
        "speedup_q25": 1.0 / figures["ratio_q75"],
        "speedup_q75": 1.0 / figures["ratio_q25"],
        "speedup_min": 1.0 / figures["ratio_max"],
        "speedup_max": 1.0 / figures["ratio_min"],
        **interval,
        "speedups": [1.0 / r for r in figures["block_ratios"]],
    }


def describe_figure(figures: dict[str, Any], of: str = "") -> str:
    """``1.148x{of} (90% interval 1.12-1.17x, 6 pairs: the noise of this window's pairs, not a run
    alone)``: a window's speedup in a few words, and what its interval covers."""
    if figures.get("ratio") is None:
        return f"not measured ({figures.get('status')}: {(figures.get('reason') or '')[:160]})"
    speedups = get_speedups(figures)
    interval = (
        f"{CONFIDENCE:.0%} interval {speedups['speedup_low']:.3f}-{speedups['speedup_high']:.3f}x, "
        if "speedup_low" in speedups
        else ""
    )
    covers = f": {INTERVAL_COVERS}" if interval else ""
    return f"{speedups['speedup_median']:.3f}x{of} ({interval}{figures.get('num_pairs', 0)} pairs{covers})"


def describe_verdict(subject: str, baseline: str, figures: dict[str, Any]) -> str:
    """The one line said where ``baseline`` is emitted because the window did not call ``subject``
    faster: ``the defaults are emitted: trial 7 was not shown faster than them ...``."""
    plural = baseline.endswith("defaults")
    emitted, them = ("are", "them") if plural else ("is", "it")
    was = "were" if subject.endswith("defaults") else "was"
    return (
        f"{baseline} {emitted} emitted: {subject} {was} not shown faster than {them} at {CONFIDENCE:.0%} "
        f"in a window that did not choose it: {describe_figure(figures, f' the speed of {baseline}')}"
    )
