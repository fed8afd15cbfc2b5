"""The fitted constants and the recorded trials split into fit and held-out sets ([Note: fit and held-out sets]
in :mod:`autotune.sim.fitted`): what the accuracy benchmarks and the tests read to report held-out error apart."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.sim.fitted import (
    CPU_STEP,
    FIGURES,
    GPU_DATASHEET,
    GPU_STEP,
    GSA_CASE,
    H200_L8B4,
    H200_LLAMA1B,
    H200_LLAMA1B_FULL,
    H200_LLAMA1B_GSA,
    H200_LLAMA1B_SELECTIVE,
    Fitted,
)
from autotune.sim.host_path import DEFAULT_RATIOS_FIT, LAUNCH_US_FIT, PROFILER_FACTOR_FIT
from autotune.sim.margin import ALLOCATOR_FRAGMENTATION_FIT, SIMULATOR_MEMORY_ERROR_FIT
from autotune.sim.trace_costs import HOOK_QUANTILE_FIT

H200_HOST_FLOOR_FIT = Fitted(
    name="profiles/clusters/h200-node.toml (and h100-node.toml) [accelerator] host_floor_us",
    value={"block_forward": 150, "block_backward": 296, "microbatch": 1177, "step": 1205},
    fit_on=(H200_L8B4,),
    how="the l8b4 trace's device idle per part, scaled to its unprofiled step ([Note: GPU calibration])",
    figure=GPU_DATASHEET,
)
FITTED = (
    PROFILER_FACTOR_FIT,
    LAUNCH_US_FIT,
    DEFAULT_RATIOS_FIT,
    HOOK_QUANTILE_FIT,
    SIMULATOR_MEMORY_ERROR_FIT,
    ALLOCATOR_FRAGMENTATION_FIT,
    H200_HOST_FLOOR_FIT,
)
"""Every constant of the simulator read off recorded trials, with the trials it was fitted on."""


def get_config_key(model: str, seq_len: int, num_microbatches: int, params: dict | None = None) -> str:
    """What ran, as the split compares GPU trials: the model, its sequence length, the microbatches and
    the search-space params that differ from FSDP2's defaults (one config measured twice: one key)."""
    changed = " ".join(f"{k}={v}" for k, v in sorted((params or {}).items()))
    return f"{model}, seq {seq_len}, {num_microbatches} microbatches" + (f", {changed}" if changed else "")


@dataclass(frozen=True, kw_only=True)
class Recorded:
    """A recorded GPU measurement in this repository: a trial dir, or a case of the recorded run."""

    name: str
    config: str
    """:func:`get_config_key` of what ran."""
    step_ms: float
    """The unprofiled step (median), as ``tests/data/gpu_traces/README.md`` lists it."""
    run: str


SELECTIVE_AC = {"ac_units": "all", "ac_kind": "selective"}
FULL_AC = {"ac_units": "all", "ac_kind": "full"}
GSA_RUN = "gpu_sim_accuracy.py --steps 4, one H200 SXM, torch 2.11.0+cu130, 2026-11-27"
"""The recorded ``gpu_sim_accuracy.py`` run: its ``case_00`` is the trial dir ``h200-llama1b-gsa-defaults``."""
_TRIAL_26, _TRIAL_27 = (f"autotune trial, one H200 SXM, torch 2.11.0+cu130, 2026-11-{d}" for d in (26, 27))
_GSA_CASES = (  # label, seq_len, microbatches, params, measured ms
    ("full checkpointing", 8192, 2, FULL_AC, 542.7),
    ("selective checkpointing", 8192, 2, SELECTIVE_AC, 586.7),
    ("2 blocks per unit", 8192, 2, {"blocks_per_unit": 2}, 437.1),
    ("no reshard after forward", 8192, 2, {"reshard_after_forward": "false"}, 432.8),
    ("1 microbatch", 8192, 1, {}, 231.2),
    ("4 microbatches", 8192, 4, {}, 858.7),
    ("seq 4096", 4096, 2, {}, 272.0),
    ("seq 4096, selective, 4 microbatches", 4096, 4, SELECTIVE_AC, 957.9),
    (
        "4 blocks per unit, no reshard after forward",
        8192,
        2,
        {"blocks_per_unit": 4, "reshard_after_forward": "false"},
        432.5,
    ),
)
GPU_RECORDED = (
    Recorded(name=H200_L8B4, config=get_config_key("l8b4", 8192, 2), step_ms=377.3, run=_TRIAL_26),
    Recorded(name=H200_LLAMA1B, config=get_config_key("llama1b", 8192, 2), step_ms=436.8, run=_TRIAL_26),
    Recorded(name=H200_LLAMA1B_GSA, config=get_config_key("llama1b", 8192, 2), step_ms=441.7, run=GSA_RUN),
    Recorded(
        name=H200_LLAMA1B_SELECTIVE,
        config=get_config_key("llama1b", 8192, 2, SELECTIVE_AC),
        step_ms=541.0,
        run=_TRIAL_27,
    ),
    Recorded(name=H200_LLAMA1B_FULL, config=get_config_key("llama1b", 8192, 2, FULL_AC), step_ms=550.0, run=_TRIAL_27),
    *(
        Recorded(name=f"{GSA_CASE}{label}", config=get_config_key("llama1b", seq, m, params), step_ms=ms, run=GSA_RUN)
        for label, seq, m, params, ms in _GSA_CASES
    ),
)
"""Every recorded GPU step in this repository (``tests/data/gpu_traces/README.md``)."""

