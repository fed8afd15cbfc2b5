"""What ``autotune compare`` needs (settings), how it reports progress, and its error types."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from autotune.trials import TrialSpec, check_dtype
from fsdp_runtime.errors import AutotuneError

if TYPE_CHECKING:
    from autotune.trials import TrialResult
    from fsdp_runtime import RuntimeConfig

WORDS = ("defaults", "torchtitan")
"""A CONFIG that is one of these words is built for the model, not read from a file: FSDP2's
defaults as a search's defaults trial runs them, or torchtitan's recipe on those defaults."""
DEFAULT_ROUNDS = 4
"""Rounds without ``--until-ci``: two forward/reversed pairs ([Note: compare rounds])."""
DEFAULT_MAX_ROUNDS = 16
"""The most rounds with ``--until-ci`` when ``--rounds`` is not given."""


class CompareError(AutotuneError):
    """A comparison that cannot start: bad settings, a config the model or the world cannot run."""


class CompareRunError(AutotuneError):
    """A run of a comparison failed (crash, timeout, out of memory): no ratio can be given."""

    exit_code = 1


@dataclass(kw_only=True)
class CompareSettings:
    """Everything a comparison needs; the CLI's options map one-to-one onto these fields."""

    model: str
    configs: list[str]
    """Each a runtime config file (TOML/JSON) or one of :data:`WORDS`; the first is the baseline."""
    world_size: int = 2
    num_rounds: int | None = None
    """Rounds to run (each config once per round); with ``until_ci_pct`` the most. None:
    :data:`DEFAULT_ROUNDS`, or :data:`DEFAULT_MAX_ROUNDS` with ``until_ci_pct``."""
    until_ci_pct: float | None = None
    """Stop after an even round once every speedup's interval half-width is within this percentage."""
    num_warmup: int = 3
    num_measured: int = 8
    """Timed steps per run; a run's figure is their median (the slowest rank per step)."""
    num_microbatches: int | None = None
    """Microbatches of the words' configs; None: the files' own (they must agree), else 1."""
    timeout_s: float = 120.0
    """Wall-clock limit of one run, start-up included."""
    cluster: str | None = None
    backend: str | None = None
    seed: int = 0
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    out_dir: Path = Path("runs/compare")

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        self.configs = [str(c) for c in self.configs]
        if len(self.configs) < 2:
            raise CompareError(
                f"compare needs at least 2 configs (CONFIG...), got {len(self.configs)}: the first is the baseline",
                field="configs",
            )
        checks = [
            ("num_rounds", self.num_rounds is None or self.num_rounds >= 2, "must be >= 2 (one round has no interval)"),
            ("until_ci_pct", self.until_ci_pct is None or self.until_ci_pct > 0, "must be a percentage > 0"),
            ("num_microbatches", self.num_microbatches is None or self.num_microbatches >= 1, "must be >= 1"),
        ]
        for name, ok, problem in checks:
            if not ok:
                raise CompareError(f"{problem}, got {getattr(self, name)}", field=name)
        check_dtype(self.param_dtype, field="param_dtype")
        check_dtype(self.reduce_dtype, field="reduce_dtype")

    @property
    def max_rounds(self) -> int:
        if self.num_rounds is not None:
            return self.num_rounds
        return DEFAULT_MAX_ROUNDS if self.until_ci_pct is not None else DEFAULT_ROUNDS

    def trial_spec(self, config: RuntimeConfig, out_dir: Path) -> TrialSpec:
        """One run of ``config``: alone (no reference), unprofiled, on fresh ranks as a training job runs."""
        return TrialSpec(
            model=self.model,
            config=config,
            world_size=self.world_size,
            out_dir=out_dir,
            num_warmup=self.num_warmup,
            num_measured=self.num_measured,
            profile=False,
            timeout_s=self.timeout_s,
            cluster=self.cluster,
            seed=self.seed,
            **({"backend": self.backend} if self.backend else {}),
        )


class CompareReporter(Protocol):
    """Progress callbacks (the CLI renders them with rich; tests pass a silent one)."""

    def on_note(self, message: str) -> None: ...
    def on_run(self, round_number: int, max_rounds: int, label: str, result: TrialResult) -> None: ...


class SilentCompareReporter:
    """A reporter that says nothing."""

    def on_note(self, message: str) -> None:
        pass

    def on_run(self, round_number: int, max_rounds: int, label: str, result: Any) -> None:
        pass
