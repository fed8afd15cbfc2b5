"""The Optuna study of a search: sampler, storage, the stored model plan, stale trials.

[Note: study storages]
Several workers (``autotune search`` processes) share one study through its storage:

- SQLite, the default (``sqlite:///<out>/study.db``): no set-up, one host. Every write takes
  the file's lock: under load sqlite3's 5 s default wait raises "database is locked", so a
  write waits up to ``storage_timeout_s``; workers starting together race to create the
  schema (:func:`open_study` retries); a write that still fails is retried and then kept on
  disk ([Note: no measurement is lost]). SQLite over a network file system is not safe, so a
  study on SQLite is a one-host study, and a search refuses one on a network file system
  ([Note: SQLite on a network file system] in :mod:`autotune.search.mounts`).
- ``journal:PATH``, Optuna's journal file (``JournalFileBackend``): an append-only log
  guarded by a lock file (a symlink: Optuna's default ``JournalFileSymlinkLock``, documented
  for NFSv2 or later; ``JournalFileOpenLock`` needs NFSv3). A writer waits for the lock
  instead of failing after a timeout, a lock left by a killed writer is broken after 30 s, and
  there is no schema to create: no lock timeout to set and no schema race to retry, for this
  storage. Stale trials as for SQLite (Optuna's journal storage has no heartbeat): on NFS
  several hosts can share the file, but a dead worker of another host leaves its trial RUNNING.
- A database server (``postgresql+psycopg://user@host/db``): several hosts. Optuna's row
  lock on the study makes trial numbers unique and contiguous across workers.

A worker that dies (``kill -9``, its host gone) leaves its trial RUNNING. On one host
(SQLite, journal) the trial records ``host:pid`` and the next worker to open the study fails
it when that PID is gone; a PID says nothing about another host's processes, so this check
skips trials of other hosts. On a server, every worker runs a heartbeat thread
(:class:`_Heartbeat`) that records Optuna's RDB heartbeat for its own running trials and fails
any trial whose last heartbeat is ``HEARTBEAT_GRACE_BEATS`` intervals old (the server's clock
on both sides: hosts' clocks need not agree). Optuna only beats inside ``Study.optimize``;
with ask/tell the beating is ours. No PID check there: hosts may share a name. A worker killed
in the second between asking a trial and its first beat (the thread polls every second)
leaves that trial RUNNING; it counts towards ``--trials`` and nothing waits for it.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import os
import socket
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy.exc

from autotune.search.gpu_pricing import Baseline
from autotune.search.proxy import ModelPlan, get_model_argument
from autotune.search.settings import JOURNAL_PREFIX, SamplerName, SearchError, SearchSettings
from autotune.trials import pid_alive
from fsdp_runtime import MixedPrecisionConfig
from profiles import ModelProfile

HEARTBEAT_POLL_S = 1.0
"""How often the heartbeat thread looks for this worker's new running trials."""
_RUNNING = (optuna.trial.TrialState.RUNNING,)


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


def make_storage(url: str, settings: SearchSettings) -> optuna.storages.BaseStorage:
    """The storage behind ``url`` ([Note: study storages])."""
    if url.startswith(JOURNAL_PREFIX):
        path = Path(url.removeprefix(JOURNAL_PREFIX)).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))
    if url.startswith("sqlite:"):
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": settings.storage_timeout_s}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        storage = optuna.storages.RDBStorage(
            url, heartbeat_interval=settings.get_heartbeat_s(), grace_period=settings.get_heartbeat_grace_s()
        )
    # Optuna warns on every ask() of a heartbeat storage: it beats only inside optimize(); we beat ourselves.
    warnings.filterwarnings(
        "ignore", message="Heartbeat of storage is supposed to be used with Study.optimize", category=UserWarning
    )
    return storage


