"""GPU calibration: a :class:`~autotune.sim.device_profile.DeviceProfile` from GPU trials' kernels.

[Note: GPU calibration]
Each trial's kernels are attributed to the parts of its step and to classes
(:mod:`autotune.sim.kernel_costs`); each rate of [Note: device profile] is then the work the
simulator counts for that trial (:mod:`autotune.sim.model_work` on fake tensors, in the
trial's param dtype; FSDP2's copies by the same formulas :mod:`autotune.sim.costs` charges)
over the device time of the kernels that did it, pooled over the trials given (work summed,
time summed). Every kernel of the step is counted once:

- GEMM kernels anywhere in the model's forward and backward -> ``gemm_tflops``;
- attention kernels (forward, backward) -> the attention rates, at the model's head dim;
- every other kernel launched by a block's forward, a block's backward, or the root's
  segments (head, tail: the loss's forward and backward run before the root's pre-backward,
  so the tail is fitted whole) -> ``elementwise_gbps`` for that part;
- every kernel FSDP2's hooks launch (unshard, pre-backward unshard, post-backward,
  reduce) -> ``copy_gbps``;
- every kernel after the last post-backward callback -> ``optimizer_ps_per_element``;
- device idle, by the part whose launch ended the gap -> ``host_floor_us`` per block
  forward, per block backward (a block's own hooks with it), per microbatch (the rest) and
  per step (the optimizer's);
- the host's own spans per block pass -> ``host_path_us`` ([Note: host path] in
  :mod:`autotune.sim.host_path`), which prices the block passes in place of their floors.

Only trials on one GPU (world 1) with one block per unit calibrate compute; their
collectives, if any, are not fitted (the cluster's links price collectives).

*The profiler's slowdown stays out of the fit.* The traced steps run slower than the unprofiled
ones the trial's step time comes from: on five H200 trials (tests/data/gpu_traces) by 0.4% to
57%. The kernels are not what slows down: their time per step (the traced span less the
device's idle) is the same within 0.5% between the two llama1b defaults trials whose profiled
steps ran 3.6% and 8.5% slower (416.1 and 417.7 ms). The host is: the profiler's callbacks
lengthen the launch path, and the device waits longer between kernels. So the kernel rates
are fitted from the traced kernels as they are, and the idle is scaled, part by part, to what
the unprofiled step leaves: ``unprofiled step - kernel time`` (clamped to ``[0, traced idle]``).
On those five trials the traced idle was 8.2-396 ms per step and the unprofiled idle it
leaves 7.1-87 ms (``get_unprofiled_idle``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.sim.costs import ORIG_BYTES, get_padded_numel
from autotune.sim.device_profile import DeviceProfile
from autotune.sim.hardware import get_dtype_bytes
from autotune.sim.host_path import (
    HostSample,
    fit_host_path,
    get_block_device,
    get_block_host,
    get_block_launches,
    get_profiler_factor,
)
from autotune.sim.kernel_costs import KernelCosts, get_kernel_costs
from autotune.sim.knobs import resolve_knobs
from autotune.sim.margin import SIMULATOR_MEMORY_ERROR, PeakComparison, get_allocator_fragmentation
from autotune.sim.model_work import ModelWork
from autotune.sim.trace_costs import CalibrationError
from fsdp_runtime import ROOT_UNIT, RuntimeConfig, load_config

_MODEL_CLASSES = ("elementwise", "loss", "copy", "memset")
_HOOK_PREFIXES = ("unshard", "pre_hook", "post_hook", "reduce", "concat", "restore")


@dataclass(kw_only=True)
class GpuTrial:
    """One finished GPU trial read back for calibration."""

    path: Path
    config: RuntimeConfig
    world_size: int
    step_s: float
    """Median unprofiled step."""
    model: str | dict[str, Any]
    """The model as the trial named it (a profile name, a path resolved against the trial dir, or
    ``{"name": ..., **overrides}``)."""
    traces: list[Path]
    device: str
    torch: str
    peak_bytes: float | None = None
    """The trial's CUDA max allocated (``metrics.json`` ``process_peak_bytes``)."""
    main_cpu_s: float | None = None
    """The training thread's CPU time per unprofiled step (``metrics.json`` ``profiler.cpu_ms``)."""
    host_path_ms: dict[str, float] | None = None
    """The host's path per block pass as the trial timed it (``metrics.json`` v9, [Note: host path probe])."""
    memory_peaks: tuple[float, float] | None = None
    """``(max_memory_reserved, max_memory_allocated)`` over the whole trial (``metrics.json`` v8)."""


