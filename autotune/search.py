"""``autotune search``: Optuna ask/tell over the FSDP2 knobs, driving the trial launcher.

Data flow: model profile + machine -> :func:`autotune.scale.plan_for_this_machine` (real
model or scale proxy) -> :class:`autotune.space.SearchSpace` -> per trial a
:class:`RuntimeConfig` -> :func:`autotune.trial.run_trial` -> metrics -> ``study.tell`` ->
best config -> side-by-side confirmation against the defaults -> emitted config + tables.

A run directory holds::

    study.db              Optuna storage (SQLite) unless --storage names another
    trials/trial_NNNN/    each trial's dir (traces, metrics.json, config.toml, env.json)
    best.toml, best.json  the winning runtime config (applies with fsdp_runtime unchanged)
    results.csv, results.json   one row per trial
    search.json           summary: plan (proxy or not), best, defaults, confirmation

[Note: search robustness]
- Several workers may share one study (``--storage`` URL, same ``--study-name``): each
  asks and runs its own trials; trial dirs are named by Optuna's study-wide trial number,
  so workers never collide, and every worker stops when the study holds ``num_trials``.
- ``--resume`` continues a study: finished trials are kept, the model plan (proxy shape)
  stored with the study is reused so old and new trials measure the same thing, and this
  host's trials left RUNNING by a dead worker are closed as FAIL ("interrupted").
- A failed trial (timeout, crash, OOM, invalid config) is told as FAIL with its reason and
  never stops the search. A trial whose first measured steps are slower than
  ``prune_ratio`` x the best so far is stopped early and told as PRUNED. A trial whose
  peak memory exceeds the budget is infeasible (Optuna constraint > 0) and never best.
- Outputs are written atomically; nothing from an earlier run is overwritten except by
  the same run's newer result.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import io
import json
import os
import socket
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import optuna
import sqlalchemy.exc

from autotune.scale import ModelPlan, plan_for_this_machine
from autotune.space import SearchSpace
from autotune.trial import TrialResult, TrialSpec, run_trial, write_json_atomic
from autotune.launch import run_ranks
from fsdp_runtime import Provenance, RuntimeConfig, config_to_dict, save_config
from fsdp_runtime.errors import AutotuneError
from profiles import ModelProfile, load_model_profile

SEARCH_SCHEMA_VERSION = 1
SamplerName = Literal["tpe", "random", "cmaes", "qmc"]
_PLATEAU_MIN_GAIN = 0.01


class SearchError(AutotuneError):
    """A search cannot start or continue (bad settings, a study that does not match)."""


@dataclass(kw_only=True)
class SearchSettings:
    """Everything a search needs; the CLI's options map one-to-one onto these fields."""

    model: str = "small"
    """Model profile name or TOML path."""
    world_size: int = 2
    num_trials: int = 16
    """Total trials in the study (across resumes and workers), the defaults trial included."""
    num_microbatches: int = 2
    out_dir: Path = Path("runs/search")
    storage: str | None = None
    """Optuna storage URL; default ``sqlite:///<out_dir>/study.db``."""
    study_name: str | None = None
    resume: bool = False
    sampler: SamplerName = "tpe"
    seed: int = 0
    memory_budget_bytes: int | None = None
    cluster: str | None = None
    """Cluster profile for link emulation (e.g. ``cpu-emulated-ib``); None: real links."""
    fixed_mesh: str | None = None
    num_warmup: int = 2
    num_measured: int = 4
    num_profiled: int = 2
    trial_timeout_s: float = 180.0
    prune_ratio: float = 1.5
    patience: int | None = 10
    """Stop after this many finished trials without a >= 1% improvement; None: never."""
    num_confirm_pairs: int = 3
    step_budget_s: float = 1.0
    """Per-microbatch step-time budget used to size a proxy on this machine."""
    use_pool: bool = True
    rank_program: str | None = None
    """Custom per-rank workload ``module:function`` (see :class:`autotune.trial.TrialSpec`)."""

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        checks = [
            (self.world_size >= 1, f"--nproc must be >= 1, got {self.world_size}"),
            (self.num_trials >= 1, f"--trials must be >= 1, got {self.num_trials}"),
            (self.num_microbatches >= 1, f"--microbatches must be >= 1, got {self.num_microbatches}"),
            (self.prune_ratio > 1.0, f"--prune-ratio must be > 1, got {self.prune_ratio}"),
            (self.num_confirm_pairs >= 0, f"--confirm-pairs must be >= 0, got {self.num_confirm_pairs}"),
            (self.patience is None or self.patience >= 1, f"--patience must be >= 1, got {self.patience}"),
        ]
        for ok, problem in checks:
            if not ok:
                raise SearchError(problem)

    def get_storage(self) -> str:
        return self.storage or f"sqlite:///{(self.out_dir / 'study.db').resolve()}"

    def get_study_name(self, model_name: str) -> str:
        return self.study_name or f"{model_name}-w{self.world_size}-mb{self.num_microbatches}"


