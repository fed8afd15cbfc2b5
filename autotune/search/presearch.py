"""``autotune search --presearch sim``: the space ranked by the calibrated simulator, its fastest measured first.

[Note: presearch]
``autotune search --presearch sim`` measures the defaults trial first (trial 0, profiled as
every trial is), calibrates the simulator on it ([Note: calibration] in
:mod:`autotune.sim.calibrate`: this machine, this workload, these links), simulates every
point of the space, and enqueues the ``presearch_top_k`` fastest predicted configs (distinct
effective configs, the defaults excluded) as Optuna trials: they are measured first, as
ordinary trials (paired with the defaults, prunable), each carrying its prediction
(``predicted_step_ms``, ``predicted_ratio`` = predicted step / the defaults' predicted step)
and its rank. Trials the sampler or the refinement proposes afterwards are predicted too, at
the end, from the calibration the study keeps (``study.user_attrs["presearch"]``, so a
resumed study predicts with the same profile). ``search.json`` (v5; v6 rows name their
calibration trial) and the rows record predicted vs measured; the terminal shows them in a
table of their own. CPU only: the calibration reads the host's time between FSDP2's labels,
which on a GPU is launch time.

Before calibrating, the presearch measures a few calibration trials, points of the space
that show what the defaults cannot ([Note: calibration trials] in
:mod:`autotune.search.calibration_trials`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.search.calibration_trials import run_calibration_trials
from autotune.search.ranking import RankedPoint, get_simulated_space, rank_space
from autotune.search.settings import SearchError
from autotune.search.space import SearchSpace, describe_params_diff
from autotune.sim import (
    CalibrationError,
    CalibrationTrial,
    Hardware,
    MeasuredProfile,
    Simulator,
    calibrate,
    get_model_work,
    read_calibration_trial,
)

if TYPE_CHECKING:
    from autotune.search.context import SearchContext
    from autotune.search.results import TrialRow

PRESEARCH_KINDS = ("sim",)
PRESEARCH_ATTR = "presearch"


@dataclass(kw_only=True)
class Predictor:
    """A calibrated simulator of a search's workload on this machine."""

    space: SearchSpace
    simulator: Simulator
    default_step_s: float
    summary: dict[str, Any] = field(default_factory=dict)

    def predict(self, params: dict[str, Any]) -> dict[str, float]:
        """The predicted step and ratio; none for a config the simulator does not model (a root split)."""
        if params.get("root_split", "none") != "none":
            return {}
        step = self.simulator.simulate(self.space.build_config(params)).step_s
        return {"predicted_step_ms": 1e3 * step, "predicted_ratio": step / self.default_step_s}


def make_predictor(ctx: SearchContext, measured: MeasuredProfile) -> Predictor:
    """The simulator for ``ctx``'s workload, links and world size, priced by ``measured`` (a MeasuredProfile):
    any model source the trials train (a profile, a factory, an HF config, torchtitan's), traced on fake tensors."""
    from profiles import load_cluster_profile

    run = ctx.plan.run
    hardware = Hardware(
        load_cluster_profile(ctx.settings.cluster or "cpu-gloo"), num_ranks=ctx.settings.world_size, measured=measured
    )
    simulator = Simulator(get_model_work(run, get_param_dtype(ctx.space)), hardware)
    default_step = simulator.simulate(ctx.space.build_config(ctx.space.get_default_params())).step_s
    return Predictor(space=ctx.space, simulator=simulator, default_step_s=default_step)


def get_param_dtype(space: SearchSpace) -> str:
    """The dtype the simulated workload is traced in: the trials' param dtype (their compute dtype)."""
    return space.mixed_precision.param_dtype or "float32"


def get_default_top_k(settings: Any, num_calibration: int = 0) -> int:
    """Every sampled slot but the defaults' and the calibration trials': the trials before the refinement ([Note: refinement])."""
    if settings.presearch_top_k is not None:
        return max(1, min(settings.presearch_top_k, settings.num_trials - 2 - num_calibration))
    return max(0, min(settings.num_trials - 2, settings.num_trials - 1 - settings.get_num_refine()) - num_calibration)


def run_presearch(ctx: SearchContext) -> None:
    """Measure the defaults, calibrate on them, rank the space, enqueue the top-k (see [Note: presearch])."""
    settings, study = ctx.settings, ctx.study
    if settings.presearch is None or PRESEARCH_ATTR in study.user_attrs:
        return  # off, or done before this --resume
    if ctx.space.device_type != "cpu":
        raise SearchError(
            "--presearch sim calibrates from CPU traces; on GPUs measure the device with `autotune trial --nproc 1` and "
            "`autotune calibrate`, then rank configs with `autotune plan --device-profile`",
            field="presearch",
        )
    default = _measure_defaults(ctx)
    ctx.reporter.on_phase(
        "presearch: measuring the calibration trials (the defaults with async unshard, replicated, with eager concat)"
    )
    calibration_rows = run_calibration_trials(ctx)
    extra = _read_calibration_trials(ctx, calibration_rows)
    measured = _calibrate(ctx, default, extra)
    predictor = make_predictor(ctx, measured)
    started = time.perf_counter()
    ranked = rank_space(
        get_simulated_space(ctx.space), predictor.simulator, world_size=settings.world_size, device="cpu"
    )
    elapsed = time.perf_counter() - started
    chosen = _choose(ctx, ranked, calibration_rows)
    _enqueue(ctx, chosen, predictor)
    summary = {
        "kind": "sim",
        "num_ranked": len(ranked),
        "ranked_s": elapsed,
        "configs_per_s": len(ranked) / elapsed if elapsed else None,
        "num_enqueued": len(chosen),
        "calibrated_on": default.trial_dir,
        "calibration_trials": [str(t.path.relative_to(settings.out_dir)) for t in extra],
        "predicted_default_ms": 1e3 * predictor.default_step_s,
        "notes": measured.notes,
        "profile": measured.to_dict(),
    }
    study.set_user_attr(PRESEARCH_ATTR, summary)
    best = (
        f"{describe_params_diff(chosen[0].params, ctx.space.get_default_params())} at "
        f"{chosen[0].prediction.step_s / predictor.default_step_s:.3f}x"
        if chosen
        else "none"
    )
    ctx.reporter.on_phase(
        f"presearch: simulated {len(ranked)} configs ({summary['configs_per_s'] or 0:,.0f}/s); measuring the {len(chosen)} fastest first (best predicted: {best})"
    )


