"""The search space through the step simulator: every point, the knobs of any point, the staged ranking.

One module walks the space, builds a point's knobs and ranks the points for both callers:
``autotune search --presearch sim`` (:mod:`autotune.search.presearch`, one process, on this
machine) and ``autotune plan`` (:mod:`autotune.plan`, forked workers, a GPU cluster).

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
``tests/autotune/plan/test_plan.py`` checks the assembled knobs equal those of the built config.

[Note: staged ranking]
Grouping, the root's knobs and checkpointing multiply the space: ``small`` at 2 ranks and 4
microbatches has 12,600 points without them, 316,800 with grouping and the root's knobs and
2,851,200 with checkpointing too, against ~2,500-3,000 simulations/s on one core. So with any of
them on, :func:`rank_staged` ranks in two stages: every point of the space without them (their
FSDP2 defaults), then every memory-knob variant (:func:`iter_memory_variants`) of the
``num_top`` fastest of those; a variant of a slower core config is not simulated. ``autotune
search --presearch sim`` (:func:`rank_space`) and ``autotune plan`` both rank through it; what
differs between them is a parameter of it, with its reason there. This
assumes that what the memory knobs change (collective count and size, recompute, the root's
reduction) adds to what the core knobs do rather than reorders them, which holds where it was
checked: on ``small`` at 2 ranks the staged and the exhaustive ranking of the grouping + root
space agree on the fastest prediction (``tests/autotune/plan/test_plan.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from autotune.search.method_knobs import get_default_answers, get_method_fields
from autotune.search.space import SearchSpace, describe_params
from autotune.sim import Knobs, Simulator, StepPrediction, resolve_knobs
from fsdp_runtime import KNOBS, MixedPrecisionConfig, RuntimeConfig, get_sim_values

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

    @property
    def _unsupported(self) -> set[str]:
        """Besides what this torch lacks, the knobs the simulator does not price: walking their
        choices would repeat every prediction ([Note: the knob registry]'s ``priced``)."""
        return {name for name, _ in self.unsupported_knobs} | {k.name for k in KNOBS if not k.priced}

    @functools.cache  # noqa: B019 (one _Questions per walk, short-lived: the cache holding it is intended)
    def get_mesh_choices(self, pp: int = 1) -> list[str]:
        return SearchSpace.get_mesh_choices(self, pp)

    @functools.cache  # noqa: B019 (as above)
    def _get_reshard_choices(self, shard: int) -> list[str]:
        return SearchSpace._get_reshard_choices(self, shard)


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
    """Every point of ``space`` as its Optuna params (see [Note: enumerating the search space]), the
    knobs the simulator does not price answered with FSDP2's default where the space asks them."""
    lacking = {name for name, _ in space.unsupported_knobs}
    unpriced = [k for k in KNOBS if not k.priced]
    for params in _walk(_questions(space).suggest):  # type: ignore[arg-type]
        for knob in unpriced:
            params.update(get_default_answers(knob, space.device_type, lacking, params))
        yield params


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
        self,
        space: SearchSpace,
        *,
        world_size: int,
        device: str,
        mixed_precision: MixedPrecisionConfig | None = None,
    ) -> None:
        """``mixed_precision``: every point's, replacing the space's own (None: the space's, a searched
        ``reduce_dtype`` included)."""
        self.space, self.world_size, self.device, self.mp = space, world_size, device, mixed_precision
        self.defaults = space.get_default_params()
        self._cache: dict[tuple[Any, ...], Knobs] = {}

    def build_config(self, params: dict[str, Any]) -> RuntimeConfig:
        config = self.space.build_config(params)
        return config if self.mp is None else dataclasses.replace(config, mixed_precision=self.mp)

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
        methods = dataclasses.replace(RuntimeConfig(), **get_method_fields(params))  # the registry's method knobs
        return dataclasses.replace(
            meshed,
            method_values=get_sim_values(methods, self.device),
            unshard_async=asynchronous == "on" or (asynchronous == "auto" and self.device == "cpu"),
            max_rs_buffers=params.get("reduce_scatter_buffers", 1),
            forward_prefetch=fwd.forward_prefetch,
            backward_prefetch=bwd.backward_prefetch,
            sync=nosync.sync,
            reshard_after_backward=nosync.reshard_after_backward,
            defer_concat=nosync.defer_concat,
            checkpointing=checkpointing,
            reduce_dtype=(
                params["reduce_dtype"] if self.mp is None and "reduce_dtype" in params else meshed.reduce_dtype
            ),
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


@dataclass(kw_only=True)
class RankedPoint:
    """A point of the space with its predicted step."""

    params: dict[str, Any]
    prediction: StepPrediction
    exact: bool = True
    """Simulated at the model's depth (False: extrapolated from shallower simulations, [Note: plan speed]
    in :mod:`autotune.plan.evaluate`)."""

    @property
    def description(self) -> str:
        return describe_params(self.params)


Evaluate = Callable[[list[dict[str, Any]], bool], list[RankedPoint]]
"""Predictions for a list of points (the bool: they are the second stage's memory-knob variants)."""

STAGED_TOP = 64
"""Core configs whose memory-knob variants :func:`rank_space` simulates ([Note: staged ranking])."""


def rank_staged(
    space: SearchSpace,
    evaluate: Evaluate,
    *,
    num_top: int,
    top_fitting: bool = False,
    key: Callable[[RankedPoint], Any] = lambda point: point.prediction.step_s,
) -> list[RankedPoint]:
    """Every point of ``space`` through ``evaluate``, sorted by ``key`` (stable: ties keep the order
    of evaluation); with memory knobs on, staged ([Note: staged ranking]): every core point, then
    every memory-knob variant of the ``num_top`` fastest core points (of those simulated at full
    depth: ``RankedPoint.exact``).

    What differs between the two callers is a parameter, each for a reason:

    - ``num_top``: the presearch takes ``STAGED_TOP`` = 64 (``small`` on this machine: ~15,000
      simulations in ~8 s); ``autotune plan`` takes 8, since its variants are simulated at the full
      depth of a GPU-sized model (~8 ms per simulation of 81 units, [Note: plan speed]).
    - ``top_fitting``: ``autotune plan`` also takes the variants of the ``num_top`` fastest that fit
      in memory outside its margin (``StepPrediction.is_safe``, [Note: memory margin]: what the plan
      may emit; a fast config over memory or at its edge may become safe once it checkpoints or
      groups differently, and is among the ``num_top`` fastest seeds anyway); the
      presearch does not, since its trials measure the peak (process RSS), which the simulator's
      tensor memory does not predict.
    - ``key``: the presearch ranks by step time; ``autotune plan`` puts the configs that fit first,
      ranked with a tie-break toward the fewest knobs changed, then those over memory by their peak
      (``autotune.plan.run._get_order_key``)."""
    if not has_memory_knobs(space):
        return sorted(evaluate(list(iter_space_params(space)), False), key=key)
    variants = {mesh: list(iter_memory_variants(space, mesh)) for mesh in space.get_mesh_choices()}
    core = evaluate([{**p, **variants[p["mesh"]][0]} for p in iter_space_params(get_core_space(space))], False)
    exact = sorted((p for p in core if p.exact), key=lambda p: p.prediction.step_s)
    fitting = [p for p in exact if p.prediction.is_safe][:num_top] if top_fitting else []
    seeds = {id(p): p for p in [*exact[:num_top], *fitting]}
    varied = [{**p.params, **variant} for p in seeds.values() for variant in variants[p.params["mesh"]][1:]]
    return sorted(core + evaluate(varied, True), key=key)


def simulate_points(points: Iterable[dict[str, Any]], factory: KnobFactory, simulator: Simulator) -> list[RankedPoint]:
    """Every point's prediction, in one process (points sharing a first forward simulated together)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for params in points:
        groups.setdefault(get_forward_key(params), []).append(params)
    return [
        RankedPoint(params=params, prediction=prediction)
        for group in groups.values()
        for params, prediction in zip(group, simulator.simulate_knobs([factory.get_knobs(p) for p in group]))
    ]


def rank_space(
    space: SearchSpace,
    simulator: Simulator,
    *,
    world_size: int,
    device: str,
    mixed_precision: MixedPrecisionConfig | None = None,
    num_top: int = STAGED_TOP,
) -> list[RankedPoint]:
    """The points of ``space`` with their predictions, fastest first, in one process (``autotune plan``
    parallelises): every point, or with memory knobs on, the staged subset of [Note: staged ranking]."""
    factory = KnobFactory(space, world_size=world_size, device=device, mixed_precision=mixed_precision)
    return rank_staged(space, lambda points, _: simulate_points(points, factory, simulator), num_top=num_top)
