"""Optuna's own figures of the search's study (``optuna.visualization``), read from its storage.

Each figure Optuna cannot draw from this study (too few completed trials, no variation to
attribute, no study found) becomes one line saying why, never an exception.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from autotune.report.frames import FigureSection
from autotune.report.model import Report

OPTUNA_FIGURES = {
    "optuna_history": "optimization history",
    "optuna_importances": "parameter importances",
    "optuna_parallel": "parallel coordinate",
    "optuna_slice": "slice",
}
JOURNAL_PREFIX = "journal:"
"""``autotune search --storage journal:PATH``: Optuna's journal file (as the search spells it)."""
TARGET_NAME = "step-time ratio vs defaults"
"""What the study minimises: the median candidate/defaults ratio of a trial's pairs ([Note: paired measurement])."""


@contextlib.contextmanager
def _quiet_optuna() -> Iterator[None]:
    """Optuna's logger and experimental warnings off while the report reads the study."""
    import optuna

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            yield
    finally:
        optuna.logging.set_verbosity(verbosity)


def _open_storage(url: str) -> Any:
    """An Optuna storage to read: a journal file (``journal:PATH``), else an SQLAlchemy URL (no tables created)."""
    import optuna

    if url.startswith(JOURNAL_PREFIX):
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(url[len(JOURNAL_PREFIX) :]))
    return optuna.storages.RDBStorage(url, skip_table_creation=True)


def load_study(report: Report) -> tuple[Any, str | None]:
    """The search's Optuna study (read only), or None and the one-line reason.

    Storage: :attr:`Report.storage`, else ``<search dir>/study.db`` (the default of
    ``autotune search``); study: :attr:`Report.study_name`, else the only study there.
    """
    import optuna
    import sqlalchemy.exc

    url = report.storage
    if url is None:
        db = report.root / "study.db"
        if not db.exists():
            return (
                None,
                f"no Optuna study: {db} does not exist (a search run with --storage elsewhere keeps its study there)",
            )
        url = f"sqlite:///{db.resolve()}"
    if url.startswith(JOURNAL_PREFIX) and not Path(url[len(JOURNAL_PREFIX) :]).exists():
        return None, f"no Optuna study: the journal file {url[len(JOURNAL_PREFIX) :]} does not exist"
    try:
        with _quiet_optuna():
            return optuna.load_study(study_name=report.study_name, storage=_open_storage(url)), None
    except (
        ValueError,
        KeyError,
        ImportError,
        RuntimeError,
        sqlalchemy.exc.SQLAlchemyError,
        optuna.exceptions.OptunaError,
    ) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        return None, f"cannot read the Optuna study {report.study_name or '(the only one)'} in {url}: {first}"


def _completed(study: Any) -> list[Any]:
    import optuna

    trials = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return [t for t in trials if t.value is not None and math.isfinite(t.value)]


def why_no_importances(completed: list[Any]) -> str | None:
    """Why Optuna cannot attribute the objective to parameters here, or None when it can: it needs
    two completed trials, objective values that differ, and a parameter that takes two values."""
    if len(completed) < 2:
        return f"parameter importances need at least 2 completed trials with a value; this study has {len(completed)}"
    if len({t.value for t in completed}) < 2:
        return (
            f"all {len(completed)} completed trials have the same objective value: there is no variation to attribute"
        )
    names = {name for t in completed for name in t.params}
    if not any(len({repr(t.params[name]) for t in completed if name in t.params}) > 1 for name in names):
        return f"no parameter takes two values in the {len(completed)} completed trials: there is no variation to attribute"
    return None


def _draw(name: str, study: Any) -> Any:
    import optuna.visualization as vis

    match name:
        case "optuna_history":
            return vis.plot_optimization_history(study, target_name=TARGET_NAME)
        case "optuna_importances":
            return vis.plot_param_importances(
                study, target_name=TARGET_NAME
            )  # PED-ANOVA: deterministic, no scikit-learn
        case "optuna_parallel":
            return vis.plot_parallel_coordinate(study, target_name=TARGET_NAME)
        case "optuna_slice":
            return vis.plot_slice(study, target_name=TARGET_NAME)
    raise ValueError(f"unknown Optuna figure {name!r}")


def get_study_section(report: Report) -> FigureSection:
    """The Optuna part of a search report: the four figures, or why each one is absent."""
    section = FigureSection(title="Search (Optuna's figures of the study)")
    study, error = load_study(report)
    if study is None:
        section.absent = dict.fromkeys(OPTUNA_FIGURES, error)
        return section
    completed = _completed(study)
    section.lines.append(
        f"study {study.study_name!r}: {len(study.trials)} trials, {len(completed)} completed; objective: {TARGET_NAME} (lower is faster)"
    )
    for name, what in OPTUNA_FIGURES.items():
        reason = why_no_importances(completed) if name == "optuna_importances" else None
        if not completed:
            reason = f"the {what} needs a completed trial; this study has none"
        if reason is None:
            try:
                with _quiet_optuna(), warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always", UserWarning)
                    fig = _draw(name, study)
                section.lines += list(
                    dict.fromkeys(
                        f"Optuna on the {what}: {w.message}" for w in caught if issubclass(w.category, UserWarning)
                    )
                )
            except (ValueError, RuntimeError, ZeroDivisionError) as e:
                reason = (
                    f"Optuna could not draw the {what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                )
            else:
                if fig.data:
                    section.figures[name] = fig
                else:
                    reason = f"Optuna drew an empty {what} (no trial with the values it plots)"
        if reason is not None:
            section.absent[name] = reason
    return section
