"""The ask/tell loop: sample a config, run it as a trial, tell Optuna what it measured.

[Note: search robustness]
- Several workers may share one study (``--storage`` URL, same ``--study-name``): each
  asks and runs its own trials; trial dirs are named by Optuna's study-wide trial number,
  so workers never collide, and every worker stops when the study holds ``num_trials``.
- ``--resume`` continues a study: finished trials are kept, the model plan (proxy shape)
  stored with the study is reused so old and new trials measure the same thing, and this
  host's trials left RUNNING by a dead worker are closed as FAIL ("interrupted").
- Every trial is measured against a reference on the same ranks ([Note: paired measurement]
  in :mod:`autotune.trials.paired`): the defaults, or with ``--reference best`` the best trial
  so far ([Note: measured against the best] in :mod:`autotune.search.reference`); its objective
  is its median block ratio to the defaults (chained through the reference's with ``best``), so
  background load cancels instead of deciding.
- A trial measures until its ratio is known ([Note: sequential measurement] in
  :mod:`fsdp_runtime.tuning.sequential`): clearly faster than the best, clearly slower (pruned,
  from its second block on, so one burst of load on a block's candidate steps cannot prune a
  config), or settled; a tie runs to ``num_measured`` pairs, and a ratio still spread wider
  than ``max_ratio_spread`` there is flagged ``noisy``. A failed trial (timeout, crash, OOM,
  invalid config) is told as FAIL with its reason and never stops the search; its time limit
  follows what this box measured ([Note: trial timeouts] in :mod:`autotune.search.timeouts`),
  so a slow box makes trials slow, not failed. A trial whose peak memory exceeds the budget
  is infeasible (Optuna constraint > 0) and never best.
- The budget (``num_trials``) counts measured trials, not enqueued ones (:func:`count_measured`).
- Two parameter sets that expand to the same effective config (``config_hash``) are
  measured once: the second is told the first one's result (``duplicate_of``).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from pathlib import Path
from typing import Any

import optuna

from autotune.search.context import SearchContext
from autotune.search.outcome import Outcome, record
from autotune.search.reference import DRIFT_LIMIT, Reference, chain, choose_reference, get_drift, measure_anchor
from autotune.search.refine import ORIGIN_ATTR, enqueue_neighbour
from autotune.search.results import TrialRow, pick_best
from autotune.search.settings import SearchError
from autotune.search.study import close_interrupted, get_worker_id, record_first_heartbeat
from autotune.trials import NodePool, RankPool, TrialResult, get_default_backend, get_pool_secret, parse_oom
from fsdp_runtime import RuntimeConfig, dumps_config

PLATEAU_MIN_GAIN = 0.01
FINISHED_STATES = ("COMPLETE", "PRUNED", "FAIL")
_COPIED_ATTRS = (
    "status",
    "reason",
    "step_ms",
    "ratio",
    "ratio_q25",
    "ratio_q75",
    "ratio_spread",
    "noisy",
    "profiler_overhead",
    "process_peak_bytes",
    "memory_over_budget",
    "exposed_comm_ms",
    "overlap_ratio",
    "bound_ratio",
    "trial_dir",
    "stopped",
    "ratio_to_reference",
    "reference_trial",
    "reference_ratio",
)


def get_config_hash(config: RuntimeConfig) -> str:
    """A stable hash of the effective config (what the ranks would run)."""
    return hashlib.sha256(dumps_config(config, "json").encode()).hexdigest()[:16]


def to_row(trial: optuna.trial.FrozenTrial) -> TrialRow:
    attrs = trial.user_attrs
    return TrialRow(
        number=trial.number,
        state=trial.state.name,
        status=attrs.get("status", trial.state.name.lower()),
        reason=attrs.get("reason", ""),
        step_ms=attrs.get("step_ms"),
        ratio=attrs.get("ratio"),
        ratio_q25=attrs.get("ratio_q25"),
        ratio_q75=attrs.get("ratio_q75"),
        ratio_spread=attrs.get("ratio_spread"),
        noisy=bool(attrs.get("noisy", False)),
        attempts=int(attrs.get("attempts", 1)),
        refined_from=attrs.get(ORIGIN_ATTR),
        first_status=attrs.get("first_status"),
        first_ratio=attrs.get("first_ratio"),
        profiler_overhead=attrs.get("profiler_overhead"),
        process_peak_bytes=attrs.get("process_peak_bytes", attrs.get("peak_memory_bytes")),
        exposed_comm_ms=attrs.get("exposed_comm_ms"),
        overlap_ratio=attrs.get("overlap_ratio"),
        bound_ratio=attrs.get("bound_ratio"),
        feasible=attrs.get("memory_over_budget", 0.0) <= 0.0,
        is_default=bool(attrs.get("is_default", False)),
        duplicate_of=attrs.get("duplicate_of"),
        trial_dir=attrs.get("trial_dir"),
        params=dict(trial.params),
        predicted_step_ms=attrs.get("predicted_step_ms"),
        predicted_ratio=attrs.get("predicted_ratio"),
        presearch_rank=attrs.get("presearch_rank"),
        calibration=attrs.get("calibration"),
        stopped=attrs.get("stopped"),
        ratio_to_reference=attrs.get("ratio_to_reference"),
        reference_trial=attrs.get("reference_trial"),
        reference_ratio=attrs.get("reference_ratio"),
        reference_drift=attrs.get("reference_drift"),
    )


def get_rows(study: optuna.Study) -> list[TrialRow]:
    return sorted((to_row(t) for t in study.get_trials(deepcopy=False)), key=lambda r: r.number)


def _headline(result: TrialResult) -> dict[str, Any]:
    """The overlap figures of a trial's trace metrics (median over ranks and steps)."""
    aggregate = ((result.metrics.trace_metrics if result.metrics else None) or {}).get("aggregate") or {}
    return {k: aggregate.get(k) for k in ("exposed_comm_ms", "overlap_ratio", "bound_ratio")}


