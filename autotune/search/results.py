"""A search's results: one row per trial, the best-trial rule, and ``search.json``/``results.*``.

The best-trial rule lives in :func:`pick_best` alone; the search, the report and the CLI
all call it.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from autotune.artifacts import (
    ArtifactError,
    build_dataclass,
    get_added_field_migrations,
    read_artifact,
    write_artifact,
)
from autotune.trials import TrialFigures
from fsdp_runtime.files import write_atomic

RESULTS_KIND = "search_results"


R = TypeVar("R", bound=TrialFigures)


def pick_best(trials: Iterable[R]) -> R | None:
    """The best trial: succeeded, feasible under the memory budget, then the lowest objective
    (the paired step-time ratio against the defaults; the step time where a trial has no ratio)."""
    done = [t for t in trials if t.succeeded and t.feasible and t.objective is not None]
    return min(done, key=lambda t: t.objective) if done else None


@dataclass(kw_only=True)
class TrialRow(TrialFigures):
    """One trial of the study as the search, its tables and ``results.json`` see it: its
    :class:`~autotune.trials.TrialFigures` and what the study knows of it."""

    number: int
    state: str
    """Optuna's state: COMPLETE, PRUNED, FAIL, RUNNING, WAITING."""
    ratio_q25: float | None = None
    ratio_q75: float | None = None
    noisy: bool = False
    """Its ratio still spread wider than ``max_ratio_spread`` after its most pairs (before v9: after a re-measurement)."""
    attempts: int = 1
    """Measurement windows: 2 when the first one pruned the trial or spread too wide to rank."""
    first_status: str | None = None
    """The first window's status (``ok`` or ``pruned``) when the trial was measured twice."""
    first_ratio: float | None = None
    refined_from: str | None = None
    """How a refinement trial was made from the incumbent ([Note: refinement]); None: sampled."""
    exposed_comm_ms: float | None = None
    overlap_ratio: float | None = None
    bound_ratio: float | None = None
    is_default: bool = False
    duplicate_of: int | None = None
    """The trial that measured the same effective config (this one was not run again)."""
    trial_dir: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    predicted_step_ms: float | None = None
    """The step time the calibrated simulator predicted ([Note: presearch]); None without ``--presearch``."""
    predicted_ratio: float | None = None
    """That prediction over the defaults' predicted step (compare with :attr:`ratio`)."""
    presearch_rank: int | None = None
    """Its rank among the simulated configs when ``--presearch`` enqueued it; None: sampled or refined."""
    calibration: str | None = None
    """Which of the presearch's calibration trials it was (``no_sync``, ...; [Note: presearch]); None: not one."""
    stopped: str | None = None
    """Why its pairs stopped ([Note: sequential measurement]: ``faster``, ``slower``, ``settled``, ``unlikely`` ([Note: futility]),
    ``max_blocks``); None: a fixed number of pairs (before v9) or not measured."""
    ratio_to_reference: float | None = None
    """Its median block ratio to the trial it was paired with ([Note: measured against the best]);
    None: paired with the defaults, so :attr:`ratio` is the measured one."""
    reference_trial: int | None = None
    """The trial it was paired with; None: the defaults."""
    reference_ratio: float | None = None
    """That trial's ratio to the defaults it was chained through (an anchor's where one was measured)."""
    reference_drift: float | None = None
    """How far the reference's median step moved from where its ratio was measured (relative)."""

    @property
    def succeeded(self) -> bool:
        """Optuna's state is COMPLETE: the study's record, not the trial's own :attr:`status`."""
        return self.state == "COMPLETE"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "row", what: str = "trial row") -> TrialRow:
        names = {f.name for f in dataclasses.fields(cls)}
        body = {k: v for k, v in data.items() if k in names} if isinstance(data, dict) else data
        return build_dataclass(cls, body, source=source, what=what)


def _migrate_row_v1(row: dict[str, Any] | None) -> dict[str, Any] | None:
    if row is None:
        return None
    row = dict(row)
    row["process_peak_bytes"] = row.pop("peak_memory_bytes", None)
    return row


def _migrate_summary_v1(data: dict[str, Any]) -> dict[str, Any]:
    """v1 -> v2: rows name the process peak ``process_peak_bytes``."""
    return {**data, "best": _migrate_row_v1(data.get("best")), "default": _migrate_row_v1(data.get("default"))}


def _migrate_summary_v6(data: dict[str, Any]) -> dict[str, Any]:
    """v6 -> v7: a final round's figures were medians of single pairs (``estimator = "pairs"``);
    from v7 they are medians of ABBA blocks measured after settle steps ([Note: switch cost])."""
    confirmation = data.get("confirmation")
    if isinstance(confirmation, dict):
        confirmation = {**confirmation, "estimator": confirmation.get("estimator", "pairs")}
    return {**data, "confirmation": confirmation}


