"""A GPU trial's step attribution as plain tables ([Note: GPU step attribution]): device time per
step by kernel class, by part of the step, and per call of each part (a block's forward per block
per microbatch). ``cli.py`` renders them with rich after :func:`~autotune.report.tables.get_tables`,
``html.py`` in the GPU sections; a CPU trial has none."""

from __future__ import annotations

from autotune.report.attribution import CLASS_SHORT, CLASS_TITLES, PARTS, StepAttribution
from autotune.report.formatting import fmt
from autotune.report.model import Report, ReportTable

OVERLAP_SHOWN = 0.005
"""Kernels running at once are shown as their own row when they exceed this share of the span."""


def get_gpu_tables(report: Report) -> list[ReportTable]:
    """A trial report's attribution tables; none for a search report, a CPU trial or unusable traces."""
    attribution = report.attribution if report.kind == "trial" else None
    return get_attribution_tables(attribution) if attribution is not None else []


def describe_attribution(attribution: StepAttribution) -> str:
    """``median of 2 profiled steps, 1 rank, 4 units (layers.0 ... layers.3), 2 microbatches; as traced``."""
    blocks = attribution.blocks
    units = (
        f"{len(blocks)} units ({blocks[0]} ... {blocks[-1]})"
        if len(blocks) > 1
        else (f"1 unit ({blocks[0]})" if blocks else "no FSDP2 labels: every kernel under other")
    )
    mb = f", {attribution.num_microbatches} microbatches" if attribution.num_microbatches else ""
    ranks = f"{attribution.num_ranks} rank" + ("s" if attribution.num_ranks != 1 else "")
    return f"median of {attribution.num_steps} profiled steps over {ranks}, {units}{mb}; as traced"


def _share(attribution: StepAttribution, ms: float) -> str:
    return fmt(ms / attribution.span_ms, "pct") if attribution.span_ms > 0 else "-"


def _closing_rows(attribution: StepAttribution, width: int) -> list[list[str]]:
    """Overlapping kernels (where they matter), idle and the span: what the rows above add up to."""
    pad = [""] * (width - 3)
    rows = []
    if abs(attribution.overlap_ms) > OVERLAP_SHOWN * attribution.span_ms:
        rows.append(
            [
                "kernels running at once (counted above once each)",
                fmt(-attribution.overlap_ms),
                _share(attribution, -attribution.overlap_ms),
                *pad,
            ]
        )
    rows.append(["idle (no kernel running)", fmt(attribution.idle_ms), _share(attribution, attribution.idle_ms), *pad])
    rows.append(["device span of the step", fmt(attribution.span_ms), "100.0%", *pad])
    return rows


def _top_classes(classes: dict[str, float], n: int = 3) -> str:
    """The ``n`` largest classes with their ms (short names), leaving out those under 1% of the largest."""
    floor = max(0.01 * max(classes.values(), default=0.0), 0.005)
    ranked = sorted(((ms, cls) for cls, ms in classes.items() if ms >= floor), reverse=True)
    return ", ".join(f"{CLASS_SHORT.get(cls, cls)} {fmt(ms)}" for ms, cls in ranked[:n])


def get_class_table(attribution: StepAttribution, label: str = "") -> ReportTable:
    """Device ms per step and % of the step's device span per kernel class, then idle and the span."""
    table = ReportTable(
        title=f"{label}GPU step by kernel class (ms per step; {describe_attribution(attribution)})",
        columns=["kernel class", "ms", "% of span"],
    )
    for cls, ms in attribution.by_class().items():
        table.rows.append([CLASS_TITLES.get(cls, cls), fmt(ms), _share(attribution, ms)])
    table.rows += _closing_rows(attribution, 3)
    return table


def get_part_table(attribution: StepAttribution, label: str = "") -> ReportTable:
    """Device ms per step per part of the step (model forward, backward, FSDP2 unshard/reduce,
    optimizer, other), with its largest classes, then idle and the span."""
    table = ReportTable(
        title=f"{label}GPU step by part (ms per step; kernels by the host span that launched them)",
        columns=["part", "ms", "% of span", "largest classes (ms)"],
    )
    by_part_class = attribution.by_part_class()
    for part, ms in attribution.by_part().items():
        classes = {cls: v for (p, cls), v in by_part_class.items() if p == part}
        table.rows.append([PARTS[part], fmt(ms), _share(attribution, ms), _top_classes(classes)])
    table.rows += _closing_rows(attribution, 4)
    return table


def get_unit_cost_table(attribution: StepAttribution, label: str = "") -> ReportTable:
    """Each part per call: a block's forward and backward per block per microbatch, the head and tail
    per microbatch, each FSDP2 hook per call, the optimizer per step."""
    table = ReportTable(
        title=f"{label}GPU time per call (ms; the tail's forward holds the loss's backward too)",
        columns=["what", "part", "per", "calls", "ms/call", "ms/step", "largest classes (ms/step)"],
    )
    for row in attribution.get_unit_costs():
        calls = f"{row.calls:g}" if row.calls is not None else "-"
        table.rows.append(
            [row.title, PARTS[row.part], row.per, calls, fmt(row.ms_per_call), fmt(row.ms), _top_classes(row.classes)]
        )
    return table


def get_attribution_tables(attribution: StepAttribution, label: str = "") -> list[ReportTable]:
    """The three attribution tables, or one line saying why there are none (``label`` heads each title)."""
    if attribution.error:
        return [
            ReportTable(
                title=f"{label}GPU step attribution", columns=["", ""], rows=[["unavailable", attribution.error]]
            )
        ]
    return [
        get_class_table(attribution, label),
        get_part_table(attribution, label),
        get_unit_cost_table(attribution, label),
    ]
