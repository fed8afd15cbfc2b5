"""Every table the tool shows, as plain rows of formatted strings (``cli.py`` renders them with
rich, ``html.py`` as HTML); number formats live here alone (:func:`fmt`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autotune.report.formatting import fmt
from autotune.report.model import OVERHEAD_TOLERANCE, Comparison, Report, ReportTable, TrialSummary
from autotune.report.trials_table import (
    NOTE_CHARS,
    cut,
    describe_knobs,
    describe_status,
    get_default_params,
    get_search_trials_table,
)
from autotune.search import SearchRecord, TrialRow, describe_figure

if TYPE_CHECKING:
    from autotune.search import SearchSummary
    from autotune.trials import TrialMetrics

STEP_TABLE = [  # (short column title, long title, summary field, format)
    ("step", "step ms", "step_ms", "ms"),
    ("compute", "compute ms", "compute_ms", "ms"),
    ("comm", "communication ms", "comm_ms", "ms"),
    ("AG", "all-gather ms", "all_gather_ms", "ms"),
    ("RS", "reduce-scatter ms", "reduce_scatter_ms", "ms"),
    ("AR", "all-reduce ms", "all_reduce_ms", "ms"),
    ("exposed", "exposed communication ms", "exposed_comm_ms", "ms"),
    ("overlap", "overlap", "overlap_ratio", "pct"),
    ("bound", "bound max(compute, comm) ms", "bound_ms", "ms"),
    ("/bound", "step / bound", "bound_ratio", "x"),
    ("barrier", "barrier (synchronization, not comm) ms", "barrier_ms", "ms"),
]
UNIT_TABLE = [  # the step table's communication columns, then the unit's own
    *(c for t in ("AG", "RS", "AR", "comm", "exposed", "overlap") for c in STEP_TABLE if c[0] == t),
    ("hooks", "time in the unit's FSDP hooks ms", "hook_ms", "ms"),
]
_LEGEND = "ms; AG/RS/AR: all-gather/reduce-scatter/all-reduce"
_SUMMARY_ONLY = ("AG", "RS", "AR", "barrier")  # kept out of the per-step table, to fit 80 columns


def get_tables(report: Report) -> list[ReportTable]:
    """The tables of a trial or search report."""
    if report.kind == "trial":
        return get_trial_tables(report.trials[0])
    if report.rows:  # the search's own rows: knobs, noise and attempts of every trial
        summary = [get_search_summary_table(report.search, report.comparison)] if report.search else []
        final = get_final_round_table(report.search.confirmation, report.search.recipe) if report.search else None
        return [*summary, *([final] if final else []), get_search_trials_table(report.rows, report.comparison)]
    return get_search_tables(report.trials, report.best, report.search)


def describe_profiler(trial: TrialSummary) -> str | None:
    """One line: whether and how the trace times are scaled, and what profiling cost; e.g.
    ``trace times scaled to the unprofiled step: ×0.87 rank 0, ×0.91 rank 1; profiler overhead
    +15% wall, +12% CPU, page faults ×3.1`` (see [Note: scaled trace times])."""
    if trial.profiler_overhead is None:
        return None
    cost = [f"{fmt(trial.profiler_overhead, 'over')} wall"]
    if trial.profiler_cpu_overhead is not None:
        cost.append(f"{fmt(trial.profiler_cpu_overhead, 'over')} CPU")
    if trial.profiler.get("page_fault_ratio") is not None:
        cost.append(f"page faults ×{trial.profiler['page_fault_ratio']:.1f}")
    scale = trial.trace_scale
    if scale:
        how = "trace times scaled to the unprofiled step: " + ", ".join(
            f"×{s:.2f} rank {r}" for r, s in sorted(scale.items())
        )
    elif trial.trace_scale_refused:
        how = f"trace times as measured, not scaled: {trial.trace_scale_refused}"
    elif trial.profiler.get("per_rank"):
        how = f"trace times as measured (within {100 * OVERHEAD_TOLERANCE:.0f}% of the unprofiled step)"
    else:
        how = "trace times as measured (this metrics.json has no per-rank unprofiled figures to scale by)"
    return f"{how}; profiler overhead {', '.join(cost)}"


def get_trial_tables(trial: TrialSummary) -> list[ReportTable]:
    summary = ReportTable(title=f"Trial {trial.name}", columns=["metric", "value"])
    summary.rows += [
        ["status", trial.status + (f" ({trial.reason})" if trial.reason else "")],
        ["step ms (unprofiled, median)", fmt(trial.step_ms)],
        ["process peak memory", fmt(trial.process_peak_bytes, "mb")],
    ]
    if trial.ratio is not None:
        summary.rows.append(
            ["step time / defaults (paired)", f"{fmt(trial.ratio, 'x')} (spread {fmt(trial.ratio_spread, 'pct')})"]
        )
    profiler = describe_profiler(trial)
    if profiler is not None:
        summary.rows.append(["profiler", profiler])
    metrics = trial.shown_trace_metrics
    if metrics is None:
        summary.rows.append(
            ["trace metrics", f"unavailable{': ' + trial.analysis_error if trial.analysis_error else ''}"]
        )
        return [summary]
    note = ", scaled" if trial.trace_scale is not None else ""  # times only: ratios stay as measured
    aggregate = metrics["aggregate"]
    summary.rows += [
        [f"profiled {title} (median{note if kind == 'ms' else ''})", fmt(aggregate[key], kind)]
        for _, title, key, kind in STEP_TABLE
    ]
    columns = [c for c in STEP_TABLE if c[0] not in _SUMMARY_ONLY]
    steps = ReportTable(
        title=f"Per rank and profiled step (ms{note})", columns=["rank", "step#", *(t for t, _, _, _ in columns)]
    )
    for rank in metrics["per_rank"]:
        for step in rank["steps"]:
            steps.rows.append(
                [str(rank["rank"]), str(step["step"]), *(fmt(step[k], kind) for _, _, k, kind in columns)]
            )
    stage = ["stage"] if metrics.get("pipeline") else []  # each pipeline stage has its own units, root included
    units = ReportTable(
        title=f"Per FSDP unit, median over ranks and steps ({_LEGEND}{note})",
        columns=[*stage, "unit", *(t for t, _, _, _ in UNIT_TABLE)],
    )
    for unit in aggregate["per_unit"]:
        label = [str(unit.get("stage"))] * len(stage) + [unit["unit"]]
        units.rows.append([*label, *(fmt(unit[k], kind) for _, _, k, kind in UNIT_TABLE)])
    return [summary, steps, units]


def get_search_summary_table(summary: SearchRecord, comparison: Comparison | None = None) -> ReportTable:
    """Model (and proxy), why the search stopped, best (the emitted trial first) vs defaults, consolidation timing."""
    table = ReportTable(title="Search", columns=["", "value"])
    proxy = summary.proxy or {}
    table.rows.append(["model", str(summary.model)])
    if proxy.get("is_proxy"):
        table.rows.append(
            ["measured on", f"scale proxy {proxy.get('name')} (not {summary.model}): {proxy.get('reason')}"]
        )
    if summary.mixed_precision:
        mp = summary.mixed_precision
        searched = ", reduce dtype searched" if summary.searched_reduce_dtype else ""
        table.rows.append(["precision", f"{mp.get('param_dtype')} params, {mp.get('reduce_dtype')} reduce{searched}"])
    table.rows += [["environment", note] for note in summary.notes]
    table.rows += [["not measured", line] for line in summary.shortfall]
    table.rows += [["anchor", _describe_anchor(trial, a)] for trial, a in sorted(summary.anchors.items())]
    table.rows.append(["stopped", str(summary.stopped_because)])
    best, default = summary.best, summary.default
    if comparison is not None:
        table.rows.append(["best", comparison.note])
    if best:
        ratio = f"ratio {fmt(best.ratio, 'x')}, " if best.ratio is not None else ""
        table.rows.append(
            [
                "lowest ratio in the search" if comparison else "best",
                f"trial {best.number}: {ratio}{fmt(best.step_ms)} ms, overlap {fmt(best.overlap_ratio, 'pct')}, {fmt(best.bound_ratio, 'x')} the max(compute, comm) bound",
            ]
        )
    if default:
        table.rows.append(["defaults", f"trial {default.number}: {fmt(default.step_ms)} ms"])
    conf = summary.confirmation or {}
    if conf.get("speedup_median") is not None:
        table.rows.append(["speedup vs defaults", _describe_speedup(conf)])
    if summary.recipe:
        table.rows.append(["vs torchtitan's recipe", describe_recipe(summary.recipe)])
    cons = summary.consolidation or {}
    if cons.get("seconds"):
        parts = [f"{m} {sec * 1e3:.0f} ms" for m, sec in cons["seconds"].items()]
        table.rows.append(
            [
                "checkpoint consolidation",
                f"{', '.join(parts)} (emitted config uses {cons.get('chosen', cons.get('method'))})",
            ]
        )
    elif cons.get("skipped"):
        table.rows.append(["checkpoint consolidation", f"not timed: {cons['skipped']}"])
    elif cons.get("error"):
        table.rows.append(["checkpoint consolidation", f"failed: {cons['error']}"])
    return table


def describe_recipe(recipe: dict[str, Any]) -> str:
    """The final round against torchtitan's recipe in one line ([Note: beating the recipe])."""
    if not recipe.get("measured"):
        return f"not measured: {recipe.get('reason')}"
    if recipe.get("speedup_median") is None:
        return str(recipe.get("reason"))
    if recipe.get("verdict"):  # v11: the recipe emitted, the window did not call the candidate faster
        return str(recipe["verdict"])
    who = (
        "the defaults (emitted by the final round)" if recipe.get("candidate") == "defaults" else "the search's config"
    )
    if recipe.get("emit_rule") == "interval":
        text = f"{who} " + describe_figure(recipe, " the recipe's speed")
    else:  # before v11: the median of the blocks decided
        text = (
            f"{who} {recipe['speedup_median']:.3f}x the recipe's speed, median of {len(recipe['speedups'])} blocks "
            f"(interquartile {recipe['speedup_q25']:.3f}-{recipe['speedup_q75']:.3f}, min {recipe['speedup_min']:.3f}, max {recipe['speedup_max']:.3f})"
        )
    if recipe.get("emitted") == "recipe":
        return f"{text}: not faster, so the recipe is emitted"
    return text + (f"; {recipe['reason']}" if recipe.get("reason") else "")


