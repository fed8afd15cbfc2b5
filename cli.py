"""The ``autotune`` command line: parse, call into the library, render, map errors to exit codes.

Errors derived from :class:`fsdp_runtime.AutotuneError` print as one line on stderr and
exit non-zero; set ``AUTOTUNE_DEBUG=1`` for the traceback.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from fsdp_runtime.errors import AutotuneError

app = typer.Typer(
    name="autotune",
    help="Profiling-driven autotuner for PyTorch FSDP2: run trials, search the knobs, emit the best runtime config.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
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

# One definition of the precision options for search, trial and plan; resolved in
# autotune.trials.resolve_precision ([Note: precision defaults]).
ParamDtype = Annotated[
    str | None,
    typer.Option(
        "--param-dtype",
        help="Dtype of the unsharded parameters (compute) in every trial: float32, bfloat16 or float16. Default: bfloat16 on CUDA (as torchtitan trains), float32 on CPU (CPU bf16 matmuls are slow). trial --config keeps the config's own mixed_precision table unless this is given.",
        show_default=False,
    ),
]
ReduceDtype = Annotated[
    str | None,
    typer.Option(
        "--reduce-dtype",
        help="Dtype of gradient reduction in every trial: float32, bfloat16 or float16. Default: float32 (CUDA and CPU). trial --config keeps the config's own mixed_precision table unless this is given.",
        show_default=False,
    ),
]


@app.command()
def validate(
    config: Annotated[Path, typer.Argument(help="Runtime config (.toml or .json) to check.")],
    world_size: Annotated[
        int | None, typer.Option("--world-size", "-w", help="Also check the mesh against this world size.")
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model", "-m", help="Also check the units against this model (as in search), built on the meta device."
        ),
    ] = None,
) -> None:
    """Check a runtime config; print a one-line error naming the field if it is invalid."""
    from fsdp_runtime import load_config, validate_for_world

    cfg, notes = load_config(config), []
    if world_size is not None:
        validate_for_world(cfg, world_size, source=str(config))
    if model is not None:
        from profiles import resolve_config_for_model

        cfg, notes = resolve_config_for_model(cfg, model, source=str(config))
    console.print(
        f"{config}: ok (schema_version {cfg.schema_version}, {len(cfg.units) or 'default'} units{f' of {model}' if model else ''})",
        highlight=False,
    )
    for note in notes:
        console.print(f"note: {note}", highlight=False, soft_wrap=True)


@app.command()
def report(
    directory: Annotated[
        Path,
        typer.Argument(
            metavar="DIR", help="A trial dir (metrics.json + traces) or a search dir (trials/*/metrics.json)."
        ),
    ],
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Where to write report.html and the PNGs; default: DIR/report."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary JSON only (no tables, no files).")] = False,
) -> None:
    """Summarize a trial or a search: terminal tables, a self-contained HTML report and PNG plots."""
    import json

    from autotune.report import get_gpu_tables, get_pipeline_tables, get_tables, load_report, write_report

    result = load_report(directory)
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
        return
    _print_tables([*get_tables(result), *get_pipeline_tables(result), *get_gpu_tables(result)])
    for path in write_report(result, out if out is not None else directory / "report"):
        console.print(f"wrote {path}")


def _print_tables(tables) -> None:
    """Render the report package's plain tables with rich (the CLI has no table code of its own)."""
    from rich import box
    from rich.table import Column, Table

    for table in tables:
        columns = [Column(c, overflow="fold") for c in table.columns]
        rich_table = Table(*columns, title=table.title, title_justify="left", box=box.SIMPLE_HEAD)
        for row in table.rows:
            rich_table.add_row(*row)
        console.print(rich_table)


class _RichSearchReporter:
    """Live progress for ``autotune search``: trial n/N, current best, ETA."""

    def __init__(self) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(
            TextColumn("[bold]trials"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[best]}"),
            console=err_console,
            transient=False,
        )
        self.task = None

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

        status = row.status if not row.succeeded else f"{fmt(row.ratio, 'x')} the defaults ({fmt(row.step_ms)} ms)"
        if row.predicted_step_ms is not None:
            status += f", predicted {row.predicted_step_ms:.1f} ms"
        best_text = f"best {fmt(best.ratio, 'x')} (trial {best.number})" if best else "no best yet"
        self.progress.console.print(
            f"trial {row.number:>3}: {status}" + (f" - {row.reason[:120]}" if row.reason else ""), highlight=False
        )
        self.progress.update(self.task, advance=1, best=best_text)

    def on_phase(self, message: str) -> None:
        self.progress.console.print(message, highlight=False)

    def on_trials_done(self, stopped_because: str) -> None:
        self.progress.stop()
        err_console.print(f"trials done: {stopped_because}", highlight=False)


