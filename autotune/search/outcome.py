"""What a trial told the study, as data: written to the storage with retries, or kept on disk.

[Note: no measurement is lost]
A trial's outcome (state, objective value, user attributes, memory constraint) is computed
first and written to the study in one place (:func:`record`). A storage that stays
unavailable (an SQLite file locked by another writer past its timeout, a database server
gone) does not lose the measurement: after ``RETRIES`` attempts the outcome is written to
``<out>/pending/trial_NNNN.json`` and the search stops with one line saying so. The next
``--resume`` records every pending outcome before anything else (:func:`apply_pending`),
so the trial ends with the value it measured, not as "interrupted".
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import optuna
import sqlalchemy.exc

from autotune.search.settings import SearchError
from fsdp_runtime.files import write_json_atomic

RETRIES = 3
STORAGE_ERRORS = (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError)
"""What a study storage raises when it is locked, gone or broken."""


@dataclass(kw_only=True)
class Outcome:
    """Everything a finished trial tells the study."""

    number: int
    state: Literal["COMPLETE", "PRUNED", "FAIL"]
    value: float | None = None
    """The objective (COMPLETE only)."""
    intermediate: float | None = None
    """Reported before pruning (PRUNED only)."""
    user_attrs: dict[str, Any] = field(default_factory=dict)
    constraints: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def get_running_trial(study: optuna.Study, number: int) -> tuple[optuna.Trial, optuna.trial.FrozenTrial]:
    """A handle to write into trial ``number`` (optuna has no public lookup of a trial's id by number)."""
    frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == number)
    return optuna.Trial(study, frozen._trial_id), frozen


def _write(study: optuna.Study, outcome: Outcome) -> None:
    trial, frozen = get_running_trial(study, outcome.number)
    for key, value in outcome.user_attrs.items():
        trial.set_user_attr(key, value)
    for key, value in outcome.constraints.items():
        if not any(k.endswith(f":{key}") for k in frozen.system_attrs):  # set once (a retry may follow a partial write)
            trial.set_constraint(key, value)
    if outcome.state == "COMPLETE":
        study.tell(outcome.number, outcome.value, skip_if_finished=True)
    else:
        if outcome.intermediate is not None:
            trial.report(outcome.intermediate, 0)
        study.tell(outcome.number, state=optuna.trial.TrialState[outcome.state], skip_if_finished=True)


def record(study: optuna.Study, outcome: Outcome, *, pending_dir: Path, retry_wait_s: float = 1.0) -> None:
    """Tell the study; if its storage stays unavailable, keep the outcome on disk and raise :class:`SearchError`."""
    for attempt in range(RETRIES):
        try:
            _write(study, outcome)
            return
        except (*STORAGE_ERRORS, OSError) as e:  # OSError: a journal file's write failing (disk full, NFS gone)
            error = e
            time.sleep(retry_wait_s * (attempt + 1))
    pending_dir.mkdir(parents=True, exist_ok=True)
    path = write_json_atomic(pending_dir / f"trial_{outcome.number:04d}.json", outcome.to_dict())
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise SearchError(
        f"the study storage is unavailable ({first[:200]}); trial {outcome.number}'s result is kept in {path} and is recorded by --resume",
        field="storage",
    )


def apply_pending(study: optuna.Study, pending_dir: Path) -> list[int]:
    """Record the outcomes a previous run kept on disk; returns their trial numbers."""
    applied = []
    for path in sorted(pending_dir.glob("trial_*.json")):
        outcome = Outcome(**json.loads(path.read_text(encoding="utf-8")))
        _write(study, outcome)
        path.unlink()
        applied.append(outcome.number)
    return applied
