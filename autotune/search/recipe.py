"""The final round's second baseline: the config to emit measured against torchtitan's recipe.

[Note: beating the recipe]
A speedup over FSDP2's defaults answers a question few users ask: most train with torchtitan,
whose ``apply_fsdp_to_decoder`` already departs from the defaults ([Note: the torchtitan
recipe] in :mod:`fsdp_runtime.recipes`). After the final round has chosen the config to emit
(the fastest finalist against the defaults, or the defaults themselves), that config is
measured once more against the recipe built for the run's model, exactly as a finalist is
measured against the defaults: the same paired trial on the same ranks, ABBA blocks after
settle steps ([Note: paired measurement], [Note: switch cost]), at most ``2 *
num_confirm_pairs`` pairs, stopping once the answer is known: clearly faster than the recipe,
clearly slower (from two blocks on, or one and a confirming pair), or its ratio settled ([Note:
sequential measurement]; a clear 0.78 stops after one block of two pairs where it used to run
all six, ~9 s of the main command); the recipe carries the search's mesh, microbatches and precision (the defaults'
config with torchtitan's units), so the two baselines differ only in what torchtitan changes.

The record (``search.json``'s ``recipe``, v10) keeps the ratio to the recipe with its spread
and the speedup over it (recipe time / emitted time, per block). Where the config to emit is
not faster than the recipe side by side (median ratio >= 1), the recipe is emitted instead and
the record, the terminal and the emitted config's notes say so: the tool never hands back a
config slower than one the user already has. Two exceptions, each said in the record: under a
memory budget the recipe is measured but not emitted in its place (its peak was never held to
the budget), and where the measurement fails the search's config stays, with the reason.

[Note: the emitted config's trace]
The report shows the config to emit beside the defaults: each one's trace, overlap and exposed
communication per unit. Its trace used to come from its search trial, so every trial that beat
the best so far ran a profiled window when it was measured (a warm-up step, two traced steps and
the trace's export: 3-4 s of a 10 s trial on the README's main command, three or four times a
search), and the final round could still pick a finalist that never was a best when it ran and
so had no trace at all. Where the recipe round runs (``profiles_at_end``: a final round, and a
recipe that differs from the defaults), the config to emit is profiled there instead, once,
after its pairs against the recipe (the candidate's profiled window, as in any trial), and no
other search trial profiles but the defaults trial and the presearch's calibration trials, whose
traces the presearch reads. The record keeps ``profiled``; the report takes that trial's traces
where the emitted config's search trial has none (:func:`autotune.report.load.get_comparison`).
A search stopped before its final round (interrupted, or a worker that does not run it) has no
trace of its best; a search without a recipe round profiles each new best as before. When the
emitted config proves clearly slower than the recipe, that trial is pruned and profiles nothing.

Not measured (``measured = false`` and the reason): a search without a final round
(``--confirm-pairs 0``), a custom rank program (it builds its own model), a space that forces
pipeline stages (torchtitan's recipe then drops reshard after forward; not built here), a
model that cannot be built on the meta device, and a model whose recipe is FSDP2's defaults
(no embeddings, norm or head outside its blocks: nothing for torchtitan to change).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autotune.search.confirm import get_speedups_over_defaults
from autotune.search.context import SearchContext
from autotune.trials import median_or_none
from autotune.trials.sequential import StoppingRule
from fsdp_runtime import RuntimeConfig, get_torchtitan_config

RECIPE_NAME = "torchtitan"


def get_recipe_config(ctx: SearchContext) -> tuple[RuntimeConfig | None, str | None]:
    """torchtitan's recipe for the run's model in this search's mesh, microbatches and precision,
    or None and why it is not measured ([Note: beating the recipe])."""
    if ctx.settings.rank_program is not None:
        return None, "a custom rank program builds its own model"
    if min(ctx.space.get_pp_choices()) > 1:
        return None, "the space forces pipeline stages, where torchtitan's recipe differs and is not built here"
    try:
        model = ctx.plan.run.build(device="meta")
    except Exception as e:  # a factory that cannot build on meta
        return None, f"the model cannot be built on the meta device ({type(e).__name__})"
    defaults = ctx.default_config
    recipe = get_torchtitan_config(model, defaults)
    if [dataclasses.astuple(u) for u in recipe.units] == [dataclasses.astuple(u) for u in defaults.units]:
        return None, "the recipe is FSDP2's defaults for this model (no embeddings or head outside its blocks)"
    return recipe, None


def profiles_at_end(ctx: SearchContext) -> bool:
    """Whether the recipe round will run and profile the config to emit ([Note: the emitted config's trace])."""
    return ctx.settings.num_confirm_pairs > 0 and get_recipe_config(ctx)[0] is not None


def run_recipe_round(
    ctx: SearchContext, config: RuntimeConfig, confirmation: dict[str, Any] | None
) -> tuple[RuntimeConfig, dict[str, Any]]:
    """The config to emit (``config``, or the recipe where ``config`` does not beat it) and the record."""
    recipe, why = get_recipe_config(ctx)
    if recipe is not None and (confirmation is None or ctx.settings.num_confirm_pairs == 0):
        recipe, why = None, "no final round ran (--confirm-pairs 0)"
    if recipe is None:
        ctx.reporter.on_phase(f"not measured against torchtitan's recipe: {why}")
        return config, {"name": RECIPE_NAME, "measured": False, "reason": why, "emitted": "search"}
    candidate = "the defaults" if confirmation and confirmation.get("emitted") == "defaults" else "the emitted config"
    num_pairs = 2 * ctx.settings.num_confirm_pairs
    ctx.reporter.on_phase(f"final round: {candidate} vs torchtitan's recipe, at most {num_pairs} pairs")
    figures = _measure(ctx, config, recipe, num_pairs)
    record = {
        "name": RECIPE_NAME,
        "measured": True,
        "candidate": "defaults" if candidate == "the defaults" else "search",
        "units": recipe.unit_names,
        **figures,
        **get_speedups(figures),
    }
    if figures.get("ratio") is None:
        reason = f"the measurement against the recipe failed ({figures['status']}: {(figures['reason'] or '')[:160]})"
        return config, record | {"emitted": "search", "reason": reason}
    if figures["ratio"] < 1.0:
        return config, record | {"emitted": "search"}
    if ctx.settings.memory_budget_bytes is not None:
        reason = "not faster than torchtitan's recipe, which is not emitted in its place under a memory budget"
        return config, record | {"emitted": "search", "reason": reason}
    return recipe, record | {"emitted": "recipe"}


def get_recipe_rule(ctx: SearchContext, num_pairs: int) -> StoppingRule:
    """Stopped once the answer is known: clearly faster than the recipe (an interval below 1),
    clearly slower (above 1, whatever ``--prune-ratio`` says), or settled; never for futility (a
    config near the recipe must be measured to the end to say which of the two to emit)."""
    rule = ctx.get_stopping_rule(prune=True, faster_below=1.0, num_pairs=num_pairs, futility=False)
    return dataclasses.replace(rule, prune_above=1.0)


def _measure(ctx: SearchContext, config: RuntimeConfig, recipe: RuntimeConfig, num_pairs: int) -> dict[str, Any]:
    """``config`` paired with ``recipe`` as a finalist is paired with the defaults (``confirm._measure_finalist``)."""
    rule = get_recipe_rule(ctx, num_pairs)
    out_dir = ctx.write_dir / "final" / f"vs_{RECIPE_NAME}"
    # the config to emit is profiled here, once ([Note: the emitted config's trace]); not the defaults (trial 0 was)
    profile = config != ctx.default_config
    spec = ctx.trial_spec(config, out_dir, profile=profile, num_pairs=num_pairs, stopping=rule, reference=recipe)
    result = ctx.run(spec)
    ok = result.metrics is not None and result.status in ("ok", "pruned")
    paired = result.metrics.paired if ok else {}
    return {
        "status": result.status,
        "reason": result.reason,
        "profiled": bool(result.metrics and result.metrics.traces),
        "step_ms": result.step_ms,
        "recipe_step_ms": median_or_none(result.metrics.reference_step_ms_per_step) if result.metrics else None,
        "stopped": result.metrics.stopped if result.metrics else None,
        "dir": str(out_dir),
        **paired,
    }


def get_speedups(figures: dict[str, Any]) -> dict[str, Any]:
    """Speedup over the recipe (recipe / config time): the inverse of the pair ratios, as the final round's
    speedup over the defaults is (:func:`~autotune.search.confirm.get_speedups_over_defaults`)."""
    if figures.get("ratio") is None:
        return {"speedup_median": None, "speedups": []}
    return get_speedups_over_defaults(figures)
