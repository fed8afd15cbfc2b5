"""The options of the ``autotune`` commands: each option's flags and help, once, as a type
``cli.py``'s commands annotate their parameters with, and the library setting it sets.

An error from the library names a setting by the library's name (``AutotuneError.field``:
``num_trials``); :data:`FLAGS`, filled as the options below are declared, turns it into the flag
a user typed (``--trials``), so the two cannot drift apart. An option that sets no one setting
(``--json``, ``--resume``) declares no field. An option several commands share is declared once,
under the first command that has it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

FLAGS: dict[str, str] = {}
"""A library setting's name (``AutotuneError.field``) -> the flag that sets it."""


def option(*names: str, field: str | None = None, **kwargs: Any) -> Any:
    """``typer.Option(*names, **kwargs)``, recording in :data:`FLAGS` that its first flag sets ``field``."""
    if field is not None:
        flag = names[0].split("/")[0]
        if FLAGS.setdefault(field, flag) != flag:
            raise ValueError(f"{field} is set by {FLAGS[field]} and by {flag}: one setting, one flag")
    return typer.Option(*names, **kwargs)


# --------------------------------------------------------------------------- search, trial and plan

# One definition of the precision options; resolved in autotune.trials.resolve_precision
# ([Note: precision defaults]).
ParamDtype = Annotated[
    str | None,
    option(
        "--param-dtype",
        help="Dtype of the unsharded parameters (compute) in every trial: float32, bfloat16 or float16. Default: bfloat16 on CUDA (as torchtitan trains), float32 on CPU (CPU bf16 matmuls are slow). trial --config keeps the config's own mixed_precision table unless this is given.",
        show_default=False,
        field="param_dtype",
    ),
]
ReduceDtype = Annotated[
    str | None,
    option(
        "--reduce-dtype",
        help="Dtype of gradient reduction in every trial: float32, bfloat16 or float16. Default: float32 (CUDA and CPU). trial --config keeps the config's own mixed_precision table unless this is given.",
        show_default=False,
        field="reduce_dtype",
    ),
]

# --------------------------------------------------------------------------- autotune validate

WorldSize = Annotated[int | None, option("--world-size", "-w", help="Also check the mesh against this world size.")]
ValidateModel = Annotated[
    str | None,
    option("--model", "-m", help="Also check the units against this model (as in search), built on the meta device."),
]

# --------------------------------------------------------------------------- autotune report

ReportOut = Annotated[
    Path | None, option("--out", "-o", help="Where to write report.html and the PNGs; default: DIR/report.")
]
ReportJson = Annotated[bool, option("--json", help="Print the summary JSON only (no tables, no files).")]

# --------------------------------------------------------------------------- autotune search