def _migrate_summary_v10(data: dict[str, Any]) -> dict[str, Any]:
    """v10 -> v11: a config was emitted over the defaults or the recipe on a median ratio below 1
    (``emit_rule = "median"``), and the final round's speedup was the figure of the round that chose
    the config (``speedup_from = "selection"``); from v11, on a window's interval and from a window
    that did not choose it ([Note: emitted on an interval] in :mod:`autotune.search.verdict`)."""
    confirmation, recipe = data.get("confirmation"), data.get("recipe")
    if isinstance(confirmation, dict):
        confirmation = {"emit_rule": "median", "speedup_from": "selection", **confirmation}
    if isinstance(recipe, dict) and recipe.get("measured"):
        recipe = {"emit_rule": "median", **recipe}
    return {**data, "confirmation": confirmation, "recipe": recipe}


@dataclass(kw_only=True)
class SearchRecord:
    """``search.json``: what a search found (read back by ``autotune report``)."""

    KIND: ClassVar[str] = "search_summary"
    SCHEMA_VERSION: ClassVar[int] = 12
    # v3 rows gained the paired fields, v4 rows the measurement attempts and refinement origin, v5 rows the
    # simulator's prediction and the record its presearch, v6 rows which presearch calibration trial they were:
    # all with defaults; v7 the final round's estimator (blocks after settle steps, was single pairs); v8 the
    # trials' precision, whether the reduce dtype was searched, and notes on the environment (defaults: unknown, none);
    # v9 what the search was asked to measure and did not (``shortfall``; default: none said), the
    # drift ``anchors`` (default: none), and rows
    # why their pairs stopped and what they were paired with (``stopped``, ``ratio_to_reference``,
    # ``reference_trial``, ``reference_ratio``, ``reference_drift``; defaults: the defaults, a fixed count);
    # v10 the emitted config against torchtitan's recipe (``recipe``; default: none measured); v11 a config
    # emitted over a baseline only on an interval, its speedup from a window that did not choose it; v12 the
    # search plan (``search_plan``: target, links, rounds and cost), the ``baseline`` (defaults: none
    # recorded, FSDP2's defaults) and what each round ran (``rounds``; default: none recorded).
    MIGRATIONS: ClassVar[dict] = {
        1: _migrate_summary_v1,
        **get_added_field_migrations(2, 3, 4, 5),
        6: _migrate_summary_v6,
        **get_added_field_migrations(7, 8, 9),
        10: _migrate_summary_v10,
        **get_added_field_migrations(11),
    }

    model: str
    proxy: dict[str, Any] = field(default_factory=dict)
    """``is_proxy``, ``name``, ``reason``, ``overrides`` (see [Note: scale proxy])."""
    num_trials: int = 0
    stopped_because: str = ""
    best: TrialRow | None = None
    default: TrialRow | None = None
    confirmation: dict[str, Any] | None = None
    """The final round ([Note: emitted on an interval] in :mod:`autotune.search.verdict`): the
    finalists re-measured against the defaults, the ``chosen`` one, its ``verdict_window`` (v11),
    ``emitted`` (``best``, ``defaults`` or ``search``), the ``verdict`` line where the defaults are
    emitted, and the speedup over the defaults (``speedup_*``; from ``speedup_from``: the window
    that did not choose the config, ``verdict``, or before v11 the round that chose it, ``selection``),
    with ``interval_covers`` beside its 90% interval (``speedup_low``-``speedup_high``): what that
    interval covers, said in words (a record written before it says nothing, and covers the same)."""
    consolidation: dict[str, Any] | None = None
    """Seconds per consolidation method of the emitted config, and the chosen one."""
    best_config: str | None = None
    report: list[str] = field(default_factory=list)
    report_error: str | None = None
    presearch: dict[str, Any] | None = None
    """``--presearch``: configs ranked, calibration notes, predicted vs measured error (v5)."""
    mixed_precision: dict[str, Any] | None = None
    """``param_dtype`` and ``reduce_dtype`` of every trial (v8; None: an older search, which set none)."""
    searched_reduce_dtype: bool = False
    """The reduce dtype was a knob of the space (``--search-reduce-dtype``, v8)."""
    notes: list[str] = field(default_factory=list)
    """Lines about the environment that change what the trials measured, each with its fix
    (``CUDA_DEVICE_MAX_CONNECTIONS=1``: :func:`autotune.trials.get_overlap_warning`; v8)."""
    shortfall: list[str] = field(default_factory=list)
    """What the search was asked to measure and did not, one line each (fewer measured trials
    than asked, failed trials, calibration trials missing: :mod:`autotune.search.shortfall`; v9)."""
    anchors: dict[str, Any] = field(default_factory=dict)
    """Per reference trial, its ratio to the defaults measured again after its steps drifted
    ([Note: measured against the best] in :mod:`autotune.search.reference`; v9)."""
    recipe: dict[str, Any] | None = None
    """The config to emit measured against torchtitan's recipe in the final round ([Note: beating
    the recipe] in :mod:`autotune.search.recipe`): ``measured`` (and ``reason`` where not), the
    pair figures (``ratio``: emitted / recipe step), ``speedup_*`` over the recipe, and
    ``emitted``: ``search`` or ``recipe`` (the search's config was not shown faster: ``verdict``, v11).
    None: before v10."""

    search_plan: dict[str, Any] | None = None
    """What the search planned before its first trial ([Note: the search plan] in
    :mod:`autotune.search.search_plan`): the target, the links, each round's most builds and steps and
    the estimated wall (v12; None: before)."""
    baseline: dict[str, Any] | None = None
    """The reference of every pair, which every speedup is over: ``name``, ``checkpointing``, ``reason``
    (v12; None: before, FSDP2's defaults)."""
    rounds: dict[str, Any] | None = None
    """What each round ran ([Note: round costs] in :mod:`autotune.search.cost`): ``by_round`` (runs,
    steps, builds, ``run_s`` in runs, ``seconds`` in the round, the most steps and builds planned),
    ``total``, ``planned``, the rates, ``eta_after_first_trial_s`` and each run's figures (``runs``)
    (:meth:`~autotune.search.cost.RoundLedger.to_dict`; v12; None: before)."""

    def to_dict(self) -> dict[str, Any]:
        body = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        body |= {
            "best": self.best.to_dict() if self.best else None,
            "default": self.default.to_dict() if self.default else None,
        }
        return {"schema_version": self.SCHEMA_VERSION, "kind": self.KIND, **body}

    @classmethod
    def read(cls, path: str | Path) -> SearchRecord:
        data = read_artifact(path, kind=cls.KIND, version=cls.SCHEMA_VERSION, migrations=cls.MIGRATIONS)
        names = {f.name for f in dataclasses.fields(cls)}
        body = {k: v for k, v in data.items() if k in names}  # fields of newer minor additions are ignored
        for key in ("best", "default"):
            body[key] = TrialRow.from_dict(body[key], source=str(path), what=key) if body.get(key) else None
        return build_dataclass(cls, body, source=str(path), what="search summary")

    def write(self, path: str | Path) -> Path:
        return write_artifact(path, self.to_dict())