class SearchReporter(Protocol):
    """Progress callbacks (the CLI renders them with rich; tests pass a silent one)."""

    def on_start(self, plan: ModelPlan, settings: SearchSettings, num_existing: int) -> None: ...
    def on_trial_start(self, number: int, total: int) -> None: ...
    def on_trial_end(self, row: dict[str, Any], best: dict[str, Any] | None) -> None: ...
    def on_phase(self, message: str) -> None: ...
    def on_trials_done(self, stopped_because: str) -> None: ...


class SilentReporter:
    def on_start(self, plan: ModelPlan, settings: SearchSettings, num_existing: int) -> None:
        pass

    def on_trial_start(self, number: int, total: int) -> None:
        pass

    def on_trial_end(self, row: dict[str, Any], best: dict[str, Any] | None) -> None:
        pass

    def on_phase(self, message: str) -> None:
        pass

    def on_trials_done(self, stopped_because: str) -> None:
        pass


@dataclass(kw_only=True)
class SearchSummary:
    out_dir: Path
    plan: ModelPlan
    rows: list[dict[str, Any]]
    best: dict[str, Any] | None
    default: dict[str, Any] | None
    confirmation: dict[str, Any] | None
    best_config_path: Path | None
    stopped_because: str
    extra: dict[str, Any] = field(default_factory=dict)
    report_paths: list[Path] = field(default_factory=list)
    """``report/report.html`` and the PNGs written into the run dir."""
    report_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "schema_version": SEARCH_SCHEMA_VERSION,
            "kind": "search_summary",
            "model": plan.requested.name,
            "proxy": {"is_proxy": plan.is_proxy, "name": plan.proxy_name, "reason": plan.reason, "overrides": plan.overrides},
            "num_trials": len(self.rows),
            "stopped_because": self.stopped_because,
            "best": self.best,
            "default": self.default,
            "confirmation": self.confirmation,
            "best_config": str(self.best_config_path) if self.best_config_path else None,
            "report": [str(p) for p in self.report_paths],
            "report_error": self.report_error,
            **self.extra,
        }


# ---------------------------------------------------------------------------


def _make_sampler(name: SamplerName, seed: int) -> optuna.samplers.BaseSampler:
    match name:
        case "tpe":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=5)
        case "random":
            return optuna.samplers.RandomSampler(seed=seed)
        case "cmaes":
            return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
        case "qmc":
            return optuna.samplers.QMCSampler(seed=seed, warn_independent_sampling=False)
    raise SearchError(f"--sampler: unknown sampler {name!r} (use tpe, random, cmaes or qmc)")