@app.command()
def search(
    model: Annotated[
        str,
        typer.Option(
            "--model",
            "-m",
            help="Model profile (tiny, small, llama1b, llama8b, llama70b), a model TOML, package.module:function (a factory) or a Hugging Face config.json / model dir.",
        ),
    ] = "small",
    nproc: Annotated[int, typer.Option("--nproc", "-n", help="Ranks (world size) of every trial.")] = 2,
    trials: Annotated[
        int, typer.Option("--trials", "-t", help="Total trials in the study, the defaults trial included.")
    ] = 10,
    microbatches: Annotated[
        int, typer.Option("--microbatches", help="Gradient-accumulation microbatches per step.")
    ] = 2,
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Run directory (study, trials, best config, tables).")
    ] = Path("runs/search"),
    storage: Annotated[
        str | None,
        typer.Option(
            "--storage",
            help="Optuna storage shared by several workers: sqlite:///PATH, journal:PATH or postgresql+psycopg://USER@HOST/DB; default: sqlite in --out.",
        ),
    ] = None,
    study_name: Annotated[str | None, typer.Option("--study-name", help="Study name; default: MODEL-wN-mbM.")] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the study (or join it as another worker).")
    ] = False,
    sampler: Annotated[str, typer.Option("--sampler", help="tpe (seeded, default), random, cmaes or qmc.")] = "tpe",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    memory_budget_gib: Annotated[
        float | None,
        typer.Option("--memory-budget-gib", help="Peak memory per rank above this makes a trial infeasible."),
    ] = None,
    grouping: Annotated[
        bool, typer.Option("--grouping/--no-grouping", help="Search 1, 2 or 4 blocks per FSDP unit.")
    ] = True,
    root_knobs: Annotated[
        bool,
        typer.Option(
            "--root-knobs/--no-root-knobs",
            help="Search the root unit's reshard and sync level, and embeddings and head as units of their own.",
        ),
    ] = True,
    checkpointing: Annotated[
        bool | None,
        typer.Option(
            "--checkpointing/--no-checkpointing",
            help="Search activation checkpointing per block (none, selective, full); default: only with --memory-budget-gib.",
            show_default=False,
        ),
    ] = None,
    cluster: Annotated[
        str | None,
        typer.Option("--cluster", help="Cluster profile whose links are emulated (e.g. cpu-emulated-ib)."),
    ] = None,
    mesh: Annotated[str | None, typer.Option("--mesh", help="Fix the mesh: fsdp or hsdp:RxS.")] = None,
    pp: Annotated[
        str,
        typer.Option(
            "--pp",
            help="Pipeline degrees to search with FSDP2 inside each stage, e.g. 1,2 (those dividing the world size and the blocks; 1: no stages).",
        ),
    ] = "1",
    patience: Annotated[
        int, typer.Option("--patience", help="Stop after this many trials without a 1% improvement (0: never).")
    ] = 10,
    refine: Annotated[
        int | None,
        typer.Option(
            "--refine",
            help="Last trials that try neighbours of the best config instead of sampling; default: a third of --trials.",
        ),
    ] = None,
    confirm_pairs: Annotated[
        int, typer.Option("--confirm-pairs", help="Alternating best/default re-measurements at the end.")
    ] = 3,
    trial_timeout: Annotated[
        float | None,
        typer.Option(
            "--trial-timeout",
            help="Seconds before a trial's ranks are killed; default: 5x what this box measured per step times the trial's steps, at least 120.",
        ),
    ] = None,
    reference: Annotated[
        str,
        typer.Option(
            "--reference",
            help="What each trial is paired with: defaults (FSDP2's, every trial) or best (the best trial so far, its ratio chained to the defaults').",
        ),
    ] = "defaults",
    precision: Annotated[
        float,
        typer.Option(
            "--precision",
            help="A trial stops measuring once its ratio's 90% interval is within this relative half-width (or it is clearly faster or slower than the best).",
        ),
    ] = 0.05,
    storage_timeout: Annotated[
        float, typer.Option("--storage-timeout", help="Seconds a write waits for a locked SQLite study.")
    ] = 120.0,
    heartbeat: Annotated[
        int | None,
        typer.Option(
            "--heartbeat",
            help="Seconds between a worker's heartbeats on a database server; a trial silent for 4 of them is failed. Default: --trial-timeout / 20, 5 to 60.",
        ),
    ] = None,
    presearch: Annotated[
        str | None,
        typer.Option(
            "--presearch",
            help="sim: calibrate the step simulator on the defaults trial, rank the whole space in it and measure the fastest predictions first.",
        ),
    ] = None,
    presearch_top: Annotated[
        int | None,
        typer.Option(
            "--presearch-top", help="Configs --presearch measures; default: every trial before the refinement."
        ),
    ] = None,
    param_dtype: ParamDtype = None,
    reduce_dtype: ReduceDtype = None,
    search_reduce_dtype: Annotated[
        bool,
        typer.Option(
            "--search-reduce-dtype",
            help="Also search the reduce dtype (float32 or bfloat16; bfloat16 halves reduce-scatter bytes and changes the sums). The defaults trial reduces in float32.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout (no progress).")] = False,
) -> None:
    """Search the FSDP2 knobs with Optuna; write the best config, a results table and the report."""
    from autotune.search import SearchSettings

    settings = SearchSettings(
        model=model,
        world_size=nproc,
        num_trials=trials,
        num_microbatches=microbatches,
        out_dir=out,
        storage=storage,
        study_name=study_name,
        resume=resume,
        sampler=sampler,
        seed=seed,
        memory_budget_bytes=int(memory_budget_gib * 2**30) if memory_budget_gib is not None else None,
        grouping=grouping,
        root_knobs=root_knobs,
        checkpointing=checkpointing,
        cluster=cluster,
        fixed_mesh=mesh,
        pipeline_degrees=pp,
        patience=patience or None,
        num_refine=refine,
        num_confirm_pairs=confirm_pairs,
        trial_timeout_s=trial_timeout,
        reference=reference,
        precision=precision,
        storage_timeout_s=storage_timeout,
        heartbeat_s=heartbeat,
        presearch=presearch,
        presearch_top_k=presearch_top,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        search_reduce_dtype=search_reduce_dtype,
    )
    _run_search(settings, as_json=as_json)


