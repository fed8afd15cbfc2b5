"""The objects every stage of a search run shares, travelling together."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.trials import TrialSpec
from fsdp_runtime import RuntimeConfig

if TYPE_CHECKING:
    import optuna

    from autotune.search.proxy import ModelPlan
    from autotune.search.settings import SearchReporter, SearchSettings
    from autotune.search.space import SearchSpace


@dataclass(kw_only=True)
class SearchContext:
    """One search run: its study, space, settings, model plan, progress reporter and rank pool."""

    study: optuna.Study
    space: SearchSpace
    settings: SearchSettings
    plan: ModelPlan
    reporter: SearchReporter
    pool: Any = None
    """A :class:`~autotune.trials.RankPool` shared by trials, confirmation and consolidation timing, or None."""
    own_dir: Path | None = None
    """Where this worker writes warm-up, confirmation, emitted config, tables and report
    (``settings.out_dir`` unless another worker holds it; see ``study.claim_out_dir``)."""

    @property
    def write_dir(self) -> Path:
        return self.own_dir or self.settings.out_dir

    @property
    def default_config(self) -> RuntimeConfig:
        """FSDP2's defaults in this space: the reference every trial is measured against."""
        return self.space.build_config(self.space.get_default_params())

    def trial_spec(
        self,
        config: RuntimeConfig,
        out_dir: Path,
        *,
        profile: bool,
        paired: bool = True,
        num_pairs: int | None = None,
        prune_if_ratio_above: float | None = None,
    ) -> TrialSpec:
        """A trial of ``config`` measured as every trial of this search is: against the defaults,
        alternating on the same ranks (see [Note: paired measurement]), unless ``paired=False``."""
        s = self.settings
        extra = {"rank_program": s.rank_program} if s.rank_program else {}
        return TrialSpec(
            model=self.plan.trial_model,
            config=config,
            world_size=s.world_size,
            out_dir=out_dir,
            num_warmup=s.num_warmup,
            num_measured=num_pairs or s.num_measured,
            num_profiled=s.num_profiled,
            profile=profile,
            seed=s.seed,
            timeout_s=s.trial_timeout_s,
            cluster=s.cluster,
            reference=self.default_config if paired else None,
            prune_if_ratio_above=prune_if_ratio_above,
            **extra,
        )
