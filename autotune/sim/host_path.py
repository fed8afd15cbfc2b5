"""The host's launch path on a GPU, per block pass, from trials' traces ([Note: host path]).

[Note: host path]
On a GPU the host launches every kernel: for each op, Python, the dispatcher, autograd, and a
CUDA launch. When a block's kernels are short (a small model, short sequences) or the host
does more per op (selective activation checkpointing runs its policy in Python for every op
of the forward and of the recompute), the device waits for the launches and the step is the
host's length, not the device's. The simulator prices it per block pass
(``DeviceProfile.host_path_us``, ``Timeline.compute``'s ``host``): a pass ends no earlier
than the host has launched it.

*Measured from the trace's CPU side, like the device side.* The host's time per block pass
is the profiled host spans of [Note: calibration]'s keys (:func:`autotune.sim.kernel_costs.get_host_spans`):
a block's forward with its unshard hook, a block's backward with its pre-backward,
post-backward and reduce hooks, per block and microbatch.

*Timed by the trial.* A GPU trial times the host's path per block itself on an unprofiled step
([Note: host path probe] in :mod:`autotune.trials.host_probe`, ``metrics.json`` v9
``host_path_ms``); where any of a calibration's trials has it, those times are the host path
and nothing below is needed. The H200 trials in tests/data/gpu_traces predate it.

*The profiler's slowdown.* The profiler slows the host far more than the device: on one H200
(tests/data/gpu_traces) the profiled backward's host spans took 17-18 us per recorded op
against 8.5 us unprofiled. The unprofiled host path is read from the trial's unprofiled
steps: the training thread waits without CPU while autograd's thread runs the backward, so
``step - training thread CPU time`` (``time.thread_time``, [Note: what a trial measures])
is the backward's unprofiled wall on the host; over the profiled backward's host spans it
gives the factor ``k`` that takes the profiler out. It is the host path itself where the host
never waited on the device, and an upper bound where the launch queue filled (a
device-bound step: the host blocks in the launch once it is far enough ahead). On the
H200 trials: 0.64 (selective AC, host-bound) and 0.59 (full AC), 0.76 (defaults,
device-bound: the bound). The profile takes the smallest over its trials (the tightest
bound), applied to the forward too.

*A run's own slowdown, by launches.* Where every trial was device-bound, the bound is loose and
the profiler's factor must come from elsewhere, and it is not one number: the same llama1b
defaults, profiled in two runs on H200s, took 54.3 and 38.1 us of traced host per device op its
block forward launched, 62.9 and 46.0 us per op of its backward, hooks included (76 and 128
launches per block and microbatch in both: the launches are the code's, the microseconds the
profiler's and the host's). A constant factor (0.64, the host-bound trial's) carried the first
run's slowdown into profiles calibrated on the second and predicted llama1b with selective AC
10-12% too fast from them. So a calibration with plain trials whose launches were counted takes
its run's factors, forward and backward apart: ``LAUNCH_US`` (the H200 host's unprofiled
microseconds per launch, from the run that had a host-bound trial) over the trials' own traced
microseconds per launch, the backward's capped by the trials' bound (it bounds the backward)
and the forward's at 1 (the profiler never makes the host faster). That holds as far as the
host is the same machine and the blocks launch alike: l8b4's blocks (8B width) took 33.4 and
52.1 us per launch in the second run where llama1b's took 38.1 and 46.0, so width moves the
split a little.

*Checkpointing kinds a calibration did not run* come from the block forward's host path by
ratios measured on those H200 trials (llama1b, seq 8192, bf16; profiled, each over the
defaults trial's block forward with its hooks, 4.13 ms): full AC's forward 0.88 (its
forward runs without autograd's graph), its recompute 1.41 (the forward again, with the
checkpoint's own bookkeeping), selective AC's forward 2.24 and recompute 1.74 (the policy
per op). A calibration that includes a trial of that kind measures it instead. The ratios
hold for decoders whose blocks launch about the same ops per block as Llama's.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from autotune.sim.fitted import GPU_STEP, H200_LLAMA1B_FULL, H200_LLAMA1B_GSA, H200_LLAMA1B_SELECTIVE, Fitted
from autotune.sim.kernel_costs import KernelCosts
from autotune.sim.trace_costs import CalibrationError

DEFAULT_RATIOS = {
    "checkpoint_forward": 0.88,
    "recompute_full": 1.41,
    "selective_forward": 2.24,
    "recompute_selective": 1.74,
}
"""Host path over the block forward's (see [Note: host path]: H200, llama1b, profiled)."""
DEFAULT_RATIOS_FIT = Fitted(
    name="host_path.DEFAULT_RATIOS",
    value=DEFAULT_RATIOS,
    fit_on=(H200_LLAMA1B_GSA, H200_LLAMA1B_FULL, H200_LLAMA1B_SELECTIVE),
    how="profiled host per block pass of the full and selective AC trials over the gsa defaults trial's "
    "block forward (4.13 ms), recompute = (AC backward - gsa backward) over the same",
    figure=GPU_STEP,
)
_FORWARD_KEY = {"none": "block_forward", "full": "checkpoint_forward", "selective": "selective_forward"}
_RECOMPUTE_KEY = {"full": "recompute_full", "selective": "recompute_selective"}
_BACKWARD_HOOKS = ("pre_hook", "post_hook", "reduce")
K_RANGE = (0.2, 1.0)
PROFILER_FACTOR = 0.64
"""The profiler's factor on the host-bound H200 trial (``h200-llama1b-selective-ac``, see [Note: host path]):
used where every trial of a calibration was device-bound, its own factor only a looser bound, and
no plain trial's launches were counted (else ``LAUNCH_US`` gives that run's factor)."""
PROFILER_FACTOR_FIT = Fitted(
    name="host_path.PROFILER_FACTOR",
    value=PROFILER_FACTOR,
    fit_on=(H200_LLAMA1B_SELECTIVE,),
    how="(step - training thread CPU) / profiled backward host of the host-bound trial",
    figure=GPU_STEP,
)
LAUNCH_US = {"forward": 34.8, "backward": 40.2}
"""Unprofiled host microseconds per device op a plain block's forward and backward launch (hooks
included) on the H200 host: ``PROFILER_FACTOR`` times the traced host per launch of the defaults
trial profiled in the same run as the host-bound trial (``h200-llama1b-gsa-defaults``: 54.3 and
62.9 us over 76 and 128 launches per block and microbatch; see [Note: host path])."""
LAUNCH_US_FIT = Fitted(
    name="host_path.LAUNCH_US",
    value=LAUNCH_US,
    fit_on=(H200_LLAMA1B_GSA, H200_LLAMA1B_SELECTIVE),
    how="PROFILER_FACTOR (the selective trial's) x the gsa defaults trial's traced host per launch",
    figure=GPU_STEP,
)


