"""One trial: run a config on N ranks, measure it, and write a self-describing trial dir.

    from autotune.trials import TrialSpec, run_trial
    result = run_trial(TrialSpec(model="small", config=cfg, world_size=2, out_dir=Path("runs/t0")))
    result.status, result.step_ms, result.process_peak_bytes

The trial dir's layout is in :mod:`autotune.trials.trialdir` (its one writer). A failure
is data: :func:`run_trial` returns a :class:`TrialResult` with status ``timeout``,
``crash`` (reason: the failing rank's last stderr line), ``oom`` or ``invalid_config``
and still writes ``metrics.json`` with that status and reason. It only raises
:class:`TrialSpecError` for a spec that cannot describe a trial at all (e.g. a pool of
the wrong size). What the ranks run and measure is described in [Note: what a trial
measures] in :mod:`autotune.trials.program`; several nodes run it under torchrun
(:mod:`autotune.trials.torchrun`).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.trials.gather import receive_files
from autotune.trials.metrics import TrialResult
from autotune.trials.precision import (
    apply_precision_options,
    check_cuda_devices,
    check_device_type,
    check_fits_gpu,
    get_device_type,
)
from autotune.trials.spec import TrialSpec, TrialSpecError
from autotune.trials.trialdir import prepare_trial_dir, write_trial_dir
from fsdp_runtime import RuntimeConfig
from fsdp_runtime.errors import AutotuneError

if TYPE_CHECKING:
    from autotune.trials.pools import Pool


def load_trial_config(config_path: str | Path | None, model: str | dict[str, Any]) -> RuntimeConfig:
    """The config file's runtime config; a recipe's, built for the model, where ``config_path`` names
    one (``torchtitan``: [Note: the torchtitan recipe] in :mod:`fsdp_runtime.recipes`); or FSDP2's
    defaults for the model's units when no file is given."""
    from autotune.trials.training import resolve_profile
    from fsdp_runtime import RECIPES, default_config, get_torchtitan_config, load_config

    if config_path is not None and str(config_path) in RECIPES:
        return get_torchtitan_config(resolve_profile(model).build(device="meta"))
    if config_path is not None:
        return load_config(config_path)
    return default_config(resolve_profile(model).unit_names)


def resolve_trial_config(
    config_path: str | Path | None,
    model: str | dict[str, Any],
    *,
    backend: str | None = None,
    param_dtype: str | None = None,
    reduce_dtype: str | None = None,
) -> tuple[RuntimeConfig, list[str]]:
    """:func:`load_trial_config` in the precision the trial runs (:func:`~autotune.trials.precision.apply_precision_options`:
    a config's own ``[mixed_precision]`` kept unless an option is given), and one note per option that overrode it."""
    from autotune.trials.spec import get_default_backend

    device_type = get_device_type(backend or get_default_backend())
    return apply_precision_options(
        load_trial_config(config_path, model), device_type, param_dtype=param_dtype, reduce_dtype=reduce_dtype
    )


def check_trial_machine(spec: TrialSpec, *, local: bool = True) -> None:
    """Before anything is written: the model trains on the device (:func:`check_device_type`); on CUDA one
    GPU per local rank (``local``: ranks on this node, not a torchrun spec's world) and the model's
    sharded training state fits one GPU."""
    from autotune.trials.training import resolve_profile

    device_type = get_device_type(spec.backend)
    if local:
        check_cuda_devices(spec.world_size, device_type)
    source = resolve_profile(spec.model)
    check_device_type(source, device_type)
    check_fits_gpu(source, spec.world_size, spec.config.mixed_precision, device_type=device_type)


def load_rank_program(target: str) -> Callable[..., dict[str, Any]]:
    module_name, fn_name = target.split(":")
    return getattr(importlib.import_module(module_name), fn_name)


def run_trial(spec: TrialSpec, *, pool: Pool | None = None) -> TrialResult:
    """Run one trial (fresh ranks, or ``pool``'s) and write its trial dir; never raises for what a rank does."""
    start = time.monotonic()
    if pool is not None and (pool.world_size != spec.world_size or pool.backend != spec.backend):
        raise TrialSpecError(
            f"trial spec: world {spec.world_size}/{spec.backend} does not match the pool's {pool.world_size}/{pool.backend}"
        )
    try:
        prepare_trial_dir(spec)
    except AutotuneError as e:
        return write_trial_dir(
            spec, status="invalid_config", reason=str(e), rank_results=[], wall_s=time.monotonic() - start
        )
    remote = pool is not None and pool.remote  # ranks that may share no filesystem with this process
    kwargs = {"spec": spec.to_dict() | ({"send_files": True} if remote else {})}
    if pool is not None:
        run = pool.run(spec.rank_program, kwargs, timeout_s=spec.timeout_s)
    else:
        from autotune.trials.launch import run_ranks

        run = run_ranks(
            spec.rank_program, world_size=spec.world_size, kwargs=kwargs, timeout_s=spec.timeout_s, backend=spec.backend
        )
    if run.ok:
        status = "pruned" if any(r["pruned"] for r in run.results) else "ok"
        kept = receive_files(run.results, spec.out_dir) if remote else []  # [Note: node-local files]
        wall_s = time.monotonic() - start
        result = write_trial_dir(
            spec, status=status, reason="", rank_results=run.results, wall_s=wall_s, kept_traces=kept
        )
    else:
        result = write_trial_dir(
            spec,
            status=run.status,
            reason=run.reason,
            rank_results=[],
            wall_s=time.monotonic() - start,
            placement=run.placement,
        )
    result.rank_pids = list(run.pids)
    return result
