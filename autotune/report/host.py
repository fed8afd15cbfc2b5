"""FSDP2's own host time in the report ([Note: host-bound steps] in ``autotune.analysis._host_analysis``):
per unit, the time FSDP's hooks keep the host busy against the step, and whether the step is
host-bound; in a search report, the emitted config's figure against the defaults', and what the
search changed that bears on it (the number of units). ``cli.py`` prints the tables after the
others, ``html.py`` puts them on the page."""

from __future__ import annotations

from autotune.report.compare import get_compared_traces
from autotune.report.formatting import fmt
from autotune.report.host_time import HostTime, get_host_time
from autotune.report.model import Report, ReportTable

MAX_UNIT_ROWS = 8
"""Units shown one per row (those with the most host time); the rest are summed in one row."""


def get_unit_table(host: HostTime, label: str = "") -> ReportTable:
    """The hooks' host time per unit, the most first, then the step's total and the verdict."""
    table = ReportTable(
        title=f"{label}FSDP hooks on the host (ms per step as traced, median of {host.num_steps} (rank, step) rows; {host.describe()})",
        columns=["unit", "forward hooks", "backward hooks", "share of step"],
    )
    shown, rest = host.units.iloc[:MAX_UNIT_ROWS], host.units.iloc[MAX_UNIT_ROWS:]
    rows = [(str(u.unit), u.forward_host_ms, u.backward_host_ms) for u in shown.itertuples()]
    if len(rest):
        rows.append((f"{len(rest)} more units", rest["forward_host_ms"].sum(), rest["backward_host_ms"].sum()))
    for name, fwd, bwd in rows:
        table.rows.append([name, fmt(fwd), fmt(bwd), fmt((fwd + bwd) / host.step_ms, "pct") if host.step_ms else "-"])
    table.rows.append(["FSDP's own host work (the step's)", fmt(host.host_ms), "", fmt(host.share, "pct")])
    table.rows.append(["step", fmt(host.step_ms), "", "100.0%"])
    return table


def get_found_line(report: Report, best: HostTime, default: HostTime) -> str:
    """What the search found for a host-bound defaults trial: the emitted config's share and units."""
    comparison = report.comparison
    ours, theirs = best.num_units, default.num_units
    if ours != theirs:
        change = f"{ours} units instead of {theirs}: " + ("larger units" if ours < theirs else "more units")
    else:
        change = "the same units: the search changed no unit's size"
    return (
        f"the defaults are host-bound ({fmt(default.share, 'pct')} of their step in FSDP's own host work); "
        f"{comparison.best_label} spends {fmt(best.share, 'pct')} ({change})"
    )


def get_host_tables(report: Report) -> list[ReportTable]:
    """A trial report's per-unit table; a search report's emitted vs defaults table, with what the
    search found where the defaults are host-bound; none without usable traces."""
    if report.kind == "trial":
        host = get_host_time(report.analysis) if report.analysis is not None else None
        return [get_unit_table(host)] if host is not None else []
    compared = {label: traces.host for label, (_, traces) in get_compared_traces(report.comparison).items()}
    compared = {label: host for label, host in compared.items() if host is not None}
    if not compared:
        return []
    table = ReportTable(
        title="FSDP hooks on the host, emitted vs defaults (ms per step as traced, medians)",
        columns=["trial", "step", "FSDP's own host work", "share", "verdict"],
    )
    for label, host in compared.items():
        verdict = "host-bound" if host.host_bound else "not host-bound"
        table.rows.append([label, fmt(host.step_ms), fmt(host.host_ms), fmt(host.share, "pct"), verdict])
    best = compared.get(report.comparison.best_label)
    default = compared.get(report.comparison.default_label)
    if best is not None and default is not None and default.host_bound:
        table.rows.append([get_found_line(report, best, default), "", "", "", ""])
    return [table]