def _open_study(settings: SearchSettings, study_name: str) -> tuple[optuna.Study, bool]:
    """The study, and whether this worker created it (only the creator enqueues the defaults trial)."""
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    url = settings.get_storage()
    sampler = _make_sampler(settings.sampler, settings.seed)
    for attempt in range(5):
        try:
            storage = _make_storage(url)
            exists = study_name in {s.study_name for s in optuna.get_all_study_summaries(storage)}
            if exists and not settings.resume:
                raise SearchError(f"study {study_name!r} already exists in {url} (use --resume to continue it, or another --out / --study-name)")
            if not exists:
                try:
                    return optuna.create_study(study_name=study_name, storage=storage, direction="minimize", sampler=sampler), True
                except optuna.exceptions.DuplicatedStudyError:
                    pass  # another worker created it between our check and our create
            return optuna.load_study(study_name=study_name, storage=storage, sampler=sampler), False
        except sqlalchemy.exc.SQLAlchemyError as e:
            # Workers starting together race to create the schema: the loser retries.
            if attempt == 4:
                raise SearchError(f"--storage: cannot open {url}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
            time.sleep(0.5 + attempt)
        except (ValueError, ImportError, KeyError) as e:
            raise SearchError(f"--storage: cannot open {url}: {type(e).__name__}: {e}") from None
    raise AssertionError("unreachable")


def _make_storage(url: str) -> optuna.storages.BaseStorage | str:
    """SQLite gets a long lock timeout: several workers write to one file, and sqlite3's default
    5 s wait raised "database is locked" under load."""
    if url.startswith("sqlite:"):
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 120}})
    return url


def _resolve_plan(study: optuna.Study, settings: SearchSettings, profile: ModelProfile, device_type: str) -> ModelPlan:
    stored = study.user_attrs.get("plan")
    if stored is not None:
        for key, value in (("world_size", settings.world_size), ("num_microbatches", settings.num_microbatches), ("model", profile.name)):
            if stored[key] != value:
                raise SearchError(f"study {study.study_name!r} was run with {key}={stored[key]!r}, not {value!r} (use the same settings or another --study-name)")
        run = profile.with_overrides(**stored["overrides"]) if stored["overrides"] else profile
        return ModelPlan(requested=profile, run=run, is_proxy=stored["is_proxy"], reason=stored["reason"], estimated_memory_per_rank=stored["estimated_memory_per_rank"], estimated_step_s=stored["estimated_step_s"], overrides=stored["overrides"])
    plan = plan_for_this_machine(profile, world_size=settings.world_size, device_type=device_type, step_budget_s=settings.step_budget_s)
    study.set_user_attr(
        "plan",
        {
            "model": profile.name,
            "world_size": settings.world_size,
            "num_microbatches": settings.num_microbatches,
            "is_proxy": plan.is_proxy,
            "reason": plan.reason,
            "overrides": plan.overrides,
            "estimated_memory_per_rank": plan.estimated_memory_per_rank,
            "estimated_step_s": plan.estimated_step_s,
        },
    )
    return plan


