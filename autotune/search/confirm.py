"""The final round: the search's top configs re-measured against the defaults, side by side.

A search ranks hundreds of configs from short trials; the emitted config is decided by a
longer, second measurement of the ``num_finalists`` best distinct configs, each paired with
the defaults on the same ranks ([Note: paired measurement]) with at most ``2 * num_confirm_pairs``
pairs: each stops once its ratio is settled ([Note: sequential measurement]), a finalist
clearly slower than the leader so far is pruned there (from its second block on: the two-sample
interval of its mean log ratio less the leader's, the leader's own error counted, wholly above 0),
and one unlikely to end below the leader stops before its last block ([Note: futility], the
leader's error counted too). Where a contested leader's second window moves it above a finalist
pruned against its first, that finalist is measured again against the new leader and ranked. The finalist with the lowest median ratio is chosen; if even it is
not faster than the defaults (median ratio >= 1), the defaults are emitted, and the record says why.
The chosen one is emitted only where a window of its own, after the choice, calls it faster than
the defaults, and the speedup reported is that window's ([Note: emitted on an interval] in
:mod:`autotune.search.verdict`).

A contested final round is measured once more before it is decided: when the leader did not
settle within the precision and either its pairs spread wider than ``max_ratio_spread`` or a
runner-up's median lies inside its interquartile range, the leader and those runners-up each
get a second window of as many pairs, and each is ranked on all its pairs pooled (with the
box's noise known, only a noisy leader, or a leader with a runner-up a second window could show
faster than it by more than the precision: :func:`get_contested`). Why: the
lowest of a few noisy medians is
biased low (the winner's curse). Measured in ``studies/search_noise.py``: a final round
whose reference slowed by a quarter under a package install emitted a winner at 1.42x with
pairs from 0.90x to 1.80x, while its runner-up measured a tight 1.22x; re-measured side by side
later, the winner was 1.24x.

Under a memory budget the final round is a second measurement of memory too: a finalist whose
peak in the final round is over the budget is not ranked (``over_budget``), so the emitted
config fit both times it was measured. Why: a process peak varies between measurements of one
config (CPU: resident set size, ~5-10%, with the allocator's history and how far prefetched
all-gathers run ahead), so the lowest of several peaks just under a budget is biased low like
the fastest of several noisy times. Measured in ``benchmarks/memory_knobs.py``: a search trial
at 620 MiB under a 635 MiB budget measured 672 MiB in the benchmark's re-measurement. And where
the defaults are over the budget, a finalist slower than them is still emitted (the fastest
that fits): the defaults are not a config the user can run.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

from autotune.search.context import SearchContext
from autotune.search.refine import pick_base
from autotune.search.results import TrialRow, pick_best
from autotune.search.verdict import describe_verdict, get_speedups, get_verdict_pairs, measure_verdict
from autotune.trials import median_or_none
from fsdp_runtime import RuntimeConfig
from fsdp_runtime.tuning import REFERENCE, StoppingRule, get_burst_proof_mean

Z_90 = 1.2816
"""The standard normal's 90th percentile: a one-sided 90% call that one finalist is faster."""


def get_finalists(rows: list[TrialRow], num_finalists: int) -> list[TrialRow]:
    """The best distinct, feasible, finished configs (the defaults and duplicates left out), best
    first; then the refinement's last base where it is not among them ([Note: refinement])."""
    candidates = [r for r in rows if not r.is_default and r.duplicate_of is None]
    finalists: list[TrialRow] = []
    while len(finalists) < num_finalists:
        best = pick_best(r for r in candidates if r not in finalists)
        if best is None:
            break
        finalists.append(best)
    base = pick_base(candidates)
    if base is not None and base not in finalists:
        finalists.append(base)
    return finalists