def _describe_speedup(conf: dict[str, Any]) -> str:
    """The final round's verdict in one line (older records: the best-vs-defaults confirmation)."""
    if conf.get("speedup_from") == "verdict":  # v11: the figure of a window that did not choose the config
        window = conf.get("verdict_window") or {}
        text = (
            f"{describe_figure(window)} in a window that did not choose it "
            f"(trial {conf['chosen']}, the fastest of {len(conf['finalists'])} finalists at {conf['selection_speedup']:.3f}x)"
        )
        return f"{text}; {conf['verdict']}" if conf.get("verdict") else f"{text}; emitted trial {conf['winner']}"
    spread = f"interquartile {conf['speedup_q25']:.3f}-{conf['speedup_q75']:.3f}, " if "speedup_q25" in conf else ""
    # v7 and later: one speedup per ABBA block of two pairs ([Note: paired measurement]); before, per pair
    unit = "blocks" if conf.get("estimator") == "blocks" else "pairs"
    text = f"{conf['speedup_median']:.3f}x median of {len(conf['speedups'])} {unit} ({spread}min {conf['speedup_min']:.3f}, max {conf['speedup_max']:.3f})"
    if conf.get("verdict"):
        return f"{text}; {conf['verdict']}"
    if conf.get("finalists"):
        verdict = (
            f"trial {conf['winner']}" if conf.get("winner") is not None else "the defaults (no finalist beat them)"
        )
        return f"{text}; {len(conf['finalists'])} finalists re-measured, emitted {verdict}"
    return f"{text}; emitted: {conf.get('emitted', 'best')}"


