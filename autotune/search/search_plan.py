"""What a search will run, made once: the target, the model or its proxy, the baseline, the links and the cost.

[Note: the search plan]
Everything a search decides before its first trial is decided here, once, and passed down to the
study (which stores it, so a resumed search measures what it measured before), the space, the
loop, the dry run and ``search.json``:

- *the target*: this machine (its GPUs, or its CPU cores), or with ``--plan-for CLUSTER`` that
  cluster profile's GPU node, answered from a box without GPUs (a dry run only). On CUDA without
  ``--workers`` the world is one rank per visible GPU (``CUDA_VISIBLE_DEVICES`` honoured), as
  torchrun's ``--nproc-per-node gpu``; ``--nproc`` overrides it.
- *the model as itself or a proxy*. On a GPU the question is the simulator's
  (:mod:`autotune.sim`, whose peak the H200 trials in ``tests/data/gpu_traces`` check): bf16
  parameters, fp32 reduction, activations in the compute dtype with SDPA (no ``seq^2`` score
  matrix), each checkpointing choice priced. The model runs as itself unless even its leanest
  config (full checkpointing on every block, every unit resharded after forward) is over the
  GPU's usable memory; then the largest scale proxy whose leanest config fits, said in one line
  with the figures. No step-time budget on a GPU unless ``--step-budget-s`` sets one. On a CPU box
  the rule of :func:`autotune.search.proxy.plan_for_this_machine` (fp32, a step budget of
  ``CPU_STEP_BUDGET_S``) stays. ``--proxy`` / ``--no-proxy`` force either.
- *the baseline*: the reference of every pair and the config every speedup is quoted over
  (:class:`Baseline`). FSDP2's defaults where they fit (on a GPU: the simulator's peak is safe,
  [Note: memory margin]); else the defaults with the least activation checkpointing on every
  block that does (selective, then full), and checkpointing is then searched. torchtitan's
  recipe, the second baseline, gets the same checkpointing. The space's
  :meth:`~autotune.search.space.SearchSpace.get_default_params` is the one place it becomes a
  config, which the search, its decisions and ``compare`` read.
- *the links*: over NCCL, ``--cluster`` gives the topology (ranks per node, which mesh groups stay
  in a node) and never emulates links; over gloo it emulates them
  (:func:`autotune.trials.linkemu.get_emulated_cluster`).
- *the cost*: each round's most builds and steps (:mod:`autotune.search.cost`), and an estimated
  wall time: on a GPU from the simulator's step and an estimated build, on CPU once the defaults
  trial ran (the progress bar's ETA).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.search.calibration_trials import CALIBRATION_CHANGES
from autotune.search.cost import RoundCost, estimate_search_cost
from autotune.search.gpu_pricing import Baseline, choose_baseline, plan_model_on_gpu
from autotune.search.proxy import ModelPlan, plan_for_this_machine
from autotune.search.settings import SearchError, SearchSettings
from autotune.search.target import Target, get_target
from autotune.search.timeouts import may_build_in_turn
from autotune.search.verdict import MIN_PAIRS
from autotune.trials import get_emulated_cluster
from fsdp_runtime import MixedPrecisionConfig

if TYPE_CHECKING:
    from profiles.sources import ModelSource

ALLOCATION_S = 30 * 60.0
"""A GPU allocation's length the plan says how many trials fit (the dry run's hint line)."""
CPU_STEP_BUDGET_S = 1.0
"""Per-microbatch step-time budget that sizes a proxy on a CPU box (``--step-budget-s`` overrides it)."""
GPU_BUILD_S = 5.0
GPU_BUILD_S_PER_BILLION = 8.0
"""An estimated GPU build: seconds fixed plus seconds per billion parameters a rank holds (its shard
drawn on the host, copied, sharded). Read off one H200 search (torch 2.11, 2026-11-27, docs/gpu.md):
33-49 s per paired trial of a ~1.9B-parameter model at world 1 with two builds and ~6 s of steps,
so 14-22 s a build; 5 + 8 x 1.9 = 20 s."""


@dataclass(kw_only=True)
class SearchPlan:
    """What a search will run and what it will cost ([Note: the search plan])."""

    target: Target
    source: ModelSource
    """The model as the user named it, with ``--seq-len`` / ``--batch-size`` applied."""
    model: ModelPlan
    precision: MixedPrecisionConfig
    baseline: Baseline
    emulated_cluster: str | None
    """The cluster profile whose links trials emulate (gloo only), or None: real links."""
    links_note: str
    rounds: list[Any] = field(default_factory=list)
    """Each round's most builds and steps (:class:`autotune.search.cost.RoundCost`)."""
    estimated_step_s: float | None = None
    """The baseline's step (every microbatch and the optimizer), the simulator's on a GPU; None on CPU
    until the defaults trial ran."""
    estimated_build_s: float | None = None
    notes: list[str] = field(default_factory=list)
    allocation_hint: str | None = None
    """On a GPU, where the estimated wall is over :data:`ALLOCATION_S`: the flags that fit it (:func:`get_allocation_hint`)."""

    @property
    def device_type(self) -> str:
        return self.target.device_type

    @property
    def num_builds(self) -> int:
        return sum(r.builds for r in self.rounds)

    @property
    def num_steps(self) -> int:
        return sum(r.steps for r in self.rounds)

    @property
    def estimated_wall_s(self) -> float | None:
        if self.estimated_step_s is None or self.estimated_build_s is None:
            return None
        return self.num_steps * self.estimated_step_s + self.num_builds * self.estimated_build_s

    def describe(self) -> list[str]:
        """The lines a dry run prints and a search prints first."""
        t, m, mp = self.target, self.model, self.precision
        shape = f"seq {m.run.seq_len}, batch {m.run.batch_size}"
        if m.is_proxy:
            what = f"{m.requested.name} as the scale proxy {m.proxy_name} ({shape}): {m.reason}"
        else:
            what = f"{m.requested.name} as itself ({shape}; {m.reason})"
        lines = [
            f"target: {t.description}",
            f"model: {what}",
            f"ranks: {t.world_size} ({t.backend}, {mp.param_dtype} parameters, {mp.reduce_dtype} reduction)",
            f"baseline: {self.baseline.name} ({self.baseline.reason})",
            f"links: {self.links_note}",
        ]
        if self.rounds:
            lines.append("rounds (at most): " + "; ".join(_describe_round(r) for r in self.rounds))
            lines.append(f"cost (at most): {self.num_builds} builds, {self.num_steps} steps")
        wall = self.estimated_wall_s
        if wall is not None:
            gpu_min = wall * t.world_size / 60 if t.on_gpu else None
            lines.append(
                f"estimated wall: {_fmt_s(wall)} at most (step {self.estimated_step_s:.2f} s, build {self.estimated_build_s:.0f} s"
                + (f"; {gpu_min:.0f} GPU-minutes on {t.world_size} GPUs)" if gpu_min is not None else ")")
            )
            if self.allocation_hint:
                lines.append(self.allocation_hint)
        else:
            lines.append("estimated wall: from the defaults trial, once it ran (the progress bar's ETA)")
        return [*lines, *self.notes]

    def get_trials_within(self, seconds: float) -> int | None:
        """The most trials whose search's estimated wall, every other round as planned, is within ``seconds``."""
        from autotune.search.cost import estimate_round_s

        if self.estimated_step_s is None or self.estimated_build_s is None:
            return None
        prices = {"step_s": self.estimated_step_s, "build_s": self.estimated_build_s}
        trials = next((r for r in self.rounds if r.name == "trials"), None)
        if trials is None or trials.num_trials < 1:
            return None
        rest = sum(estimate_round_s(r, **prices) for r in self.rounds if r is not trials)
        per_trial = estimate_round_s(trials, **prices) / trials.num_trials
        return max(0, int((seconds - rest) // per_trial)) if per_trial > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target.to_dict(),
            "baseline": self.baseline.to_dict(),
            "emulated_cluster": self.emulated_cluster,
            "links": self.links_note,
            "rounds": [dataclasses.asdict(r) for r in self.rounds],
            "num_builds": self.num_builds,
            "num_steps": self.num_steps,
            "estimated_step_s": self.estimated_step_s,
            "estimated_build_s": self.estimated_build_s,
            "estimated_wall_s": self.estimated_wall_s,
        }


def _describe_round(r: Any) -> str:
    return f"{r.name} {_count(r.builds, 'build')}, {_count(r.steps, 'step')}"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _fmt_s(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


# --------------------------------------------------------------------------- the model


def get_search_source(settings: SearchSettings) -> ModelSource:
    """The model as named, with ``--seq-len`` and ``--batch-size`` applied."""
    from profiles.sources import load_model_source

    source = load_model_source(settings.model)
    shape = get_shape_overrides(settings)
    return source.with_overrides(**shape) if shape else source


def get_shape_overrides(settings: SearchSettings) -> dict[str, int]:
    return {k: v for k, v in (("seq_len", settings.seq_len), ("batch_size", settings.batch_size)) if v is not None}


# --------------------------------------------------------------------------- the links and the cost


def get_links(settings: SearchSettings, target: Target) -> tuple[str | None, str]:
    """The cluster whose links trials emulate (gloo only), and the line that says so."""
    emulated = get_emulated_cluster(settings.cluster, target.backend)
    if emulated is not None:
        return emulated, f"emulated as {emulated}'s (gloo: each collective held to the profile's link speed)"
    if settings.cluster is not None:
        return (
            None,
            f"real ({target.backend}); --cluster {settings.cluster} gives the topology and the simulator's prices, never emulated",
        )
    return None, f"real ({target.backend})"


def estimate_build_s(source: ModelSource, target: Target) -> float:
    """An estimated build on a GPU (:data:`GPU_BUILD_S_PER_BILLION`)."""
    per_rank = source.get_num_params() / max(1, target.world_size)
    return GPU_BUILD_S + GPU_BUILD_S_PER_BILLION * per_rank / 1e9


def get_rounds(settings: SearchSettings, target: Target, *, recipe: bool = True) -> list[RoundCost]:
    """Each round's most builds and steps (:func:`autotune.search.cost.estimate_search_cost`); on NCCL the
    two models of a structural pair are built in turn; ``recipe``: the recipe round runs."""
    return estimate_search_cost(
        settings,
        in_turn=target.backend == "nccl" or may_build_in_turn(),
        recipe=recipe,
        min_verdict_pairs=MIN_PAIRS,
        num_calibration_changes=len(CALIBRATION_CHANGES),
    )


# --------------------------------------------------------------------------- the plan


def make_search_plan(settings: SearchSettings, *, target: Target | None = None) -> SearchPlan:
    """What ``settings`` would run on ``target`` (default: :func:`get_target`'s) ([Note: the search plan]);
    one line naming the flag where it cannot."""
    from autotune.trials import resolve_precision

    target = target or get_target(settings)
    if settings.plan_for is not None and not settings.dry_run:
        raise SearchError(
            f"--plan-for {settings.plan_for} answers for a GPU node from this box: add --dry-run (a search runs on the GPUs it finds)",
            field="plan_for",
        )
    source = get_search_source(settings)
    precision = resolve_precision(
        target.device_type, param_dtype=settings.param_dtype, reduce_dtype=settings.reduce_dtype
    )
    notes: list[str] = []
    if target.on_gpu:
        model, pricer = plan_model_on_gpu(source, target, precision, settings)
        baseline = choose_baseline(pricer, target, settings.baseline_checkpointing)
        step_s = pricer.price(baseline.checkpointing).step_s if pricer is not None else None
        build_s = estimate_build_s(model.run, target)
    else:
        model = plan_for_this_machine(
            source,
            world_size=target.world_size,
            step_budget_s=settings.step_budget_s if settings.step_budget_s is not None else CPU_STEP_BUDGET_S,
            memory_bound=settings.memory_budget_bytes is not None,
            force_proxy=settings.proxy,
        )
        baseline = choose_baseline(None, target, settings.baseline_checkpointing)
        step_s = build_s = None
    if baseline.checkpointing != "none" and settings.checkpointing is False:
        raise SearchError(
            f"the baseline needs {baseline.checkpointing} activation checkpointing ({baseline.reason}), "
            "so checkpointing is searched: drop --no-checkpointing",
            field="checkpointing",
        )
    model = dataclasses.replace(model, shape_overrides=get_shape_overrides(settings))
    emulated, links = get_links(settings, target)
    plan = SearchPlan(
        target=target,
        source=source,
        model=model,
        precision=precision,
        baseline=baseline,
        emulated_cluster=emulated,
        links_note=links,
        rounds=get_rounds(settings, target),
        estimated_step_s=step_s,
        estimated_build_s=build_s,
        notes=notes,
    )
    plan.allocation_hint = get_allocation_hint(plan, settings)
    return plan


def get_allocation_hint(plan: SearchPlan, settings: SearchSettings) -> str | None:
    """On a GPU whose estimated wall is over :data:`ALLOCATION_S`: the most trials that fit it, with fewer
    final-round pairs (``--confirm-pairs``) where even 2 trials do not; None where it fits (or on CPU)."""
    wall = plan.estimated_wall_s
    if not plan.target.on_gpu or wall is None or wall <= ALLOCATION_S:
        return None
    limit = f"to finish within {ALLOCATION_S / 60:.0f} min"
    for pairs in range(settings.num_confirm_pairs, 0, -1):
        fewer = dataclasses.replace(settings, num_confirm_pairs=pairs)
        trials = dataclasses.replace(plan, rounds=get_rounds(fewer, plan.target)).get_trials_within(ALLOCATION_S)
        if trials is not None and trials >= 2:
            flags = f"--trials {trials}" + (f" --confirm-pairs {pairs}" if pairs != settings.num_confirm_pairs else "")
            return f"{limit}: {flags} (at most, as estimated above)"
    return f"not {limit} even with 2 trials and 1 confirmation pair: use --proxy, or more time"