def get_outcome(ctx: SearchContext, number: int, result: TrialResult, reference: Reference | None = None) -> Outcome:
    """What trial ``number`` tells the study about ``result``, measured against ``reference``
    (None: the defaults; its ratio is chained to the defaults: [Note: measured against the best])."""
    attrs: dict[str, Any] = {"status": result.status, "reason": result.reason[:1000]}
    constraints = {}
    if result.step_ms is not None:
        attrs["step_ms"] = result.step_ms
    if result.process_peak_bytes is not None:
        attrs["process_peak_bytes"] = result.process_peak_bytes
        if ctx.settings.memory_budget_bytes is not None:
            over = float(result.process_peak_bytes - ctx.settings.memory_budget_bytes)
            attrs["memory_over_budget"] = constraints["memory_over_budget"] = over  # TPE learns feasibility from it
    oom = parse_oom(result.reason) if result.status == "oom" else None
    if oom is not None:  # infeasible on this device, with what the rank held when it ran out ([Note: the search plan])
        attrs["process_peak_bytes"] = oom[0]
        attrs["memory_over_budget"] = constraints["memory_over_budget"] = float(max(1, oom[1]))
    attrs |= {k: v for k, v in _headline(result).items() if v is not None}
    paired = result.metrics.paired if result.metrics else {}
    if reference is not None and not reference.is_defaults and paired.get("ratio") is not None:
        attrs["ratio_to_reference"] = paired["ratio"]
        paired = chain(paired, reference)
    attrs |= {k: paired[k] for k in ("ratio", "ratio_q25", "ratio_q75", "ratio_spread") if paired.get(k) is not None}
    if result.metrics and result.metrics.profiler_overhead is not None:
        attrs["profiler_overhead"] = result.metrics.profiler_overhead
    objective = paired.get("ratio", result.step_ms)
    if result.status == "ok" and objective is not None:
        return Outcome(number=number, state="COMPLETE", value=objective, user_attrs=attrs, constraints=constraints)
    if result.status == "pruned":
        return Outcome(number=number, state="PRUNED", intermediate=objective, user_attrs=attrs, constraints=constraints)
    return Outcome(number=number, state="FAIL", user_attrs=attrs, constraints=constraints)


