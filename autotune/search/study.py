"""The Optuna study of a search: sampler, storage, the stored model plan, stale trials."""

from __future__ import annotations

import fcntl
import hashlib
import os
import socket
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy.exc

from autotune.search.proxy import ModelPlan, plan_for_this_machine
from autotune.search.settings import SamplerName, SearchError, SearchSettings
from autotune.trials import pid_alive
from profiles import ModelProfile


def make_sampler(name: SamplerName, seed: int) -> optuna.samplers.BaseSampler:
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
    raise SearchError(f"unknown sampler {name!r} (use tpe, random, cmaes or qmc)", field="sampler")


def _make_storage(url: str, timeout_s: float) -> optuna.storages.BaseStorage | str:
    """SQLite gets a long lock timeout: several workers write to one file, and sqlite3's default
    5 s wait raised "database is locked" under load."""
    if url.startswith("sqlite:"):
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": timeout_s}})
    return url


def _check_out_dir_study(settings: SearchSettings, study_name: str, existing: set[str]) -> None:
    """The default storage lives in ``--out``: one run dir holds one study, never two mixed."""
    others = sorted(existing - {study_name})
    if settings.storage is None and others:
        raise SearchError(
            f"{settings.out_dir} already holds study {others[0]!r}, not {study_name!r} (another model, world size or microbatch count); "
            "use another --out, or the same settings with --resume", field="out_dir",
        )  # fmt: skip


def get_worker_seed(seed: int, worker_id: str) -> int:
    """A sampler seed of its own for a worker that joins a study: workers seeded alike sample
    the same points (measured: 3 of 12 trial pairs were duplicates)."""
    digest = hashlib.sha256(f"{seed}:{worker_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def open_study(settings: SearchSettings, study_name: str) -> tuple[optuna.Study, bool]:
    """The study, and whether this worker created it (only the creator enqueues the defaults trial).

    The creator samples with ``settings.seed`` (a one-worker search is reproducible); a worker
    that joins an existing study with a seed derived from it and the worker's id.
    """
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    url = settings.get_storage()
    sampler = make_sampler(settings.sampler, settings.seed)
    joined_sampler = make_sampler(settings.sampler, get_worker_seed(settings.seed, get_worker_id()))
    for attempt in range(5):
        try:
            storage = _make_storage(url, settings.storage_timeout_s)
            existing = {s.study_name for s in optuna.get_all_study_summaries(storage)}
            _check_out_dir_study(settings, study_name, existing)
            exists = study_name in existing
            if exists and not settings.resume:
                raise SearchError(f"study {study_name!r} already exists in {url} (use --resume to continue it, or another --out / --study-name)")
            if not exists:
                try:
                    return optuna.create_study(study_name=study_name, storage=storage, direction="minimize", sampler=sampler), True
                except optuna.exceptions.DuplicatedStudyError:
                    pass  # another worker created it between our check and our create
            return optuna.load_study(study_name=study_name, storage=storage, sampler=joined_sampler), False
        except sqlalchemy.exc.SQLAlchemyError as e:
            # Workers starting together race to create the schema: the loser retries.
            if attempt == 4:
                raise SearchError(f"cannot open storage {url}: {type(e).__name__}: {str(e).splitlines()[0]}", field="storage") from None
            time.sleep(0.5 + attempt)
        except (ValueError, ImportError, KeyError) as e:
            raise SearchError(f"cannot open storage {url}: {type(e).__name__}: {e}", field="storage") from None
    raise AssertionError("unreachable")


def resolve_plan(study: optuna.Study, settings: SearchSettings, profile: ModelProfile, device_type: str) -> ModelPlan:
    """The model plan stored with the study (a resumed study measures what it measured before), else a new one."""
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
            "model": profile.name, "world_size": settings.world_size, "num_microbatches": settings.num_microbatches,
            "is_proxy": plan.is_proxy, "reason": plan.reason, "overrides": plan.overrides,
            "estimated_memory_per_rank": plan.estimated_memory_per_rank, "estimated_step_s": plan.estimated_step_s,
        },
    )  # fmt: skip
    return plan


def get_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def close_interrupted(study: optuna.Study) -> None:
    """Trials left RUNNING by a dead worker on this host become FAIL ("interrupted")."""
    host = socket.gethostname()
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        worker = trial.user_attrs.get("worker", "")
        worker_host, _, pid = worker.rpartition(":")
        if worker_host == host and pid.isdigit() and not pid_alive(int(pid)):
            running = optuna.Trial(study, trial._trial_id)
            running.set_user_attr("status", "interrupted")
            running.set_user_attr("reason", f"worker {worker} died before the trial finished")
            study.tell(running, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)


def claim_out_dir(out_dir: Path) -> tuple[Path, Any]:
    """The directory this worker writes its warm-up, confirmation, emitted config, tables and
    report into, and the lock that holds it.

    The first worker in ``out_dir`` holds ``out_dir/.worker.lock`` (an flock, released when the
    process ends, however it ends) and writes into ``out_dir`` itself; a worker that shares
    ``out_dir`` with a running one writes into ``out_dir/workers/<host>-<pid>/``, so no worker
    overwrites another's files. Trial dirs are study-wide (``out_dir/trials``) either way.
    """
    handle = open(out_dir / ".worker.lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return out_dir, handle
    except BlockingIOError:
        handle.close()
        own = out_dir / "workers" / get_worker_id().replace(":", "-")
        own.mkdir(parents=True, exist_ok=True)
        return own, None
