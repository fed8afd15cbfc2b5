"""``plan.json``: what ``autotune plan`` ranked and chose, a versioned artifact ([Note: artifacts])."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from autotune.artifacts import build_dataclass, read_artifact, write_artifact


@dataclass(kw_only=True)
class PlanRecord:
    """``plan.json`` (written by :func:`autotune.plan.run_plan` into ``--out``)."""

    KIND: ClassVar[str] = "plan_summary"
    SCHEMA_VERSION: ClassVar[int] = 1
    MIGRATIONS: ClassVar[dict] = {}

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
    """The emitted config: ``config``, ``params`` and its prediction (per unit too)."""
    top: list[dict[str, Any]] = field(default_factory=list)
    """The top distinct predictions: ``config``, ``params``, ``num_alike`` and the predicted figures."""

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": self.SCHEMA_VERSION, "kind": self.KIND, **dataclasses.asdict(self)}

    @classmethod
    def read(cls, path: str | Path) -> PlanRecord:
        data = read_artifact(path, kind=cls.KIND, version=cls.SCHEMA_VERSION, migrations=cls.MIGRATIONS)
        body = {k: v for k, v in data.items() if k not in ("kind", "schema_version")}
        return build_dataclass(cls, body, source=str(path), what="plan summary")

    def write(self, path: str | Path) -> Path:
        return write_artifact(path, self.to_dict())
