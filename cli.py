"""The ``autotune`` command line: parse, call into the library, render, map errors to exit codes.

Each command here turns its options (declared in :mod:`autotune.cli.options`) into the library's
settings, calls the library and hands the result to :mod:`autotune.cli.render`, which prints it.
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

from autotune.cli import (
    CompareProgress,
    PlanProgress,
    SearchProgress,
    console,
    err_console,
    options,
    print_compare,
    print_device_profile,
    print_error,
    print_plan,
    print_search_summary,
    print_tables,
    print_trial_summary,
)
from fsdp_runtime.errors import AutotuneError

app = typer.Typer(
    name="autotune",
    help="Profiling-driven autotuner for PyTorch FSDP2: run trials, search the knobs, emit the best runtime config.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def validate(
    config: Annotated[Path, typer.Argument(help="Runtime config (.toml or .json) to check.")],
    world_size: options.WorldSize = None,
    model: options.ValidateModel = None,
) -> None:
    """Check a runtime config; print a one-line error naming the field if it is invalid."""
    from fsdp_runtime import check_torch_supports, load_config, validate_for_world

    cfg, notes = load_config(config), []
    check_torch_supports(cfg, source=str(config))  # a knob this torch lacks: the release that has it
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
    out: options.ReportOut = None,
    as_json: options.ReportJson = False,
) -> None:
    """Summarize a trial or a search: terminal tables, a self-contained HTML report and PNG plots."""
    import json

    from autotune.report import (
        get_gpu_tables,
        get_host_tables,
        get_pipeline_tables,
        get_tables,
        load_report,
        write_report,
    )

    result = load_report(directory)
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
        return
    print_tables([*get_tables(result), *get_pipeline_tables(result), *get_gpu_tables(result), *get_host_tables(result)])
    for path in write_report(result, out if out is not None else directory / "report"):
        console.print(f"wrote {path}")


@app.command()
def search(
    model: options.SearchModel = "small",
    nproc: options.SearchNproc = None,
    seq_len: options.SeqLen = None,
    batch_size: options.BatchSize = None,
    proxy: options.Proxy = None,
    plan_for: options.PlanFor = None,
    step_budget_s: options.StepBudget = None,
    baseline_ac: options.BaselineAc = None,
    trials: options.Trials = 10,
    microbatches: options.Microbatches = 2,
    out: options.SearchOut = Path("runs/search"),
    storage: options.Storage = None,
    study_name: options.StudyName = None,
    resume: options.Resume = False,
    sampler: options.Sampler = "tpe",
    seed: options.Seed = 0,
    memory_budget_gib: options.MemoryBudgetGib = None,
    grouping: options.Grouping = True,
    root_knobs: options.RootKnobs = True,
    checkpointing: options.Checkpointing = None,
    cluster: options.EmulatedCluster = None,
    mesh: options.Mesh = None,
    pp: options.SearchPp = "1",
    patience: options.Patience = 10,
    refine: options.Refine = None,
    confirm_pairs: options.ConfirmPairs = 3,
    trial_timeout: options.TrialTimeout = None,
    reference: options.Reference = "defaults",
    precision: options.Precision = 0.05,
    storage_timeout: options.StorageTimeout = 120.0,
    heartbeat: options.Heartbeat = None,
    presearch: options.Presearch = None,
    presearch_top: options.PresearchTop = None,
    param_dtype: options.ParamDtype = None,
    reduce_dtype: options.ReduceDtype = None,
    search_reduce_dtype: options.SearchReduceDtype = False,
    workers: options.NodeWorkers = None,
    join_timeout: options.JoinTimeout = 900.0,
    dry_run: options.SearchDryRun = False,
    as_json: options.SearchJson = False,
) -> None:
    """Search the FSDP2 knobs with Optuna; write the best config, a results table and the report."""
    from autotune.search import SearchSettings

    settings = SearchSettings(
        model=model,
        world_size=nproc,
        seq_len=seq_len,
        batch_size=batch_size,
        proxy=proxy,
        plan_for=plan_for,
        dry_run=dry_run,
        step_budget_s=step_budget_s,
        baseline_checkpointing=baseline_ac,
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
        workers=workers,
        join_timeout_s=join_timeout,
    )
    if dry_run:
        from autotune.search import dry_run_search

        for line in dry_run_search(settings):
            print(line)
        return
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
        summary = search_and_report(settings, reporter=SilentReporter() if as_json else SearchProgress())
    except KeyboardInterrupt:
        err_console.print(describe_interrupted(settings), highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None
    if as_json:
        print(json.dumps(summary.to_dict(), indent=2))
    else:
        print_search_summary(summary)
    if summary.best is None:
        err_console.print(
            f"[bold red]error:[/] no trial succeeded ({len(summary.rows)} trials); see {summary.out_dir / 'results.csv'} for the reasons",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(1)


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@app.command()
def trial(
    model: options.TrialModel,
    out: options.TrialOut,
    config: options.TrialConfig = None,
    nproc: options.TrialNproc = 2,
    steps: options.Steps = 5,
    warmup: options.Warmup = 2,
    profiled_steps: options.ProfiledSteps = 2,
    timeout: options.Timeout = 120.0,
    cluster: options.EmulatedCluster = None,
    backend: options.Backend = None,
    seed: options.Seed = 0,
    write_spec: options.WriteSpec = None,
    param_dtype: options.ParamDtype = None,
    reduce_dtype: options.ReduceDtype = None,
    as_json: options.TrialJson = False,
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
        print_trial_summary(result)
    if result.status not in ("ok", "pruned"):
        raise typer.Exit(1)


@app.command()
def compare(
    configs: Annotated[
        list[str],
        typer.Argument(
            metavar="CONFIG",
            help="Runtime configs (.toml/.json, e.g. a search's best.toml), or the words defaults (FSDP2's, as the search's defaults trial) and torchtitan (its recipe); the first is the baseline.",
            show_default=False,
        ),
    ],
    model: options.TrialModel,
    nproc: options.TrialNproc = 2,
    rounds: options.Rounds = None,
    until_ci: options.UntilCi = None,
    steps: options.Steps = 8,
    warmup: options.Warmup = 3,
    microbatches: options.CompareMicrobatches = None,
    timeout: options.Timeout = 120.0,
    cluster: options.EmulatedCluster = None,
    backend: options.Backend = None,
    seed: options.Seed = 0,
    param_dtype: options.ParamDtype = None,
    reduce_dtype: options.ReduceDtype = None,
    out: options.CompareOut = Path("runs/compare"),
) -> None:
    """Run configs alone, each on fresh ranks as a training job runs it, in rounds; their speedups over the first with 90% intervals."""
    from autotune.compare import CompareSettings, run_compare

    settings = CompareSettings(
        model=model,
        configs=configs,
        world_size=nproc,
        num_rounds=rounds,
        until_ci_pct=until_ci,
        num_warmup=warmup,
        num_measured=steps,
        num_microbatches=microbatches,
        timeout_s=timeout,
        cluster=cluster,
        backend=backend,
        seed=seed,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        out_dir=out,
    )
    record, path = run_compare(settings, reporter=CompareProgress())
    print_compare(record, path)


@app.command()
def plan(
    model: options.PlanModel = "llama8b",
    cluster: options.PlanCluster = "h100-node",
    nodes: options.Nodes = 1,
    microbatches: options.Microbatches = 2,
    ac: options.Ac = "auto",
    mesh: options.Mesh = None,
    top: options.Top = 10,
    workers: options.Workers = None,
    out: options.PlanOut = Path("runs/plan"),
    exact: options.Exact = False,
    memory_knobs: options.MemoryKnobs = True,
    pp: options.PlanPp = None,
    param_dtype: options.ParamDtype = None,
    reduce_dtype: options.ReduceDtype = None,
    device_profile: options.DeviceProfile = None,
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
    reporter = PlanProgress()
    try:
        result = run_plan(settings, reporter=reporter)
    finally:
        reporter.stop()
    print_plan(result)
    if not result.ranked:
        raise typer.Exit(1)


@app.command()
def calibrate(
    trials: Annotated[
        list[Path], typer.Argument(help="GPU trial dirs (`autotune trial --nproc 1` on one GPU of your cluster).")
    ],
    out: options.CalibrateOut = Path("device.toml"),
    model: options.CalibrateModel = None,
    cluster: options.CalibrateCluster = None,
) -> None:
    """Measure a GPU from trials' kernels: a device profile for `autotune plan --device-profile`."""
    from autotune.sim import calibrate_trials

    profile, lines = calibrate_trials(trials, model=model, cluster=cluster)
    profile.write(out)
    print_device_profile(profile, lines, out)


def main() -> None:
    try:
        app()
    except AutotuneError as e:
        if os.environ.get("AUTOTUNE_DEBUG"):
            raise
        print_error(options.FLAGS.get(e.field or ""), str(e))
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