def _find_measured(study: optuna.Study, config_hash: str) -> optuna.trial.FrozenTrial | None:
    """A finished trial that measured the same effective config (a failure counts: it would fail again)."""
    done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)
    for t in study.get_trials(deepcopy=False, states=done):
        if (
            t.user_attrs.get("config_hash") == config_hash
            and "duplicate_of" not in t.user_attrs
            and t.user_attrs.get("status") != "interrupted"
        ):
            return t
    return None


def _duplicate_outcome(number: int, original: optuna.trial.FrozenTrial) -> Outcome:
    attrs = {key: original.user_attrs[key] for key in _COPIED_ATTRS if key in original.user_attrs} | {
        "duplicate_of": original.number
    }
    constraints = {"memory_over_budget": attrs["memory_over_budget"]} if "memory_over_budget" in attrs else {}
    state = original.state.name if original.state.name in ("COMPLETE", "PRUNED") else "FAIL"
    return Outcome(
        number=number,
        state=state,
        value=original.value if state == "COMPLETE" else None,
        user_attrs=attrs,
        constraints=constraints,
    )


def _interrupted_outcome(number: int) -> Outcome:
    return Outcome(
        number=number,
        state="FAIL",
        user_attrs={
            "status": "interrupted",
            "reason": "the search was stopped (Ctrl-C or SIGTERM) while this trial ran",
        },
    )


def run_one(ctx: SearchContext, best: TrialRow | None, *, against_defaults: bool = False) -> TrialRow:
    """Ask for a config, run (or recognise) it, tell the study; returns the trial's row. It must beat
    ``best`` ([Note: sequential measurement]); it is paired with the defaults, or with ``best`` under
    ``--reference best`` ([Note: measured against the best]) unless ``against_defaults`` (the
    presearch's calibration)."""
    ctx.round = "trials"  # [Note: round costs]: the presearch's trials too
    trial = ctx.study.ask()
    trial.set_user_attr("worker", get_worker_id())
    record_first_heartbeat(ctx.study, trial)
    config = ctx.space.suggest(trial)
    config_hash = get_config_hash(config)
    trial.set_user_attr("config_hash", config_hash)
    original = _find_measured(ctx.study, config_hash)
    if original is not None:
        outcome = _duplicate_outcome(trial.number, original)
    else:
        trial_dir = ctx.settings.out_dir / "trials" / f"trial_{trial.number:04d}"
        trial.set_user_attr("trial_dir", str(trial_dir.relative_to(ctx.settings.out_dir)))
        rows = get_rows(ctx.study)
        reference = choose_reference(ctx, rows, None if against_defaults else best)
        # What the trial must beat, as a ratio to its reference: the best so far (the defaults' 1.0 before any).
        beat = best.ratio / reference.ratio if best is not None and best.ratio and best.feasible else 1.0
        try:
            result, attrs = _measure(
                ctx, config, trial_dir, reference, trial.number, beat=beat, calibration=against_defaults
            )
        except KeyboardInterrupt:
            record(
                ctx.study,
                _interrupted_outcome(trial.number),
                pending_dir=ctx.settings.out_dir / "pending",
                retry_wait_s=0.1,
            )
            raise
        outcome = get_outcome(ctx, trial.number, result, attrs.pop("reference"))
        outcome.user_attrs |= attrs
    record(ctx.study, outcome, pending_dir=ctx.settings.out_dir / "pending")
    return to_row(next(t for t in ctx.study.get_trials(deepcopy=False) if t.number == trial.number))


def _too_noisy(result: TrialResult, max_spread: float) -> bool:
    spread = result.metrics.paired.get("ratio_spread") if result.metrics else None
    return result.status == "ok" and spread is not None and spread > max_spread