def get_search_tables(
    trials: list[TrialSummary], best: TrialSummary | None, summary: SearchRecord | None = None
) -> list[ReportTable]:
    """Every trial: step, paired ratio, profiler overhead (``prof``, profiled / unprofiled wall) and
    trace figures (times scaled to the unprofiled step where ``prof`` is beyond 3%, marked ``*``)."""
    table = ReportTable(
        title=f"{len(trials)} trials" + (f", best: {best.name}" if best else ", no successful trial"),
        columns=["trial", "status", "step ms", "/defaults", "prof", "overlap", "exposed", "/bound", "peak", "note"],
    )
    for t in sorted(trials, key=lambda t: (t.objective is None, t.objective or 0.0)):
        note = "best" if t is best else t.reason or (t.analysis_error or "")
        exposed = fmt(t.get_aggregate("exposed_comm_ms")) + ("*" if t.trace_scale else "")
        table.rows.append(
            [
                t.name,
                t.status,
                fmt(t.step_ms),
                fmt(t.ratio, "x"),
                fmt(t.profiler_overhead, "over"),
                fmt(t.get_aggregate("overlap_ratio"), "pct"),
                exposed,
                fmt(t.get_aggregate("bound_ratio"), "x"),
                fmt(t.process_peak_bytes, "mb"),
                note[:80],
            ]
        )
    if any(t.trace_scale for t in trials):
        table.title += "; * trace times scaled to the unprofiled step"
    if not summary:
        return [table]
    final = get_final_round_table(summary.confirmation, summary.recipe)
    return [get_search_summary_table(summary), *([final] if final else []), table]


