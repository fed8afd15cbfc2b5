"""``autotune plan``'s output: ``best.toml``/``best.json`` with ``simulated`` provenance and ``plan.json``."""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path
from typing import Any

from autotune.plan.pipeline import get_pipeline_summary
from autotune.plan.record import PlanRecord
from autotune.plan.result import PlanResult
from autotune.search import RankedPoint
from autotune.sim import Hardware, PipelinePrediction
from fsdp_runtime import Provenance, save_config


def emit_plan(result: PlanResult, model_name: str, hardware: Hardware) -> list[Path]:
    """``best.toml``/``best.json`` (provenance: simulated, the cluster) and ``plan.json``."""
    import torch

    detail = result.best_detail
    assert result.best_config is not None and detail is not None
    speedup = result.default.prediction.step_s / detail.step_s if result.default.prediction.fits else None
    provenance = Provenance(
        produced_by="autotune plan (simulated)",
        model=model_name,
        world_size=result.world_size,
        backend=hardware.cluster.backend,
        torch_version=torch.__version__,
        measured=False,
        created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        notes=_get_notes(result, hardware, speedup),
        metrics={**detail.to_metrics(), **({"predicted_speedup_vs_default": speedup} if speedup else {})},
    )
    config = dataclasses.replace(result.best_config, provenance=provenance)
    out = result.settings.out_dir
    files = [save_config(config, out / "best.toml"), save_config(config, out / "best.json")]
    return [*files, _get_record(result, model_name, hardware).write(out / "plan.json")]


def _get_notes(result: PlanResult, hardware: Hardware, speedup: float | None) -> list[str]:
    """The emitted config's provenance notes: simulated on what, the checkpointing assumption, the choice."""
    best, detail, settings = result.best, result.best_detail, result.settings
    assert best is not None and detail is not None
    notes = [
        f"simulated, not measured: autotune plan ranked {result.num_evaluated} configs on {settings.num_nodes} x {hardware.cluster.name} "
        f"({result.world_size} ranks of {hardware.accelerator.name}) with the FSDP2 step simulator (autotune.sim)",
        (
            f"activation checkpointing is set per unit in this config ({result.ac_reason}); the training script must not checkpoint the blocks itself"
            if result.ac_in_config
            else f"assumes activation checkpointing {'full (every block)' if result.activation_checkpointing else 'none'} in the training script ({result.ac_reason}); this config does not set it"
        ),
        f"chosen: {best.description}",
        *_get_pipeline_notes(result),
        *hardware.describe_prices(),
    ]
    if speedup is not None:
        notes.append(
            f"predicted {speedup:.3f}x FSDP2's defaults ({1e3 * result.default.prediction.step_s:.0f} ms -> {1e3 * detail.step_s:.0f} ms per step)"
        )
    edge = result.get_edge_note()
    return [*notes, edge] if edge else notes


def _get_record(result: PlanResult, model_name: str, hardware: Hardware) -> PlanRecord:
    best, detail, settings = result.best, result.best_detail, result.settings
    assert best is not None and detail is not None
    m = settings.num_microbatches
    return PlanRecord(
        model=model_name,
        cluster=hardware.cluster.name,
        num_nodes=settings.num_nodes,
        world_size=result.world_size,
        num_microbatches=settings.num_microbatches,
        activation_checkpointing="per_unit"
        if result.ac_in_config
        else ("full" if result.activation_checkpointing else "none"),
        num_evaluated=result.num_evaluated,
        num_simulated=result.num_simulated,
        num_pruned=result.num_pruned,
        num_exact=result.num_exact,
        num_fit=len(result.ranked),
        num_dropped=len(result.dropped),
        configs_per_s=result.configs_per_s,
        default={
            "config": result.default.description,
            **result.default.prediction.to_dict(),
            "pipeline": get_pipeline_summary(result.default, m),
        },
        best={
            "config": best.description,
            "params": best.params,
            **detail.to_dict(),
            "pipeline": get_pipeline_summary(best, m),
        },
        top=[{**_get_row(r, m), "num_alike": n} for r, n in result.get_distinct_top()],
        memory_margin=result.memory_margin.to_dict() if result.memory_margin else None,
        num_at_edge=result.num_at_edge,
        pp_degrees=list(result.pp_degrees),
        best_per_pp=[_get_row(r, m) for r in result.best_per_pp],
    )


def _get_row(row: RankedPoint, num_microbatches: int) -> dict[str, Any]:
    return {
        "config": row.description,
        "params": row.params,
        **row.prediction.to_metrics(),
        "at_edge": row.prediction.at_edge,
        "pipeline": get_pipeline_summary(row, num_microbatches),
    }


def _get_pipeline_notes(result: PlanResult) -> list[str]:
    """What the emitted config's pipeline is, and whether the config carries it."""
    detail = result.best_detail
    if not isinstance(detail, PipelinePrediction):
        return []
    spec, dp = detail.pipeline, result.world_size // detail.pipeline.pp
    notes = [
        f"pipeline: {spec.pp} stages deep x {dp} data-parallel ranks, schedule {spec.schedule} with {spec.virtual_stages} "
        f"stage(s) per pp rank, {spec.num_microbatches} microbatches per step ({result.settings.num_microbatches} per "
        f"data-parallel rank without PP: the same tokens per step); bubble {detail.bubble_fraction:.1%} of the step "
        "([Note: pipeline schedules] in autotune/sim/pipeline.py)"
    ]
    if not result.pipeline_in_config:
        notes.append(
            f"this fsdp_runtime has no pipeline schema (schema 3): the config holds the data-parallel mesh and every stage's "
            f"units; set mesh.pp = {spec.pp}, pipeline.schedule = {spec.schedule!r}, pipeline.virtual_stages = "
            f"{spec.virtual_stages} when it does"
        )
    return notes