def read_gpu_trial(path: str | Path) -> GpuTrial:
    """A GPU trial dir (``metrics.json``, ``config.toml``, ``env.json``, traces) as calibration input."""
    from autotune.trials import TrialMetrics

    path = Path(path)
    if not (path / "metrics.json").is_file():
        raise CalibrationError(f"{path}: no metrics.json: not a trial dir (run `autotune trial` on the GPU first)")
    metrics = TrialMetrics.read(path / "metrics.json")
    if metrics.status != "ok" or not metrics.step_ms or not metrics.traces:
        raise CalibrationError(
            f"{path}: trial status {metrics.status}, {len(metrics.traces)} traces: only a finished, profiled trial calibrates"
        )
    env = json.loads((path / "env.json").read_text()) if (path / "env.json").is_file() else {}
    if not str(env.get("device", "cuda")).startswith("cuda") or metrics.backend != "nccl":
        raise CalibrationError(
            f"{path}: a {metrics.backend} trial on {env.get('device', '?')}: GPU calibration reads CUDA kernels"
        )
    if metrics.world_size != 1:
        raise CalibrationError(
            f"{path}: world size {metrics.world_size}: calibrate compute on a trial of one GPU (`--nproc 1`)"
        )
    model = _resolve_model(path, metrics.model)
    return GpuTrial(
        path=path,
        config=load_config(path / "config.toml"),
        world_size=metrics.world_size,
        step_s=metrics.step_ms / 1e3,
        model=model,
        traces=[path / t for t in metrics.traces],
        device=str(env.get("cuda_device_name", "unknown GPU")),
        torch=str(env.get("torch_version", "unknown")),
        peak_bytes=float(metrics.process_peak_bytes)
        if metrics.memory_source == "cuda_max_allocated" and metrics.process_peak_bytes
        else None,
        main_cpu_s=metrics.profiler["cpu_ms"] / 1e3 if (metrics.profiler or {}).get("cpu_ms") else None,
        host_path_ms=metrics.host_path_ms,
        memory_peaks=(float(metrics.reserved_peak_bytes), float(metrics.trial_peak_bytes))
        if metrics.reserved_peak_bytes and metrics.trial_peak_bytes
        else None,
    )


def _resolve_model(path: Path, model: str | dict[str, Any]) -> str | dict[str, Any]:
    """The trial's model as :func:`profiles.sources.load_model_source` takes it: a model file named
    relative to the trial dir made absolute (also as a dict's ``name``: a profile with overrides)."""
    if isinstance(model, dict):
        return {**model, "name": _resolve_model(path, model["name"])}
    return str(path / model) if (path / model).is_file() else model


def load_kernel_costs(trial: GpuTrial, work: ModelWork) -> KernelCosts:
    from autotune.analysis import FsdpTraceAnalysis

    if any(len(u.get_modules()) > 1 for u in trial.config.units if u.name != ROOT_UNIT):
        raise CalibrationError(f"{trial.path}: units that group blocks: calibrate on a trial with one block per unit")
    events = FsdpTraceAnalysis(trial.traces).events
    if any(e.device != "gpu" for e in events.values()):
        raise CalibrationError(f"{trial.path}: the traces hold no CUDA kernels")
    return get_kernel_costs(events, block_names=work.block_names, local=True)


@dataclass
class _Sums:
    """Work counted and device seconds, pooled over trials."""

    work: dict[str, float]
    seconds: dict[str, float]

    def add(self, name: str, work: float, seconds: float) -> None:
        self.work[name] = self.work.get(name, 0.0) + float(work)
        self.seconds[name] = self.seconds.get(name, 0.0) + float(seconds)

    def rate(self, name: str) -> float:
        if self.seconds.get(name, 0.0) <= 0 or self.work.get(name, 0.0) <= 0:
            raise CalibrationError(f"the trials show no {name.replace('_', ' ')} work to fit its rate from")
        return float(self.work[name] / self.seconds[name])