def get_final_round_table(conf: dict[str, Any] | None, recipe: dict[str, Any] | None = None) -> ReportTable | None:
    """The final round's finalists with their order figures: the median pair ratio of each order
    (reference first, candidate first) and each side's switch cost ([Note: switch cost]); a gap
    between the orders means the step after a switch still costs something the blocks cancel.
    With ``recipe`` (``search.json``'s round against torchtitan's recipe, [Note: beating the
    recipe]) a last row: the same figures for the config it measured against the recipe."""
    finalists = [f for f in (conf or {}).get("finalists", []) if f.get("ratio") is not None]
    against_recipe = recipe if recipe and recipe.get("measured") and recipe.get("ratio") is not None else None
    if not finalists and against_recipe is None:
        return None
    unit = "blocks" if (conf or {}).get("estimator", "blocks") == "blocks" else "pairs"
    title = (
        f"Final round: each finalist vs the defaults (ratio = median of {unit}; by order: the reference or the "
        "candidate first, and the gap between; switch cost: candidate/reference; * emitted)"
    )
    table = ReportTable(
        title=title + ("; last row: against torchtitan's recipe" if against_recipe else ""),
        columns=["trial", "/baseline", "IQR", "ref 1st", "cand 1st", "gap", "switch c/r", "windows"],
    )
    for f in sorted(finalists, key=lambda f: f["ratio"]):
        name = str(f["trial"]) + (" *" if f["trial"] == conf.get("winner") else "")
        table.rows.append([name, *_round_figures(f)])
    if against_recipe is not None:
        who = "defaults" if against_recipe.get("candidate") == "defaults" else "search's config"
        table.rows.append([f"{who} / recipe", *_round_figures(against_recipe)])
    return table


def _round_figures(f: dict[str, Any]) -> list[str]:
    """One final-round row's figures after its name: ratio, quartiles, order ratios and gap, switch costs, windows."""
    orders = f.get("order_ratios") or {}
    first, second = orders.get("reference_first"), orders.get("candidate_first")
    gap = first / second - 1.0 if first and second else None
    cost = f.get("switch_cost") or {}
    return [
        fmt(f["ratio"], "x"),
        f"{f['ratio_q25']:.3f}-{f['ratio_q75']:.3f}" if f.get("ratio_q25") is not None else "-",
        fmt(first, "x"),
        fmt(second, "x"),
        fmt(gap, "pct"),
        f"{fmt(cost.get('candidate'), 'pct')}/{fmt(cost.get('reference'), 'pct')}",
        str(f.get("windows", 1)),
    ]


def _describe_anchor(trial: str, anchor: dict[str, Any]) -> str:
    """``trial 3 against the defaults again at trial 7 (its steps moved +30%): 0.500x -> 0.600x``."""
    return (
        f"trial {trial} against the defaults again at trial {anchor.get('at_trial')} (its steps moved "
        f"{fmt(anchor.get('drift'), 'pct')}): {fmt(anchor.get('previous_ratio'), 'x')} -> {fmt(anchor.get('ratio'), 'x')}"
    )


def get_search_rows_table(rows: list[TrialRow], best: TrialRow | None) -> ReportTable:
    """Every trial of a search, the terminal summary of ``autotune search``, made for 100 columns: its
    ratio to the defaults with the spread of its pairs, and its knobs as the change from the defaults
    trial's with its note (why it failed or was pruned) on a line below; every figure and knob is in
    the report and ``results.csv``."""
    table = ReportTable(
        title="trials (* the best; knobs: what differs from FSDP2's defaults; every figure: the report)",
        columns=["trial", "status", "/defaults", "spread", "knobs / note"],
    )
    defaults = get_default_params(rows)
    for row in rows:
        knobs = describe_knobs(row.params, defaults)
        table.rows.append(
            [
                f"{row.number}{' *' if best and row.number == best.number else ''}",
                describe_status(row),
                fmt(row.ratio, "x"),
                fmt(row.ratio_spread, "pct"),
                f"{knobs}\nnote: {cut(row.reason, NOTE_CHARS)}" if row.reason else knobs,
            ]
        )
    return table