def _measure_defaults(ctx: SearchContext) -> TrialRow:
    """The study's finished defaults trial, run now if it has none; refused unless it succeeded with traces."""
    from autotune.search.loop import count_measured, get_rows, run_one

    default = next((r for r in get_rows(ctx.study) if r.is_default and r.state == "COMPLETE"), None)
    if default is None:
        ctx.reporter.on_trial_start(count_measured(get_rows(ctx.study)), ctx.settings.num_trials)
        default = run_one(ctx, None)
        ctx.reporter.on_trial_end(default, default if default.state == "COMPLETE" else None)
    if default.state != "COMPLETE" or default.trial_dir is None:
        raise SearchError(
            f"--presearch sim calibrates on the defaults trial, which did not succeed ({default.status}: {default.reason[:200]})",
            field="presearch",
        )
    return default


def _read_calibration_trials(ctx: SearchContext, rows: list[TrialRow]) -> list[CalibrationTrial]:
    """The calibration trials' traces as the calibration reads them; a trial it cannot read is left out, said in one line."""
    extra = []
    for row in rows:
        try:
            extra.append(read_calibration_trial(ctx.settings.out_dir / row.trial_dir))
        except CalibrationError as e:  # e.g. a trial that ran without traces: calibrate without it
            ctx.reporter.on_phase(f"presearch: trial {row.number} ({row.calibration}) left out of the calibration: {e}")
    return extra


def _calibrate(ctx: SearchContext, default: TrialRow, extra: list[CalibrationTrial]) -> MeasuredProfile:
    """The simulator's measured profile of this machine, from the defaults' and the calibration trials' traces."""
    ctx.reporter.on_phase(
        f"presearch: calibrating the simulator on the traces of the defaults and {len(extra)} calibration trials"
    )
    work_source = ctx.plan.run
    anchor = read_calibration_trial(ctx.settings.out_dir / default.trial_dir)
    # The defaults as timed alongside the calibration trials (their pairs' reference), else the defaults trial's own steps.
    references = [t.reference_step_s for t in extra if t.reference_step_s]
    return calibrate(
        get_model_work(work_source, get_param_dtype(ctx.space)),
        anchor,
        extra=extra,
        anchor_step_s=statistics.median(references) if references else None,
        name=f"{work_source.name} on this machine",
    )


def _choose(ctx: SearchContext, ranked: list[RankedPoint], calibration_rows: list[TrialRow]) -> list[RankedPoint]:
    """The fastest predictions with distinct effective configs, none measured already (the defaults, the calibration trials)."""
    from autotune.search.loop import get_config_hash

    top_k = get_default_top_k(ctx.settings, len(calibration_rows))
    seen = {get_config_hash(ctx.default_config)} | {
        get_config_hash(ctx.space.build_config(r.params)) for r in calibration_rows
    }
    chosen: list[RankedPoint] = []
    for point in ranked:
        if len(chosen) >= top_k:
            break
        config_hash = get_config_hash(ctx.space.build_config(point.params))
        if config_hash not in seen:
            seen.add(config_hash)
            chosen.append(point)
    return chosen


def _enqueue(ctx: SearchContext, chosen: list[RankedPoint], predictor: Predictor) -> None:
    """Each chosen point as an Optuna trial measured next, carrying its prediction and rank."""
    for rank, point in enumerate(chosen, 1):
        attrs = {
            "predicted_step_ms": 1e3 * point.prediction.step_s,
            "predicted_ratio": point.prediction.step_s / predictor.default_step_s,
            "presearch_rank": rank,
        }
        # Pin what the simulated space left out, or the sampler would pick it for this trial.
        params = {**point.params, "root_split": "none"} if ctx.space.can_split else point.params
        ctx.study.enqueue_trial(params, user_attrs=attrs)


def add_predictions(ctx: SearchContext, rows: list[TrialRow]) -> list[TrialRow]:
    """Rows with a prediction where the calibration the study keeps can give one (sampled and refined trials)."""
    summary = ctx.study.user_attrs.get(PRESEARCH_ATTR)
    if not summary:
        return rows
    predictor = make_predictor(ctx, MeasuredProfile.from_dict(summary["profile"]))
    return [
        row
        if row.predicted_step_ms is not None or not row.params
        else dataclasses.replace(row, **predictor.predict(row.params))
        for row in rows
    ]
