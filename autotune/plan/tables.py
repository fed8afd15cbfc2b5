"""``autotune plan``'s results as report tables and lines (``cli.py`` renders them with rich)."""

from __future__ import annotations

from autotune.plan.result import PlanResult
from autotune.report import ReportTable, fmt
from autotune.search import RankedPoint
from autotune.sim import PipelinePrediction
from autotune.trials import describe_precision

_GIB = 2**30


def _row(rank: str, row: RankedPoint, default_step_s: float | None) -> list[str]:
    p = row.prediction
    speedup = default_step_s / p.step_s if default_step_s else None
    return [
        rank,
        fmt(1e3 * p.step_s),
        fmt(speedup, "x"),
        f"{p.tokens_per_s_per_device:,.0f}",
        fmt(p.mfu, "pct"),
        fmt(1e3 * p.exposed_comm_s),
        f"{p.peak_memory_bytes / _GIB:.1f}",
        f"{p.memory_headroom_bytes / _GIB:+.1f}",
        "edge" if p.at_edge else "",
    ]


def get_plan_table(result: PlanResult) -> ReportTable:
    """The top distinct predictions among configs that fit, then FSDP2's defaults for reference."""
    s = result.settings
    default_step = result.default.prediction.step_s if result.default.prediction.fits else None
    title = (
        f"{s.model} on {s.num_nodes} x {s.cluster} ({result.world_size} ranks), {s.num_microbatches} microbatches, "
        f"activation checkpointing {result.ac_label}: of {len(result.ranked)} configs that fit, "
        f"the top distinct predictions (simulated; tokens/s per device; peak and free memory in GiB; 'edge': at the edge "
        f"of memory, peak within the memory margin, not emitted while a safe config fits; speedup over the defaults 'def'; 'same': configs predicted alike)"
    )
    columns = ["#", "step ms", "speedup", "tok/s", "MFU", "exp ms", "peak", "free", "mem", "same"]
    rows = [
        [*_row(str(i + 1), row, default_step), str(count)] for i, (row, count) in enumerate(result.get_distinct_top())
    ]
    rows.append([*_row("def", result.default, default_step), ""])
    return ReportTable(title=title, columns=columns, rows=rows)


def get_pipeline_table(result: PlanResult) -> ReportTable | None:
    """The best config that fits of each PP degree ranked (PP 1: FSDP2 alone); None when only PP 1 was."""
    if result.pp_degrees == [1]:
        return None
    rows = []
    for row in result.best_per_pp:
        p = row.prediction
        pipeline = p.pipeline if isinstance(p, PipelinePrediction) else None
        rows.append(
            [
                str(pipeline.pp if pipeline else 1),
                pipeline.schedule if pipeline else "-",
                str(pipeline.virtual_stages if pipeline else 1),
                str(pipeline.num_microbatches if pipeline else result.settings.num_microbatches),
                fmt(1e3 * p.step_s),
                fmt(p.mfu, "pct"),
                f"{p.peak_memory_bytes / _GIB:.1f}",
                fmt(p.bubble_fraction, "pct") if isinstance(p, PipelinePrediction) else "-",
                fmt(1e3 * p.exposed_comm_s),
                "emitted" if result.is_emitted(row) else "",
            ]
        )
    missing = [str(d) for d in result.pp_degrees if d not in {r.params.get("pp", 1) for r in result.best_per_pp}]
    return ReportTable(
        title="the best config that fits of each PP degree (simulated; the same tokens per step; m: microbatches per step, "
        "v: stages per pp rank, bubble: the share of the step a pp rank idles, mean over ranks; exp ms: exposed FSDP2 "
        "communication of the worst rank)" + (f"; nothing fits with PP {', '.join(missing)}" if missing else ""),
        columns=["pp", "schedule", "v", "m", "step ms", "MFU", "peak", "bubble", "exp ms", ""],
        rows=rows,
    )


def get_config_lines(result: PlanResult) -> list[str]:
    """The configs of :func:`get_plan_table`'s rows, by rank (kept out of the table to fit 80 columns)."""
    lines = [
        f"{i + 1:>3}  {row.description}{'  [emitted]' if result.is_emitted(row) else ''}{'  [at the edge]' if row.prediction.at_edge else ''}"
        for i, (row, _) in enumerate(result.get_distinct_top())
    ]
    return [*lines, f"def  {result.default.description}"]


def get_unit_table(result: PlanResult, *, num_units: int = 6) -> ReportTable | None:
    """The emitted config's units with the most exposed communication."""
    detail = result.best_detail
    if detail is None:
        return None
    units = sorted(detail.units, key=lambda u: -u.exposed_s)[:num_units]
    rows = [[u.name, fmt(1e3 * u.comm_s), fmt(1e3 * u.exposed_s), fmt(u.overlap, "pct")] for u in units]
    return ReportTable(
        title="best config: units with the most exposed communication (per step)",
        columns=["unit", "comm ms", "exposed ms", "overlap"],
        rows=rows,
    )


def get_plan_lines(result: PlanResult) -> list[str]:
    """What was evaluated, how fast, what was dropped and why, and what was written."""
    extrapolated = result.num_evaluated - result.num_exact
    how = (
        f"{extrapolated} extrapolated from shallower simulations, the fastest {result.num_exact} at full depth; "
        if extrapolated
        else ""
    )
    degrees = ", ".join(map(str, result.pp_degrees))
    lines = [
        f"PP degrees ranked: {degrees} ([Note: the plan's pipeline axis] in autotune/plan/pipeline.py)",
        f"evaluated {result.num_evaluated} configs in {result.evaluate_s:.1f} s ({result.configs_per_s:,.0f} configs/s; {how}{result.num_simulated} distinct "
        f"simulations, the other configs' knobs equal one of them; {result.num_pruned} not simulated: defer_concat=false, dominated by its deferred twin)",
        f"activation checkpointing: {result.ac_label} ({result.ac_reason})",
        f"precision: {describe_precision(result.mixed_precision)}",
    ]
    if result.dropped:
        least = result.dropped[0]
        lines.append(
            f"dropped {len(result.dropped)} configs over memory; the closest to fitting: {least.description}: {least.prediction.describe_memory()}"
        )
    if result.memory_margin is not None:
        lines.append(
            f"memory: {result.memory_margin.describe()}; {result.num_at_edge} of the configs that fit are at the edge"
        )
    if not result.ranked:
        lines.append("no config fits in memory")
    if result.best_detail is not None and result.best is not None:
        best = result.best_detail
        lines.append(
            f"best: {result.best.description}: {1e3 * best.step_s:.1f} ms/step, {best.tokens_per_s_per_device:,.0f} tokens/s/device, "
            f"MFU {100 * best.mfu:.1f}%, exposed communication {1e3 * best.exposed_comm_s:.1f} ms, {best.describe_memory()}"
        )
    edge = result.get_edge_note()
    if edge:
        lines.append(
            f"{'WARNING: best is ' if result.best is not None and result.best.prediction.at_edge else ''}{edge}"
        )
    lines.extend(f"wrote {path}" for path in result.out_files)
    return lines
