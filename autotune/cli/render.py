"""What the ``autotune`` command prints on a terminal: rich consoles, the report package's plain
tables drawn with rich, live progress of a search and a plan, and each command's summary.

``cli.py`` parses the command line, calls the library and hands the results here; this module
neither parses nor decides anything (the tables' contents come from :mod:`autotune.report` and
:mod:`autotune.plan`).
"""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console
from rich.markup import escape

__all__ = [
    "PIPED_WIDTH",
    "CompareProgress",
    "PlanProgress",
    "SearchProgress",
    "console",
    "err_console",
    "make_console",
    "print_compare",
    "print_device_profile",
    "print_error",
    "print_plan",
    "print_search_summary",
    "print_tables",
    "print_trial_summary",
]

PIPED_WIDTH = 240
"""Columns of the tables when the output is not a terminal and ``COLUMNS`` is unset: rich then
falls back to 80, which wraps the knobs column of a search's trials letter by letter in a log."""


def make_console(*, stderr: bool = False) -> Console:
    """A rich console: a terminal's own width, ``COLUMNS`` where set, else ``PIPED_WIDTH``."""
    console = Console(stderr=stderr)
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    return Console(stderr=stderr, width=PIPED_WIDTH)


err_console = make_console(stderr=True)
console = make_console()


def print_tables(tables: Any) -> None:
    """Render the report package's plain tables with rich (the CLI has no table code of its own)."""
    from rich import box
    from rich.table import Column, Table

    for table in tables:
        columns = [Column(c, overflow="fold") for c in table.columns]
        # one space between columns and none at the edges: the final round fits 80 columns unfolded
        rich_table = Table(
            *columns,
            title=table.title,
            title_justify="left",
            box=box.SIMPLE_HEAD,
            pad_edge=False,
            collapse_padding=True,
        )
        for row in table.rows:
            rich_table.add_row(*row)
        console.print(rich_table)


def print_error(flag: str | None, message: str) -> None:
    """One line on stderr: ``error: --flag: message``."""
    # escaped: messages name extras and tables in brackets ('fsdp-autotune[torchtitan]')
    err_console.print(
        f"[bold red]error:[/] {escape(flag + ': ' if flag else '')}{escape(message)}",
        highlight=False,
        soft_wrap=True,
    )


# --------------------------------------------------------------------------- autotune search


