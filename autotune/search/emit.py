"""Emit the winning config: ``best.toml`` and ``best.json`` with their provenance."""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path
from typing import Any

from autotune.search.context import SearchContext
from autotune.search.nodes import get_world_notes
from autotune.search.results import TrialRow
from autotune.search.verdict import describe_figure
from autotune.trials import get_default_backend, get_emulated_cluster
from fsdp_runtime import Provenance, RuntimeConfig, save_config


def _get_notes(ctx: SearchContext, best: TrialRow, confirmation: dict[str, Any] | None) -> list[str]:
    settings, plan = ctx.settings, ctx.plan
    notes = [
        f"chosen by {settings.sampler} search over {settings.num_trials} trials (best in the search: trial {best.number})"
    ]
    if confirmation and confirmation.get("emitted") == "defaults":
        verdict = confirmation.get("verdict") or "no finalist was faster than FSDP2's defaults in the final round"
        notes = [f"{verdict} (best in the search: trial {best.number}): these are the defaults"]
    elif confirmation and confirmation.get("winner") is not None:
        notes.append(
            f"emitted: trial {confirmation['winner']}, the fastest of {len(confirmation['finalists'])} finalists re-measured against the defaults, "
            f"then once more in a window that did not choose it: {describe_figure(confirmation.get('verdict_window') or {})}"
        )
    conf = confirmation or {}
    over = [f["trial"] for f in conf.get("finalists", []) if f.get("over_budget")]
    if conf.get("memory"):
        notes.append(
            f"{conf['memory']}: emitted the search's pick (trial {best.number}), which fit the budget in the search"
        )
    else:
        if conf.get("defaults_over_budget"):
            notes.append(
                "FSDP2's defaults are over the memory budget: this is the fastest finalist that fits, slower than the defaults"
            )
        if over:
            notes.append(
                f"finalist trial(s) {', '.join(map(str, over))} went over the memory budget when re-measured and were not ranked"
            )
    if plan.is_proxy:
        notes.append(
            f"trials ran on a scale proxy ({plan.proxy_name}) because {plan.requested.name} does not fit this machine "
            f"({plan.reason}); per-unit knobs map one-to-one onto {plan.requested.name}'s units, but the measured times are the proxy's, not {plan.requested.name}'s"
        )
    baseline = ctx.space.baseline_checkpointing
    if baseline != "none":
        notes.append(
            f"baseline: FSDP2's defaults with {baseline} activation checkpointing on every block (the defaults alone do not fit); "
            "every speedup here, and torchtitan's recipe, carry it"
        )
    if get_emulated_cluster(settings.cluster, get_default_backend()):
        notes.append(f"collectives were held to the emulated links of cluster profile {settings.cluster!r}")
    notes.extend(get_world_notes(getattr(ctx, "pool", None)))  # the nodes, where the trials spanned them
    notes.extend(ctx.space.notes)  # knobs this torch cannot set, left out of the search
    return notes


def get_recipe_notes(recipe: dict[str, Any] | None) -> list[str]:
    """What the final round said of torchtitan's recipe ([Note: beating the recipe])."""
    if not recipe:
        return []
    if not recipe.get("measured"):
        return [f"not measured against torchtitan's recipe: {recipe.get('reason')}"]
    if recipe.get("speedup_median") is None:
        return [f"torchtitan's recipe: {recipe.get('reason')}"]
    if recipe.get("emitted") == "recipe":
        verdict = recipe.get("verdict") or "the search's config was not faster than torchtitan's recipe side by side"
        return [f"{verdict}: these are torchtitan's recipe (apply_fsdp_to_decoder's units and flags)"]
    line = f"vs torchtitan's recipe, re-measured side by side: {describe_figure(recipe)}"
    return [line + (f"; {recipe['reason']}" if recipe.get("reason") else "")]


def _get_emitted_notes(
    ctx: SearchContext, best: TrialRow, confirmation: dict[str, Any] | None, recipe: dict[str, Any] | None
) -> list[str]:
    notes = _get_notes(ctx, best, confirmation)
    if (
        recipe and recipe.get("emitted") == "recipe"
    ):  # not the defaults after all: the recipe beat what would be emitted
        notes = [n for n in notes if not n.endswith("these are the defaults")]
    return notes + get_recipe_notes(recipe)


def _get_metrics(
    best: TrialRow,
    default: TrialRow | None,
    confirmation: dict[str, Any] | None,
    consolidation: dict[str, Any],
    emitted_defaults: bool,
    recipe: dict[str, Any] | None = None,
) -> dict[str, float]:
    metrics = {"search_best_step_ms": best.step_ms, "search_best_ratio": best.ratio}
    if default is not None and default.step_ms:
        metrics["default_step_ms"] = default.step_ms
    metrics["step_ms"] = metrics.get("default_step_ms", best.step_ms) if emitted_defaults else best.step_ms
    winner = next(
        (f for f in (confirmation or {}).get("finalists", []) if f["trial"] == (confirmation or {}).get("winner")), None
    )
    window = (confirmation or {}).get("verdict_window") or winner
    if winner is not None and window.get(
        "step_ms"
    ):  # the emitted config as the window that did not choose it measured it
        metrics["step_ms"], metrics["final_default_step_ms"] = window["step_ms"], window["reference_step_ms"]
    if confirmation and confirmation["speedup_median"] is not None:
        metrics |= {
            k: confirmation[k]
            for k in (
                "speedup_median",
                "speedup_q25",
                "speedup_q75",
                "speedup_min",
                "speedup_max",
                "speedup_low",
                "speedup_high",
            )
            if k in confirmation
        }
    if recipe and recipe.get("emitted") == "recipe":  # the figures above are the search config's, not the recipe's
        metrics = {k: v for k, v in metrics.items() if not k.startswith("speedup_")} | {
            "step_ms": recipe.get("recipe_step_ms")
        }
    metrics |= {f"{k}_vs_torchtitan": v for k, v in (recipe or {}).items() if k.startswith("speedup_")}
    metrics = {k: v for k, v in metrics.items() if v is not None}
    for method, seconds in consolidation.get("seconds", {}).items():
        metrics[f"consolidation_s_{method}"] = seconds
    return metrics


def emit_best(
    ctx: SearchContext,
    config: RuntimeConfig,
    *,
    best: TrialRow,
    default: TrialRow | None,
    confirmation: dict[str, Any] | None,
    consolidation: dict[str, Any],
    recipe: dict[str, Any] | None = None,
) -> Path:
    """Write ``best.json`` and ``best.toml`` (the path returned) into the run dir."""
    import torch

    emitted_defaults = bool(confirmation and confirmation.get("emitted") == "defaults")
    provenance = Provenance(
        produced_by="autotune search",
        model=ctx.plan.requested.name,
        proxy_model=ctx.plan.proxy_name,
        world_size=ctx.settings.world_size,
        backend="nccl" if torch.cuda.is_available() else "gloo",
        torch_version=torch.__version__,
        measured=True,
        created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        notes=_get_emitted_notes(ctx, best, confirmation, recipe),
        metrics=_get_metrics(best, default, confirmation, consolidation, emitted_defaults, recipe),
    )
    config = dataclasses.replace(config, provenance=provenance)
    save_config(config, ctx.write_dir / "best.json")
    return save_config(config, ctx.write_dir / "best.toml")
