"""``autotune plan``'s output: ``best.toml``/``best.json`` with ``simulated`` provenance and ``plan.json``."""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path

from autotune.plan.record import PlanRecord
from autotune.plan.result import PlanResult
from autotune.sim import Hardware
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
        default={"config": result.default.description, **result.default.prediction.to_dict()},
        best={"config": best.description, "params": best.params, **detail.to_dict()},
        top=[
            {
                "config": r.description,
                "params": r.params,
                "num_alike": n,
                **r.prediction.to_metrics(),
                "at_edge": r.prediction.at_edge,
            }
            for r, n in result.get_distinct_top()
        ],
        memory_margin=result.memory_margin.to_dict() if result.memory_margin else None,
        num_at_edge=result.num_at_edge,
    )
