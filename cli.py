"""The ``autotune`` command line: parse, call into the library, render, map errors to exit codes.

Errors derived from :class:`fsdp_runtime.AutotuneError` print as one line on stderr and
exit non-zero; set ``AUTOTUNE_DEBUG=1`` for the traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from fsdp_runtime.errors import AutotuneError

app = typer.Typer(
    name="autotune",
    help="Profiling-driven autotuner for PyTorch FSDP2: run trials, search the knobs, emit the best runtime config.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err_console = Console(stderr=True)
console = Console()


@app.command()
def validate(
    config: Annotated[Path, typer.Argument(help="Runtime config (.toml or .json) to check.")],
    world_size: Annotated[Optional[int], typer.Option("--world-size", "-w", help="Also check the mesh against this world size.")] = None,
) -> None:
    """Check a runtime config; print a one-line error naming the field if it is invalid."""
    from fsdp_runtime import load_config, validate_for_world

    cfg = load_config(config)
    if world_size is not None:
        validate_for_world(cfg, world_size, source=str(config))
    console.print(f"{config}: ok (schema_version {cfg.schema_version}, {len(cfg.units) or 'default'} units)")


@app.command()
def report(
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="A trial dir (metrics.json + traces) or a search dir (trials/*/metrics.json).")],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Where to write report.html and the PNGs [default: DIR/report].")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary JSON only (no tables, no files).")] = False,
) -> None:
    """Summarize a trial or a search: terminal tables, a self-contained HTML report and PNG plots."""
    import json

    from rich import box
    from rich.table import Table

    from autotune.report import load_report, write_report

    result = load_report(directory)
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
        return
    for table in result.get_tables():
        rich_table = Table(*table.columns, title=table.title, title_justify="left", box=box.SIMPLE_HEAD)
        for row in table.rows:
            rich_table.add_row(*row)
        console.print(rich_table)
    for path in write_report(result, out if out is not None else directory / "report"):
        console.print(f"wrote {path}")


def main() -> None:
    try:
        app()
    except AutotuneError as e:
        if os.environ.get("AUTOTUNE_DEBUG"):
            raise
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