@dataclass(frozen=True)
class HostSample:
    """One trial's profiled host per block pass (seconds) and its profiler factor bound."""

    kind: str
    """The blocks' activation checkpointing (``none``, ``full``, ``selective``)."""
    forward_s: float
    backward_s: float
    factor: float | None
    """Unprofiled over profiled host time, or a bound of it (None: the trial did not record its thread's CPU time)."""
    probed: bool = False
    """Timed unprofiled by the trial itself ([Note: host path probe]): the times are the host's, ``factor`` 1."""
    device_s: float = 0.0
    """The device's time per block (forward and backward, hooks included): the host bound the trial where
    ``factor x (forward + backward)`` reaches it, and ``factor`` is then the host's own, not a bound."""
    launches: tuple[float, float] = (0.0, 0.0)
    """Device ops launched per block forward and backward, hooks included ((0, 0): not counted)."""

    @property
    def host_bound(self) -> bool:
        return self.factor is not None and self.factor * (self.forward_s + self.backward_s) >= self.device_s


def get_block_device(kc: KernelCosts, num_microbatches: int, num_blocks: int) -> float:
    """Device seconds of one block's forward and backward, its hooks' kernels included."""
    keys = {k for k, _ in kc.seconds if k in ("block.forward", "block.backward") or k.endswith(".block")}
    return sum(kc.get(k) for k in keys) / (num_microbatches * num_blocks)


def get_block_host(kc: KernelCosts, num_microbatches: int, num_blocks: int) -> tuple[float, float]:
    """Profiled host seconds of one block's forward and one block's backward, their hooks included."""
    return _per_block_pass(kc.host_by_key, num_microbatches * num_blocks)


def get_block_launches(kc: KernelCosts, num_microbatches: int, num_blocks: int) -> tuple[float, float]:
    """Device ops launched by one block's forward and by its backward, their hooks' spans included."""
    return _per_block_pass(kc.launches_by_key, num_microbatches * num_blocks)


def _per_block_pass(by_key: dict[str, float], per: int) -> tuple[float, float]:
    """A per-step figure by host span key, summed over a block's forward (with its unshard hook) and
    its backward (with its pre/post-backward and reduce hooks), per block and microbatch."""
    forward = by_key.get("block.forward", 0.0) + sum(
        v for k, v in by_key.items() if k.startswith("unshard") and k.endswith(".block")
    )
    backward = by_key.get("block.backward", 0.0) + sum(
        v for k, v in by_key.items() if k.startswith(_BACKWARD_HOOKS) and k.endswith(".block")
    )
    return forward / per, backward / per