GPU_HELD_OUT = (
    H200_L8B4,
    *(
        f"{GSA_CASE}{label}"
        for label in (
            "2 blocks per unit",
            "no reshard after forward",
            "1 microbatch",
            "4 microbatches",
            "seq 4096",
            "seq 4096, selective, 4 microbatches",
            "4 blocks per unit, no reshard after forward",
        )
    ),
)
"""The recorded GPU steps no constant of ``GPU_STEP`` was read off, nor another measurement of their config:
the only ones a device profile's accuracy is quoted on (``test_fit_split.py`` checks it against ``FITTED``)."""
CPU_HELD_OUT = ("small/emulated", "small/2x2", "wide/emulated", "wide/2x2", "deep/raw", "deep/emulated", "deep/2x2")
"""``sim_accuracy.py``'s workload/settings no constant of ``CPU_STEP`` was fitted on: every setting but raw
loopback of ``small`` and ``wide`` (``HOOK_QUANTILE``'s), and ``deep`` on every setting."""


def get_fit_trials(figure: str) -> set[str]:
    """The recorded trials some constant entering ``figure`` was read off."""
    if figure not in FIGURES:
        raise ValueError(f"figure {figure!r} is not one of {FIGURES}")
    return {name for fitted in FITTED if fitted.figure == figure for name in fitted.fit_on}


def get_fit_configs(figure: str) -> set[str]:
    """The configs (:func:`get_config_key`) of the recorded GPU trials some constant of ``figure`` was read off."""
    trials = get_fit_trials(figure)
    return {r.config for r in GPU_RECORDED if r.name in trials}


def is_held_out(name: str, figure: str, config: str | None = None) -> bool:
    """Whether a trial (by name, and by config where given) judges ``figure``'s constants: no constant of
    that figure was read off it nor off another measurement of its config."""
    if name in get_fit_trials(figure):
        return False
    return config is None or config not in get_fit_configs(figure)


def split_gpu_recorded(figure: str = GPU_STEP) -> tuple[tuple[Recorded, ...], tuple[Recorded, ...]]:
    """``GPU_RECORDED`` as (fit set, held out) for ``figure``."""
    held = tuple(r for r in GPU_RECORDED if is_held_out(r.name, figure, r.config))
    return tuple(r for r in GPU_RECORDED if r not in held), held


def get_gsa_measured_ms() -> dict[str, float]:
    """The recorded ``gpu_sim_accuracy.py`` run's measured step per case config (``case_00`` included)."""
    return {r.config: r.step_ms for r in GPU_RECORDED if r.run == GSA_RUN}


def is_cpu_held_out(workload: str, setting: str) -> bool:
    """Whether a ``sim_accuracy.py`` workload/setting judges the CPU constants (``CPU_STEP``)."""
    return is_held_out(f"{workload}/{setting}", CPU_STEP)


def check_split() -> None:
    """Raise where a trial is in both sets: a held-out trial (``GPU_HELD_OUT``, ``CPU_HELD_OUT``) some constant
    was read off or that re-measures a config one was read off, or a fitted constant naming no recorded trial."""
    known = {r.name for r in GPU_RECORDED} | set(CPU_HELD_OUT) | get_fit_trials(CPU_STEP)
    for fitted in FITTED:
        unknown = set(fitted.fit_on) - known
        if unknown:
            raise ValueError(f"{fitted.name}: fitted on {sorted(unknown)}, not a recorded trial of this repository")
    both = [name for name in GPU_HELD_OUT if not is_held_out(name, GPU_STEP, _get_recorded(name).config)]
    both += [name for name in CPU_HELD_OUT if name in get_fit_trials(CPU_STEP)]
    if both:
        raise ValueError(f"in a fitted constant's fit set and held out: {both}")
    if set(GPU_HELD_OUT) != {r.name for r in split_gpu_recorded(GPU_STEP)[1]}:
        raise ValueError("GPU_HELD_OUT is not every recorded GPU trial outside the fit set")


def _get_recorded(name: str) -> Recorded:
    return next(r for r in GPU_RECORDED if r.name == name)