SearchModel = Annotated[
    str,
    option(
        "--model",
        "-m",
        help="Model profile (tiny, small, llama1b, llama8b, llama70b), a model TOML, package.module:function (a factory) or a Hugging Face config.json / model dir.",
        field="model",
    ),
]
SearchNproc = Annotated[
    int | None,
    option(
        "--nproc",
        "-n",
        help="Ranks (world size) of every trial. Default: one per visible GPU on CUDA (CUDA_VISIBLE_DEVICES honoured), the --plan-for node's GPUs, else 2.",
        show_default=False,
        field="world_size",
    ),
]
SeqLen = Annotated[
    int | None, option("--seq-len", help="Sequence length of the trials (default: the model's).", field="seq_len")
]
BatchSize = Annotated[
    int | None,
    option("--batch-size", help="Per-rank microbatch size of the trials (default: the model's).", field="batch_size"),
]
Proxy = Annotated[
    bool | None,
    option(
        "--proxy/--no-proxy",
        help="Force a scale proxy, or the model as it is. Default: the model itself wherever its leanest config fits (on a GPU, by the simulator).",
        show_default=False,
        field="proxy",
    ),
]
PlanFor = Annotated[
    str | None,
    option(
        "--plan-for",
        help="With --dry-run: answer for this GPU cluster profile's node (h100-node, h200-node, ...) from a box without GPUs.",
        field="plan_for",
    ),
]
StepBudget = Annotated[
    float | None,
    option(
        "--step-budget-s",
        help="Size a proxy to this step time: per microbatch on CPU (default 1 s), per step on a GPU (default: none).",
        field="step_budget_s",
    ),
]
BaselineAc = Annotated[
    str | None,
    option(
        "--baseline-ac",
        help="Activation checkpointing of the baseline on every block: none, selective or full. Default: the least that fits.",
        field="baseline_checkpointing",
    ),
]
Trials = Annotated[
    int, option("--trials", "-t", help="Total trials in the study, the defaults trial included.", field="num_trials")
]
Microbatches = Annotated[
    int, option("--microbatches", help="Gradient-accumulation microbatches per step.", field="num_microbatches")
]
SearchOut = Annotated[
    Path, option("--out", "-o", help="Run directory (study, trials, best config, tables).", field="out_dir")
]
Storage = Annotated[
    str | None,
    option(
        "--storage",
        help="Optuna storage shared by several workers: sqlite:///PATH, journal:PATH or postgresql+psycopg://USER@HOST/DB; default: sqlite in --out.",
        field="storage",
    ),
]
NodeWorkers = Annotated[
    str | None,
    option(
        "--workers",
        help="HOST:PORT where the ranks torchrun starts on every node join (-m autotune.trials.worker --pool HOST:PORT); "
        "default: this host's own ranks.",
        field="workers",
    ),
]
SearchDryRun = Annotated[
    bool,
    option(
        "--dry-run",
        help="Print the plan (model or proxy, ranks, baseline, rounds, builds, steps, estimated wall), the space and, with --workers, the world formed across the nodes; run no trial.",
    ),
]
JoinTimeout = Annotated[
    float,
    option("--join-timeout", help="With --workers: seconds to wait for the world to form.", field="join_timeout_s"),
]
StudyName = Annotated[str | None, option("--study-name", help="Study name; default: MODEL-wN-mbM.", field="study_name")]
Resume = Annotated[bool, option("--resume", help="Continue the study (or join it as another worker).")]
Sampler = Annotated[str, option("--sampler", help="tpe (seeded, default), random, cmaes or qmc.", field="sampler")]
Seed = Annotated[int, option("--seed", field="seed")]
MemoryBudgetGib = Annotated[
    float | None,
    option(
        "--memory-budget-gib",
        help="Peak memory per rank above this makes a trial infeasible.",
        field="memory_budget_bytes",
    ),
]
Grouping = Annotated[
    bool, option("--grouping/--no-grouping", help="Search 1, 2 or 4 blocks per FSDP unit.", field="grouping")
]
RootKnobs = Annotated[
    bool,
    option(
        "--root-knobs/--no-root-knobs",
        help="Search the root unit's reshard and sync level, and embeddings and head as units of their own.",
        field="root_knobs",
    ),
]
Checkpointing = Annotated[
    bool | None,
    option(
        "--checkpointing/--no-checkpointing",
        help="Search activation checkpointing per block (none, selective, full); default: only with --memory-budget-gib.",
        show_default=False,
        field="checkpointing",
    ),
]
EmulatedCluster = Annotated[
    str | None,
    option(
        "--cluster",
        help="Cluster profile: over gloo its links are emulated (e.g. cpu-emulated-ib); over NCCL it gives the topology and the simulator's prices, never emulated.",
        field="cluster",
    ),
]
Mesh = Annotated[str | None, option("--mesh", help="Fix the mesh: fsdp or hsdp:RxS.", field="fixed_mesh")]
SearchPp = Annotated[
    str,
    option(
        "--pp",
        help="Pipeline degrees to search with FSDP2 inside each stage, e.g. 1,2 (those dividing the world size and the blocks; 1: no stages).",
        field="pipeline_degrees",
    ),
]
Patience = Annotated[
    int, option("--patience", help="Stop after this many trials without a 1% improvement (0: never).", field="patience")
]
Refine = Annotated[
    int | None,
    option(
        "--refine",
        help="Last trials that try neighbours of the best config instead of sampling; default: a third of --trials.",
        field="num_refine",
    ),
]
ConfirmPairs = Annotated[
    int,
    option("--confirm-pairs", help="Alternating best/default re-measurements at the end.", field="num_confirm_pairs"),
]
TrialTimeout = Annotated[
    float | None,
    option(
        "--trial-timeout",
        help="Seconds before a trial's ranks are killed; default: 5x what this box measured per step times the trial's steps, at least 120.",
        field="trial_timeout_s",
    ),
]
Reference = Annotated[
    str,
    option(
        "--reference",
        help="What each trial is paired with: defaults (FSDP2's, every trial) or best (the best trial so far, its ratio chained to the defaults').",
        field="reference",
    ),
]
Precision = Annotated[
    float,
    option(
        "--precision",
        help="A trial stops measuring once its ratio's 90% interval is within this relative half-width (or it is clearly faster or slower than the best).",
        field="precision",
    ),
]
StorageTimeout = Annotated[
    float,
    option("--storage-timeout", help="Seconds a write waits for a locked SQLite study.", field="storage_timeout_s"),
]
Heartbeat = Annotated[
    int | None,
    option(
        "--heartbeat",
        help="Seconds between a worker's heartbeats on a database server; a trial silent for 4 of them is failed. Default: --trial-timeout / 20, 5 to 60.",
        field="heartbeat_s",
    ),
]
Presearch = Annotated[
    str | None,
    option(
        "--presearch",
        help="sim: calibrate the step simulator on the defaults trial, rank the whole space in it and measure the fastest predictions first.",
        field="presearch",
    ),
]
PresearchTop = Annotated[
    int | None,
    option(
        "--presearch-top",
        help="Configs --presearch measures; default: every trial before the refinement.",
        field="presearch_top_k",
    ),
]
SearchReduceDtype = Annotated[
    bool,
    option(
        "--search-reduce-dtype",
        help="Also search the reduce dtype (float32 or bfloat16; bfloat16 halves reduce-scatter bytes and changes the sums). The defaults trial reduces in float32.",
        field="search_reduce_dtype",
    ),
]
SearchJson = Annotated[bool, option("--json", help="Print the summary as JSON on stdout (no progress).")]

