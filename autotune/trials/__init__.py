"""Trials: run one runtime config on N ranks, measure it, write a trial dir.

Data flow: :class:`TrialSpec` -> :func:`run_trial` -> ranks (:func:`run_ranks` fresh, or a
:class:`RankPool`; ``python -m autotune.trials.rank``) each running the rank program
(:mod:`autotune.trials.program`: the :mod:`~autotune.trials.training` under optional
:mod:`~autotune.trials.linkemu`) -> :func:`~autotune.trials.trialdir.write_trial_dir`
(the one writer of a trial dir) -> :class:`TrialResult` with :class:`TrialMetrics`.
Several nodes: :mod:`autotune.trials.torchrun`.
"""

from autotune.trials.figures import TrialFigures
from autotune.trials.killing import kill_tree, pid_alive
from autotune.trials.launch import EXIT_USER_ERROR, RankRun, classify_failure, parse_oom, run_ranks
from autotune.trials.linkemu import LinkEmulator, check_emulation_backend, get_emulated_cluster, get_link_name
from autotune.trials.metrics import RankMetrics, TrialMetrics, TrialResult, TrialStatus, median_or_none
from autotune.trials.nodes import NodePool, NodePoolError, get_pool_secret
from autotune.trials.pool import RankPool
from autotune.trials.pools import Pool
from autotune.trials.precision import (
    DEFAULT_PRECISION,
    OVERLAP_ENV,
    PRECISION_DTYPES,
    MachineError,
    PrecisionError,
    apply_precision_options,
    check_cuda_devices,
    check_device_type,
    check_dtype,
    check_fits_gpu,
    describe_precision,
    get_device_type,
    get_min_gpu_bytes,
    get_overlap_env,
    get_overlap_warning,
    resolve_precision,
)
from autotune.trials.sides import PAIRED_MODELS_ENV
from autotune.trials.spec import DEFAULT_RANK_PROGRAM, TrialSpec, TrialSpecError, get_default_backend
from autotune.trials.training import Training, build_training, resolve_profile
from autotune.trials.trial import check_trial_machine, load_trial_config, resolve_trial_config, run_trial
from autotune.trials.trialdir import INCOMPLETE_MARKER, check_trial_spec
from fsdp_runtime.tuning.sequential import Interval, PairNoise, StoppingRule, get_interval, get_rule_interval

__all__ = [
    "check_emulation_backend",
    "get_emulated_cluster",
    "parse_oom",
    "NodePool",
    "NodePoolError",
    "get_pool_secret",
    "Interval",
    "get_interval",
    "get_rule_interval",
    "get_default_backend",
    "DEFAULT_PRECISION",
    "OVERLAP_ENV",
    "PAIRED_MODELS_ENV",
    "PRECISION_DTYPES",
    "MachineError",
    "PrecisionError",
    "apply_precision_options",
    "check_cuda_devices",
    "check_device_type",
    "check_dtype",
    "check_fits_gpu",
    "describe_precision",
    "get_device_type",
    "get_min_gpu_bytes",
    "get_overlap_env",
    "get_overlap_warning",
    "resolve_precision",
    "DEFAULT_RANK_PROGRAM",
    "EXIT_USER_ERROR",
    "INCOMPLETE_MARKER",
    "LinkEmulator",
    "RankMetrics",
    "Pool",
    "RankPool",
    "RankRun",
    "PairNoise",
    "StoppingRule",
    "Training",
    "TrialFigures",
    "TrialMetrics",
    "TrialResult",
    "TrialSpec",
    "TrialSpecError",
    "TrialStatus",
    "build_training",
    "check_trial_spec",
    "classify_failure",
    "get_link_name",
    "load_trial_config",
    "median_or_none",
    "kill_tree",
    "pid_alive",
    "resolve_profile",
    "run_ranks",
    "run_trial",
    "check_trial_machine",
    "resolve_trial_config",
]
