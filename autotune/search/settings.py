"""What a search needs (settings), how it reports progress, and its error type."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from autotune.trials import check_dtype
from fsdp_runtime.errors import AutotuneError

if TYPE_CHECKING:
    from autotune.search.proxy import ModelPlan
    from autotune.search.results import TrialRow

SamplerName = Literal["tpe", "random", "cmaes", "qmc"]
SAMPLERS: tuple[str, ...] = ("tpe", "random", "cmaes", "qmc")
JOURNAL_PREFIX = "journal:"
"""``--storage journal:PATH``: Optuna's journal file storage."""
HEARTBEAT_GRACE_BEATS = 4
"""Heartbeat intervals without a heartbeat after which a running trial counts as dead: a
worker's heartbeat thread may be held up a few seconds (a busy host, a slow server)."""
DEFAULT_HEARTBEAT_BASIS_S = 180.0
"""The trial time a default heartbeat interval is a twentieth of, where no ``--trial-timeout`` is fixed."""


class SearchError(AutotuneError):
    """A search cannot start or continue (bad settings, a study that does not match)."""


@dataclass(kw_only=True)
class SearchSettings:
    """Everything a search needs; the CLI's options map one-to-one onto these fields."""

    model: str = "small"
    """Model profile name or TOML path, ``package.module:function`` (a model factory) or a
    Hugging Face ``config.json`` / local model dir ([Note: model sources] in :mod:`profiles.sources`)."""
    world_size: int | None = None
    """Ranks of every trial; None: one per visible GPU on CUDA without ``workers`` (as torchrun's
    ``--nproc-per-node gpu``), the ``plan_for`` node's GPUs, else 2
    (:func:`autotune.search.search_plan.get_default_world_size`)."""
    seq_len: int | None = None
    """The sequence length trials run (None: the model's own)."""
    batch_size: int | None = None
    """The per-rank microbatch size trials run (None: the model's own)."""
    proxy: bool | None = None
    """True: trials run a scale proxy; False: the model as it is, whatever the estimates; None: decided
    ([Note: the search plan] in :mod:`autotune.search.search_plan`)."""
    plan_for: str | None = None
    """A GPU cluster profile (``h100-node``): the dry run answers for its GPU node from this box."""
    dry_run: bool = False
    """Plan only: print what the search would run and cost; run no trial."""
    baseline_checkpointing: Literal["none", "selective", "full"] | None = None
    """The baseline's activation checkpointing on every block; None: the least that fits ([Note: the
    search plan])."""
    num_trials: int = 10
    """Total trials in the study (across resumes and workers), the defaults trial included. Why 10
    (16 before): on the README's main command (``small``, 2 ranks, 11% pair noise on a 2-core CPU
    box, 2026-11-28) six searches of 10 trials took 130-183 s (median 157) and emitted 1.21-1.33x
    the defaults, three of 16 alternating with them 191-219 s and 1.31-1.39x, where twelve earlier
    16-trial searches had spread 1.18-1.38x: after the fourth trial a clearly faster config is rare
    (4 of 36 recorded searches), and the later trials are mostly ties of the best the final round
    cannot tell apart (docs/studies.md, "Trial budget"; docs/benchmarks.md, "Search time")."""
    num_microbatches: int = 2
    out_dir: Path = Path("runs/search")
    storage: str | None = None
    """Optuna storage: an SQLAlchemy URL (``sqlite:///PATH``, ``postgresql+psycopg://...``) or
    ``journal:PATH`` (Optuna's journal file); default ``sqlite:///<out_dir>/study.db``
    ([Note: study storages] in :mod:`autotune.search.study`)."""
    storage_timeout_s: float = 120.0
    """How long a write waits for a locked SQLite study (several workers share one file)."""
    heartbeat_s: int | None = None
    """On a database server (PostgreSQL, MySQL): how often a worker records that its running
    trial is alive; any worker fails a trial whose last heartbeat is ``HEARTBEAT_GRACE_BEATS``
    intervals old. None: a twentieth of ``trial_timeout_s`` (of 180 s where trial limits follow the box), 5 to 60 s."""
    study_name: str | None = None
    resume: bool = False
    sampler: SamplerName = "tpe"
    seed: int = 0
    memory_budget_bytes: int | None = None
    grouping: bool = True
    """Search blocks per FSDP unit (``blocks_per_unit``: 1, 2, 4; [Note: search-space parametrization])."""
    root_knobs: bool = True
    """Search the root's reshard, its sync level on non-final microbatches and whether the
    embeddings and the head are units of their own."""
    checkpointing: bool | None = None
    """Search per-block activation checkpointing (``ac_units``, ``ac_kind``); None: only under
    a memory budget (it never makes a step faster, so without a budget it only costs trials)."""
    cluster: str | None = None
    """Cluster profile for link emulation (e.g. ``cpu-emulated-ib``); None: real links."""
    fixed_mesh: str | None = None
    pipeline_degrees: tuple[int, ...] | str = (1,)
    """Pipeline degrees searched (``pp``, with FSDP2 inside each stage: [Note: pipeline stages]);
    a string ``"1,2"`` is read as the tuple. ``(1,)``: no pipeline stages."""
    num_warmup: int = 2
    num_measured: int = 4
    """Most pairs (candidate and reference step, see [Note: paired measurement]) per trial; a
    trial stops earlier once its ratio is known ([Note: sequential measurement])."""
    reference: Literal["defaults", "best"] = "defaults"
    """What a search trial is paired with: FSDP2's defaults, or the best trial so far with its ratio
    chained to the defaults' ([Note: measured against the best] in :mod:`autotune.search.reference`:
    fewer of the defaults' slow steps, but a chain of two measurements)."""
    precision: float = 0.05
    """A trial's ratio counts as known once its 90% interval is within this relative half-width
    ([Note: sequential measurement] in :mod:`fsdp_runtime.tuning.sequential`)."""
    num_profiled: int = 2
    trial_timeout_s: float | None = None
    """Seconds before a trial's ranks are killed; None: follow what this box measured, so a slow
    box makes trials slow, not failed ([Note: trial timeouts] in :mod:`autotune.search.timeouts`)."""
    prune_ratio: float = 1.0
    """Prune a trial once its ratio to the best trial so far (its reference: [Note: measured
    against the best]) is surely above this: its whole 90% interval, from two blocks on."""
    max_ratio_spread: float = 0.10
    """A trial whose ratio still spreads wider than this (interquartile range / median) after its
    most pairs is flagged ``noisy``; in the final round, a leader this noisy is contested."""
    num_finalists: int = 3
    """Configs re-measured against the defaults at the end; the fastest of them is emitted."""
    patience: int | None = 10
    """Stop after this many finished trials without a >= 1% improvement; None: never
    (a plateau first moves the search on to its refinement trials)."""
    num_refine: int | None = None
    """Trials at the end that try neighbours of the best config instead of sampling
    ([Note: refinement] in :mod:`autotune.search.refine`); None: a third of ``num_trials``."""
    num_confirm_pairs: int = 3
    """Pairs per finalist in the final round (each an ABBA quartet of steps: twice this many pairs run)."""
    step_budget_s: float | None = None
    """A step-time budget that sizes a proxy: per microbatch on CPU (None: 1 s there), per step on a GPU
    (None: no budget, the model is measured as itself wherever it fits)."""
    use_pool: bool = True
    workers: str | None = None
    """``HOST:PORT``: the ranks are started by torchrun (or srun) on every node and join this
    search's store there (``-m autotune.trials.worker --pool HOST:PORT``: [Note: node pool] in
    :mod:`autotune.trials.nodes`); None: the search starts its own ranks on this host."""
    join_timeout_s: float = 900.0
    """With ``workers``: how long to wait for a world to form (the first, and after a failed trial)."""
    rank_program: str | None = None
    """Custom per-rank workload ``module:function`` (see :class:`autotune.trials.TrialSpec`)."""
    presearch: str | None = None
    """``sim``: rank the space in the step simulator calibrated on the defaults trial and measure the
    ``presearch_top_k`` fastest predictions first ([Note: presearch] in :mod:`autotune.search.presearch`)."""
    presearch_top_k: int | None = None
    """Configs the presearch enqueues; None: every trial before the refinement, the defaults' aside."""
    param_dtype: str | None = None
    """Dtype of the unsharded parameters in every trial (the defaults' included); None: the
    device's default, bfloat16 on CUDA, float32 on CPU ([Note: precision defaults] in
    :mod:`autotune.trials.precision`)."""
    reduce_dtype: str | None = None
    """Dtype of gradient reduction in every trial; None: float32."""
    search_reduce_dtype: bool = False
    """Search the reduce dtype (float32 or bfloat16) as a knob; the defaults trial reduces in float32.
    bfloat16 reduction changes the sums (``tests/fsdp_runtime/test_knobs_multirank.py`` bounds by how much)."""

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        if self.world_size is None:
            self.world_size = get_default_world_size(plan_for=self.plan_for, workers=self.workers)
        self.pipeline_degrees = parse_degrees(self.pipeline_degrees)
        for name, ok, problem in self._get_checks():
            if not ok:
                raise SearchError(problem, field=name)
        check_dtype(self.param_dtype, field="param_dtype")
        check_dtype(self.reduce_dtype, field="reduce_dtype")
        if self.search_reduce_dtype and self.reduce_dtype is not None:
            raise SearchError(
                f"--search-reduce-dtype searches the reduce dtype, so it cannot also be fixed to {self.reduce_dtype}; drop one",
                field="reduce_dtype",
            )

    def _get_checks(self) -> list[tuple[str, bool, str]]:
        """Each field's check: (field, holds, the problem in one line)."""
        return [
            ("world_size", self.world_size >= 1, f"world size must be >= 1, got {self.world_size}"),
            *self._get_plan_checks(),
            ("num_trials", self.num_trials >= 1, f"number of trials must be >= 1, got {self.num_trials}"),
            ("num_microbatches", self.num_microbatches >= 1, f"microbatches must be >= 1, got {self.num_microbatches}"),
            ("prune_ratio", self.prune_ratio >= 1.0, f"prune ratio must be >= 1, got {self.prune_ratio}"),
            ("precision", self.precision > 0, f"precision must be > 0, got {self.precision}"),
            (
                "reference",
                self.reference in ("defaults", "best"),
                f"unknown reference {self.reference!r} (use defaults or best)",
            ),
            (
                "num_confirm_pairs",
                self.num_confirm_pairs >= 0,
                f"confirmation pairs must be >= 0, got {self.num_confirm_pairs}",
            ),
            ("num_finalists", self.num_finalists >= 1, f"finalists must be >= 1, got {self.num_finalists}"),
            (
                "max_ratio_spread",
                self.max_ratio_spread > 0,
                f"max ratio spread must be > 0, got {self.max_ratio_spread}",
            ),
            ("num_measured", self.num_measured >= 2, f"measured pairs must be >= 2, got {self.num_measured}"),
            (
                "num_refine",
                self.num_refine is None or self.num_refine >= 0,
                f"refinement trials must be >= 0, got {self.num_refine}",
            ),
            ("patience", self.patience is None or self.patience >= 1, f"patience must be >= 1, got {self.patience}"),
            ("sampler", self.sampler in SAMPLERS, f"unknown sampler {self.sampler!r} (use {', '.join(SAMPLERS)})"),
            (
                "trial_timeout_s",
                self.trial_timeout_s is None or self.trial_timeout_s > 0,
                f"trial timeout must be > 0 s, got {self.trial_timeout_s}",
            ),
            (
                "storage_timeout_s",
                self.storage_timeout_s > 0,
                f"storage timeout must be > 0 s, got {self.storage_timeout_s}",
            ),
            ("presearch", self.presearch in (None, "sim"), f"unknown presearch {self.presearch!r} (use sim)"),
            (
                "presearch_top_k",
                self.presearch_top_k is None or self.presearch_top_k >= 1,
                f"presearch top-k must be >= 1, got {self.presearch_top_k}",
            ),
            (
                "heartbeat_s",
                self.heartbeat_s is None or self.heartbeat_s >= 1,
                f"heartbeat interval must be >= 1 s, got {self.heartbeat_s}",
            ),
            (
                "storage",
                self.storage != JOURNAL_PREFIX,
                f"a journal storage needs a file: {JOURNAL_PREFIX}PATH, got {self.storage!r}",
            ),
        ]

    def _get_plan_checks(self) -> list[tuple[str, bool, str]]:
        """The checks of what the search plan reads (the shape, the budget, the baseline)."""
        return [
            ("seq_len", self.seq_len is None or self.seq_len >= 1, f"sequence length must be >= 1, got {self.seq_len}"),
            (
                "batch_size",
                self.batch_size is None or self.batch_size >= 1,
                f"batch size must be >= 1, got {self.batch_size}",
            ),
            (
                "step_budget_s",
                self.step_budget_s is None or self.step_budget_s > 0,
                f"step budget must be > 0 s, got {self.step_budget_s}",
            ),
            (
                "baseline_checkpointing",
                self.baseline_checkpointing in (None, "none", "selective", "full"),
                f"unknown baseline checkpointing {self.baseline_checkpointing!r} (use none, selective or full)",
            ),
        ]

    def get_checkpointing(self) -> bool:
        return self.memory_budget_bytes is not None if self.checkpointing is None else self.checkpointing

    def get_num_refine(self) -> int:
        return self.num_trials // 3 if self.num_refine is None else self.num_refine

    def get_storage(self) -> str:
        return self.storage or f"sqlite:///{(self.out_dir / 'study.db').resolve()}"

    def get_heartbeat_s(self) -> int:
        """The heartbeat interval: a dead worker's trial is failed ``HEARTBEAT_GRACE_BEATS`` of
        them after its last heartbeat, within about a fifth of a trial's time limit."""
        if self.heartbeat_s is not None:
            return self.heartbeat_s
        return int(min(60.0, max(5.0, (self.trial_timeout_s or DEFAULT_HEARTBEAT_BASIS_S) / 20)))

    def get_heartbeat_grace_s(self) -> int:
        return HEARTBEAT_GRACE_BEATS * self.get_heartbeat_s()

    def get_study_name(self, model_name: str) -> str:
        return self.study_name or f"{model_name}-w{self.world_size}-mb{self.num_microbatches}"


