"""The trial spec: what to run in one trial and where to write it (an artifact, see [Note: artifacts]).

``autotune trial --write-spec`` writes it for torchrun; local launchers hand its
``to_dict()`` to every rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from autotune.artifacts import check_artifact, get_added_field_migrations, read_artifact, write_artifact
from fsdp_runtime import RuntimeConfig, config_from_dict, config_to_dict
from fsdp_runtime.errors import AutotuneError

DEFAULT_RANK_PROGRAM = "autotune.trials.program:run_trial_rank"


class TrialSpecError(AutotuneError):
    """A trial spec that cannot describe a trial (bad counts, backend, pool mismatch)."""


def get_default_backend() -> str:
    """``nccl`` where CUDA is available, else ``gloo``."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


@dataclass(kw_only=True)
class TrialSpec:
    """What to run in one trial, and where to write it."""

    KIND: ClassVar[str] = "trial_spec"
    SCHEMA_VERSION: ClassVar[int] = 4
    MIGRATIONS: ClassVar[dict] = {
        1: lambda data: {"reference": None, "prune_if_ratio_above": None, **data},
        **get_added_field_migrations(2, 3),
    }  # v2: paired measurement; v3: the stopping rule and profile_below; v4: keep_reference (defaults: off)

    model: str | dict[str, Any]
    """Model profile name/path, or ``{"name": ..., **shape/seq_len/batch_size overrides}``."""
    config: RuntimeConfig
    """The FSDP2 runtime config under test."""
    world_size: int
    out_dir: Path
    """The trial dir (created; a previous trial's files in it are replaced)."""
    num_warmup: int = 2
    """Unmeasured steps first (allocator, gloo connections, autograd caches)."""
    num_measured: int = 5
    """Unprofiled, timed steps: the step-time figures."""
    num_profiled: int = 2
    """Steps recorded in the traces (after one profiler warm-up step)."""
    seed: int = 0
    timeout_s: float = 120.0
    """Wall-clock limit for the whole trial, start-up included; then every rank is killed."""
    backend: str = field(default_factory=get_default_backend)
    """``gloo`` (CPU) or ``nccl`` (CUDA); default: ``nccl`` when CUDA is available."""
    cluster: str | None = None
    """Cluster profile whose emulated links hold the collectives (autotune.trials.linkemu); None: real links."""
    profile: bool = True
    """Run the profiled window and write traces."""
    prune_if_slower_than_ms: float | None = None
    """Unpaired trials: stop after the first measured steps (status ``pruned``) if their median is above this."""
    reference: RuntimeConfig | None = None
    """Measure the config against this one, alternating on the same ranks (see [Note: paired
    measurement] in :mod:`autotune.trials.paired`); None: time the config alone."""
    prune_if_ratio_above: float | None = None
    """Paired trials: stop after the first pairs if every pair's candidate/reference ratio is above this."""
    stopping: dict[str, Any] | None = None
    """Paired trials: a :class:`~fsdp_runtime.tuning.sequential.StoppingRule` as a dict; the trial then
    stops measuring as soon as its ratio is known ([Note: sequential measurement]) and
    ``num_measured`` is the most pairs it runs. None: every pair runs."""
    profile_below: float | None = None
    """Paired trials: run the profiled window only when the candidate's median block ratio to its
    reference is below this (a search's best so far: only a new best's traces are read); None: always."""
    keep_reference: bool = False
    """Keep the reference config's model warm in a rank pool's processes for the next trial with
    the same reference, and step the one kept by the last (CPU; [Note: a warm reference] in
    :mod:`autotune.trials.kept`). Off: every trial builds its own, as outside a pool."""
    rank_program: str = DEFAULT_RANK_PROGRAM
    """``module:function`` each rank runs as ``fn(rank, world_size, spec=dict)``; replace it to
    trial a custom workload that returns the same measurements."""

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        checks = [
            ("world_size", self.world_size >= 1, f"world size must be >= 1, got {self.world_size}"),
            ("num_warmup", self.num_warmup >= 0, f"warm-up steps must be >= 0, got {self.num_warmup}"),
            ("num_measured", self.num_measured >= 1, f"measured steps must be >= 1, got {self.num_measured}"),
            (
                "num_profiled",
                not self.profile or self.num_profiled >= 1,
                f"profiled steps must be >= 1 when profiling, got {self.num_profiled}",
            ),
            ("timeout_s", self.timeout_s > 0, f"timeout must be > 0 s, got {self.timeout_s}"),
            ("backend", self.backend in ("gloo", "nccl"), f"backend must be 'gloo' or 'nccl', got {self.backend!r}"),
            (
                "cluster",
                self.cluster is None or self.backend == "gloo",
                f"link emulation ({self.cluster}) is a CPU tool for gloo ranks; over {self.backend} the links are real: drop --cluster",
            ),
            (
                "rank_program",
                ":" in self.rank_program,
                f"rank program must be 'module:function', got {self.rank_program!r}",
            ),
        ]
        for name, ok, problem in checks:
            if not ok:
                raise TrialSpecError(f"trial spec: {problem}", field=name)
        if self.stopping is not None:
            from fsdp_runtime.tuning.sequential import StoppingRule

            try:
                rule = StoppingRule.from_dict(self.stopping)
            except TypeError as e:
                raise TrialSpecError(f"trial spec: stopping rule {self.stopping!r}: {e}", field="stopping") from None
            if rule.max_blocks < 1 or rule.min_blocks < 1 or rule.precision <= 0:
                raise TrialSpecError(
                    f"trial spec: stopping rule needs max_blocks, min_blocks >= 1 and precision > 0, got {self.stopping}",
                    field="stopping",
                )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (what ranks receive, and ``--write-spec`` writes for torchrun)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        reference = config_to_dict(self.reference) if self.reference is not None else None
        return {
            "schema_version": self.SCHEMA_VERSION,
            "kind": self.KIND,
            **data,
            "config": config_to_dict(self.config),
            "reference": reference,
            "out_dir": str(self.out_dir),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "trial spec") -> TrialSpec:
        if isinstance(data, dict) and "kind" not in data and "config" in data:
            raise TrialSpecError(
                f"{source}: a trial spec written by an older fsdp-autotune (no 'kind'); write it again with `autotune trial --write-spec`"
            )
        data = dict(
            check_artifact(data, kind=cls.KIND, version=cls.SCHEMA_VERSION, migrations=cls.MIGRATIONS, source=source)
        )
        del data["kind"], data["schema_version"]
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise TrialSpecError(f"{source}: unknown field {unknown[0]!r} (known: {', '.join(sorted(names))})")
        try:
            reference = (
                config_from_dict(data["reference"], source=source) if data.get("reference") is not None else None
            )
            return cls(
                **{
                    **data,
                    "config": config_from_dict(data["config"], source=source),
                    "reference": reference,
                    "out_dir": Path(data["out_dir"]),
                }
            )
        except (KeyError, TypeError) as e:
            raise TrialSpecError(f"{source}: incomplete trial spec ({e})") from None
        except TrialSpecError as e:
            raise TrialSpecError(f"{source}: {str(e).removeprefix('trial spec: ')}", field=e.field) from None

    @classmethod
    def read(cls, path: str | Path) -> TrialSpec:
        return cls.from_dict(
            read_artifact(path, kind=cls.KIND, version=cls.SCHEMA_VERSION, migrations=cls.MIGRATIONS), source=str(path)
        )

    def write(self, path: str | Path) -> Path:
        return write_artifact(path, self.to_dict())