def _add_trial(sums: _Sums, trial: GpuTrial, work: ModelWork, kc: KernelCosts) -> None:
    m, n = trial.config.num_microbatches, len(work.block_names)
    w = work.work
    model_keys = ("block.", "head.", "tail.")
    gemm_flops = sum(
        w[s, p].gemm_flops * (n if s == "block" else 1)
        for s in ("head", "block", "tail")
        for p in ("forward", "backward")
    )
    sums.add("gemm", m * gemm_flops, sum(kc.get(k, ("gemm",)) for k in model_keys))
    for phase in ("forward", "backward"):
        sums.add(
            f"attention_{phase}",
            m * n * 0.5 * w["block", phase].attention_flops,
            sum(kc.get(k, (f"attention_{phase}",)) for k in model_keys),
        )
        sums.add(
            f"elementwise_block_{phase}",
            m * n * w["block", phase].memory_bytes,
            kc.get(f"block.{phase}", _MODEL_CLASSES),
        )
    root_bytes = sum(w[s, p].memory_bytes for s in ("head", "tail") for p in ("forward", "backward"))
    sums.add("elementwise_root", m * root_bytes, kc.get("head.", _MODEL_CLASSES) + kc.get("tail.", _MODEL_CLASSES))
    hook_seconds = sum(s for (k, _), s in kc.seconds.items() if k.startswith(_HOOK_PREFIXES))
    sums.add("copy", _get_copy_bytes(trial, work), hook_seconds)
    sharded = sum(get_padded_numel(work.param_shapes[u], 1) for u in (*work.block_names, ROOT_UNIT))
    sums.add("optimizer", sharded, kc.get("optimizer"))
    idle = get_unprofiled_idle(trial, kc)
    block_fwd = sum(
        v for k, v in idle.items() if k == "block.forward" or k.startswith("unshard") and k.endswith(".block")
    )
    block_bwd = sum(
        v
        for k, v in idle.items()
        if k == "block.backward" or k.endswith(".block") and k.startswith(("pre_hook", "post_hook", "reduce"))
    )
    step = idle.get("optimizer", 0.0)
    sums.add("floor_block_forward", m * n, block_fwd)
    sums.add("floor_block_backward", m * n, block_bwd)
    sums.add("floor_step", 1, step)
    sums.add("floor_microbatch", m, sum(idle.values()) - block_fwd - block_bwd - step)


def get_unprofiled_idle(trial: GpuTrial, kc: KernelCosts) -> dict[str, float]:
    """The device's idle time per step by part, as in the trial's unprofiled steps: the traced
    idle scaled to the unprofiled step less the kernels' time (see [Note: GPU calibration])."""
    if kc.idle_s <= 0:
        return dict(kc.idle_by_key)
    busy_s = kc.span_s - kc.idle_s
    keep = min(1.0, max(0.0, trial.step_s - busy_s) / kc.idle_s)
    return {key: seconds * keep for key, seconds in kc.idle_by_key.items()}


def _get_copy_bytes(trial: GpuTrial, work: ModelWork) -> float:
    """Bytes FSDP2's copies move in one step of ``trial`` on one GPU, as :mod:`autotune.sim.costs`
    charges them: a cast of each unit's params at every unshard (forward, and backward where the
    unit resharded after forward), and at every reduce the gradient packed into the reduce dtype
    plus the post-reduce's read-modify-write of the sharded grad (3 float32 accesses)."""
    mp = trial.config.mixed_precision
    pb = get_dtype_bytes(mp.param_dtype or "float32")
    rb = get_dtype_bytes(mp.reduce_dtype or mp.param_dtype or "float32")
    knobs = resolve_knobs(trial.config, work.block_names, world_size=1, device="cuda")
    m = trial.config.num_microbatches
    total = 0.0
    for u, unit in enumerate((*work.block_names, ROOT_UNIT)):
        p = get_padded_numel(work.param_shapes[unit], 1)
        unshards = m * (2 if knobs.reshard_after_forward[u] is not False else 1)
        reduces = m if knobs.sync[u] == "every" else 1
        total += unshards * p * (ORIG_BYTES + pb) + reduces * (p * (pb + rb) + 3 * p * ORIG_BYTES)
    return total