def get_default_world_size(*, plan_for: str | None, workers: str | None) -> int:
    """``--nproc`` when not given: the ``--plan-for`` node's GPUs; on CUDA without ``--workers`` the
    visible GPUs (``CUDA_VISIBLE_DEVICES`` honoured, as torchrun's ``--nproc-per-node gpu``); else 2."""
    if plan_for is not None:
        from profiles import load_cluster_profile

        return load_cluster_profile(plan_for).ranks_per_node
    if workers is None:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return torch.cuda.device_count()
    return 2


def parse_degrees(value: tuple[int, ...] | str) -> tuple[int, ...]:
    """``"1,2,4"`` (or a tuple) as sorted distinct degrees >= 1; a one-line error naming ``--pp`` otherwise."""
    try:
        degrees = tuple(int(x) for x in value.split(",")) if isinstance(value, str) else tuple(value)
    except ValueError:
        raise SearchError(
            f"pipeline degrees must be integers like 1,2,4, got {value!r}", field="pipeline_degrees"
        ) from None
    if not degrees or any(d < 1 for d in degrees):
        raise SearchError(f"pipeline degrees must be >= 1, got {value!r}", field="pipeline_degrees")
    return tuple(sorted(set(degrees)))


class SearchReporter(Protocol):
    """Progress callbacks (the CLI renders them with rich; tests pass a silent one)."""

    def on_start(self, plan: ModelPlan, settings: SearchSettings, num_existing: int) -> None: ...
    def on_trial_start(self, number: int, total: int) -> None: ...
    def on_trial_end(self, row: TrialRow, best: TrialRow | None) -> None: ...
    def on_phase(self, message: str) -> None: ...
    def on_trials_done(self, stopped_because: str) -> None: ...


class SilentReporter:
    """A reporter that says nothing."""

    def on_start(self, plan: Any, settings: SearchSettings, num_existing: int) -> None:
        pass

    def on_trial_start(self, number: int, total: int) -> None:
        pass

    def on_trial_end(self, row: Any, best: Any) -> None:
        pass

    def on_phase(self, message: str) -> None:
        pass

    def on_trials_done(self, stopped_because: str) -> None:
        pass