# --------------------------------------------------------------------------- autotune trial

TrialModel = Annotated[
    str,
    option(
        "--model",
        "-m",
        help="Model profile (tiny, small, ...), a model TOML, package.module:function or a Hugging Face config.json / model dir.",
        field="model",
    ),
]
TrialOut = Annotated[
    Path, option("--out", "-o", help="Trial dir: traces, metrics.json, config.toml, env.json.", field="out_dir")
]
TrialConfig = Annotated[
    Path | None,
    option(
        "--config",
        "-c",
        help="Runtime config (.toml/.json), or torchtitan (its FSDP2 recipe built for the model); default: FSDP2 defaults for the model.",
    ),
]
TrialNproc = Annotated[int, option("--nproc", "-n", help="Ranks (world size).", field="world_size")]
Steps = Annotated[int, option("--steps", help="Measured (unprofiled) steps.", field="num_measured")]
Warmup = Annotated[int, option("--warmup", help="Warm-up steps before measuring.", field="num_warmup")]
ProfiledSteps = Annotated[
    int, option("--profiled-steps", help="Steps in the traces (0: no profiling).", field="num_profiled")
]
Timeout = Annotated[float, option("--timeout", help="Seconds before every rank is killed.", field="timeout_s")]
Backend = Annotated[
    str | None, option("--backend", help="gloo or nccl; default: nccl when CUDA is available.", field="backend")
]
WriteSpec = Annotated[
    Path | None,
    option("--write-spec", help="Only write the trial spec JSON for `torchrun -m autotune.trials.torchrun --spec`."),
]
TrialJson = Annotated[bool, option("--json", help="Print metrics.json on stdout.")]