def calibrate_device(
    trials: list[tuple[GpuTrial, ModelWork]], *, kernel_costs: list[KernelCosts] | None = None
) -> DeviceProfile:
    """A device profile from GPU trials and their models' work (see [Note: GPU calibration])."""
    if not trials:
        raise CalibrationError("no GPU trial to calibrate from")
    sums = _Sums({}, {})
    costs = kernel_costs or [load_kernel_costs(t, w) for t, w in trials]
    for (trial, work), kc in zip(trials, costs):
        _add_trial(sums, trial, work, kc)
    host_path_us, host_lines = _fit_host_path(trials, costs)
    fragmentation = get_allocator_fragmentation({t.path.name: t.memory_peaks for t, _ in trials if t.memory_peaks})
    first, work = trials[0]
    head_dims = {w.attention_head_dim for _, w in trials}
    if len(head_dims) > 1:
        raise CalibrationError(
            f"the trials' models have head dims {sorted(head_dims)}: calibrate attention on one head dim at a time"
        )
    return DeviceProfile(
        device=first.device,
        torch=first.torch,
        measured_on=_describe(trials),
        sources=[str(t.path) for t, _ in trials],
        gemm_tflops=sums.rate("gemm") / 1e12,
        attention_forward_tflops=sums.rate("attention_forward") / 1e12,
        attention_backward_tflops=sums.rate("attention_backward") / 1e12,
        attention_head_dim=work.attention_head_dim,
        elementwise_gbps={
            "block_forward": sums.rate("elementwise_block_forward") / 1e9,
            "block_backward": sums.rate("elementwise_block_backward") / 1e9,
            "root": sums.rate("elementwise_root") / 1e9,
        },
        copy_gbps=sums.rate("copy") / 1e9,
        optimizer_ps_per_element=1e12 / sums.rate("optimizer"),
        host_floor_us={
            k: 1e6 * sums.seconds[f"floor_{k}"] / sums.work[f"floor_{k}"]
            for k in ("block_forward", "block_backward", "microbatch", "step")
        },
        host_path_us=host_path_us,
        allocator_fragmentation=fragmentation[0] if fragmentation else None,
        allocator_fragmentation_source=fragmentation[1] if fragmentation else "",
        notes=[
            *(
                f"{t.path}: {len(c.seconds)} (part, class) cells over {c.num_steps} profiled steps; device span {1e3 * c.span_s:.1f} ms, idle {1e3 * c.idle_s:.1f} ms, unprofiled step {1e3 * t.step_s:.1f} ms"
                for (t, _), c in zip(trials, costs)
            ),
            *host_lines,
        ],
    )


def _fit_host_path(
    trials: list[tuple[GpuTrial, ModelWork]], costs: list[KernelCosts]
) -> tuple[dict[str, float], list[str]]:
    """The host path of [Note: host path] from the trials whose blocks share one checkpointing kind;
    none (the block floors price the host) where no trial recorded its thread's CPU time."""
    samples = []
    for (trial, work), kc in zip(trials, costs):
        kinds = {u.activation_checkpointing for u in trial.config.units if u.name != ROOT_UNIT} or {"none"}
        if len(kinds) == 1:
            kind, m, n = kinds.pop(), trial.config.num_microbatches, len(work.block_names)
            if trial.host_path_ms:
                timed = trial.host_path_ms
                samples.append(HostSample(kind, timed["block_forward"] / 1e3, timed["block_backward"] / 1e3, 1.0, True))
                continue
            fwd, bwd = get_block_host(kc, m, n)
            factor = get_profiler_factor(trial.step_s, trial.main_cpu_s, kc)
            device, launches = get_block_device(kc, m, n), get_block_launches(kc, m, n)
            samples.append(HostSample(kind, fwd, bwd, factor, device_s=device, launches=launches))
    try:
        return fit_host_path(samples)
    except CalibrationError as exc:
        return {}, [f"host path: not priced ({exc}); the block floors price the host"]


def _describe(trials: list[tuple[GpuTrial, ModelWork]]) -> dict[str, Any]:
    trial, work = trials[0]
    mp = trial.config.mixed_precision
    return {
        "model": ", ".join(dict.fromkeys(w.name for _, w in trials)),
        "tokens_per_microbatch": work.tokens,
        "num_microbatches": trial.config.num_microbatches,
        "param_dtype": mp.param_dtype or "float32",
        "reduce_dtype": mp.reduce_dtype or mp.param_dtype or "float32",
        "world_size": trial.world_size,
    }


