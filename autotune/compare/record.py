"""``compare.json``: what ``autotune compare`` measured, a versioned artifact ([Note: artifacts])."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from autotune.artifacts import ArtifactError, build_dataclass, read_artifact, write_artifact

FILE_NAME = "compare.json"


@dataclass(kw_only=True)
class ConfigFigures:
    """One config's runs and its speedup over the first config ([Note: compare interval])."""

    label: str
    """The CONFIG argument as typed: a path, ``defaults`` or ``torchtitan``."""
    source: str
    """``file``, ``defaults`` or ``torchtitan``."""
    step_ms: float
    """The median of its runs' step medians (each run's: the slowest rank per step, median of the steps)."""
    process_peak_bytes: int | None
    """The largest ``process_peak_bytes`` of its runs (peak RSS on CPU, CUDA max allocated on GPU)."""
    step_ms_per_round: list[float] = field(default_factory=list)
    process_peak_bytes_per_round: list[int | None] = field(default_factory=list)
    round_ratios: list[float] = field(default_factory=list)
    """Per round, the first config's run median over this one's (empty for the first config)."""
    speedup: float | None = None
    """The median of ``round_ratios``; None for the first config."""
    speedup_low: float | None = None
    speedup_high: float | None = None
    verdict: str | None = None
    """``faster``, ``slower`` or ``within noise`` (the interval includes 1.0); None for the first config."""
    dirs: list[str] = field(default_factory=list)
    """Its runs' trial dirs, per round."""


@dataclass(kw_only=True)
class CompareRecord:
    """``compare.json`` (written by :func:`autotune.compare.run_compare` into ``--out``)."""

    KIND: ClassVar[str] = "compare_summary"
    SCHEMA_VERSION: ClassVar[int] = 1
    MIGRATIONS: ClassVar[dict] = {}

    model: str
    world_size: int
    backend: str
    cluster: str | None
    num_microbatches: int
    num_warmup: int
    num_measured: int
    """Timed steps per run."""
    num_rounds: int
    """Rounds run."""
    max_rounds: int
    until_ci_pct: float | None
    stopped: str
    """``rounds`` (every round ran) or ``interval`` (``--until-ci``: every interval narrow enough)."""
    interval_method: str
    """How the speedups' intervals were made ([Note: compare interval])."""
    orders: list[list[int]]
    """Per round, the configs' indices (from 0) in the order they ran ([Note: compare rounds])."""
    configs: list[ConfigFigures]
    wall_s: float
    created_at: str
    """ISO-8601 UTC time the comparison finished."""

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": self.SCHEMA_VERSION, "kind": self.KIND, **dataclasses.asdict(self)}

    @classmethod
    def read(cls, path: str | Path) -> CompareRecord:
        data = read_artifact(path, kind=cls.KIND, version=cls.SCHEMA_VERSION, migrations=cls.MIGRATIONS)
        body = {k: v for k, v in data.items() if k not in ("kind", "schema_version")}
        if "configs" in body:
            configs = body["configs"]
            if not isinstance(configs, list):
                raise ArtifactError(f"{path}: configs must be a JSON list, got {type(configs).__name__}")
            body["configs"] = [
                build_dataclass(ConfigFigures, c, source=str(path), what=f"configs[{i}]") for i, c in enumerate(configs)
            ]
        return build_dataclass(cls, body, source=str(path), what="compare summary")

    def write(self, path: str | Path) -> Path:
        return write_artifact(path, self.to_dict())