def _measure_finalist(
    ctx: SearchContext, row: TrialRow, *, window: int = 0, leader: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``row``'s config against the defaults until its ratio is known ([Note: sequential
    measurement]); pruned once it is clearly slower than ``leader`` (the leader so far's figures):
    the two-sample interval of its mean log ratio less the leader's, both errors counted, wholly
    above 0 (``limit_pairs``), not its own interval above the leader's point estimate."""
    config = ctx.space.build_config(row.params)
    name = f"trial_{row.number:04d}" + (f"_window{window}" if window else "")
    num_pairs = 2 * ctx.settings.num_confirm_pairs
    rule = get_finalist_rule(ctx.get_stopping_rule(prune=False, faster_below=None, num_pairs=num_pairs), leader)
    spec = ctx.trial_spec(config, ctx.write_dir / "final" / name, profile=False, num_pairs=num_pairs, stopping=rule)
    result = ctx.run(spec)
    paired = result.metrics.paired if result.metrics and result.status in ("ok", "pruned") else {}
    reference_ms = median_or_none(result.metrics.reference_step_ms_per_step) if result.metrics else None
    budget, peak = ctx.settings.memory_budget_bytes, result.process_peak_bytes
    memory = (
        {"process_peak_bytes": peak, "over_budget": peak > budget} if budget is not None and peak is not None else {}
    )
    return {
        "trial": row.number,
        "status": result.status,
        "reason": result.reason,
        "search_ratio": row.ratio,
        "step_ms": result.step_ms,
        "reference_step_ms": reference_ms,
        "stopped": result.metrics.stopped if result.metrics else None,
        **paired,
        **memory,
    }


def get_finalist_rule(rule: StoppingRule, leader: dict[str, Any] | None) -> StoppingRule:
    """A finalist's rule (the search's, no faster call): two blocks before it may settle or be
    pruned, as the verdict window (one burst over the two reference steps a candidate-first block
    shares slows both its pairs alike: a tie that settles faster, then a leader no finalist can
    beat; ``studies/decisions.py``'s ``lose`` rows), and pruned, or stopped as futile, against the
    ``leader``'s figure (:func:`get_leader_mean`) with its pairs' error counted (``limit_pairs``)."""
    slower_than = get_leader_mean(leader)
    return dataclasses.replace(
        rule,
        min_blocks=2,
        prune_above=slower_than,
        futile_above=slower_than,
        limit_pairs=len(leader.get("pair_ratios") or []) if slower_than is not None else 0,
    )


def get_leader_mean(leader: dict[str, Any] | None) -> float | None:
    """The leader's geometric mean pair ratio, the figure a two-sample comparison of means holds a
    finalist to, as no single burst in the leader's window can have lowered it
    (:func:`fsdp_runtime.tuning.get_burst_proof_mean`; its median ratio where it has no pairs)."""
    if leader is None:
        return None
    ratios = [r for r in leader.get("pair_ratios") or [] if r > 0]
    return get_burst_proof_mean(ratios, leader.get("first") or REFERENCE) if ratios else leader.get("ratio")


def run_final_round(ctx: SearchContext, rows: list[TrialRow]) -> tuple[RuntimeConfig, dict[str, Any] | None]:
    """The config to emit and the final round's record (None when there was nothing to compare)."""
    finalists = get_finalists(rows, ctx.settings.num_finalists)
    if ctx.settings.num_confirm_pairs == 0 or not finalists:
        best = pick_best(rows)
        return (ctx.space.build_config(best.params) if best else ctx.default_config), None
    ctx.round = "final round"
    measured, contested = _measure_finalists(ctx, finalists)
    ranked = sorted(
        (m for m in measured if m["status"] == "ok" and m.get("ratio") is not None and not m.get("over_budget")),
        key=lambda m: m["ratio"],
    )
    record: dict[str, Any] = {
        "estimator": "blocks",
        "finalists": measured,
        "num_pairs": 2 * ctx.settings.num_confirm_pairs,
        "contested": contested,
        "emit_rule": "interval",
        "speedup_from": "selection",
        "chosen": None,
        "verdict_window": None,
    }
    # Under a memory budget the defaults may not fit: they are then the yardstick, never the fallback.
    defaults_fit = all(r.feasible for r in rows if r.is_default)
    any_over = any(m.get("over_budget") for m in measured)
    if not ranked and (any_over or not defaults_fit):
        # Keep the search's pick (it fit once), and say why.
        best = pick_best(rows)
        why = (
            "every finalist was over the memory budget in the final round"
            if any_over
            else "no finalist was measured in the final round and the defaults are over the memory budget"
        )
        return ctx.space.build_config(best.params), record | {
            "emitted": "search",
            "winner": None,
            "memory": why,
            **get_speedups(None),
        }
    if not ranked or (ranked[0]["ratio"] >= 1.0 and defaults_fit):
        # Not one finalist beats the defaults side by side: the search's ranking was noise.
        return ctx.default_config, record | {
            "emitted": "defaults",
            "winner": None,
            "verdict": "no finalist was faster than the defaults in the final round: they are emitted",
            **get_speedups(ranked[0] if ranked else None),
        }
    row = next(r for r in finalists if r.number == ranked[0]["trial"])
    return _decide_chosen(ctx, row, ranked[0], record, defaults_fit=defaults_fit)


def _decide_chosen(
    ctx: SearchContext, row: TrialRow, chosen: dict[str, Any], record: dict[str, Any], *, defaults_fit: bool
) -> tuple[RuntimeConfig, dict[str, Any]]:
    """The chosen finalist measured in a window of its own, and emitted where that window calls it
    faster than the defaults ([Note: emitted on an interval]); the defaults otherwise, with why."""
    config = ctx.space.build_config(row.params)
    window = _measure_verdict(ctx, row, config)
    record = record | {
        "chosen": chosen["trial"],
        "verdict_window": window,
        "speedup_from": "verdict",
        "selection_speedup": 1.0 / chosen["ratio"],
        **get_speedups(window),
    }
    if not defaults_fit:  # the defaults are not a config the user can run: the fastest that fits, however slow
        slower = {"defaults_over_budget": True} if chosen["ratio"] >= 1.0 else {}
        return config, record | {"emitted": "best", "winner": chosen["trial"], **slower}
    if not window["faster"]:
        verdict = describe_verdict(f"trial {chosen['trial']} (the fastest finalist)", "the defaults", window)
        return ctx.default_config, record | {"emitted": "defaults", "winner": None, "verdict": verdict}
    return config, record | {"emitted": "best", "winner": chosen["trial"]}


def _measure_verdict(ctx: SearchContext, row: TrialRow, config: RuntimeConfig) -> dict[str, Any]:
    """The chosen finalist against the defaults once more, in a window that did not choose it."""
    ctx.round = "verdict"
    ctx.reporter.on_phase(
        f"final round: trial {row.number} vs the defaults once more, in a window that did not choose it, "
        f"at most {get_verdict_pairs(ctx)} pairs"
    )
    out_dir = ctx.write_dir / "final" / f"trial_{row.number:04d}_verdict"
    return {"trial": row.number} | measure_verdict(ctx, config, out_dir)


def _measure_finalists(ctx: SearchContext, finalists: list[TrialRow]) -> tuple[list[dict[str, Any]], list[int]]:
    """Each finalist against the defaults, a second window for each contested one; and the contested trials."""
    ctx.reporter.on_phase(
        f"final round: {len(finalists)} best configs vs the defaults, at most {2 * ctx.settings.num_confirm_pairs} pairs each"
    )
    measured: list[dict[str, Any]] = []
    for row in finalists:  # best first: a later finalist clearly slower than the leader so far is pruned
        measured.append(_measure_finalist(ctx, row, leader=_get_leader(measured)))
    noise = ctx.noise.get()
    contested = get_contested(
        [m for m in measured if m["status"] == "ok"],
        ctx.settings.max_ratio_spread,
        noise[0] if noise else None,
        ctx.settings.precision,
    )
    if contested:
        ctx.reporter.on_phase(
            f"final round contested (trials {', '.join(str(n) for n in contested)}): a second window each"
        )
        by_number = {row.number: row for row in finalists}
        measured = [
            pool_windows(m, _measure_finalist(ctx, by_number[m["trial"]], window=1)) if m["trial"] in contested else m
            for m in measured
        ]
        measured = _rerank_pruned(ctx, measured, by_number)
    return measured, contested


def _get_leader(measured: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The finalist with the lowest ratio among those measured that fit (None: none yet)."""
    fits = [m for m in measured if m["status"] == "ok" and m.get("ratio") and not m.get("over_budget")]
    return min(fits, key=lambda m: m["ratio"], default=None)


def _rerank_pruned(
    ctx: SearchContext, measured: list[dict[str, Any]], by_number: dict[int, TrialRow]
) -> list[dict[str, Any]]:
    """Finalists pruned against a leader the contested windows then moved: each whose own ratio lies
    below the leader's new one is measured again (a second window, pooled with its first) against
    the new leader, and ranked with the rest; the others stay pruned."""
    leader = _get_leader(measured)
    if leader is None:
        return measured
    again = [m for m in measured if m["status"] == "pruned" and m.get("ratio") and m["ratio"] < leader["ratio"]]
    for m in again:
        ctx.reporter.on_phase(
            f"final round: trial {m['trial']} was pruned against a leader the second windows moved: measured again"
        )
    redone = {m["trial"]: _remeasure(ctx, m, by_number[m["trial"]], leader) for m in again}
    return [redone.get(m["trial"], m) for m in measured]


def _remeasure(ctx: SearchContext, first: dict[str, Any], row: TrialRow, leader: dict[str, Any]) -> dict[str, Any]:
    second = _measure_finalist(ctx, row, window=1, leader=leader)
    pooled = pool_windows(first, second)
    return pooled | {"status": second["status"], "reranked": True}


def get_contested(
    measured: list[dict[str, Any]], max_spread: float, noise_sd: float | None = None, precision: float = 0.05
) -> list[int]:
    """The finalists to measure again: the leader and every runner-up whose median lies inside
    the leader's interquartile range, when the leader is noisy or has such a runner-up; else none.
    A leader whose ratio settled ([Note: sequential measurement]: its 90% interval within the
    precision) is not contested: a runner-up that close is as fast within what a second window
    could resolve (measured, ``benchmarks/search_time.py`` on ``wide1024``: a settled 0.628 and
    a 0.636 each took a second window, 44 steps, to come out in the same order).

    With the box's pair noise known (``noise_sd``, [Note: pooled noise]) a leader that is not
    noisy is measured again only with a runner-up that could change the choice by more than the
    ``precision`` (:func:`could_be_faster`); a runner-up that cannot is a tie the round does not
    spend a window on, and the leader is not measured again alone. What that leaves: where
    runners-up tie with it, the leader's figure is the lowest of a few noisy ones (the winner's
    curse), optimistic by about one standard error of a finalist's ratio at most (0.85 of it for
    three exact ties: 4% at six pairs spreading 11%, this box's). Measured (``search_time.py`` on
    ``small``, four runs that took windows): the windows cost 14-42 s of a 230-300 s search and
    changed the emitted config once, between two configs 2% apart."""
    ranked = sorted((m for m in measured if m.get("ratio") is not None), key=lambda m: m["ratio"])
    if len(ranked) == 0 or ranked[0].get("stopped") == "settled":
        return []
    leader = ranked[0]
    close = [m for m in ranked[1:] if m["ratio"] <= leader["ratio_q75"]]
    noisy = leader.get("ratio_spread") is not None and leader["ratio_spread"] > max_spread
    if noisy or noise_sd is None:
        return [leader["trial"], *(m["trial"] for m in close)] if (close or noisy) else []
    contenders = [m["trial"] for m in close if could_be_faster(leader, m, noise_sd, precision)]
    return [leader["trial"], *contenders] if contenders else []


def could_be_faster(leader: dict[str, Any], runner: dict[str, Any], noise_sd: float, precision: float) -> bool:
    """A second window each could show ``runner`` faster than ``leader`` by more than ``precision``:
    it may be (a chance of at least 10%: its log gap under ``Z_90`` standard errors of the gap less
    the precision's log) and the two windows pooled would resolve a difference that size (``Z_90``
    of their pooled standard errors within the precision's log). At this box's 11% pair spread and
    six pairs each, the second condition fails: no window resolves 5%."""
    n_leader, n_runner = leader.get("num_pairs") or 1, runner.get("num_pairs") or 1
    gap, zone = math.log(runner["ratio"] / leader["ratio"]), math.log(1 + precision)
    spread = noise_sd * math.sqrt(1 / n_leader + 1 / n_runner)
    return gap < Z_90 * spread - zone and Z_90 * spread / math.sqrt(2) < zone


def pool_windows(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """One finalist's figures over the blocks of both its windows (a failed window adds none);
    see [Note: paired measurement] for blocks."""
    blocks = list(first.get("block_ratios", [])) + list(second.get("block_ratios", []))
    if not blocks:
        return first | {"windows": 2}
    q25, _, q75 = (
        statistics.quantiles(blocks, n=4, method="inclusive") if len(blocks) > 1 else (blocks[0], 0, blocks[0])
    )
    median = statistics.median(blocks)
    pairs = [list(w.get("pair_ratios", [])) for w in (first, second)]
    # each window's even pairs start with its ``first`` side (the reference in metrics before v10)
    by_order = [
        [r for w, window in zip(pairs, (first, second)) for r in w[(k + (window.get("first") == "candidate")) % 2 :: 2]]
        for k in (0, 1)
    ]
    noise = [x for x in (first.get("candidate_noise"), second.get("candidate_noise")) if x is not None]
    reference_noise = [x for x in (first.get("reference_noise"), second.get("reference_noise")) if x is not None]
    peaks = [x for x in (first.get("process_peak_bytes"), second.get("process_peak_bytes")) if x is not None]
    memory = (
        {"process_peak_bytes": max(peaks), "over_budget": first.get("over_budget") or bool(second.get("over_budget"))}
        if peaks
        else {}
    )
    return (
        first
        | memory
        | {
            "ratio": median,
            "ratio_q25": q25,
            "ratio_q75": q75,
            "ratio_min": min(blocks),
            "ratio_max": max(blocks),
            "ratio_spread": (q75 - q25) / median if median > 0 else None,
            "block_ratios": blocks,
            "num_blocks": len(blocks),
            "pair_ratios": pairs[0] + pairs[1],
            "num_pairs": len(pairs[0]) + len(pairs[1]),
            "order_ratios": {
                "reference_first": statistics.median(by_order[0]) if by_order[0] else None,
                "candidate_first": statistics.median(by_order[1]) if by_order[1] else None,
            },
            "second_window_switch_cost": second.get("switch_cost"),
            "candidate_noise": max(noise, default=None),
            "reference_noise": max(reference_noise, default=None),
            "windows": 2,
            "first_window_ratio": first.get("ratio"),
            "second_window_status": second.get("status"),
        }
    )