# --------------------------------------------------------------------------- autotune plan

PlanModel = Annotated[
    str,
    option(
        "--model",
        "-m",
        help="Model profile (llama1b, llama8b, llama70b, ...), a model TOML, package.module:function (a factory) or a Hugging Face config.json / model dir.",
        field="model",
    ),
]
PlanCluster = Annotated[
    str,
    option("--cluster", help="GPU cluster profile: h100-node, h200-node, a100-node or a TOML path.", field="cluster"),
]
Nodes = Annotated[
    int, option("--nodes", help="Nodes of that profile (world size = nodes x ranks per node).", field="num_nodes")
]
Ac = Annotated[
    str,
    option(
        "--ac",
        help="Activation checkpointing: auto (searched per unit and set in the config; with --no-memory-knobs: none if the defaults fit, else full), or none / full in your training script.",
        field="activation_checkpointing",
    ),
]
Top = Annotated[int, option("--top", help="Configs to show.", field="num_top")]
Workers = Annotated[
    int | None, option("--workers", help="Simulating processes; default: CPU count (max 8).", field="num_workers")
]
PlanOut = Annotated[Path, option("--out", "-o", help="Where best.toml, best.json and plan.json go.", field="out_dir")]
Exact = Annotated[
    bool,
    option(
        "--exact",
        help="Simulate every config at the model's depth (deep models are otherwise extrapolated from 8 and 16 blocks, the fastest re-simulated).",
        field="exact",
    ),
]
MemoryKnobs = Annotated[
    bool,
    option(
        "--memory-knobs/--no-memory-knobs",
        help="Also rank blocks per unit, the root's knobs and (with --ac auto) checkpointing per unit, for the fastest configs.",
        field="memory_knobs",
    ),
]
PlanPp = Annotated[
    str | None,
    option(
        "--pp",
        help="Pipeline-parallel degrees to rank beside FSDP alone, e.g. 1,2,4,8 (default: 1 and those up to 8 dividing the world size and the blocks).",
        field="pp_degrees",
    ),
]
DeviceProfile = Annotated[
    Path | None,
    option(
        "--device-profile",
        help="A GPU measured by `autotune calibrate`: its rates price compute, copies, the optimizer and the host floor instead of the datasheet.",
        field="device_profile",
    ),
]

# --------------------------------------------------------------------------- autotune calibrate

CalibrateOut = Annotated[Path, option("--out", "-o", help="The device profile (TOML) to write.")]
CalibrateModel = Annotated[
    str | None, option("--model", help="The trials' model, where metrics.json's name does not resolve.", field="model")
]
CalibrateCluster = Annotated[
    str | None,
    option(
        "--cluster", help="Cluster profile of that GPU, for the check (default: by the GPU's name).", field="cluster"
    ),
]

# --------------------------------------------------------------------------- autotune compare

Rounds = Annotated[
    int | None,
    option(
        "--rounds",
        help="Rounds; each config runs once per round, alone, the order rotating and reversing. Default: 4; with --until-ci the most rounds, default 16.",
        show_default=False,
        field="num_rounds",
    ),
]
UntilCi = Annotated[
    float | None,
    option(
        "--until-ci",
        metavar="PCT",
        help="Stop after an even round once every speedup's 90% interval is within +-PCT% (relative half-width).",
        field="until_ci_pct",
    ),
]
CompareMicrobatches = Annotated[
    int | None,
    option(
        "--microbatches",
        help="Microbatches of the defaults and torchtitan configs; default: the config files' own (they must agree), else 1.",
        show_default=False,
        field="num_microbatches",
    ),
]
CompareOut = Annotated[
    Path,
    option("--out", "-o", help="Where compare.json and each run's trial dir (roundR/I-NAME) go.", field="out_dir"),
]
