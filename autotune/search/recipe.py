"""The final round's second baseline: the config to emit measured against torchtitan's recipe.

[Note: beating the recipe]
A speedup over FSDP2's defaults answers a question few users ask: most train with torchtitan,
whose ``apply_fsdp_to_decoder`` already departs from the defaults ([Note: the torchtitan
recipe] in :mod:`fsdp_runtime.recipes`). After the final round has chosen the config to emit
(the fastest finalist against the defaults, or the defaults themselves), that config is
measured once more against the recipe built for the run's model, as the chosen finalist is
measured against the defaults ([Note: emitted on an interval] in :mod:`autotune.search.verdict`):
the same paired trial on the same ranks, ABBA blocks after settle steps ([Note: paired
measurement], [Note: switch cost]), at most ``2 * num_confirm_pairs`` pairs, stopped early only
where the config proves clearly slower than the recipe (from two blocks on, or one and a
confirming pair) or its ratio settles ([Note: sequential measurement]), never as clearly faster:
its figure is the speedup over the recipe the search reports; the recipe carries the search's mesh, microbatches and precision (the defaults' config with torchtitan's
units), so the two baselines differ only in what torchtitan changes.

The record (``search.json``'s ``recipe``, v10; the rule and interval v11) keeps the ratio to the
recipe with its spread and 90% interval, and the speedup over it (recipe time / emitted time, per
block). Where this round does not call the config to emit faster than the recipe (v11: its
interval wholly below 1; before, a median below 1), the recipe is emitted instead and the record
(``verdict``), the terminal and the emitted config's notes say so: the tool never hands back a
config it cannot show faster than one the user already has. Two exceptions, each said in the
record: under a memory budget the recipe is measured but not emitted in its place (its peak was
never held to the budget), and where the measurement fails the search's config stays, with the
reason.

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

from autotune.search.context import SearchContext
from autotune.search.verdict import describe_verdict, get_speedups, get_verdict_pairs, measure_verdict
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
    """The config to emit (``config``, or the recipe where this round does not call ``config``
    faster than it: [Note: emitted on an interval]) and the record."""
    recipe, why = get_recipe_config(ctx)
    if recipe is not None and (confirmation is None or ctx.settings.num_confirm_pairs == 0):
        recipe, why = None, "no final round ran (--confirm-pairs 0)"
    if recipe is None:
        ctx.reporter.on_phase(f"not measured against torchtitan's recipe: {why}")
        return config, {"name": RECIPE_NAME, "measured": False, "reason": why, "emitted": "search"}
    candidate = "the defaults" if confirmation and confirmation.get("emitted") == "defaults" else "the emitted config"
    ctx.reporter.on_phase(f"final round: {candidate} vs torchtitan's recipe, at most {get_verdict_pairs(ctx)} pairs")
    ctx.round = "recipe"
    figures = _measure(ctx, config, recipe)
    record = {
        "name": RECIPE_NAME,
        "measured": True,
        "candidate": "defaults" if candidate == "the defaults" else "search",
        "units": recipe.unit_names,
        "emit_rule": "interval",
        **figures,
        **get_speedups(figures),
    }
    if figures.get("ratio") is None:
        reason = f"the measurement against the recipe failed ({figures['status']}: {(figures['reason'] or '')[:160]})"
        return config, record | {"emitted": "search", "reason": reason}
    if figures["faster"]:
        return config, record | {"emitted": "search"}
    if ctx.settings.memory_budget_bytes is not None:
        reason = "not faster than torchtitan's recipe, which is not emitted in its place under a memory budget"
        return config, record | {"emitted": "search", "reason": reason}
    return recipe, record | {
        "emitted": "recipe",
        "verdict": describe_verdict(candidate, "torchtitan's recipe", figures),
    }


def _measure(ctx: SearchContext, config: RuntimeConfig, recipe: RuntimeConfig) -> dict[str, Any]:
    """``config`` paired with ``recipe`` under the verdict rule, as the chosen finalist is paired
    with the defaults (:func:`autotune.search.verdict.measure_verdict`); the recipe's step time as ``recipe_step_ms``."""
    # the config to emit is profiled here, once ([Note: the emitted config's trace]); not the defaults (trial 0 was)
    profile = config != ctx.default_config
    out_dir = ctx.write_dir / "final" / f"vs_{RECIPE_NAME}"
    figures = measure_verdict(ctx, config, out_dir, reference=recipe, profile=profile)
    recipe_ms = figures.pop("reference_step_ms")
    return figures | {"recipe_step_ms": recipe_ms}