def _close_interrupted(study: optuna.Study) -> None:
    """Trials left RUNNING by a dead worker on this host become FAIL ("interrupted")."""
    host = socket.gethostname()
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        worker = trial.user_attrs.get("worker", "")
        worker_host, _, pid = worker.rpartition(":")
        if worker_host == host and pid.isdigit() and not _pid_alive(int(pid)):
            running = optuna.Trial(study, trial._trial_id)
            running.set_user_attr("status", "interrupted")
            running.set_user_attr("reason", f"worker {worker} died before the trial finished")
            study.tell(running, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------------


def _row(trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
    attrs = trial.user_attrs
    return {
        "number": trial.number,
        "state": trial.state.name,
        "status": attrs.get("status", trial.state.name.lower()),
        "reason": attrs.get("reason", ""),
        "step_ms": attrs.get("step_ms"),
        "peak_memory_bytes": attrs.get("peak_memory_bytes"),
        "exposed_comm_ms": attrs.get("exposed_comm_ms"),
        "overlap_ratio": attrs.get("overlap_ratio"),
        "bound_ratio": attrs.get("bound_ratio"),
        "feasible": attrs.get("memory_over_budget", 0.0) <= 0.0,
        "is_default": bool(attrs.get("is_default", False)),
        "trial_dir": attrs.get("trial_dir"),
        "params": dict(trial.params),
    }


def _best_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    done = [r for r in rows if r["state"] == "COMPLETE" and r["feasible"] and r["step_ms"] is not None]
    return min(done, key=lambda r: r["step_ms"]) if done else None


def _aggregate(metrics: dict[str, Any] | None) -> dict[str, Any]:
    """The headline overlap numbers from a trial's trace metrics (median over ranks/steps)."""
    agg = ((metrics or {}).get("trace_metrics") or {}).get("aggregate") or {}
    return {
        "exposed_comm_ms": agg.get("exposed_comm_ms"),
        "overlap_ratio": agg.get("overlap_ratio"),
        "bound_ratio": agg.get("bound_ratio"),
    }


def _run_one(study: optuna.Study, space: SearchSpace, settings: SearchSettings, plan: ModelPlan, pool: Any, best: dict[str, Any] | None) -> dict[str, Any]:
    trial = study.ask()
    trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
    config = space.suggest(trial)
    trial_dir = settings.out_dir / "trials" / f"trial_{trial.number:04d}"
    trial.set_user_attr("trial_dir", str(trial_dir.relative_to(settings.out_dir)))
    spec = TrialSpec(
        model=plan.trial_model,
        config=config,
        world_size=settings.world_size,
        out_dir=trial_dir,
        num_warmup=settings.num_warmup,
        num_measured=settings.num_measured,
        num_profiled=settings.num_profiled,
        seed=settings.seed,
        timeout_s=settings.trial_timeout_s,
        cluster=settings.cluster,
        prune_if_slower_than_ms=best["step_ms"] * settings.prune_ratio if best else None,
        **_program(settings),
    )
    result = run_trial(spec, pool=pool)
    _tell(study, trial, result, settings)
    return _row(_find(study, trial.number))


def _program(settings: SearchSettings) -> dict[str, str]:
    return {"rank_program": settings.rank_program} if settings.rank_program else {}


def _find(study: optuna.Study, number: int) -> optuna.trial.FrozenTrial:
    return next(t for t in study.get_trials(deepcopy=False) if t.number == number)


def _tell(study: optuna.Study, trial: optuna.Trial, result: TrialResult, settings: SearchSettings) -> None:
    trial.set_user_attr("status", result.status)
    trial.set_user_attr("reason", result.reason[:1000])
    if result.step_ms is not None:
        trial.set_user_attr("step_ms", result.step_ms)
    if result.peak_memory_bytes is not None:
        trial.set_user_attr("peak_memory_bytes", result.peak_memory_bytes)
        if settings.memory_budget_bytes is not None:
            over = float(result.peak_memory_bytes - settings.memory_budget_bytes)
            trial.set_user_attr("memory_over_budget", over)
            trial.set_constraint("memory_over_budget", over)  # TPE learns feasibility from it
    for key, value in _aggregate(result.metrics).items():
        if value is not None:
            trial.set_user_attr(key, value)
    if result.status == "ok" and result.step_ms is not None:
        study.tell(trial, result.step_ms)
    elif result.status == "pruned":
        if result.step_ms is not None:
            trial.report(result.step_ms, 0)
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    else:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)


def _plateaued(rows: list[dict[str, Any]], patience: int | None) -> bool:
    if patience is None:
        return False
    finished = [r for r in sorted(rows, key=lambda r: r["number"]) if r["state"] in ("COMPLETE", "PRUNED", "FAIL")]
    best_ms, since = None, 0
    for r in finished:
        ms = r["step_ms"] if r["state"] == "COMPLETE" and r["feasible"] else None
        if ms is not None and (best_ms is None or ms < best_ms * (1 - _PLATEAU_MIN_GAIN)):
            best_ms, since = ms, 0
        else:
            since += 1
    return best_ms is not None and since >= patience


def run_search(settings: SearchSettings, *, reporter: SearchReporter | None = None) -> SearchSummary:
    """Run (or continue) a search and write the run directory; returns the summary."""
    import torch

    reporter = reporter or SilentReporter()
    profile = load_model_profile(settings.model)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    study_name = settings.get_study_name(profile.name)
    study, created = _open_study(settings, study_name)
    plan = _resolve_plan(study, settings, profile, device_type)
    _close_interrupted(study)
    space = SearchSpace(block_names=tuple(plan.run.unit_names[:-1]), world_size=settings.world_size, num_microbatches=settings.num_microbatches, device_type=device_type, fixed_mesh=settings.fixed_mesh)
    if created:
        study.enqueue_trial(space.get_default_params(), user_attrs={"is_default": True})
    reporter.on_start(plan, settings, len(study.get_trials(deepcopy=False)))
    # One pool for everything that runs ranks: trials, confirmation and consolidation timing
    # all see the same warmed-up processes (see _warm_up).
    with _pool(settings) as pool:
        _warm_up(space, settings, plan, pool, reporter)
        stopped = _search_loop(study, space, settings, plan, reporter, pool)
        reporter.on_trials_done(stopped)
        return finish_search(study, space, settings, plan, reporter, stopped_because=stopped, pool=pool)


def _search_loop(study: optuna.Study, space: SearchSpace, settings: SearchSettings, plan: ModelPlan, reporter: SearchReporter, pool: Any) -> str:
    while True:
        rows = [_row(t) for t in study.get_trials(deepcopy=False)]
        if len(rows) >= settings.num_trials:
            return f"reached {settings.num_trials} trials"
        if _plateaued(rows, settings.patience):
            return f"plateau: no >=1% improvement in {settings.patience} trials"
        reporter.on_trial_start(len(rows), settings.num_trials)
        row = _run_one(study, space, settings, plan, pool, _best_row(rows))
        reporter.on_trial_end(row, _best_row([*rows, row]))


def _warm_up(space: SearchSpace, settings: SearchSettings, plan: ModelPlan, pool: Any, reporter: SearchReporter) -> None:
    """One unrecorded defaults run as long as a trial, first: a fresh process's first jobs pay
    page faults for fresh heap (~3 ms/MB on this VM), gloo connections and autograd warm-up that
    would otherwise be charged to trial 0, the defaults (measured 1.5-1.9x slower)."""
    reporter.on_phase("warming up the ranks (not recorded)")
    spec = TrialSpec(
        model=plan.trial_model, config=space.build_config(space.get_default_params()), world_size=settings.world_size,
        out_dir=settings.out_dir / "warmup", num_warmup=settings.num_warmup, num_measured=settings.num_measured, profile=False, seed=settings.seed,
        timeout_s=settings.trial_timeout_s, cluster=settings.cluster, **_program(settings),
    )  # fmt: skip
    run_trial(spec, pool=pool)


class _NoPool:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _pool(settings: SearchSettings) -> Any:
    import torch

    if not settings.use_pool or torch.cuda.is_available():
        return _NoPool()
    from autotune.pool import RankPool

    return RankPool(settings.world_size)


# ---------------------------------------------------------------------------


def finish_search(study: optuna.Study, space: SearchSpace, settings: SearchSettings, plan: ModelPlan, reporter: SearchReporter, *, stopped_because: str, pool: Any = None) -> SearchSummary:
    """Confirm best vs defaults side by side, write best config, tables and summary."""
    rows = sorted((_row(t) for t in study.get_trials(deepcopy=False)), key=lambda r: r["number"])
    best = _best_row(rows)
    default = next((r for r in rows if r["is_default"]), None)
    confirmation = None
    best_path = None
    if best is not None:
        best_config = space.build_config(best["params"])
        default_config = space.build_config(space.get_default_params())
        if settings.num_confirm_pairs > 0 and not best["is_default"]:
            reporter.on_phase(f"confirming: best (trial {best['number']}) vs defaults, {settings.num_confirm_pairs} alternating pairs")
            confirmation = confirm(best_config, default_config, settings, plan, pool=pool)
            if confirmation["speedup_median"] is not None and confirmation["speedup_median"] < 1.0:
                # The search's best was a lucky measurement: the defaults win side by side.
                confirmation["emitted"] = "defaults"
                best_config = default_config
            else:
                confirmation["emitted"] = "best"
        reporter.on_phase("timing checkpoint consolidation of the emitted config")
        consolidation = time_consolidation(best_config, settings, plan)
        if consolidation.get("seconds"):
            # Emit the consolidation method that measured fastest here (on CPU gloo broadcast
            # beats all_gather for large tensors; see [Note: all_gather consolidation]).
            fastest = min(consolidation["seconds"], key=consolidation["seconds"].get)
            consolidation["chosen"] = fastest
            best_config = dataclasses.replace(best_config, checkpoint=dataclasses.replace(best_config.checkpoint, consolidation=fastest))
        best_path = _emit_best(best_config, best, default, confirmation, settings, plan, consolidation)
    _write_tables(rows, settings.out_dir)
    summary = SearchSummary(
        out_dir=settings.out_dir, plan=plan, rows=rows, best=best, default=default, confirmation=confirmation, best_config_path=best_path,
        stopped_because=stopped_because, extra={"consolidation": consolidation} if best is not None else {},
    )
    write_json_atomic(settings.out_dir / "search.json", summary.to_dict())
    reporter.on_phase("writing the search report")
    summary.report_paths, summary.report_error = _write_search_report(settings.out_dir)
    return summary


def _write_search_report(out_dir: Path) -> tuple[list[Path], str | None]:
    """``autotune report`` of the run dir into ``out_dir/report``; a failure is recorded, not raised."""
    from autotune.report import load_report, write_report

    try:
        return write_report(load_report(out_dir), out_dir / "report"), None
    except (AutotuneError, OSError, ValueError) as e:
        return [], f"{type(e).__name__}: {e}"


def confirm(best: RuntimeConfig, default: RuntimeConfig, settings: SearchSettings, plan: ModelPlan, *, pool: Any = None) -> dict[str, Any]:
    """Re-measure defaults and best alternately (ABBA order cancels drift); speedup = default / best per pair."""
    pairs = []
    for i in range(settings.num_confirm_pairs):
        times = {}
        order = (("default", default), ("best", best)) if i % 2 == 0 else (("best", best), ("default", default))
        for name, config in order:
            spec = TrialSpec(
                model=plan.trial_model,
                config=config,
                world_size=settings.world_size,
                out_dir=settings.out_dir / "confirm" / f"pair{i}_{name}",
                num_warmup=settings.num_warmup,
                num_measured=settings.num_measured,
                profile=False,
                seed=settings.seed,
                timeout_s=settings.trial_timeout_s,
                cluster=settings.cluster,
                **_program(settings),
            )
            result = run_trial(spec, pool=pool)
            times[name] = result.step_ms if result.ok else None
        pairs.append({"default": times["default"], "best": times["best"]})
    speedups = [p["default"] / p["best"] for p in pairs if p["default"] and p["best"]]
    return {
        "pairs": pairs,
        "speedups": speedups,
        "speedup_median": statistics.median(speedups) if speedups else None,
        "speedup_min": min(speedups) if speedups else None,
        "speedup_max": max(speedups) if speedups else None,
    }


CONSOLIDATION_METHODS = ("all_gather", "broadcast")


def time_consolidation(config: RuntimeConfig, settings: SearchSettings, plan: ModelPlan) -> dict[str, Any]:
    """Seconds to consolidate the full model + optimizer state of ``config`` onto rank 0, once per method.

    The config's own method is listed first; broadcast (the baseline) is timed beside it so
    the report can show what the choice saves. A failure is recorded, never raised.
    """
    methods = [config.checkpoint.consolidation, *(m for m in CONSOLIDATION_METHODS if m != config.checkpoint.consolidation)]
    kwargs = {"model": plan.trial_model, "config": config_to_dict(config), "methods": methods, "seed": settings.seed}
    # Fresh ranks, not the pool: in a pool rank that already ran other jobs, the device mesh
    # built for this job resolved a process group that the pool had destroyed after an earlier
    # job ("Could not resolve the process group registered under the name 1").
    target = "autotune.consolidation:consolidation_timing"
    run = run_ranks(target, world_size=settings.world_size, kwargs=kwargs, timeout_s=settings.trial_timeout_s)
    if not run.ok:
        return {"method": config.checkpoint.consolidation, "error": f"{run.status}: {run.reason}"}
    seconds = {m: max(r["seconds"][m][0] for r in run.results) for m in methods}
    return {"method": config.checkpoint.consolidation, "seconds": seconds, "state_bytes": run.results[0]["state_bytes"]}


def _emit_best(
    config: RuntimeConfig,
    best: dict[str, Any],
    default: dict[str, Any] | None,
    confirmation: dict[str, Any] | None,
    settings: SearchSettings,
    plan: ModelPlan,
    consolidation: dict[str, Any],
) -> Path:
    import torch

    notes = [f"chosen by {settings.sampler} search over {settings.num_trials} trials (best: trial {best['number']})"]
    if confirmation and confirmation.get("emitted") == "defaults":
        notes = [f"trial {best['number']} measured fastest in the search but was slower than FSDP2's defaults in the side-by-side confirmation: these are the defaults"]
    if plan.is_proxy:
        notes.append(
            f"trials ran on a scale proxy ({plan.proxy_name}) because {plan.requested.name} does not fit this machine "
            f"({plan.reason}); per-unit knobs map one-to-one onto {plan.requested.name}'s units, but the measured times are the proxy's, not {plan.requested.name}'s"
        )
    if settings.cluster:
        notes.append(f"collectives were held to the emulated links of cluster profile {settings.cluster!r}")
    emitted_defaults = bool(confirmation and confirmation.get("emitted") == "defaults")
    metrics = {"search_best_step_ms": best["step_ms"]}
    if default is not None and default.get("step_ms"):
        metrics["default_step_ms"] = default["step_ms"]
    metrics["step_ms"] = metrics.get("default_step_ms", best["step_ms"]) if emitted_defaults else best["step_ms"]
    if confirmation and confirmation["speedup_median"] is not None:
        metrics |= {k: confirmation[k] for k in ("speedup_median", "speedup_min", "speedup_max")}
    for method, seconds in consolidation.get("seconds", {}).items():
        metrics[f"consolidation_s_{method}"] = seconds
    provenance = Provenance(
        produced_by="autotune search",
        model=plan.requested.name,
        proxy_model=plan.proxy_name,
        world_size=settings.world_size,
        backend="nccl" if torch.cuda.is_available() else "gloo",
        torch_version=torch.__version__,
        measured=True,
        created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        notes=notes,
        metrics=metrics,
    )
    config = dataclasses.replace(config, provenance=provenance)
    save_config(config, settings.out_dir / "best.json")
    return save_config(config, settings.out_dir / "best.toml")


_TABLE_FIELDS = ("number", "state", "status", "step_ms", "peak_memory_bytes", "exposed_comm_ms", "overlap_ratio", "bound_ratio", "feasible", "is_default", "reason", "trial_dir", "params")


def _write_tables(rows: list[dict[str, Any]], out_dir: Path) -> None:
    write_json_atomic(out_dir / "results.json", {"schema_version": SEARCH_SCHEMA_VERSION, "kind": "search_results", "trials": rows})
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=_TABLE_FIELDS)
    writer.writeheader()
    for row in rows:
        writer.writerow({**{k: row.get(k) for k in _TABLE_FIELDS}, "params": json.dumps(row["params"], sort_keys=True)})
    tmp = out_dir / ".results.csv.tmp"
    tmp.write_text(buffer.getvalue())
    tmp.replace(out_dir / "results.csv")
