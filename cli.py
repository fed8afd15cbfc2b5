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


@app.command()
def trial(
    model: Annotated[str, typer.Option("--model", "-m", help="Model profile name (tiny, small, llama1b, ...) or a TOML path.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Trial dir: traces, metrics.json, config.toml, env.json.")],
    config: Annotated[Optional[Path], typer.Option("--config", "-c", help="Runtime config (.toml/.json); default: FSDP2 defaults for the model.")] = None,
    nproc: Annotated[int, typer.Option("--nproc", "-n", help="Ranks (world size).")] = 2,
    steps: Annotated[int, typer.Option("--steps", help="Measured (unprofiled) steps.")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", help="Warm-up steps before measuring.")] = 2,
    profiled_steps: Annotated[int, typer.Option("--profiled-steps", help="Steps in the traces (0: no profiling).")] = 2,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds before every rank is killed.")] = 120.0,
    cluster: Annotated[Optional[str], typer.Option("--cluster", help="Cluster profile whose links are emulated (e.g. cpu-emulated-ib).")] = None,
    backend: Annotated[Optional[str], typer.Option("--backend", help="gloo or nccl; default: nccl when CUDA is available.")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    write_spec: Annotated[Optional[Path], typer.Option("--write-spec", help="Only write the trial spec JSON for `torchrun -m autotune.trial_rank --spec`.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print metrics.json on stdout.")] = False,
) -> None:
    """Run one trial: N ranks, warm-up, timed steps, a profiled window; exit 1 if the trial failed."""
    import json

    from autotune.trial import TrialSpec, load_trial_config, run_trial, write_json_atomic

    spec = TrialSpec(
        model=model, config=load_trial_config(config, model), world_size=nproc, out_dir=out, num_warmup=warmup, num_measured=steps,
        num_profiled=profiled_steps, profile=profiled_steps > 0, timeout_s=timeout, cluster=cluster, seed=seed,
        **({"backend": backend} if backend else {}),
    )
    if write_spec is not None:
        write_json_atomic(write_spec, spec.to_dict())
        console.print(f"wrote {write_spec}; run on every node: torchrun --nnodes N --nproc-per-node M ... -m autotune.trial_rank --spec {write_spec}", highlight=False)
        return
    result = run_trial(spec)
    if as_json:
        print(json.dumps(result.metrics, indent=2))
    else:
        _print_trial_summary(result)
    if result.status not in ("ok", "pruned"):
        raise typer.Exit(1)


def _print_trial_summary(result) -> None:
    from rich.table import Table

    m = result.metrics
    color = "green" if result.ok else "red"
    console.print(f"trial [{color}]{result.status}[/]" + (f": {result.reason}" if result.reason else "") + f" ({result.wall_s:.1f} s) -> {result.out_dir}", highlight=False)
    if not m["ranks"]:
        return
    table = Table("rank", "median step ms", "profiled step ms", "peak MiB", title=f"step {result.step_ms:.1f} ms (median of the slowest rank per step)", title_justify="left")
    for r in m["ranks"]:
        profiled = f"{sorted(r['profiled_step_ms'])[len(r['profiled_step_ms']) // 2]:.1f}" if r["profiled_step_ms"] else "-"
        table.add_row(str(r["rank"]), f"{sorted(r['step_ms'])[len(r['step_ms']) // 2]:.1f}", profiled, f"{r['peak_memory_bytes'] / 2**20:.0f}")
    console.print(table)
    if m.get("analysis_error"):
        console.print(f"[yellow]trace analysis failed:[/] {m['analysis_error']}", highlight=False)
    elif m["traces"]:
        console.print(f"traces: {', '.join(m['traces'])}; details: autotune report {result.out_dir}", highlight=False)


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