def _measure(
    ctx: SearchContext,
    config: RuntimeConfig,
    trial_dir: Path,
    reference: Reference,
    number: int,
    *,
    beat: float,
    calibration: bool,
) -> tuple[TrialResult, dict[str, Any]]:
    """Run the trial against ``reference`` until the stopping rule says its ratio is known
    ([Note: sequential measurement]): clearly below ``beat`` (the best so far, as a ratio to the
    reference), clearly above it times ``prune_ratio`` (pruned), or settled; with ``--reference
    best``, measure an anchor when the reference drifted ([Note: measured against the best]).
    Returns the result and the attributes that say how it was measured."""
    is_defaults = config == reference.config
    # The defaults against themselves measure the noise: nothing to decide but its precision.
    # Calibration trials are never pruned: the presearch reads their traces.
    rule = ctx.get_stopping_rule(prune=not (is_defaults or calibration), faster_below=None if is_defaults else beat)
    # Traces are read from the defaults and the calibration trials (the presearch) and from the
    # config to emit (the report): profiled at the end where the recipe round runs ([Note: the
    # emitted config's trace]), else in its trial, so a trial that did not beat the best skips it.
    profile = is_defaults or calibration or not ctx.profile_at_end
    profile_below = None if (is_defaults or calibration) else beat
    spec = ctx.trial_spec(
        config, trial_dir, profile=profile, reference=reference.config, stopping=rule, profile_below=profile_below
    )
    result = ctx.run(spec)
    attrs: dict[str, Any] = {"stopped": result.metrics.stopped if result.metrics else None}
    if is_defaults:
        return result, attrs | {"reference": None}
    drift = get_drift(reference, result)
    if drift is not None:
        attrs["reference_drift"] = drift
    if (
        not reference.is_defaults
        and drift is not None
        and abs(drift) > DRIFT_LIMIT
        and result.status in ("ok", "pruned")
    ):
        reference = measure_anchor(ctx, reference, at_trial=number, drift=drift)
        attrs["anchored"] = True
    if _too_noisy(result, ctx.settings.max_ratio_spread):
        attrs["noisy"] = True
    attrs["reference_trial"] = reference.trial
    attrs["reference_ratio"] = reference.ratio
    return result, attrs | {"reference": reference}


def plateaued(rows: list[TrialRow], patience: int | None) -> bool:
    """True when the last ``patience`` finished trials brought no >= 1% improvement."""
    if patience is None:
        return False
    best_value, since = None, 0
    for r in rows:
        if r.state not in ("COMPLETE", "PRUNED", "FAIL"):
            continue
        value = r.objective if r.succeeded and r.feasible else None
        if value is not None and (best_value is None or value < best_value * (1 - PLATEAU_MIN_GAIN)):
            best_value, since = value, 0
        else:
            since += 1
    return best_value is not None and since >= patience


def wait_for_other_workers(study: optuna.Study, *, timeout_s: float, poll_s: float = 1.0) -> None:
    """Until no other worker's trial is RUNNING: each finishes (a hung one is killed by its
    trial timeout) or is closed as interrupted once its worker is found dead (its heartbeat
    stopped, or its PID is gone). Without this, a worker that reached the trial count while
    another worker's last trial ran would confirm and emit without that trial, and a dead
    worker's trial would stay RUNNING with no live worker left to close it. Gives up after
    ``timeout_s`` (a trial's timeout and then some: a worker on another host of a shared
    SQLite file cannot be seen to die; ``--resume`` closes its trial later)."""
    me, deadline = get_worker_id(), time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(
        t.user_attrs.get("worker") != me
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    ):
        close_interrupted(study)
        time.sleep(poll_s)


def count_measured(rows: list[TrialRow]) -> int:
    """Trials that used up the budget: finished (COMPLETE, PRUNED, FAIL; a duplicate was told a
    result), except those closed as interrupted, which measured nothing. An enqueued (WAITING)
    trial has not been measured: counting it stopped a search before the presearch's picks ran."""
    return sum(r.state in FINISHED_STATES and r.status != "interrupted" for r in rows)


