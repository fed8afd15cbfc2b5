"""Calibration: a :class:`~autotune.sim.measured.MeasuredProfile` of this machine from trials' traces.

[Note: calibration]
The simulator's CPU prices come from trials of the workload itself, not from datasheets
(a CPU box has none that predicts a gloo step). From each trial dir: ``metrics.json``
(the unprofiled step time, the cluster whose links were emulated), ``config.toml`` (what
ran) and the per-rank traces, read through :class:`autotune.analysis.FsdpTraceAnalysis`
(its events: the training thread's ``FSDP::`` labels, collectives with their holds, barriers).

- *Model compute per segment* (:func:`get_trace_costs`): the training thread's wall time
  between FSDP2's top-level labels, minus any communication in it, attributed by the label
  before it: after ``pre_forward (root)`` the head (embeddings); after ``pre_forward`` of a
  block its forward; after the last block's ``post_forward`` the tail (norm, output) and
  after the root's the loss (forward and backward, until the root's ``pre_backward``); after
  ``pre_backward (root)`` the tail's backward; after a block's ``pre_backward`` its backward;
  after block 0's post-backward labels the head's backward; after the last
  ``root_post_backward_callback`` of a step the optimizer step (AdamW, ``zero_grad``, the
  loss's ``.item()``); anything else (the batch, the barrier's tail) is per-microbatch
  overhead. Per microbatch, and per block for blocks; medians over ranks and profiled steps.
- *FSDP2's hooks*: the labels' own wall time minus communication: ``pre_forward`` /
  ``pre_backward`` holding the unit's ``all_gather_copy_out`` (unshard: copy-out and hook),
  without one (a hook that finds the unit unsharded), ``post_backward_accumulate`` /
  ``_reshard`` / ``_rs_wait`` (post-hook), ``post_backward_reduce`` (copy-in, post-reduce;
  the root's: its ``root_post_backward_callback``, which holds the root's whole post-backward
  and ``finalize_backward``); per call, blocks and root apart: the lower quartile
  (``trace_costs.HOOK_QUANTILE``) over every call of every rank and profiled step, not a
  per-step mean nor the median call. A hook that allocates a large buffer (the reduce's
  ``chunk_cat`` and gloo's clone of the reduce-scatter input, the unshard's all-gather output)
  runs now and then into a storm of page faults that multiplies that call's time; the profiled
  window is where they cluster (``wide``, raw loopback, 2 ranks, 2026-11-28: the anchor's two
  profiled steps ran 842 and 1266 ms against 509-650 ms unprofiled, with 10-50k page faults
  against 2-37k, and a block's 18.7 MB ``chunk_cat`` took 47-68 ms instead of 2.5 ms). Per-step
  means priced a block's reduce at 34-42 ms on three runs of one day against 14-16 ms the day
  before, which the compute scale then took out of compute (0.65 instead of 0.9-1.0), and
  replicated configs, which skip that hook, came out 20% too fast. The median call held on five
  recorded runs (8.6-10.2 ms) but not on a sixth, whose storms hit 10 of rank 0's 16 reduce calls:
  35.3 ms, a compute scale of 0.64 and replicated configs 20.8% too fast (``sim_accuracy`` wide /
  raw ratio median error 15.7%). Clean calls spread little, so their lower quartile sits near
  their median (``small``'s block reduce: 1.40 ms against 1.58 ms) and it stays clean while a
  quarter of the calls are: 4.8 ms on that run, which replays at 4.7% (``studies/sim_replay.py``
  recalibrates recorded runs; figures in docs/benchmarks.md, "Simulator accuracy", and docs/studies.md).
- *Hooks the anchor does not run* (``OPTIONAL_HOOK_KEYS``), from the first extra trial whose
  trace shows them: on a shard group of one (HSDP Nx1) FSDP2 unshards by a plain copy and
  reduces without a reduce-scatter (``unshard_local``/``reduce_local``: its pre-forward labels,
  its reduces); ``fsdp_runtime``'s ``eager_concat``/``eager_restore`` labels price
  FSDP1-style concat (``defer_concat = false``). Priced instead as memory traffic at the
  copy-out's speed (a lower bound: its Python is in it), every eager-concat config on ``wide``
  is over-predicted by 12-25% (``sim_accuracy``); without a trial on a shard group of one, its
  copies are priced like the anchor's copy-out.
- *Collectives*: each traced collective's duration (gloo span, extended by its link-emulation
  hold) with its bytes from the model's units and the trial's mesh (all-gather output,
  reduce-scatter input, all-reduce of the shard: what link emulation and nccl-tests count).
  Under emulation a duration is ``max(real, modelled)``: only those above 1.15x the modelled
  time say what the real transfer costs; the others are dropped, and a trial without link
  emulation (raw loopback, same world size) supplies them. Per kind (all-gather; reduce-scatter
  and all-reduce pooled: gloo runs both as an all-reduce) a least-squares
  ``latency + bytes x seconds_per_byte`` with both terms >= 0 (through the origin where a free
  fit would give a negative latency), bytes scaled to the anchor's group size by the ring
  factor (n-1)/n.
- *Memory speed* for copies the traces do not isolate (FSDP1-style concat, int-reshard
  clones, up-casts): the bytes FSDP2's copy-out and copy-in move over their hooks' time (a
  lower bound: the hooks' Python is in it).
- *Anchor*: every figure of work on the cores (compute, hooks, copies, the optimizer, and the
  collectives' real transfers, which gloo runs on the same cores) is scaled by one factor so
  that the simulator predicts the anchor's step exactly: its *unprofiled* median step, or the
  same config timed as the reference of paired trials (``anchor_step_s``). The traced window
  runs slower than unprofiled steps, and load on the machine slows all that work alike; an
  emulated link's hold is not work and is not scaled.
- *Wait at each collective* (``sync_s``): a synchronous gloo collective is a rendezvous; the
  rank that arrives first waits for the other, and on ranks that share the cores that wait
  is more than the traced span shows apart (on ``small``, raw loopback, 2 ranks, the defaults
  paid ~175 ms of a ~790 ms step that replication with skipped sync saved, where the traced
  collectives held 142 ms and the simulator saw 120 ms). Fitted with the compute scale (bisection; each try re-solves
  the scale so the anchor stays exact) so that a calibration trial that skips gradient sync,
  paired with the anchor's config, is predicted at its measured ratio; 0 without one, and
  never negative (a trial measured slower than predicted leaves it 0). The trial should drop
  many collectives (``sim_accuracy`` uses no sync + keep unsharded + no reshard after forward:
  ~10 collectives a step instead of ~28) and be measured in many pairs (10): at ~3 ms a
  collective the saving is ~8% of the step, and 3-4 pairs spread 4-9%. *Off by default*
  (``fit_sync``): the fit absorbs whatever else the simulator gets wrong about that trial, and
  with eager concat and a shard group of one's copies priced from their own labels
  ``sim_accuracy`` predicts better without it (figures in docs/benchmarks.md, "Simulator accuracy").
- *CPU share of an asynchronous collective* (``cpu_share``): gloo's worker thread shares the
  cores with compute, so an asynchronous all-gather slows the compute it overlaps. Fitted
  (bisection on [0, 1.5]) so that the simulator predicts a calibration trial with
  ``unshard_async`` on, same machine and links, exactly; 1 (no overlap gain) without one.

What it cannot see: load on the machine that differs between the calibration trials and
the predicted ones, and contention that depends on the config beyond the one share
(``benchmarks/sim_accuracy.py`` measures how far predictions land).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from autotune.sim.calibration_trial import CalibrationTrial, is_local, load_trace_costs
from autotune.sim.costs import get_padded_numel
from autotune.sim.hardware import Hardware, get_dtype_bytes
from autotune.sim.measured import LOCAL_HOOK_KEYS, OPTIONAL_HOOK_KEYS, CollectiveFit, MeasuredProfile
from autotune.sim.model_work import ModelWork
from autotune.sim.predict import Simulator
from autotune.sim.probes import measure_add_bytes_per_s, measure_page_fault_s
from autotune.sim.trace_costs import TraceCosts
from fsdp_runtime import ROOT_UNIT, validate_for_world
from profiles import load_cluster_profile

REAL_DOMINATES = 1.15
"""An emulated collective says what its real transfer costs only above this multiple of its modelled time."""


# -- collectives ----------------------------------------------------------------------------


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def get_collective_points(
    trial: CalibrationTrial, costs: TraceCosts, work: ModelWork
) -> list[tuple[str, int, float, float]]:
    """(kind, group size, bytes, seconds) of the trial's collectives that show their real transfer."""
    replicate, shard = validate_for_world(trial.config, trial.world_size)
    mp = trial.config.mixed_precision
    pb = get_dtype_bytes(mp.param_dtype or "float32")
    rb = get_dtype_bytes(mp.reduce_dtype or mp.param_dtype or "float32")
    cluster = trial.cluster or load_cluster_profile("cpu-gloo")
    shard_group, replicate_group = Hardware(cluster, num_ranks=trial.world_size).get_mesh_groups(replicate, shard)
    points = []
    for kind, unit, seconds in costs.collectives:
        if unit not in work.param_shapes:
            continue
        padded = get_padded_numel(work.param_shapes[unit], shard)
        group = replicate_group if kind == "all_reduce" else shard_group
        num_bytes = {"all_gather": padded * pb, "reduce_scatter": padded * rb, "all_reduce": padded // shard * rb}[kind]
        link = cluster.links.get(group.link_name)
        modelled = link.get_seconds(int(num_bytes)) if trial.emulated and link is not None and link.emulated else 0.0
        if group.size > 1 and (modelled == 0.0 or seconds > REAL_DOMINATES * modelled):
            points.append(
                ("all_gather" if kind == "all_gather" else "reduce_scatter", group.size, float(num_bytes), seconds)
            )
    return points


def fit_collective(points: list[tuple[int, float, float]], group_size: int) -> CollectiveFit:
    """``latency + bytes x seconds_per_byte`` (both >= 0) through (group size, bytes, seconds) points,
    bytes scaled to ``group_size`` by the ring factor."""
    if not points:
        return CollectiveFit(latency_s=0.0, seconds_per_byte=0.0, group_size=group_size, num_points=0)
    xs = [b * _ring(n) / _ring(group_size) for n, b, _ in points]
    ys = [s for _, _, s in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 1e-9 * max(1.0, mx * mx) else 0.0
    latency = my - slope * mx
    if slope <= 0 or latency < 0:  # through the origin (or a pure latency when bytes explain nothing)
        slope = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs) if any(xs) else 0.0
        latency = 0.0 if slope > 0 else my
    return CollectiveFit(
        latency_s=latency, seconds_per_byte=max(0.0, slope), group_size=group_size, num_points=len(points)
    )


# -- the profile ----------------------------------------------------------------------------


def _memory_speed(costs: TraceCosts, work: ModelWork, shard: int, param_bytes: int) -> float:
    moved = time = 0.0
    for unit, kind in ((work.block_names[0], "block"), (ROOT_UNIT, "root")):
        padded = get_padded_numel(work.param_shapes[unit], shard)
        for hook, bytes_per_element in (("unshard", 2 * param_bytes), ("reduce", 2 * 4)):
            if costs.hooks.get(f"{hook}.{kind}", 0.0) > 0:
                moved += padded * bytes_per_element
                time += costs.hooks[f"{hook}.{kind}"]
    return moved / time if time > 0 and moved > 0 else 1e10


def _predict(work: ModelWork, trial: CalibrationTrial, profile: MeasuredProfile) -> float:
    cluster = trial.cluster or load_cluster_profile("cpu-gloo")
    return (
        Simulator(work, Hardware(cluster, num_ranks=trial.world_size, measured=profile)).simulate(trial.config).step_s
    )


def _solve(predict: Any, target: float, low: float, high: float, *, iterations: int = 40) -> float:
    """The x in [low, high] where the non-decreasing ``predict(x)`` meets ``target`` (clamped)."""
    if predict(low) >= target:
        return low
    if predict(high) <= target:
        return high
    for _ in range(iterations):
        mid = (low + high) / 2
        low, high = (mid, high) if predict(mid) < target else (low, mid)
    return (low + high) / 2


def calibrate(
    work: ModelWork,
    anchor: CalibrationTrial,
    *,
    extra: list[CalibrationTrial] = (),
    name: str | None = None,
    anchor_step_s: float | None = None,
    fit_sync: bool = False,
) -> MeasuredProfile:
    """A measured profile of ``work`` on this machine: segments, hooks and the optimizer from
    ``anchor``'s traces, collectives from every trial's, scaled to ``anchor``'s unprofiled step
    (or ``anchor_step_s``: the anchor's config timed elsewhere, e.g. as the reference of paired
    trials), with ``fit_sync`` the wait per collective from an ``extra`` trial that skips gradient
    sync (paired with the anchor's config), and the CPU share of asynchronous collectives from an ``extra``
    trial with ``unshard_async`` on under ``anchor``'s links: its step, or its ratio to the
    anchor's config when it was measured against it in pairs (see [Note: calibration])."""
    costs = load_trace_costs(anchor, work)
    shard = validate_for_world(anchor.config, anchor.world_size)[1]
    points, hooks, hook_sources = _read_all_trials(work, anchor, costs, extra, shard)
    fits = {
        kind: fit_collective(
            [(n, b, s) for k, n, b, s in points if k == kind], shard if shard > 1 else anchor.world_size
        )
        for kind in ("all_gather", "reduce_scatter")
    }
    profile = _get_unscaled_profile(work, anchor, costs, hooks, fits, shard, sources=[anchor, *extra], name=name)
    # this machine, as the trials ran on it ([Note: page faults of large buffers])
    profile = profile.replace(page_fault_s=measure_page_fault_s(), add_bytes_per_s=measure_add_bytes_per_s())
    target = anchor_step_s or anchor.step_s
    profile = profile.replace(compute_scale=_solve_compute_scale(work, anchor, profile, target))
    sync_trial = _find_sync_trial(work, anchor, extra) if fit_sync else None
    if sync_trial is not None:
        profile = _fit_sync(work, anchor, sync_trial, profile, target)  # re-solves the compute scale too
    notes = [
        f"anchor {anchor.path}: step {1e3 * target:.1f} ms ({'given' if anchor_step_s else 'its unprofiled steps'}); compute scale {profile.compute_scale:.3f}"
    ]
    if sync_trial is not None:
        notes.append(
            f"sync wait {1e6 * profile.sync_s:.0f} us per collective from {sync_trial.path} (skips gradient sync: {sync_trial.ratio:.3f}x the anchor's config in pairs)"
        )
    notes += _describe_optional_hooks(hooks, hook_sources, anchor)
    share_trial = next((t for t in extra if _runs_like(t, anchor) and _is_async(t, work)), None)
    if share_trial is not None:
        profile, note = _fit_cpu_share(work, anchor, share_trial, profile)
        notes.append(note)
    notes.append(
        f"probes: page fault {1e6 * profile.page_fault_s:.2f} us, in-place add {profile.add_bytes_per_s / 1e9:.1f} GB/s"
    )
    for kind, fit in fits.items():
        notes.append(
            f"{kind}: {1e6 * fit.latency_s:.0f} us + {1e9 * fit.seconds_per_byte:.3f} ns/B at {fit.group_size} ranks ({fit.num_points} collectives)"
        )
    return profile.replace(notes=notes)


def _read_all_trials(
    work: ModelWork, anchor: CalibrationTrial, costs: TraceCosts, extra: list[CalibrationTrial], shard: int
) -> tuple[list[tuple[str, int, float, float]], dict[str, float], dict[str, Path]]:
    """The collective points of every trial, the anchor's hooks plus those it does not run (from
    the first trial on the anchor's world size showing them), and which trial each of those came from."""
    points = get_collective_points(anchor, costs, work)
    hooks = dict(costs.hooks)
    hook_sources: dict[str, Path] = {}
    for trial in extra:
        trial_costs = load_trace_costs(trial, work, local=is_local(trial))
        points += get_collective_points(trial, trial_costs, work)
        if trial.world_size != anchor.world_size:
            continue
        # Hooks the anchor's config does not run: a shard group of one's copies (from a trial on one, when the
        # anchor shards), FSDP1-style concat (from a trial that concatenates eagerly); the first trial showing them.
        found = {
            key: value
            for key, value in trial_costs.hooks.items()
            if key in OPTIONAL_HOOK_KEYS and key not in hooks and (key not in LOCAL_HOOK_KEYS or shard > 1)
        }
        hooks |= found
        hook_sources |= dict.fromkeys(found, trial.path)
    return points, hooks, hook_sources


def _get_unscaled_profile(
    work: ModelWork,
    anchor: CalibrationTrial,
    costs: TraceCosts,
    hooks: dict[str, float],
    fits: dict[str, CollectiveFit],
    shard: int,
    *,
    sources: list[CalibrationTrial],
    name: str | None,
) -> MeasuredProfile:
    """The anchor's measured prices as traced (compute scale 1, no sync wait, no CPU share)."""
    pb = get_dtype_bytes(anchor.config.mixed_precision.param_dtype or "float32")
    sharded = sum(get_padded_numel(work.param_shapes[u], shard) // shard for u in (*work.block_names, ROOT_UNIT))
    return MeasuredProfile(
        name=name
        or f"{work.name} on {anchor.world_size} ranks" + (f" ({anchor.cluster.name})" if anchor.emulated else ""),
        world_size=anchor.world_size,
        num_microbatches=anchor.config.num_microbatches,
        segments=dict(costs.segments),
        hooks=hooks,
        microbatch_s=costs.microbatch_s,
        optimizer_s_per_element=costs.optimizer_s / max(1, sharded),
        memory_bytes_per_s=_memory_speed(costs, work, shard, pb),
        collectives=fits,
        sources=[str(t.path) for t in sources],
    )


def _solve_compute_scale(
    work: ModelWork, anchor: CalibrationTrial, profile: MeasuredProfile, target: float, *, iterations: int = 40
) -> float:
    """The compute scale at which ``profile`` predicts the anchor's step at ``target`` seconds."""
    return _solve(
        lambda k: _predict(work, anchor, profile.replace(compute_scale=k)), target, 0.05, 20.0, iterations=iterations
    )


def _runs_like(trial: CalibrationTrial, anchor: CalibrationTrial) -> bool:
    """On the anchor's world size and links: a trial whose step the anchor's prices can predict."""
    return trial.world_size == anchor.world_size and _same_links(trial, anchor)


def _find_sync_trial(
    work: ModelWork, anchor: CalibrationTrial, extra: list[CalibrationTrial]
) -> CalibrationTrial | None:
    """The first ``extra`` trial that fits the wait per collective: it skips gradient sync, unshards
    synchronously and was paired with the anchor's config, on the anchor's world size and links."""
    return next(
        (
            t
            for t in extra
            if _runs_like(t, anchor) and _skips_sync(t) and not _is_async(t, work) and t.ratio is not None
        ),
        None,
    )


def _fit_cpu_share(
    work: ModelWork, anchor: CalibrationTrial, trial: CalibrationTrial, profile: MeasuredProfile
) -> tuple[MeasuredProfile, str]:
    """``profile`` with ``cpu_share`` fitted so that ``trial`` (asynchronous unshard) is predicted at
    its measured ratio to the anchor (paired with it: load cancels out of the ratio), else at its
    step; and a note saying so."""
    if trial.ratio is not None:
        base = _predict(work, anchor, profile)
        share = _solve(lambda k: _predict(work, trial, profile.replace(cpu_share=k)) / base, trial.ratio, 0.0, 1.5)
        measured = f"{trial.ratio:.3f}x the anchor's config in pairs"
    else:
        share = _solve(lambda k: _predict(work, trial, profile.replace(cpu_share=k)), trial.step_s, 0.0, 1.5)
        measured = f"{1e3 * trial.step_s:.1f} ms"
    return profile.replace(cpu_share=share), f"cpu share {share:.2f} from {trial.path} (unshard_async on: {measured})"


def _describe_optional_hooks(
    hooks: dict[str, float], hook_sources: dict[str, Path], anchor: CalibrationTrial
) -> list[str]:
    """Notes on the hooks priced from a trial other than the anchor: a shard group of one's copies, eager concat."""
    notes = []
    if "unshard_local.block" in hook_sources:
        notes.append(
            f"shard group of one: unshard {1e6 * hooks['unshard_local.block']:.0f} us, reduce {1e6 * hooks.get('reduce_local.block', 0.0):.0f} us per block "
            f"from {hook_sources['unshard_local.block']} (the anchor's: {1e6 * hooks['unshard.block']:.0f} us, {1e6 * hooks['reduce.block']:.0f} us)"
        )
    if "concat.block" in hooks:
        notes.append(
            f"eager concat {1e6 * hooks['concat.block']:.0f} us, restore {1e6 * hooks.get('restore.block', 0.0):.0f} us per block "
            f"from {hook_sources.get('concat.block', anchor.path)}"
        )
    return notes


def _fit_sync(
    work: ModelWork, anchor: CalibrationTrial, trial: CalibrationTrial, profile: MeasuredProfile, target: float
) -> MeasuredProfile:
    """``profile`` with ``sync_s`` fitted so that ``trial`` (fewer collectives: it skips gradient
    sync) is predicted at its measured ratio to the anchor, the compute scale re-solved for each
    try so that the anchor stays predicted exactly (both unknowns share the anchor's step)."""

    def fitted(sync_s: float) -> MeasuredProfile:
        p = profile.replace(sync_s=sync_s)
        return p.replace(compute_scale=_solve_compute_scale(work, anchor, p, target, iterations=30))

    def ratio(sync_s: float) -> float:
        p = fitted(sync_s)
        return _predict(work, trial, p) / _predict(work, anchor, p)

    # The anchor's collectives on its critical path: a second of wait on each adds this many seconds.
    num_collectives = _predict(work, anchor, profile.replace(sync_s=1.0)) - _predict(work, anchor, profile)
    upper = 0.9 * target / max(1.0, num_collectives)
    # More wait per collective makes the trial (fewer collectives) relatively faster: its ratio falls.
    return fitted(_solve(lambda x: -ratio(x), -trial.ratio, 0.0, upper, iterations=30))  # type: ignore[operator]


def _skips_sync(trial: CalibrationTrial) -> bool:
    return any(unit.sync != "every" for unit in trial.config.units)


def _is_async(trial: CalibrationTrial, work: ModelWork) -> bool:
    return trial.config.unshard_async in ("on", "auto")


def _same_links(a: CalibrationTrial, b: CalibrationTrial) -> bool:
    def links(t: CalibrationTrial) -> Any:
        return sorted((k, v) for k, v in t.cluster.links.items() if v.emulated) if t.emulated else []

    return links(a) == links(b)
