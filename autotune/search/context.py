"""The objects every stage of a search run shares, travelling together."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.search.cost import RoundLedger
from autotune.search.timeouts import TrialTimeouts, builds_in_turn, count_builds, count_steps, may_build_in_turn
from autotune.trials import (
    PairNoise,
    Pool,
    StoppingRule,
    TrialResult,
    TrialSpec,
    get_default_backend,
    get_emulated_cluster,
    run_trial,
)
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
    pool: Pool | None = None
    """A :class:`~autotune.trials.Pool` (this host's :class:`~autotune.trials.RankPool`, or the nodes'
    :class:`~autotune.trials.NodePool`) shared by trials, confirmation and consolidation timing, or None."""
    own_dir: Path | None = None
    """Where this worker writes warm-up, confirmation, emitted config, tables and report
    (``settings.out_dir`` unless another worker holds it; see ``study.claim_out_dir``)."""
    timeouts: TrialTimeouts = field(default_factory=TrialTimeouts)
    """Trial time limits that follow this box ([Note: trial timeouts]); set from the settings in ``__post_init__``."""
    noise: PairNoise = field(default_factory=PairNoise)
    """The box's pair noise from this process's paired trials ([Note: pooled noise]; a resumed
    search starts it afresh)."""
    profile_at_end: bool = False
    """The config to emit is profiled once, in the recipe round, so search trials other than the
    defaults' and the presearch's calibration trials skip their profiled windows ([Note: the
    emitted config's trace] in :mod:`autotune.search.recipe`)."""

    ledger: RoundLedger = field(default_factory=RoundLedger)
    """What each round ran, and the ETA of what is left ([Note: round costs] in :mod:`autotune.search.cost`)."""

    def __post_init__(self) -> None:
        self.timeouts.fixed_s = self.settings.trial_timeout_s
        watch = getattr(self.reporter, "on_ledger", None)  # a reporter that shows the ETA
        if watch is not None:
            watch(self.ledger)

    @property
    def round(self) -> str | None:
        """The round the search is in (:data:`autotune.search.cost.ROUNDS`), set by each round's entry point."""
        return self.ledger.current

    @round.setter
    def round(self, name: str) -> None:
        self.ledger.enter(name)  # its rounds are the search plan's (run_search sets them: [Note: round costs])

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
        reference: RuntimeConfig | None = None,
        stopping: StoppingRule | None = None,
        profile_below: float | None = None,
    ) -> TrialSpec:
        """A trial of ``config`` measured as every trial of this search is: against ``reference``
        (default: the defaults), alternating on the same ranks (see [Note: paired measurement]),
        unless ``paired=False``; with ``stopping``, until the rule says it is known
        ([Note: sequential measurement])."""
        s = self.settings
        extra = {"rank_program": s.rank_program} if s.rank_program else {}
        reference = (reference or self.default_config) if paired else None
        in_turn = reference is not None and builds_in_turn(config, reference)
        limit_s = self._get_timeout_s(
            num_pairs, paired=paired, self_paired=reference == config, profile=profile, in_turn=in_turn
        )
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
            timeout_s=limit_s,
            cluster=get_emulated_cluster(s.cluster, get_default_backend()),  # [Note: the search plan]: never over NCCL
            reference=reference,
            prune_if_ratio_above=prune_if_ratio_above,
            stopping=stopping.to_dict() if stopping is not None and paired else None,
            profile_below=profile_below,
            keep_reference=self.pool is not None,  # [Note: a warm reference]: a pool's ranks outlive the trial
            **extra,
        )

    def run(self, spec: TrialSpec) -> TrialResult:
        """Run a trial on the search's ranks; its wall time teaches the next trials' limits ([Note: trial
        timeouts]), its pairs the box's noise ([Note: pooled noise] in :mod:`fsdp_runtime.tuning.sequential`)."""
        result = run_trial(spec, pool=self.pool)
        self.timeouts.observe(result)
        self.ledger.observe(self.round, result, spec)
        paired = result.metrics.paired if result.metrics is not None and result.status in ("ok", "pruned") else None
        if paired:
            self.noise.observe(paired.get("pair_ratios") or [])
        return result

    def get_trial_timeout_s(self) -> float:
        """The limit of a search trial of the standard length (every pair, profiled; its models
        built in turn where trials may build them so: the longest a trial may take)."""
        return self._get_timeout_s(None, paired=True, self_paired=False, profile=True, in_turn=may_build_in_turn())

    def _get_timeout_s(
        self, num_pairs: int | None, *, paired: bool, self_paired: bool, profile: bool, in_turn: bool = False
    ) -> float:
        """The limit of a trial of this search that runs at most these steps and builds at most
        these models ([Note: trial timeouts])."""
        s = self.settings
        counts = {
            "num_pairs": num_pairs or s.num_measured,
            "paired": paired,
            "self_paired": self_paired,
            "profiled": s.num_profiled if profile else 0,
            "in_turn": in_turn,
        }
        return self.timeouts.get(count_steps(num_warmup=s.num_warmup, **counts), count_builds(**counts))

    def get_stopping_rule(
        self, *, prune: bool, faster_below: float | None = 1.0, num_pairs: int | None = None, futility: bool = True
    ) -> StoppingRule:
        """The search's rule ([Note: sequential measurement]): at most ``num_pairs`` (default
        ``num_measured``) pairs, settled at ``precision``; stopped as clearly faster below
        ``faster_below``, pruned as clearly slower above ``prune_ratio`` times it (times 1.0
        without one) when ``prune``; with the box's noise pooled from the trials so far where
        there is enough of it ([Note: pooled noise]), then a clearly slower first block may be
        pruned on one confirming pair, and where ``prune`` and ``futility``, a trial unlikely to
        end below ``faster_below`` stops before its last block ([Note: futility])."""
        s = self.settings
        noise = self.noise.get()
        return StoppingRule(
            max_blocks=max(1, ((num_pairs or s.num_measured) + 1) // 2),
            precision=s.precision,
            faster_below=faster_below,
            prune_above=s.prune_ratio * (faster_below or 1.0) if prune else None,
            noise_sd=noise[0] if noise is not None else None,
            noise_df=noise[1] if noise is not None else 0,
            futile_above=(faster_below or 1.0) if prune and futility else None,
        )