def _check_out_dir_study(settings: SearchSettings, study_name: str, existing: set[str]) -> None:
    """The default storage lives in ``--out``: one run dir holds one study, never two mixed."""
    others = sorted(existing - {study_name})
    if settings.storage is None and others:
        raise SearchError(
            f"{settings.out_dir} already holds study {others[0]!r}, not {study_name!r} (another model, world size or microbatch count); "
            "use another --out, or the same settings with --resume",
            field="out_dir",
        )


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
            storage = make_storage(url, settings)
            existing = {s.study_name for s in optuna.get_all_study_summaries(storage)}
            _check_out_dir_study(settings, study_name, existing)
            exists = study_name in existing
            if exists and not settings.resume:
                raise SearchError(
                    f"study {study_name!r} already exists in {url} (use --resume to continue it, or another --out / --study-name)"
                )
            if not exists:
                try:
                    return _with_heartbeat(
                        optuna.create_study(
                            study_name=study_name, storage=storage, direction="minimize", sampler=sampler
                        ),
                        storage,
                    ), True
                except optuna.exceptions.DuplicatedStudyError:
                    pass  # another worker created it between our check and our create
            return _with_heartbeat(
                optuna.load_study(study_name=study_name, storage=storage, sampler=joined_sampler), storage
            ), False
        except sqlalchemy.exc.SQLAlchemyError as e:
            # Workers starting together race to create the schema: the loser retries.
            if attempt == 4:
                raise SearchError(
                    f"cannot open storage {url}: {type(e).__name__}: {str(e).splitlines()[0]}", field="storage"
                ) from None
            time.sleep(0.5 + attempt)
        except (ValueError, ImportError, KeyError, OSError) as e:
            raise SearchError(f"cannot open storage {url}: {type(e).__name__}: {e}", field="storage") from None
    raise AssertionError("unreachable")


def resolve_plan(
    study: optuna.Study,
    settings: SearchSettings,
    profile: ModelProfile,
    plan: ModelPlan,
    *,
    mixed_precision: MixedPrecisionConfig | None = None,
    baseline: Baseline | None = None,
) -> tuple[ModelPlan, Baseline]:
    """The model plan and baseline stored with the study (a resumed study measures what it measured
    before), else ``plan`` and ``baseline`` (stored). A study stores the precision and the shape
    (``--seq-len``, ``--batch-size``) of its trials: one resumed in another is refused (a study from
    before either was stored is not checked for it)."""
    stored = study.user_attrs.get("plan")
    precision = dataclasses.asdict(mixed_precision) if mixed_precision is not None else None
    baseline = baseline or Baseline()
    shape = {"seq_len": profile.seq_len, "batch_size": profile.batch_size}
    if stored is not None:
        for key, value in (
            ("world_size", settings.world_size),
            ("num_microbatches", settings.num_microbatches),
            ("model", profile.name),
            ("mixed_precision", precision),
            ("search_reduce_dtype", settings.search_reduce_dtype),
            ("shape", shape),
        ):
            if key in stored and stored[key] != value:
                raise SearchError(
                    f"study {study.study_name!r} was run with {key}={stored[key]!r}, not {value!r} (use the same settings or another --study-name)"
                )
        run = profile.with_overrides(**stored["overrides"]) if stored["overrides"] else profile
        plan = ModelPlan(
            requested=profile,
            run=run,
            is_proxy=stored["is_proxy"],
            reason=stored["reason"],
            estimated_memory_per_rank=stored["estimated_memory_per_rank"],
            estimated_step_s=stored["estimated_step_s"],
            overrides=stored["overrides"],
            shape_overrides=plan.shape_overrides,
        )
        check_budget(plan, settings)
        return plan, Baseline.from_dict(stored.get("baseline"))
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
            "mixed_precision": precision,
            "search_reduce_dtype": settings.search_reduce_dtype,
            "shape": shape,
            "baseline": baseline.to_dict(),
        },
    )
    return plan, baseline


def check_budget(plan: ModelPlan, settings: SearchSettings) -> None:
    """A memory budget is checked against the trials' measured peaks: a proxy's are not the model's."""
    if plan.is_proxy and settings.memory_budget_bytes is not None:
        raise SearchError(
            f"--memory-budget-gib: {plan.requested.name} runs as a scale proxy on this machine ({plan.reason}), whose peak memory is not the model's, "
            f"so the budget cannot be checked here; drop --memory-budget-gib, or rank the memory knobs for the target with "
            f"`autotune plan --model {get_model_argument(plan.requested)} --cluster h100-node`"
        )


def get_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


_HEARTBEATS: weakref.WeakKeyDictionary[optuna.Study, _Heartbeat] = weakref.WeakKeyDictionary()