def count_budget_used(rows: list[TrialRow]) -> int:
    """Measured trials and those running now (another worker's: this worker runs none while it
    asks), so that several workers together stop at ``num_trials``."""
    return count_measured(rows) + sum(r.state == "RUNNING" for r in rows)


def search_loop(ctx: SearchContext) -> str:
    """Run trials until the study holds ``num_trials`` measured ones or the search plateaus and
    has no refinement left to try ([Note: refinement]); returns why it stopped."""
    settings = ctx.settings
    num_refine = settings.get_num_refine()
    while True:
        rows = get_rows(ctx.study)
        if count_budget_used(rows) >= settings.num_trials:
            wait_for_other_workers(ctx.study, timeout_s=ctx.get_trial_timeout_s() + 60)
            return f"reached {settings.num_trials} trials"
        plateau = plateaued(rows, settings.patience)
        if plateau or len(rows) >= settings.num_trials - num_refine:
            refined = sum(r.refined_from is not None for r in rows if r.state != "WAITING")
            origin = enqueue_neighbour(ctx.study, ctx.space, rows, get_config_hash) if refined < num_refine else None
            if origin is None and plateau:
                return f"plateau: no >=1% improvement in {settings.patience} trials"
        ctx.ledger.set_trials_done(count_measured(rows))
        ctx.reporter.on_trial_start(count_measured(rows), settings.num_trials)
        row = run_one(ctx, pick_best(rows))
        ctx.ledger.set_trials_done(count_measured([*rows, row]))
        ctx.reporter.on_trial_end(row, pick_best([*rows, row]))


def warm_up(ctx: SearchContext) -> None:
    """One unrecorded defaults run as long as a trial, first: a fresh process's first jobs pay
    page faults for fresh heap, gloo connections and autograd warm-up, which would otherwise
    be charged to trial 0 (the defaults) and make every ratio to it look better than it is."""
    ctx.round = "warm-up"
    ctx.reporter.on_phase("warming up the ranks (not recorded)")
    result = ctx.run(ctx.trial_spec(ctx.default_config, ctx.write_dir / "warmup", profile=False, paired=False))
    if result.status == "oom":  # the baseline must run: every pair's reference is it ([Note: the search plan])
        raise SearchError(
            get_baseline_oom_message(ctx.space.baseline_checkpointing, result.reason), field="baseline_checkpointing"
        )


def get_baseline_oom_message(baseline: str, reason: str) -> str:
    """One line for a baseline that ran out of memory: what it held, and the next checkpointing to try."""
    oom = parse_oom(reason)
    held = f" at {oom[0] / 2**30:.1f} GiB in use, {oom[1] / 2**30:.2f} GiB more asked" if oom else ""
    levels = ("none", "selective", "full")
    name = "FSDP2's defaults" + ("" if baseline == "none" else f" with {baseline} activation checkpointing")
    if baseline == levels[-1]:
        fix = "the model does not train on this GPU even so: use more GPUs (--nproc), a shorter --seq-len or --proxy"
    else:
        fix = f"run with --baseline-ac {levels[levels.index(baseline) + 1]} and a new --out"
    return f"the baseline ({name}) ran out of memory in the warm-up{held}, so no pair could run: {fix}"


def open_pool(settings: Any) -> contextlib.AbstractContextManager:
    """A rank pool for the whole search (gloo on CPU, NCCL on CUDA: [Note: rank pool]); with
    ``workers``, the ranks torchrun starts on every node ([Note: node pool]); or nothing
    (``use_pool=False``)."""
    if settings.workers is not None:
        from profiles import load_cluster_profile

        per_node = load_cluster_profile(settings.cluster).ranks_per_node if settings.cluster is not None else None
        return NodePool(
            settings.world_size,
            address=settings.workers,
            secret=get_pool_secret(settings.out_dir),
            backend=get_default_backend(),
            join_timeout_s=settings.join_timeout_s,
            ranks_per_node=per_node,
        )
    if not settings.use_pool:
        return contextlib.nullcontext()
    allow = (settings.rank_program,) if settings.rank_program else ()
    return RankPool(settings.world_size, backend=get_default_backend(), allow=allow)