_CSV_FIELDS = ["number", "state", *(f.name for f in dataclasses.fields(TrialRow) if f.name not in ("number", "state"))]
"""``results.csv``'s columns: the trial number and Optuna state first, then every other field of a row."""


def write_results(rows: list[TrialRow], out_dir: Path) -> None:
    """``results.json`` (versioned) and ``results.csv`` (params as a JSON column)."""
    write_artifact(
        out_dir / "results.json",
        {"schema_version": SearchRecord.SCHEMA_VERSION, "kind": RESULTS_KIND, "trials": [r.to_dict() for r in rows]},
    )
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=_CSV_FIELDS)
    writer.writeheader()
    for row in rows:
        writer.writerow({**row.to_dict(), "params": json.dumps(row.params, sort_keys=True)})
    write_atomic(out_dir / "results.csv", buffer.getvalue())


def _migrate_results_v1(data: dict[str, Any]) -> dict[str, Any]:
    trials = data.get("trials")
    return (
        {**data, "trials": [_migrate_row_v1(r) if isinstance(r, dict) else r for r in trials]}
        if isinstance(trials, list)
        else data
    )


def read_results(out_dir: Path) -> list[TrialRow]:
    """The rows of ``results.json``."""
    path = out_dir / "results.json"
    data = read_artifact(
        path,
        kind=RESULTS_KIND,
        version=SearchRecord.SCHEMA_VERSION,
        # results.json shares search.json's version; its rows did not change in v7
        migrations={1: _migrate_results_v1, **dict.fromkeys(range(2, SearchRecord.SCHEMA_VERSION), lambda d: d)},
    )
    trials = data.get("trials")
    if not isinstance(trials, list):
        raise ArtifactError(f"{path}: 'trials' must be a list of rows")
    return [TrialRow.from_dict(r, source=str(path), what=f"trials[{i}]") for i, r in enumerate(trials)]
