"""``plan.json``: what ``autotune plan`` ranked and chose, a versioned artifact ([Note: artifacts])."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from autotune.artifacts import build_dataclass, read_artifact, write_artifact


def _add_edge_flags(data: dict[str, Any]) -> dict[str, Any]:
    """v1 -> v2: v2 flags each prediction ``at_edge`` of memory and records the margin ([Note: memory
    margin]); a v1 plan had no margin, so its flags are null (unknown), not false."""

    def flag(row: Any) -> Any:
        return {**row, "at_edge": None} if isinstance(row, dict) else row

    rows = {key: flag(data[key]) for key in ("default", "best") if key in data}
    if isinstance(data.get("top"), list):
        rows["top"] = [flag(row) for row in data["top"]]
    return {**data, **rows}


def _add_pipelines(data: dict[str, Any]) -> dict[str, Any]:
    """v2 -> v3: v3 ranks PP degrees beside FSDP2 alone ([Note: the plan's pipeline axis]) and records each
    ranked config's pipeline; a v2 plan ranked PP 1 only, every config with the plan's microbatches."""
    pipeline = {"pp": 1, "schedule": None, "virtual_stages": 1, "num_microbatches": data.get("num_microbatches")}

    def add(row: Any) -> Any:
        return {**row, "pipeline": dict(pipeline)} if isinstance(row, dict) else row

    rows = {key: add(data[key]) for key in ("default", "best") if key in data}
    if isinstance(data.get("top"), list):
        rows["top"] = [add(row) for row in data["top"]]
    return {**data, **rows, "pp_degrees": [1], "best_per_pp": []}


@dataclass(kw_only=True)
class PlanRecord:
    """``plan.json`` (written by :func:`autotune.plan.run_plan` into ``--out``).

    v2: ``memory_margin``, ``num_at_edge`` and each prediction's ``at_edge`` (``default``, ``best``, ``top``).
    v3: ``pp_degrees``, ``best_per_pp`` and each ranked config's ``pipeline`` (``pp``, ``schedule``,
    ``virtual_stages``, ``num_microbatches``)."""

    KIND: ClassVar[str] = "plan_summary"
    SCHEMA_VERSION: ClassVar[int] = 3
    MIGRATIONS: ClassVar[dict] = {1: _add_edge_flags, 2: _add_pipelines}

    model: str
    cluster: str
    num_nodes: int
    world_size: int
    num_microbatches: int
    activation_checkpointing: str
    """``per_unit`` (searched, set in the emitted config), or the training script's own: ``full`` or ``none``."""
    num_evaluated: int
    num_simulated: int
    num_pruned: int
    num_exact: int
    num_fit: int
    num_dropped: int
    configs_per_s: float
    default: dict[str, Any]
    """FSDP2's defaults: ``config`` (described) and their prediction (``StepPrediction.to_dict``)."""
    best: dict[str, Any]
    """The emitted config: ``config``, ``params`` and its prediction (per unit too): the fastest that
    fits outside the memory margin, else (``at_edge`` true) the fastest that fits."""
    top: list[dict[str, Any]] = field(default_factory=list)
    """The top distinct predictions: ``config``, ``params``, ``num_alike``, the predicted figures and ``at_edge``."""
    memory_margin: dict[str, Any] | None = None
    """``autotune.sim.MemoryMargin.to_dict``: capacity, what is outside the allocator, usable memory, the
    margin, its parts (share of the peak, GiB, source) and the edge; None for a v1 plan."""
    num_at_edge: int | None = None
    """Configs that fit the usable memory but not with the margin (None for a v1 plan)."""
    pp_degrees: list[int] = field(default_factory=lambda: [1])
    """The PP degrees ranked (``[1]``: FSDP2 alone, as every plan before v3)."""
    best_per_pp: list[dict[str, Any]] = field(default_factory=list)
    """Each PP degree's best config that fits: ``config``, ``params``, ``pipeline`` and the predicted figures
    (with ``predicted_bubble_fraction`` for a pipeline); empty for a plan before v3."""

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": self.SCHEMA_VERSION, "kind": self.KIND, **dataclasses.asdict(self)}

    @classmethod
    def read(cls, path: str | Path) -> PlanRecord:
        data = read_artifact(path, kind=cls.KIND, version=cls.SCHEMA_VERSION, migrations=cls.MIGRATIONS)
        body = {k: v for k, v in data.items() if k not in ("kind", "schema_version")}
        return build_dataclass(cls, body, source=str(path), what="plan summary")

    def write(self, path: str | Path) -> Path:
        return write_artifact(path, self.to_dict())