_CLUSTER_FOR_GPU = {"h200": "h200-node", "h100": "h100-node", "a100": "a100-node"}


def get_cluster_for(device: str, cluster: str | None) -> str:
    """The cluster profile whose accelerator a GPU of this name is (``--cluster`` wins)."""
    if cluster:
        return cluster
    for key, name in _CLUSTER_FOR_GPU.items():
        if key in device.lower():
            return name
    raise CalibrationError(
        f"no cluster profile for a {device}: pass --cluster with a profile (TOML) whose [accelerator] is that GPU",
        field="cluster",
    )


def calibrate_trials(
    paths: list[str | Path], *, model: str | None = None, cluster: str | None = None
) -> tuple[DeviceProfile, list[str]]:
    """``autotune calibrate``: a device profile from GPU trial dirs, and lines saying how well it
    reproduces each trial's unprofiled step (the simulator on one GPU of the matching cluster)."""
    from autotune.sim.hardware import Hardware
    from autotune.sim.model_work import get_model_work
    from autotune.sim.predict import Simulator
    from profiles import load_cluster_profile
    from profiles.sources import load_model_source

    trials = [read_gpu_trial(p) for p in paths]
    works = [
        get_model_work(load_model_source(model or t.model), t.config.mixed_precision.param_dtype or "float32")
        for t in trials
    ]
    costs = [load_kernel_costs(t, w) for t, w in zip(trials, works)]
    profile = calibrate_device(list(zip(trials, works)), kernel_costs=costs)
    profile_cluster = load_cluster_profile(get_cluster_for(profile.device, cluster))
    lines = []
    for trial, work in zip(trials, works):
        prediction = Simulator(work, Hardware(profile_cluster, num_ranks=1, device=profile)).simulate(trial.config)
        predicted = prediction.step_s
        lines.append(
            f"{trial.path}: predicted {1e3 * predicted:.1f} ms/step with this profile, measured {1e3 * trial.step_s:.1f} ms "
            f"({100 * (predicted / trial.step_s - 1):+.1f}%)"
        )
        if trial.peak_bytes:  # the memory margin's simulator-error share, checked on this trial
            error = prediction.peak_memory_bytes / trial.peak_bytes - 1
            beyond = abs(error) > SIMULATOR_MEMORY_ERROR
            lines.append(
                f"{trial.path}: peak memory predicted {prediction.peak_memory_bytes / 2**30:.2f} GiB, CUDA max allocated "
                f"{trial.peak_bytes / 2**30:.2f} GiB ({100 * error:+.2f}%: {'beyond' if beyond else 'within'} the plan's "
                f"{100 * SIMULATOR_MEMORY_ERROR:.2f}% margin for the simulator's memory error)"
            )
    return profile.replace(notes=[*profile.notes, *lines]), lines


def compare_trial_peak(trial_dir: str | Path, *, cluster: str = "h200-node") -> PeakComparison:
    """Simulate a GPU trial's config on its model and world size and compare the predicted peak with
    the trial's ``process_peak_bytes`` (``memory_source`` must be ``cuda_max_allocated``). The
    model is ``metrics.json``'s, a file beside it when there is one; ``cluster`` only prices time."""
    from autotune.sim.hardware import Hardware, SimError
    from autotune.sim.model_work import get_model_work
    from autotune.sim.predict import Simulator
    from autotune.trials import TrialMetrics
    from profiles import load_cluster_profile, load_model_source

    path = Path(trial_dir)
    metrics = TrialMetrics.read(path / "metrics.json")
    if metrics.memory_source != "cuda_max_allocated" or not metrics.process_peak_bytes:
        raise SimError(f"{path}: no CUDA peak to compare with (memory source {metrics.memory_source})")
    model = _resolve_model(path, metrics.model)
    config = load_config(path / "config.toml")
    work = get_model_work(load_model_source(model), config.mixed_precision.param_dtype)
    hardware = Hardware(load_cluster_profile(cluster), 1, num_ranks=metrics.world_size)
    prediction = Simulator(work, hardware).simulate(config)
    return PeakComparison(
        name=path.name, predicted_bytes=prediction.peak_memory_bytes, measured_bytes=float(metrics.process_peak_bytes)
    )