def get_search_outcome_lines(summary: SearchSummary) -> list[str]:
    """What ``autotune search`` says after its table: why it stopped, the speedup, where the files are."""
    lines = [
        *summary.record.notes,
        *(f"warning: {line}" for line in summary.record.shortfall),
        f"stopped: {summary.record.stopped_because}",
    ]
    conf = summary.confirmation
    # where torchtitan's recipe won its round, the final round's figures are the search's config's, not the emitted one's
    recipe_won = (summary.record.recipe or {}).get("emitted") == "recipe"
    if conf and conf.get("emitted") == "defaults":
        subject = "the fastest finalist (not emitted)"
    else:
        subject = "the search's config (not emitted: torchtitan's recipe is)" if recipe_won else "emitted config"
    if conf and conf["speedup_median"] is not None:
        lines.append(f"{subject} vs defaults: {_describe_speedup(conf)}")
    if conf and conf.get("defaults_over_budget"):
        lines.append(
            "FSDP2's defaults are over the memory budget: the emitted config is the fastest finalist that fits"
        )
    if conf and conf.get("memory"):
        lines.append(f"{conf['memory']}: emitted the search's pick")
    if summary.record.recipe:
        lines.append(f"vs torchtitan's recipe: {describe_recipe(summary.record.recipe)}")
    if summary.plan.is_proxy:
        lines.append(f"measured on proxy {summary.plan.proxy_name}, not {summary.plan.requested.name}")
    if summary.best_config_path:
        report = summary.report_paths[0] if summary.report_paths else f"failed ({summary.record.report_error})"
        lines += [
            f"best config: {summary.best_config_path} (and .json)",
            f"results: {summary.out_dir / 'results.csv'}",
            f"report: {report}",
        ]
    else:
        lines.append("no trial succeeded; see results.csv for the reasons")
    return lines


def get_rank_table(metrics: TrialMetrics) -> ReportTable:
    """Per rank of one trial: median unprofiled and profiled step, profiler overhead (wall, CPU, page faults), process peak."""
    table = ReportTable(
        title=f"step {fmt(metrics.step_ms)} ms (median of the slowest rank per step)",
        columns=["rank", "median step ms", "profiled step ms", "prof wall", "prof CPU", "faults/step", "peak"],
    )
    for r in metrics.ranks:
        cost = r.get_profiler_figures() or {}
        faults = (
            f"{cost['page_faults']:.0f} -> {cost['profiled_page_faults']:.0f}"
            if cost.get("page_faults") is not None
            else "-"
        )
        table.rows.append(
            [
                str(r.rank),
                fmt(r.median_step_ms),
                fmt(r.median_profiled_step_ms),
                fmt(cost.get("wall"), "over"),
                fmt(cost.get("cpu"), "over"),
                faults,
                fmt(r.process_peak_bytes, "mb"),
            ]
        )
    return table


def get_rounds_table(rounds: dict[str, Any] | None) -> ReportTable | None:
    """``search.json``'s ``rounds`` as a table: each round's runs, steps and builds (of the most it
    may run) and seconds; then the total."""
    if not rounds or not rounds.get("by_round"):
        return None

    def of(n: int, most: int | None) -> str:
        return f"{n} of {most}" if most is not None else str(n)

    rows = [
        [
            name,
            str(r["runs"]),
            of(r["steps"], r.get("max_steps")),
            of(r["builds"], r.get("max_builds")),
            f"{r['seconds']:.1f}",
        ]
        for name, r in rounds["by_round"].items()
    ]
    t = rounds["total"]
    rows.append(["total", str(t["runs"]), str(t["steps"]), str(t["builds"]), f"{t['elapsed_s']:.1f}"])
    eta = rounds.get("eta_after_first_trial_s")
    title = "rounds (steps and builds run, of the most planned)"
    if eta is not None and rounds.get("first_trial_at_s") is not None:
        title += f"; ETA after the first trial {eta:.0f} s, {t['elapsed_s'] - rounds['first_trial_at_s']:.0f} s taken"
    return ReportTable(title=title, columns=["round", "runs", "steps", "builds", "seconds"], rows=rows)