def get_backward_host(kc: KernelCosts) -> float:
    """Profiled host seconds per step of the whole backward (every part's, the root's hooks included)."""
    return sum(v for k, v in kc.host_by_key.items() if k.endswith(".backward") or k.startswith(_BACKWARD_HOOKS))


def get_profiler_factor(step_s: float, main_cpu_s: float | None, kc: KernelCosts) -> float | None:
    """``(step - training thread CPU) / profiled backward host``, clamped to ``K_RANGE`` (see [Note: host path])."""
    backward = get_backward_host(kc)
    if main_cpu_s is None or backward <= 0:
        return None
    return min(K_RANGE[1], max(K_RANGE[0], (step_s - main_cpu_s) / backward))


def get_run_factors(samples: Sequence[HostSample]) -> tuple[float, float] | None:
    """The profiler's factors (forward, backward) of the run the plain (no checkpointing) samples'
    traces come from, by their launches ([Note: host path]): ``LAUNCH_US`` over their traced host
    per launch; None without a plain sample whose launches were counted."""
    plain = [s for s in samples if s.kind == "none" and min(s.launches) > 0]
    if not plain:
        return None
    forward = statistics.fmean(1e6 * s.forward_s / s.launches[0] for s in plain)
    backward = statistics.fmean(1e6 * s.backward_s / s.launches[1] for s in plain)
    return LAUNCH_US["forward"] / forward, LAUNCH_US["backward"] / backward


def fit_host_path(samples: Sequence[HostSample]) -> tuple[dict[str, float], list[str]]:
    """``host_path_us`` from the trials' samples (see [Note: host path]) and lines saying what was
    measured and what came from the ratios."""
    probed = [s for s in samples if s.probed]
    if probed:  # timed without the profiler: no factor to take out
        samples = probed
    factors = [s.factor for s in samples if s.factor is not None]
    if not factors:
        raise CalibrationError("no trial recorded its training thread's CPU time: the host path cannot be unprofiled")
    bound = [s.factor for s in samples if s.host_bound or s.probed]
    run = get_run_factors(samples)
    if bound:
        k = k_backward = min(bound)
    elif run is not None:  # device-bound: their run's factors by launches; the backward's bound is the backward's
        k, k_backward = min(K_RANGE[1], run[0]), min(min(factors), run[1])
    else:
        k = k_backward = min(min(factors), PROFILER_FACTOR)
    plain = [s for s in samples if s.kind == "none"]
    if plain:
        base_fwd = statistics.fmean(s.forward_s for s in plain)
        base_bwd = statistics.fmean(s.backward_s for s in plain)
    else:
        base_fwd = statistics.fmean(s.forward_s / DEFAULT_RATIOS[_FORWARD_KEY[s.kind]] for s in samples)
        base_bwd = statistics.fmean(s.backward_s - DEFAULT_RATIOS[_RECOMPUTE_KEY[s.kind]] * base_fwd for s in samples)
    path = {"block_forward": base_fwd, "block_backward": base_bwd}
    measured = set(path) if plain else set()
    for kind in ("full", "selective"):
        mine = [s for s in samples if s.kind == kind]
        fwd_key, rec_key = _FORWARD_KEY[kind], _RECOMPUTE_KEY[kind]
        if mine:
            path[fwd_key] = statistics.fmean(s.forward_s for s in mine)
            path[rec_key] = max(0.0, statistics.fmean(s.backward_s for s in mine) - base_bwd)
            measured |= {fwd_key, rec_key}
        else:
            path[fwd_key] = DEFAULT_RATIOS[fwd_key] * base_fwd
            path[rec_key] = DEFAULT_RATIOS[rec_key] * base_fwd
    if probed:
        how = f"timed by {len(probed)} trial(s) on an unprofiled step ([Note: host path probe]); "
    elif bound:
        how = (
            f"the profiler's factor {k:.2f} (the host-bound trials' smallest: {', '.join(f'{f:.2f}' for f in bound)}); "
        )
    else:
        cap = f"this run's {run[0]:.2f} / {run[1]:.2f} by launches" if run else f"the H200's {PROFILER_FACTOR}"
        how = (
            f"the profiler's factor {k:.2f} / {k_backward:.2f} (forward / backward; every trial device-bound, "
            f"their bounds {', '.join(f'{f:.2f}' for f in factors)}, capped at {cap}); "
        )
    lines = [
        "host path: " + how + f"measured {', '.join(sorted(measured)) or 'none'}; from the ratios of [Note: host path] "
        f"{', '.join(sorted(set(path) - measured)) or 'none'}"
    ]
    backward_keys = {"block_backward"} | ({"recompute_full", "recompute_selective"} & measured)
    return {key: 1e6 * (k_backward if key in backward_keys else k) * sec for key, sec in path.items()}, lines