def close_interrupted(study: optuna.Study) -> None:
    """Trials left RUNNING by a dead worker become FAIL ("interrupted"): on a database server,
    those whose heartbeat stopped; else this host's trials whose worker PID is gone
    ([Note: study storages])."""
    heartbeat = _HEARTBEATS.get(study)
    if heartbeat is not None:
        heartbeat.fail_stale()
        return
    host = socket.gethostname()
    for trial in study.get_trials(deepcopy=False, states=_RUNNING):
        worker = trial.user_attrs.get("worker", "")
        worker_host, _, pid = worker.rpartition(":")
        if worker_host == host and pid.isdigit() and not pid_alive(int(pid)):
            running = optuna.Trial(study, trial._trial_id)
            running.set_user_attr("status", "interrupted")
            running.set_user_attr("reason", f"worker {worker} died before the trial finished")
            study.tell(running, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)


class _Heartbeat(threading.Thread):
    """While its study lives: records the heartbeat of this worker's running trials, and
    fails other workers' trials whose heartbeat stopped ([Note: study storages]).

    It works on the storage alone (never the study's sampler, which the main thread uses);
    the study is held weakly, only to stop when the search is done with it.
    """

    def __init__(self, study: optuna.Study, storage: optuna.storages.RDBStorage) -> None:
        super().__init__(name="autotune-heartbeat", daemon=True)
        self._study = weakref.ref(study)
        self._storage = storage
        self._study_id = storage.get_study_id_from_name(study.study_name)
        self._interval_s = float(storage.heartbeat_interval or 1)
        self._grace_s = storage.grace_period or 2 * self._interval_s
        self._worker = get_worker_id()

    def fail_stale(self) -> None:
        # Not optuna.storages.fail_stale_trials: it fails the trial first and then hands its
        # callback a finished trial, whose user attributes can no longer be written.
        for trial_id in self._storage._get_stale_trial_ids(self._study_id):
            worker = self._storage.get_trial(trial_id).user_attrs.get("worker", "?")
            reason = f"worker {worker} sent no heartbeat for {self._grace_s:.0f} s (killed, or its host is gone) before the trial finished"
            try:
                self._storage.set_trial_user_attr(trial_id, "status", "interrupted")
                self._storage.set_trial_user_attr(trial_id, "reason", reason)
                self._storage.set_trial_state_values(trial_id, state=optuna.trial.TrialState.FAIL)
            except optuna.exceptions.UpdateFinishedTrialError:
                pass  # it finished meanwhile, or another worker closed it first

    def record(self, trial_id: int) -> None:
        self._storage.record_heartbeat(trial_id)

    def beat(self, last_beat: dict[int, float]) -> None:
        """Records a heartbeat for each of this worker's running trials not beaten for an interval."""
        now = time.monotonic()
        for trial in self._storage.get_all_trials(self._study_id, deepcopy=False, states=_RUNNING):
            if (
                trial.user_attrs.get("worker") == self._worker
                and now - last_beat.get(trial._trial_id, -self._interval_s) >= self._interval_s
            ):
                self._storage.record_heartbeat(trial._trial_id)
                last_beat[trial._trial_id] = now

    def run(self) -> None:
        last_beat: dict[int, float] = {}
        last_check = time.monotonic()
        while self._study() is not None:
            try:
                self.beat(last_beat)
                if time.monotonic() - last_check >= self._interval_s:
                    self.fail_stale()
                    last_check = time.monotonic()
            except Exception:  # noqa: BLE001 (a server hiccup must not end the beating: the next poll tries again)
                pass
            time.sleep(min(HEARTBEAT_POLL_S, self._interval_s))


def record_first_heartbeat(study: optuna.Study, trial: optuna.Trial) -> None:
    """A heartbeat for a trial just asked for, before anything else runs: Optuna counts a trial
    as stale only once it has a heartbeat, so a worker killed between ``ask()`` and its
    heartbeat thread's next beat (up to a second) would leave the trial RUNNING for good."""
    heartbeat = _HEARTBEATS.get(study)
    if heartbeat is not None:
        heartbeat.record(trial._trial_id)


def _with_heartbeat(study: optuna.Study, storage: optuna.storages.BaseStorage) -> optuna.Study:
    """Starts the study's heartbeat thread when its storage has a heartbeat (a database server)."""
    if isinstance(storage, optuna.storages.RDBStorage) and storage.heartbeat_interval is not None:
        heartbeat = _Heartbeat(study, storage)
        _HEARTBEATS[study] = heartbeat
        heartbeat.start()
    return study


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
