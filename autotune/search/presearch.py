"""The search space through the step simulator: every point, ranked; ``--presearch sim``.

[Note: enumerating the search space]
The space is defined once, in :class:`autotune.search.SearchSpace`: ``suggest(trial)`` asks
its define-by-run questions and ``build_config(params)`` expands the answers (patterns over
the block index) into a per-unit :class:`RuntimeConfig`. :func:`iter_space_params` walks every
answer path depth-first with a replaying trial (each new question answered with its first
choice, every other choice pushed for later). The walk needs only the questions, so it runs
on a copy of the space that builds no config (``_Questions``): 52,650 points of llama70b on
128 ranks in about a second.

Building a 33-unit (81-unit) config, then validating and indexing it, takes longer than
simulating it; so :class:`KnobFactory` assembles the knobs of a point from each pattern
parameter's per-unit expansion, taken from ``build_config`` on the real space once per
distinct value (per mesh where the value depends on it). The expansions are independent of
each other by the space's construction ([Note: search-space parametrization]);
``tests/autotune/test_sim_plan.py`` checks the assembled knobs equal those of the built config.

[Note: staged ranking]
Grouping, the root's knobs and checkpointing multiply the space: ``small`` at 2 ranks and 4
microbatches has 12,600 points without them, 316,800 with grouping and the root's knobs and
2,851,200 with checkpointing too, against ~2,500-3,000 simulations/s on one core. So with any of
them on, :func:`rank_space` ranks in two stages: every point of the space without them (their
FSDP2 defaults), then every memory-knob variant (:func:`iter_memory_variants`) of the
``STAGED_TOP`` fastest of those; a variant of a slower core config is not simulated. This
assumes that what the memory knobs change (collective count and size, recompute, the root's
reduction) adds to what the core knobs do rather than reorders them, which holds where it was
checked: on ``small`` at 2 ranks the staged and the exhaustive ranking of the grouping + root
space agree on the fastest prediction (``tests/autotune/test_sim_plan.py``).

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
import functools
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.search.calibration_trials import run_calibration_trials
from autotune.search.settings import SearchError
from autotune.search.space import SearchSpace, describe_params
from autotune.sim import Hardware, Knobs, Simulator, StepPrediction, get_model_work, resolve_knobs
from fsdp_runtime import MixedPrecisionConfig, RuntimeConfig

if TYPE_CHECKING:
    from autotune.search.context import SearchContext
    from autotune.search.results import TrialRow

PRESEARCH_KINDS = ("sim",)
PRESEARCH_ATTR = "presearch"
_FORWARD_KEYS = (
    "mesh",
    "forward_prefetch",
    "unshard_async",
    "blocks_per_unit",
    "ac_units",
    "ac_kind",
    "root_reshard_after_forward",
    "root_split",
)
"""What the first forward depends on besides the blocks' reshard: the units (grouping), what they
save (checkpointing, which also prices their backward) and the root's reshard."""


class _ReplayTrial:
    """Answers ``suggest_categorical`` from a recorded path, then with each question's first choice."""

    def __init__(self, path: list[int]) -> None:
        self.path = path
        self.questions: list[tuple[str, int, int]] = []  # (name, number of choices, chosen index)
        self.params: dict[str, Any] = {}

    def suggest_categorical(self, name: str, choices: Any) -> Any:
        choices = list(choices)
        depth = len(self.questions)
        index = self.path[depth] if depth < len(self.path) else 0
        self.questions.append((name, len(choices), index))
        self.params[name] = choices[index]
        return choices[index]


@dataclasses.dataclass(kw_only=True, frozen=True)
class _Questions(SearchSpace):
    """The space's questions alone: ``suggest`` asks them; the config it would build, and the
    choice lists it recomputes per question, are not needed for the walk."""

    def build_config(self, params: dict[str, Any]) -> Any:
        return None

    @functools.cache  # noqa: B019 (one _Questions per walk, short-lived: the cache holding it is intended)
    def get_mesh_choices(self) -> list[str]:
        return SearchSpace.get_mesh_choices(self)

    @staticmethod
    @functools.cache
    def _get_reshard_choices(shard: int) -> list[str]:
        return SearchSpace._get_reshard_choices(shard)


def _walk(ask: Callable[[_ReplayTrial], Any]) -> Iterator[dict[str, Any]]:
    """Every answer path of ``ask``'s questions, depth-first (see [Note: enumerating the search space])."""
    stack: list[list[int]] = [[]]
    while stack:
        path = stack.pop()
        trial = _ReplayTrial(path)
        ask(trial)
        for depth in range(len(path), len(trial.questions)):
            prefix = [index for _, _, index in trial.questions[:depth]]
            stack.extend(prefix + [alt] for alt in range(trial.questions[depth][1] - 1, 0, -1))
        yield trial.params