def _fmt_eta(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class SearchProgress:
    """Live progress for ``autotune search``: trial n/N, current best, and the ETA of every round
    left (the search's :class:`~autotune.search.cost.RoundLedger` estimates it; a search's reporter)."""

    def __init__(self) -> None:
        self.baseline = "the defaults"
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
        from rich.text import Text

        reporter = self

        class EtaColumn(ProgressColumn):
            def render(self, task) -> Text:
                ledger = reporter.ledger
                return Text(_fmt_eta(ledger.get_eta_s() if ledger is not None else None), style="progress.remaining")

        self.ledger = None
        self.eta_said = False
        self.progress = Progress(
            TextColumn("[bold]trials"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            EtaColumn(),
            TextColumn("{task.fields[best]}"),
            console=err_console,
            transient=False,
        )
        self.task = None

    def on_plan(self, search_plan) -> None:
        """What every trial's ratio is over: ``the defaults``, or the baseline with its checkpointing."""
        self.baseline = search_plan.baseline.short_name

    def on_ledger(self, ledger) -> None:
        """The search's round ledger, whose ETA the bar shows."""
        self.ledger = ledger

    def on_start(self, plan, settings, num_existing: int) -> None:
        if plan.is_proxy:
            err_console.print(
                f"[yellow]{plan.requested.name} does not fit this machine ({plan.reason}).[/] Trials run a scale proxy with the same "
                f"{len(plan.run.block_names)} blocks: [bold]{plan.proxy_name}[/]. Times below are the proxy's, not {plan.requested.name}'s.",
                highlight=False,
            )
            from autotune.search import get_plan_hint

            err_console.print(get_plan_hint(plan), highlight=False, soft_wrap=True)
        err_console.print(
            f"study in {settings.get_storage()}"
            + (f" ({num_existing} trials already there)" if num_existing > 1 else ""),
            highlight=False,
        )
        self.progress.start()
        self.task = self.progress.add_task(
            "search", total=settings.num_trials, completed=max(0, num_existing - 1), best=""
        )

    def on_trial_start(self, number: int, total: int) -> None:
        self.progress.update(self.task, completed=number)

    def on_trial_end(self, row, best) -> None:
        from autotune.report import fmt

        status = row.status if not row.succeeded else f"{fmt(row.ratio, 'x')} {self.baseline} ({fmt(row.step_ms)} ms)"
        if row.predicted_step_ms is not None:
            status += f", predicted {row.predicted_step_ms:.1f} ms"
        best_text = f"best {fmt(best.ratio, 'x')} (trial {best.number})" if best else "no best yet"
        # one line per trial, cut at the terminal's width (the note is whole in results.csv and the report)
        self.progress.console.print(
            f"trial {row.number:>3}: {status}" + (f" - {row.reason}" if row.reason else ""),
            highlight=False,
            no_wrap=True,
            overflow="ellipsis",
        )
        self.progress.update(self.task, advance=1, best=best_text)
        eta = self.ledger.eta_after_first_trial_s if self.ledger is not None else None
        if eta is not None and not self.eta_said:  # once: the first estimate over every round left
            self.eta_said = True
            self.progress.console.print(f"eta over every round left: {_fmt_eta(eta)}", highlight=False)

    def on_phase(self, message: str) -> None:
        self.progress.console.print(message, highlight=False)

    def on_trials_done(self, stopped_because: str) -> None:
        self.progress.stop()
        eta = self.ledger.get_eta_s() if self.ledger is not None else None
        left = f" (the rounds after them: about {_fmt_eta(eta)} left)" if eta is not None else ""
        err_console.print(f"trials done: {stopped_because}{left}", highlight=False)


def print_search_summary(summary) -> None:
    """A finished search: its trials, the predictions against the measurements, the final round, the
    builds and steps by round, the outcome."""
    from autotune.report import (
        get_final_round_table,
        get_prediction_table,
        get_rounds_table,
        get_search_outcome_lines,
        get_search_rows_table,
    )

    print_tables([get_search_rows_table(summary.rows, summary.best)])
    print_tables([t for t in (get_prediction_table(summary.rows),) if t is not None])
    print_tables([t for t in (get_final_round_table(summary.confirmation),) if t is not None])
    print_tables([t for t in (get_rounds_table(summary.record.rounds),) if t is not None])
    for line in get_search_outcome_lines(summary):
        console.print(line, highlight=False)


# --------------------------------------------------------------------------- autotune trial


def print_trial_summary(result) -> None:
    """One trial: its status, its ranks' table and where its traces are."""
    from autotune.report import get_rank_table

    m = result.metrics
    color = "green" if result.ok else "red"
    console.print(
        f"trial [{color}]{result.status}[/]"
        + (f": {result.reason}" if result.reason else "")
        + f" ({result.wall_s:.1f} s) -> {result.out_dir}",
        highlight=False,
    )
    if not m.ranks:
        return
    print_tables([get_rank_table(m)])
    if m.analysis_error:
        console.print(f"[yellow]trace analysis failed:[/] {m.analysis_error}", highlight=False)
    elif m.traces:
        console.print(f"traces: {', '.join(m.traces)}; details: autotune report {result.out_dir}", highlight=False)


# --------------------------------------------------------------------------- autotune plan


class PlanProgress:
    """Progress for ``autotune plan``: phase lines, and a bar over the configs being simulated."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("[bold]configs"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err_console,
            transient=False,
        )
        self.task = None

    def on_phase(self, message: str) -> None:
        err_console.print(message, highlight=False)

    def on_start(self, total: int) -> None:
        self.progress.start()
        self.task = self.progress.add_task("simulate", total=total)

    def on_advance(self, count: int) -> None:
        self.progress.update(self.task, advance=count)

    def stop(self) -> None:
        if self.task is not None or self.progress.tasks:
            self.progress.stop()


def print_plan(result) -> None:
    """A plan's ranking, the best config, its pipeline stages and units, and the closing lines."""
    from autotune.plan import get_config_lines, get_pipeline_table, get_plan_lines, get_plan_table, get_unit_table

    print_tables([get_plan_table(result)])
    for line in get_config_lines(result):
        console.print(line, highlight=False, soft_wrap=True)
    print_tables([t for t in (get_pipeline_table(result), get_unit_table(result)) if t is not None])
    for line in get_plan_lines(result):
        console.print(line, highlight=False, soft_wrap=True)


# --------------------------------------------------------------------------- autotune compare


class CompareProgress:
    """Progress for ``autotune compare``: a config's notes, and a line per run as it ends."""

    def on_note(self, message: str) -> None:
        err_console.print(f"note: {message}", highlight=False, markup=False, soft_wrap=True)

    def on_run(self, round_number: int, max_rounds: int, label: str, result) -> None:
        from autotune.report import fmt

        peak = result.process_peak_bytes
        err_console.print(
            f"round {round_number}/{max_rounds}: {label} {fmt(result.step_ms)} ms"
            + (f", peak {peak / 2**20:,.0f} MB" if peak is not None else "")
            + f" ({result.wall_s:.1f} s)",
            highlight=False,
            markup=False,
            no_wrap=True,
            overflow="ellipsis",
        )


def print_compare(record, path) -> None:
    """A comparison: per config its step, peak and speedup over the first; a line per verdict; where it went."""
    from autotune.compare import get_compare_lines, get_compare_table

    print_tables([get_compare_table(record)])
    for line in get_compare_lines(record, path):  # wrapped at the console's width
        console.print(line, highlight=False, markup=False)


# --------------------------------------------------------------------------- autotune calibrate


def print_device_profile(profile, lines: list[str], out) -> None:
    """A measured GPU's rates in one line, the calibration's notes, and where the profile went."""
    console.print(
        f"{profile.device}: GEMM {profile.gemm_tflops:.0f} TFLOP/s, attention {profile.attention_forward_tflops:.0f}/"
        f"{profile.attention_backward_tflops:.0f} TFLOP/s (head dim {profile.attention_head_dim}), elementwise "
        f"{', '.join(f'{k} {v:,.0f}' for k, v in profile.elementwise_gbps.items())} GB/s, FSDP2 copies {profile.copy_gbps:,.0f} GB/s, "
        f"optimizer {profile.optimizer_ps_per_element:.1f} ps/element, host floor "
        f"{', '.join(f'{k} {v:.0f}' for k, v in profile.host_floor_us.items())} us",
        highlight=False,
    )
    for line in lines:
        console.print(line, highlight=False)
    console.print(f"wrote {out}", highlight=False)
