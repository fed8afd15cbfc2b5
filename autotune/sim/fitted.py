"""Constants read off measurements, each naming the recorded trials it was fitted on ([Note: fit and held-out sets]).

[Note: fit and held-out sets]
Some of the simulator's constants are read off recorded trials: the profiler's factor on the
host (``host_path.PROFILER_FACTOR``), the host's microseconds per launch (``LAUNCH_US``), the
activation-checkpointing host ratios (``DEFAULT_RATIOS``), the hooks' quantile
(``trace_costs.HOOK_QUANTILE``), the memory margin's shares (``margin``). A figure that judges
such a constant must not have set it, so each constant carries a :class:`Fitted` record next
to it: its value, the recorded trials it was fitted on (``fit_on``), how, and which accuracy
figure it enters (``figure``). :mod:`autotune.sim.fit_split` collects them and splits the
recorded trials of each figure into the *fit set* (a trial some constant of that figure was
read off, or another measurement of the same config: a rerun of a config judges the
constant's noise, not whether it carries to other configs) and the *held-out set* (every
other recorded trial). The accuracy benchmarks (``benchmarks/gpu_sim_accuracy.py``,
``benchmarks/sim_accuracy.py``) and the tests report the held-out error as the accuracy
figure and the fit set's error apart, labelled as such.

A trial is named by what it is in this repository: a GPU trial dir under
``tests/data/gpu_traces`` by its dir name, a case of a recorded ``gpu_sim_accuracy.py`` run as
``gpu_sim_accuracy/<case label>``, a CPU ``sim_accuracy.py`` setting as ``<workload>/<setting>``
(each run measures it afresh: the setting is what a constant was fitted on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GPU_STEP = "gpu step (device profile)"
"""A GPU step predicted with a device profile calibrated on a GPU trial (``gpu_sim_accuracy.py``)."""
GPU_DATASHEET = "gpu step (datasheet)"
"""A GPU step predicted from a cluster profile's datasheet, no device profile."""
GPU_MEMORY = "gpu peak memory"
"""A predicted peak against a GPU trial's CUDA max allocated (the memory margin)."""
CPU_STEP = "cpu step ratio"
"""A CPU config's step over the defaults', predicted against measured (``sim_accuracy.py``)."""
FIGURES = (GPU_STEP, GPU_DATASHEET, GPU_MEMORY, CPU_STEP)

# The recorded GPU trial dirs (tests/data/gpu_traces; one H200 SXM, torch 2.11.0+cu130).
H200_L8B4 = "h200-l8b4-defaults"
H200_LLAMA1B = "h200-llama1b-defaults"
H200_LLAMA1B_GSA = "h200-llama1b-gsa-defaults"
H200_LLAMA1B_SELECTIVE = "h200-llama1b-selective-ac"
H200_LLAMA1B_FULL = "h200-llama1b-full-ac"
GSA_CASE = "gpu_sim_accuracy/"
"""The prefix of a case of the recorded ``gpu_sim_accuracy.py`` run (one H200, 2026-11-27)."""


@dataclass(frozen=True, kw_only=True)
class Fitted:
    """A constant read off recorded trials (see [Note: fit and held-out sets])."""

    name: str
    """Where it lives: ``module.NAME``."""
    value: Any
    fit_on: tuple[str, ...]
    """The recorded trials it was read off (names as in [Note: fit and held-out sets])."""
    how: str
    figure: str
    """The accuracy figure it enters (one of ``FIGURES``): only that figure's held-out set judges it."""

    def __post_init__(self) -> None:
        if self.figure not in FIGURES:
            raise ValueError(f"{self.name}: figure {self.figure!r} is not one of {FIGURES}")
        if not self.fit_on:
            raise ValueError(f"{self.name}: a fitted constant names the trials it was fitted on")