def _questions(space: SearchSpace) -> _Questions:
    return _Questions(**{f.name: getattr(space, f.name) for f in dataclasses.fields(space)})


def iter_space_params(space: SearchSpace) -> Iterator[dict[str, Any]]:
    """Every point of ``space`` as its Optuna params (see [Note: enumerating the search space])."""
    yield from _walk(_questions(space).suggest)  # type: ignore[arg-type]


def iter_memory_variants(space: SearchSpace, mesh: str) -> Iterator[dict[str, Any]]:
    """Every answer to ``space``'s memory-knob questions (grouping, checkpointing, the root's) on
    ``mesh``; the first is all first choices, i.e. FSDP2's defaults."""
    questions = _questions(space)
    yield from _walk(lambda trial: questions._suggest_memory_knobs(trial, mesh))  # type: ignore[arg-type]


def get_core_space(space: SearchSpace) -> SearchSpace:
    """``space`` without its memory-knob families."""
    return dataclasses.replace(
        space, grouping=False, checkpointing=False, root_knobs=False, embedding_names=(), head_names=()
    )


def has_memory_knobs(space: SearchSpace) -> bool:
    return space.grouping or space.checkpointing or space.root_knobs


def get_forward_key(params: dict[str, Any]) -> tuple[Any, ...]:
    """What the first forward of a step depends on: points that share it share its simulation."""
    raf = next((v for k, v in params.items() if k.startswith("reshard_after_forward")), None)
    return (*(params.get(k) for k in _FORWARD_KEYS), raf)


class KnobFactory:
    """Knobs for any point of ``space``, from per-parameter expansions of ``build_config``."""

    def __init__(
        self, space: SearchSpace, *, world_size: int, device: str, mixed_precision: MixedPrecisionConfig
    ) -> None:
        self.space, self.world_size, self.device, self.mp = space, world_size, device, mixed_precision
        self.defaults = space.get_default_params()
        self._cache: dict[tuple[Any, ...], Knobs] = {}

    def build_config(self, params: dict[str, Any]) -> RuntimeConfig:
        return dataclasses.replace(self.space.build_config(params), mixed_precision=self.mp)

    def _expand(self, key: tuple[Any, ...], params: dict[str, Any]) -> Knobs:
        if key not in self._cache:
            config = self.build_config(params)
            self._cache[key] = resolve_knobs(
                config, self.space.block_names, world_size=self.world_size, device=self.device
            )
        return self._cache[key]

    def get_knobs(self, params: dict[str, Any]) -> Knobs:
        mesh = params["mesh"]
        # Grouping (and a root split) changes the units every other expansion is over.
        units = {k: params[k] for k in _UNIT_KEYS if k in params}
        ukey = tuple(sorted((k, str(v)) for k, v in units.items()))
        base = {k: v for k, v in {**self.defaults, "mesh": mesh, **units}.items() if not _is_own_key(k)}
        raf = {
            k: v
            for k, v in params.items()
            if k.startswith("reshard_after_forward") or k == "root_reshard_after_forward"
        }
        meshed = self._expand(("mesh", mesh, *ukey, *sorted((k, str(v)) for k, v in raf.items())), {**base, **raf})
        fwd = self._expand(
            ("fwd", params["forward_prefetch"], *ukey), {**base, "forward_prefetch": params["forward_prefetch"]}
        )
        bwd = self._expand(
            ("bwd", params["backward_prefetch"], *ukey), {**base, "backward_prefetch": params["backward_prefetch"]}
        )
        nosync_params = {k: params[k] for k in _SYNC_KEYS if k in params}
        nosync = self._expand(
            ("nosync", mesh, *ukey, *sorted((k, str(v)) for k, v in nosync_params.items())), {**base, **nosync_params}
        )
        ac_params = {k: params[k] for k in _AC_KEYS if k in params}
        checkpointing = self._expand(
            ("ac", *ukey, *sorted((k, str(v)) for k, v in ac_params.items())), {**base, **ac_params}
        ).checkpointing
        asynchronous = params.get("unshard_async", "auto")
        return dataclasses.replace(
            meshed,
            unshard_async=asynchronous == "on" or (asynchronous == "auto" and self.device == "cpu"),
            max_rs_buffers=params.get("reduce_scatter_buffers", 1),
            forward_prefetch=fwd.forward_prefetch,
            backward_prefetch=bwd.backward_prefetch,
            sync=nosync.sync,
            reshard_after_backward=nosync.reshard_after_backward,
            defer_concat=nosync.defer_concat,
            checkpointing=checkpointing,
        )


