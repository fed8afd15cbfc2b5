"""Emit the winning config: ``best.toml`` and ``best.json`` with their provenance."""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path
from typing import Any

from autotune.search.context import SearchContext
from autotune.search.results import TrialRow
from fsdp_runtime import Provenance, RuntimeConfig, save_config


def _get_notes(ctx: SearchContext, best: TrialRow, emitted_defaults: bool) -> list[str]:
    settings, plan = ctx.settings, ctx.plan
    notes = [f"chosen by {settings.sampler} search over {settings.num_trials} trials (best: trial {best.number})"]
    if emitted_defaults:
        notes = [f"trial {best.number} measured fastest in the search but was slower than FSDP2's defaults in the side-by-side confirmation: these are the defaults"]
    if plan.is_proxy:
        notes.append(
            f"trials ran on a scale proxy ({plan.proxy_name}) because {plan.requested.name} does not fit this machine "
            f"({plan.reason}); per-unit knobs map one-to-one onto {plan.requested.name}'s units, but the measured times are the proxy's, not {plan.requested.name}'s"
        )
    if settings.cluster:
        notes.append(f"collectives were held to the emulated links of cluster profile {settings.cluster!r}")
    return notes


def _get_metrics(best: TrialRow, default: TrialRow | None, confirmation: dict[str, Any] | None, consolidation: dict[str, Any], emitted_defaults: bool) -> dict[str, float]:
    metrics = {"search_best_step_ms": best.step_ms}
    if default is not None and default.step_ms:
        metrics["default_step_ms"] = default.step_ms
    metrics["step_ms"] = metrics.get("default_step_ms", best.step_ms) if emitted_defaults else best.step_ms
    if confirmation and confirmation["speedup_median"] is not None:
        metrics |= {k: confirmation[k] for k in ("speedup_median", "speedup_min", "speedup_max")}
    for method, seconds in consolidation.get("seconds", {}).items():
        metrics[f"consolidation_s_{method}"] = seconds
    return metrics


def emit_best(ctx: SearchContext, config: RuntimeConfig, *, best: TrialRow, default: TrialRow | None, confirmation: dict[str, Any] | None, consolidation: dict[str, Any]) -> Path:
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
        created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        notes=_get_notes(ctx, best, emitted_defaults),
        metrics=_get_metrics(best, default, confirmation, consolidation, emitted_defaults),
    )
    config = dataclasses.replace(config, provenance=provenance)
    save_config(config, ctx.write_dir / "best.json")
    return save_config(config, ctx.write_dir / "best.toml")
