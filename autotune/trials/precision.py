"""Which precision trials run, and what this machine can run: one place for search, trial and plan.

[Note: precision defaults]
Every trial of a search (the defaults it is measured against included), a single trial and a
plan run one :class:`~fsdp_runtime.MixedPrecisionConfig`, resolved by :func:`resolve_precision`
from the device and the user's ``--param-dtype`` / ``--reduce-dtype``. On CUDA the default is
what torchtitan trains with, bf16 parameters and fp32 reduction (on one H200 an 8B-width model's
defaults ran 3,185 ms/step in fp32 and 377 ms in bf16: tuning fp32 there tunes a step nobody
trains). On CPU it is fp32 for both: this CPU's bf16 matmuls are slow, and fp32 is what the test
suite and the CPU benchmarks measured. The resolved dtypes are always written out (``float32``,
not ``None``), so the emitted config says what was measured.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from fsdp_runtime import MixedPrecisionConfig, RuntimeConfig
from fsdp_runtime.errors import AutotuneError

PRECISION_DTYPES = ("float32", "bfloat16", "float16")
"""What ``--param-dtype`` and ``--reduce-dtype`` accept (dtype names as ``[mixed_precision]`` spells them)."""
DEFAULT_PRECISION: dict[str, tuple[str, str]] = {
    "cuda": ("bfloat16", "float32"),
    "cpu": ("float32", "float32"),
}
"""(param dtype, reduce dtype) per device type when no option is given ([Note: precision defaults])."""


class PrecisionError(AutotuneError):
    """A dtype option names no dtype the trials can run."""


class MachineError(AutotuneError):
    """The trials cannot run on this machine as asked (more ranks than GPUs, a model no GPU holds)."""


def check_dtype(value: str | None, *, field: str) -> None:
    """``value`` is None (the device default) or one of ``PRECISION_DTYPES``; else one line naming ``field``."""
    if value is not None and value not in PRECISION_DTYPES:
        raise PrecisionError(f"unknown dtype {value!r} (use {', '.join(PRECISION_DTYPES)})", field=field)


def get_device_type(backend: str) -> str:
    """The device a trial on ``backend`` runs on: NCCL ranks run on CUDA, gloo ranks on the CPU."""
    return "cuda" if backend == "nccl" else "cpu"


def resolve_precision(
    device_type: str, *, param_dtype: str | None = None, reduce_dtype: str | None = None
) -> MixedPrecisionConfig:
    """The precision trials on ``device_type`` run: each given dtype, else the device's default
    (``DEFAULT_PRECISION``; [Note: precision defaults])."""
    check_dtype(param_dtype, field="param_dtype")
    check_dtype(reduce_dtype, field="reduce_dtype")
    default_param, default_reduce = DEFAULT_PRECISION["cuda" if device_type == "cuda" else "cpu"]
    return MixedPrecisionConfig(param_dtype=param_dtype or default_param, reduce_dtype=reduce_dtype or default_reduce)


def has_precision(config: RuntimeConfig) -> bool:
    """The config sets a ``[mixed_precision]`` of its own."""
    mp = config.mixed_precision
    return mp.param_dtype is not None or mp.reduce_dtype is not None


def apply_precision_options(
    config: RuntimeConfig, device_type: str, *, param_dtype: str | None = None, reduce_dtype: str | None = None
) -> tuple[RuntimeConfig, list[str]]:
    """``config`` with the precision a trial runs: a config's own ``[mixed_precision]`` is kept
    unless an option is given, which then wins for its field (one note per field it changed); a
    config without one gets :func:`resolve_precision`'s."""
    if not has_precision(config):
        mp = resolve_precision(device_type, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        return dataclasses.replace(config, mixed_precision=mp), []
    check_dtype(param_dtype, field="param_dtype")
    check_dtype(reduce_dtype, field="reduce_dtype")
    own = config.mixed_precision
    chosen = {"param_dtype": param_dtype, "reduce_dtype": reduce_dtype}
    notes = [
        f"--{name.replace('_', '-')} {value} overrides the config's [mixed_precision] {name} = {getattr(own, name) or 'unset'}"
        for name, value in chosen.items()
        if value is not None and value != getattr(own, name)
    ]
    mp = dataclasses.replace(own, **{k: v for k, v in chosen.items() if v is not None})
    return dataclasses.replace(config, mixed_precision=mp), notes


def describe_precision(mp: MixedPrecisionConfig) -> str:
    """E.g. ``bfloat16 params, float32 reduce``."""
    param = mp.param_dtype or "model dtype"
    return f"{param} params, {mp.reduce_dtype or param} reduce"


# ---------------------------------------------------------------------------------------------
# What this machine can run (checked before anything is written)

SHARDED_BYTES_PER_PARAM = 16
"""Bytes per parameter that stay sharded in training: the parameter, its gradient and AdamW's two
states, each in the model's dtype (float32: trials build every model in float32). FSDP2's
``param_dtype`` does not shrink them; it applies to the unsharded copies only."""


def check_cuda_devices(world_size: int, device_type: str, *, num_devices: int | None = None) -> None:
    """On CUDA, one rank per visible device: ``--nproc`` above ``torch.cuda.device_count()`` is refused."""
    if device_type != "cuda":
        return
    if num_devices is None:
        import torch

        num_devices = torch.cuda.device_count()
    if world_size > num_devices:
        raise MachineError(
            f"{world_size} ranks need {world_size} CUDA devices on this node, {num_devices} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use --nproc {num_devices} or fewer",
            field="world_size",
        )


def check_device_type(source: Any, device_type: str) -> None:
    """Before anything is written: a model source that cannot train on ``device_type`` says so in one
    line (its ``check_device_type``, where it has one: torchtitan 0.3.0's models on CPU)."""
    check = getattr(source, "check_device_type", None)
    if callable(check):
        check(device_type)


def get_min_gpu_bytes(num_params: int, largest_unit_params: int, world_size: int, mp: MixedPrecisionConfig) -> int:
    """A lower bound of one rank's GPU memory in training, fully sharded: the sharded parameters,
    gradients and AdamW states (``SHARDED_BYTES_PER_PARAM`` / world size) plus one unit gathered
    for compute (its parameters in the param dtype, its gradients in the reduce dtype).
    Activations are not counted: a model over this does not fit whatever the knobs."""
    param_bytes = _get_dtype_bytes(mp.param_dtype or "float32")
    reduce_bytes = _get_dtype_bytes(mp.reduce_dtype or mp.param_dtype or "float32")
    return SHARDED_BYTES_PER_PARAM * num_params // world_size + largest_unit_params * (param_bytes + reduce_bytes)


def check_fits_gpu(
    source: Any, world_size: int, mp: MixedPrecisionConfig, *, device_type: str, total_memory: int | None = None
) -> None:
    """On CUDA, refuse a model whose training state cannot fit one GPU even fully sharded at
    ``world_size`` (:func:`get_min_gpu_bytes` vs the device's total memory), pointing to ``autotune plan``."""
    if device_type != "cuda":
        return
    if total_memory is None:
        import torch

        total_memory = torch.cuda.get_device_properties(0).total_memory  # ranks take devices 0..nproc-1, alike
    num_params, largest = _count_params(source)
    need = get_min_gpu_bytes(num_params, largest, world_size, mp)
    if need > total_memory:
        raise MachineError(
            f"{source.name} ({num_params / 1e9:.2f}B params) needs at least {need / 2**30:.1f} GiB per GPU fully sharded "
            f"over {world_size} ranks ({describe_precision(mp)}, AdamW), over this GPU's {total_memory / 2**30:.1f} GiB; "
            f"use more GPUs, or rank configs for a cluster that holds it: autotune plan --model {_get_model_argument(source)}",
            field="model",
        )


def _count_params(source: Any) -> tuple[int, int]:
    """(all parameters, the largest block's) of the model built on the meta device."""
    model = source.build(device="meta")
    blocks = [sum(p.numel() for p in model.get_submodule(name).parameters()) for name in source.block_names]
    return sum(p.numel() for p in model.parameters()), max(blocks, default=0)


def _get_model_argument(source: Any) -> str:
    """How ``--model`` names ``source``: a built-in profile by its name, anything else by its path."""
    from pathlib import Path

    import profiles

    path = source.source or source.name
    return source.name if Path(path).parent == Path(profiles.__file__).parent / "models" else path


def _get_dtype_bytes(name: str) -> int:
    return 4 if name == "float32" else (8 if name == "float64" else 2)


# ---------------------------------------------------------------------------------------------
# Environment that decides overlap (recorded in env.json)

OVERLAP_ENV: dict[str, str] = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1 serialises kernels onto one hardware queue: FSDP2's reduce-scatter waits behind compute",
    "NCCL_MAX_NCHANNELS": "caps the SMs NCCL kernels take (less taken from overlapped compute, slower collectives)",
    "NCCL_MIN_NCHANNELS": "raises the SMs NCCL kernels take from overlapped compute",
    "NCCL_ALGO": "ring/tree choice: the collectives' time",
    "NCCL_PROTO": "LL/LL128/Simple: the collectives' time and SM use",
    "TORCH_NCCL_HIGH_PRIORITY": "NCCL streams at high priority: collectives scheduled ahead of compute kernels",
    "NCCL_CTA_POLICY": "2 (zero-CTA): all-gathers on symmetric memory run on copy engines, taking no SMs from compute",
}
"""Environment variables that change how communication overlaps compute, and why; each trial's
``env.json`` records their values (None where unset)."""


def get_overlap_env(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The value of each ``OVERLAP_ENV`` variable in ``environ`` (default: this process's), None where unset."""
    environ = os.environ if environ is None else environ
    return {name: environ.get(name) for name in OVERLAP_ENV}


def get_overlap_warning(environ: Mapping[str, Any], device_type: str) -> str | None:
    """One line when ``CUDA_DEVICE_MAX_CONNECTIONS=1`` takes FSDP2's overlap away on CUDA, with the fix."""
    if device_type != "cuda" or str(environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "")).strip() != "1":
        return None
    return (
        "CUDA_DEVICE_MAX_CONNECTIONS=1 is set: it serialises FSDP2's reduce-scatter behind compute, so these trials "
        "measure no backward overlap (torchtitan #1147); unset it (FSDP2 needs no such setting) and search again"
    )