_UNIT_KEYS = ("blocks_per_unit", "root_split")
_SYNC_KEYS = (
    "nosync_blocks",
    "nosync_level_fsdp",
    "nosync_level_hsdp",
    "keep_unsharded",
    "defer_concat",
    "root_sync_fsdp",
    "root_sync_hsdp",
    "root_keep_unsharded",
)
_AC_KEYS = ("ac_units", "ac_kind")


def _is_own_key(key: str) -> bool:
    """A parameter one expansion of :meth:`KnobFactory.get_knobs` owns: left out of the shared base,
    so that (say) the defaults' ``root_sync_fsdp`` never shadows a point's ``root_sync_hsdp``."""
    return (
        key.startswith("reshard_after_forward")
        or key == "root_reshard_after_forward"
        or key in _SYNC_KEYS
        or key in _AC_KEYS
    )


def get_simulated_space(space: SearchSpace) -> SearchSpace:
    """``space`` as the simulator can price it: the embeddings and head stay in the root (the
    simulator's units are blocks and the root, so ``root_split`` is measured, never simulated)."""
    return (
        dataclasses.replace(space, embedding_names=(), head_names=())
        if space.embedding_names or space.head_names
        else space
    )


STAGED_TOP = 64
"""Core configs whose memory-knob variants a staged ranking simulates ([Note: staged ranking])."""


def rank_space(
    space: SearchSpace,
    simulator: Simulator,
    *,
    world_size: int,
    device: str,
    mixed_precision: MixedPrecisionConfig | None = None,
) -> list[tuple[dict[str, Any], StepPrediction]]:
    """The points of ``space`` with their predictions, fastest first (one process; ``autotune plan``
    parallelises): every point, or with memory knobs on, the staged subset of [Note: staged ranking]."""
    factory = KnobFactory(
        space, world_size=world_size, device=device, mixed_precision=mixed_precision or MixedPrecisionConfig()
    )
    if not has_memory_knobs(space):
        return _rank_points(iter_space_params(space), factory, simulator)
    variants: dict[str, list[dict[str, Any]]] = {}
    core = []
    for params, prediction in _rank_points(iter_space_params(get_core_space(space)), factory, simulator):
        mesh_variants = variants.setdefault(params["mesh"], list(iter_memory_variants(space, params["mesh"])))
        core.append(({**params, **mesh_variants[0]}, prediction))
    varied = [{**params, **variant} for params, _ in core[:STAGED_TOP] for variant in variants[params["mesh"]][1:]]
    return sorted(core + _rank_points(varied, factory, simulator), key=lambda pair: pair[1].step_s)


def _rank_points(
    points: Iterable[dict[str, Any]], factory: KnobFactory, simulator: Simulator
) -> list[tuple[dict[str, Any], StepPrediction]]:
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for params in points:
        groups.setdefault(get_forward_key(params), []).append(params)
    ranked = []
    for group in groups.values():
        ranked += zip(group, simulator.simulate_knobs([factory.get_knobs(p) for p in group]))
    return sorted(ranked, key=lambda pair: pair[1].step_s)


# -- --presearch sim ------------------------------------------------------------------------


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


def make_predictor(ctx: SearchContext, measured: Any) -> Predictor:
    """The simulator for ``ctx``'s workload, links and world size, priced by ``measured`` (a MeasuredProfile)."""
    from profiles import ModelProfile, load_cluster_profile

    run = ctx.plan.run
    if not isinstance(run, ModelProfile):
        raise SearchError(
            f"--presearch sim simulates Llama profiles only, not {type(run).__name__} {run.name!r} (search it without --presearch)",
            field="presearch",
        )
    hardware = Hardware(
        load_cluster_profile(ctx.settings.cluster or "cpu-gloo"), num_ranks=ctx.settings.world_size, measured=measured
    )
    simulator = Simulator(get_model_work(run, "float32"), hardware)
    default_step = simulator.simulate(ctx.space.build_config(ctx.space.get_default_params())).step_s
    return Predictor(space=ctx.space, simulator=simulator, default_step_s=default_step)