def _run_search(settings, *, as_json: bool) -> None:
    """Run the search and its report; print the summary (JSON or tables); map an interrupt and no success to exit codes."""
    import json

    from autotune.pipeline import search_and_report
    from autotune.search import SilentReporter, describe_interrupted

    if not as_json:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # SIGTERM stops a search like Ctrl-C
    try:
        summary = search_and_report(settings, reporter=SilentReporter() if as_json else _RichSearchReporter())
    except KeyboardInterrupt:
        err_console.print(describe_interrupted(settings), highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None
    if as_json:
        print(json.dumps(summary.to_dict(), indent=2))
    else:
        _print_search_summary(summary)
    if summary.best is None:
        err_console.print(
            f"[bold red]error:[/] no trial succeeded ({len(summary.rows)} trials); see {summary.out_dir / 'results.csv'} for the reasons",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(1)


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _print_search_summary(summary) -> None:
    from autotune.report import (
        get_final_round_table,
        get_prediction_table,
        get_search_outcome_lines,
        get_search_rows_table,
    )

    _print_tables([get_search_rows_table(summary.rows, summary.best)])
    _print_tables([t for t in (get_prediction_table(summary.rows),) if t is not None])
    _print_tables([t for t in (get_final_round_table(summary.confirmation),) if t is not None])
    for line in get_search_outcome_lines(summary):
        console.print(line, highlight=False)


@app.command()
def trial(
    model: Annotated[
        str,
        typer.Option(
            "--model",
            "-m",
            help="Model profile (tiny, small, ...), a model TOML, package.module:function or a Hugging Face config.json / model dir.",
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Trial dir: traces, metrics.json, config.toml, env.json.")],
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            help="Runtime config (.toml/.json), or torchtitan (its FSDP2 recipe built for the model); default: FSDP2 defaults for the model.",
        ),
    ] = None,
    nproc: Annotated[int, typer.Option("--nproc", "-n", help="Ranks (world size).")] = 2,
    steps: Annotated[int, typer.Option("--steps", help="Measured (unprofiled) steps.")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", help="Warm-up steps before measuring.")] = 2,
    profiled_steps: Annotated[int, typer.Option("--profiled-steps", help="Steps in the traces (0: no profiling).")] = 2,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds before every rank is killed.")] = 120.0,
    cluster: Annotated[
        str | None,
        typer.Option("--cluster", help="Cluster profile whose links are emulated (e.g. cpu-emulated-ib)."),
    ] = None,
    backend: Annotated[
        str | None, typer.Option("--backend", help="gloo or nccl; default: nccl when CUDA is available.")
    ] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    write_spec: Annotated[
        Path | None,
        typer.Option(
            "--write-spec", help="Only write the trial spec JSON for `torchrun -m autotune.trials.torchrun --spec`."
        ),
    ] = None,
    param_dtype: ParamDtype = None,
    reduce_dtype: ReduceDtype = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print metrics.json on stdout.")] = False,
) -> None:
    """Run one trial: N ranks, warm-up, timed steps, a profiled window; exit 1 if the trial failed."""
    import json

    from autotune.trials import TrialSpec, check_trial_machine, resolve_trial_config, run_trial

    runtime_config, notes = resolve_trial_config(
        config, model, backend=backend, param_dtype=param_dtype, reduce_dtype=reduce_dtype
    )
    spec = TrialSpec(
        model=model,
        config=runtime_config,
        world_size=nproc,
        out_dir=out,
        num_warmup=warmup,
        num_measured=steps,
        num_profiled=profiled_steps,
        profile=profiled_steps > 0,
        timeout_s=timeout,
        cluster=cluster,
        seed=seed,
        **({"backend": backend} if backend else {}),
    )
    check_trial_machine(spec, local=write_spec is None)
    for note in notes:  # markup off: the note names [mixed_precision]
        err_console.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)
    if write_spec is not None:
        spec.write(write_spec)
        console.print(
            f"wrote {write_spec}; run on every node: torchrun --nnodes N --nproc-per-node M ... -m autotune.trials.torchrun --spec {write_spec}",
            highlight=False,
        )
        return
    result = run_trial(spec)
    if as_json:
        print(json.dumps(result.metrics.to_dict(), indent=2))
    else:
        _print_trial_summary(result)
    if result.status not in ("ok", "pruned"):
        raise typer.Exit(1)


def _print_trial_summary(result) -> None:
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
    _print_tables([get_rank_table(m)])
    if m.analysis_error:
        console.print(f"[yellow]trace analysis failed:[/] {m.analysis_error}", highlight=False)
    elif m.traces:
        console.print(f"traces: {', '.join(m.traces)}; details: autotune report {result.out_dir}", highlight=False)


# Library errors name settings in the library's terms (``AutotuneError.field``); users know the flags.
_FLAGS = {
    "model": "--model",
    "world_size": "--nproc",
    "num_trials": "--trials",
    "num_microbatches": "--microbatches",
    "prune_ratio": "--prune-ratio",
    "num_refine": "--refine",
    "num_confirm_pairs": "--confirm-pairs",
    "patience": "--patience",
    "sampler": "--sampler",
    "trial_timeout_s": "--trial-timeout",
    "reference": "--reference",
    "precision": "--precision",
    "num_warmup": "--warmup",
    "num_measured": "--steps",
    "num_profiled": "--profiled-steps",
    "timeout_s": "--timeout",
    "backend": "--backend",
    "storage": "--storage",
    "out_dir": "--out",
    "fixed_mesh": "--mesh",
    "pipeline_degrees": "--pp",
    "storage_timeout_s": "--storage-timeout",
    "heartbeat_s": "--heartbeat",
    "presearch": "--presearch",
    "presearch_top_k": "--presearch-top",
    "param_dtype": "--param-dtype",
    "reduce_dtype": "--reduce-dtype",
}


@app.command()
def plan(
    model: Annotated[
        str,
        typer.Option(
            "--model",
            "-m",
            help="Model profile (llama1b, llama8b, llama70b, ...), a model TOML, package.module:function (a factory) or a Hugging Face config.json / model dir.",
        ),
    ] = "llama8b",
    cluster: Annotated[
        str, typer.Option("--cluster", help="GPU cluster profile: h100-node, h200-node, a100-node or a TOML path.")
    ] = "h100-node",
    nodes: Annotated[
        int, typer.Option("--nodes", help="Nodes of that profile (world size = nodes x ranks per node).")
    ] = 1,
    microbatches: Annotated[
        int, typer.Option("--microbatches", help="Gradient-accumulation microbatches per step.")
    ] = 2,
    ac: Annotated[
        str,
        typer.Option(
            "--ac",
            help="Activation checkpointing: auto (searched per unit and set in the config; with --no-memory-knobs: none if the defaults fit, else full), or none / full in your training script.",
        ),
    ] = "auto",
    mesh: Annotated[str | None, typer.Option("--mesh", help="Fix the mesh: fsdp or hsdp:RxS.")] = None,
    top: Annotated[int, typer.Option("--top", help="Configs to show.")] = 10,
    workers: Annotated[
        int | None, typer.Option("--workers", help="Simulating processes; default: CPU count (max 8).")
    ] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Where best.toml, best.json and plan.json go.")] = Path(
        "runs/plan"
    ),
    exact: Annotated[
        bool,
        typer.Option(
            "--exact",
            help="Simulate every config at the model's depth (deep models are otherwise extrapolated from 8 and 16 blocks, the fastest re-simulated).",
        ),
    ] = False,
    memory_knobs: Annotated[
        bool,
        typer.Option(
            "--memory-knobs/--no-memory-knobs",
            help="Also rank blocks per unit, the root's knobs and (with --ac auto) checkpointing per unit, for the fastest configs.",
        ),
    ] = True,
    pp: Annotated[
        str | None,
        typer.Option(
            "--pp",
            help="Pipeline-parallel degrees to rank beside FSDP alone, e.g. 1,2,4,8 (default: 1 and those up to 8 dividing the world size and the blocks).",
        ),
    ] = None,
    param_dtype: ParamDtype = None,
    reduce_dtype: ReduceDtype = None,
    device_profile: Annotated[
        Path | None,
        typer.Option(
            "--device-profile",
            help="A GPU measured by `autotune calibrate`: its rates price compute, copies, the optimizer and the host floor instead of the datasheet.",
        ),
    ] = None,
) -> None:
    """Rank every config of the search space in the FSDP2 step simulator for a GPU cluster; emit the best (provenance: simulated)."""
    from autotune.plan import PlanSettings, run_plan

    settings = PlanSettings(
        model=model,
        cluster=cluster,
        num_nodes=nodes,
        num_microbatches=microbatches,
        out_dir=out,
        activation_checkpointing=ac,  # type: ignore[arg-type]
        fixed_mesh=mesh,
        num_top=top,
        exact=exact,
        memory_knobs=memory_knobs,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        device_profile=device_profile,
        pp_degrees=pp,
        **({"num_workers": workers} if workers is not None else {}),
    )
    reporter = _RichPlanReporter()
    try:
        result = run_plan(settings, reporter=reporter)
    finally:
        reporter.stop()
    _print_plan(result)
    if not result.ranked:
        raise typer.Exit(1)


class _RichPlanReporter:
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


def _print_plan(result) -> None:
    from autotune.plan import get_config_lines, get_pipeline_table, get_plan_lines, get_plan_table, get_unit_table

    _print_tables([get_plan_table(result)])
    for line in get_config_lines(result):
        console.print(line, highlight=False, soft_wrap=True)
    _print_tables([t for t in (get_pipeline_table(result), get_unit_table(result)) if t is not None])
    for line in get_plan_lines(result):
        console.print(line, highlight=False, soft_wrap=True)


_FLAGS.update(
    num_nodes="--nodes",
    num_top="--top",
    num_workers="--workers",
    activation_checkpointing="--ac",
    cluster="--cluster",
    device_profile="--device-profile",
    pp_degrees="--pp",
)


@app.command()
def calibrate(
    trials: Annotated[
        list[Path], typer.Argument(help="GPU trial dirs (`autotune trial --nproc 1` on one GPU of your cluster).")
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="The device profile (TOML) to write.")] = Path("device.toml"),
    model: Annotated[
        str | None, typer.Option("--model", help="The trials' model, where metrics.json's name does not resolve.")
    ] = None,
    cluster: Annotated[
        str | None,
        typer.Option("--cluster", help="Cluster profile of that GPU, for the check (default: by the GPU's name)."),
    ] = None,
) -> None:
    """Measure a GPU from trials' kernels: a device profile for `autotune plan --device-profile`."""
    from autotune.sim import calibrate_trials

    profile, lines = calibrate_trials(trials, model=model, cluster=cluster)
    profile.write(out)
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


def main() -> None:
    try:
        app()
    except AutotuneError as e:
        if os.environ.get("AUTOTUNE_DEBUG"):
            raise
        flag = _FLAGS.get(e.field or "")
        # escaped: messages name extras and tables in brackets ('fsdp-autotune[torchtitan]')
        err_console.print(
            f"[bold red]error:[/] {escape(flag + ': ' if flag else '')}{escape(str(e))}",
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