def get_default_top_k(settings: Any, num_calibration: int = 0) -> int:
    """Every sampled slot but the defaults' and the calibration trials': the trials before the refinement ([Note: refinement])."""
    if settings.presearch_top_k is not None:
        return max(1, min(settings.presearch_top_k, settings.num_trials - 2 - num_calibration))
    return max(0, min(settings.num_trials - 2, settings.num_trials - 1 - settings.get_num_refine()) - num_calibration)


def run_presearch(ctx: SearchContext) -> None:
    """Measure the defaults, calibrate on them, rank the space, enqueue the top-k (see [Note: presearch])."""
    from autotune.search.loop import get_config_hash, get_rows, run_one
    from autotune.sim.calibrate import CalibrationError, calibrate, read_calibration_trial

    settings, study = ctx.settings, ctx.study
    if settings.presearch is None or PRESEARCH_ATTR in study.user_attrs:
        return  # off, or done before this --resume
    if ctx.space.device_type != "cpu":
        raise SearchError(
            "--presearch sim calibrates from CPU traces; on GPUs rank configs with `autotune plan`", field="presearch"
        )
    default = next((r for r in get_rows(study) if r.is_default and r.state == "COMPLETE"), None)
    if default is None:
        ctx.reporter.on_trial_start(len(get_rows(study)), settings.num_trials)
        default = run_one(ctx, None)
        ctx.reporter.on_trial_end(default, default if default.state == "COMPLETE" else None)
    if default.state != "COMPLETE" or default.trial_dir is None:
        raise SearchError(
            f"--presearch sim calibrates on the defaults trial, which did not succeed ({default.status}: {default.reason[:200]})",
            field="presearch",
        )
    ctx.reporter.on_phase(
        "presearch: measuring the calibration trials (the defaults with async unshard, replicated, with eager concat)"
    )
    extra = []
    calibration_rows = run_calibration_trials(ctx)
    for row in calibration_rows:
        try:
            extra.append(read_calibration_trial(settings.out_dir / row.trial_dir))
        except CalibrationError as e:  # e.g. a trial that ran without traces: calibrate without it
            ctx.reporter.on_phase(f"presearch: trial {row.number} ({row.calibration}) left out of the calibration: {e}")
    ctx.reporter.on_phase(
        f"presearch: calibrating the simulator on the traces of the defaults and {len(extra)} calibration trials"
    )
    work_source = ctx.plan.run
    anchor = read_calibration_trial(settings.out_dir / default.trial_dir)
    # The defaults as timed alongside the calibration trials (their pairs' reference), else the defaults trial's own steps.
    references = [t.reference_step_s for t in extra if t.reference_step_s]
    anchor_step_s = statistics.median(references) if references else None
    measured = calibrate(
        get_model_work(work_source, "float32"),
        anchor,
        extra=extra,
        anchor_step_s=anchor_step_s,
        name=f"{work_source.name} on this machine",
    )
    predictor = make_predictor(ctx, measured)
    started = time.perf_counter()
    ranked = rank_space(
        get_simulated_space(ctx.space), predictor.simulator, world_size=settings.world_size, device="cpu"
    )
    elapsed = time.perf_counter() - started
    chosen, seen = (
        [],
        {get_config_hash(ctx.default_config)}
        | {get_config_hash(ctx.space.build_config(r.params)) for r in calibration_rows},
    )
    for params, prediction in ranked:
        if len(chosen) >= get_default_top_k(settings, len(calibration_rows)):
            break
        config_hash = get_config_hash(ctx.space.build_config(params))
        if config_hash not in seen:
            seen.add(config_hash)
            chosen.append((params, prediction))
    for rank, (params, prediction) in enumerate(chosen, 1):
        attrs = {
            "predicted_step_ms": 1e3 * prediction.step_s,
            "predicted_ratio": prediction.step_s / predictor.default_step_s,
            "presearch_rank": rank,
        }
        # Pin what the simulated space left out, or the sampler would pick it for this trial.
        study.enqueue_trial({**params, "root_split": "none"} if ctx.space.can_split else params, user_attrs=attrs)
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
        f"{describe_params(chosen[0][0])} at {chosen[0][1].step_s / predictor.default_step_s:.3f}x"
        if chosen
        else "none"
    )
    ctx.reporter.on_phase(
        f"presearch: simulated {len(ranked)} configs ({summary['configs_per_s'] or 0:,.0f}/s); measuring the {len(chosen)} fastest first (best predicted: {best})"
    )


def add_predictions(ctx: SearchContext, rows: list[TrialRow]) -> list[TrialRow]:
    """Rows with a prediction where the calibration the study keeps can give one (sampled and refined trials)."""
    from autotune.sim.measured import MeasuredProfile

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
