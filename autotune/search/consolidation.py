"""Time full-state consolidation of a candidate config (:func:`time_consolidation`), and the
rank program that does it (:func:`consolidation_timing`; ``benchmarks/consolidation.py`` runs it too).

    from autotune.trials import run_ranks
    run = run_ranks("autotune.search.consolidation:consolidation_timing", world_size=2,
                    kwargs={"model": "small", "config": config_to_dict(config)})
    seconds = run.results[0]["seconds"][config.checkpoint.consolidation][0]  # rank 0

Each rank builds the model and optimizer exactly as a trial does, trains one step so that
AdamW's state exists, then consolidates with each requested method. Times and memory are
taken per rank; rank 0's are the ones that matter (it ends up holding the state).

Memory (``measure_memory``) is measured in a separate pass after the timed ones:
``consolidation_rise_bytes``, the rise of the process's peak resident set size (``VmHWM``, reset through
``/proc/self/clear_refs``) over its resident size just before the call. It counts every
byte the consolidation touched: the consolidated state itself on rank 0
(``state_bytes``), the collectives' buffers, and what the backend allocates internally
(gloo's all-gather allocates its own output). Before each measurement glibc's
``malloc_trim(0)`` hands every free heap page back to the kernel: otherwise memory that
an earlier call freed stays resident and is reused unseen (measured: after one training
step, freed 2 MiB tensors stayed in the heap even with a 64 KiB mmap threshold). The
timed passes run with the allocator untouched, as training does. ``None`` where this is
not Linux with glibc.
"""

from __future__ import annotations

import ctypes
import gc
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autotune.search.context import SearchContext
from autotune.search.cost import CONSOLIDATION_STEPS, RunCost
from autotune.trials import Training, build_training, run_ranks
from fsdp_runtime import CONSOLIDATION_METHODS, RuntimeConfig, config_from_dict, config_to_dict, consolidate_state
from fsdp_runtime.consolidate import DEFAULT_BUCKET_BYTES, check_method

TIMED_METHODS = tuple(m for m in CONSOLIDATION_METHODS if m != "dcp")
"""Methods a search times (``dcp`` goes through torch's own state-dict API, not a choice of collectives)."""

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def consolidation_timing(
    rank: int,
    world_size: int,
    *,
    model: str | dict[str, Any],
    config: dict[str, Any],
    methods: list[str] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    cases: dict[str, dict[str, Any]] | None = None,
    num_repeats: int = 1,
    measure_memory: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """Rank program: seconds (and peak memory) of consolidating ``model`` sharded as ``config``.

    Times each of ``methods`` (default: the config's ``checkpoint.consolidation``) with
    ``bucket_bytes``; or, when given, each of ``cases``: a name -> keyword arguments of
    :func:`~fsdp_runtime.consolidate_state` (e.g. to compare bucket sizes). With several
    cases and repeats the order rotates every repeat, so drift (a neighbour's load, the
    allocator warming up) does not favour one case. Returns, for this rank:
    ``{"seconds": {case: [s, ...]}, "consolidation_rise_bytes": {case: bytes | None},
    "state_bytes": int, "num_params": int}``; ``state_bytes`` is the size of the consolidated
    state (0 except on rank 0); ``consolidation_rise_bytes`` is empty unless ``measure_memory``.
    """
    runtime = config_from_dict(config)
    if cases is None:
        cases = {
            m: {"method": m, "bucket_bytes": bucket_bytes} for m in (methods or [runtime.checkpoint.consolidation])
        }
    for case in cases.values():
        check_method(case.get("method", "all_gather"))
    training = build_training(rank, world_size, model=model, config=config, seed=seed)
    training.step(0)
    names = list(cases)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    state_bytes = 0
    for repeat in range(num_repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            elapsed, state_bytes = _time_once(training, to_cpu=runtime.checkpoint.to_cpu, **cases[name])
            seconds[name].append(elapsed)
    rise = {}
    if measure_memory:
        rise = {name: _measure_rise_once(training, to_cpu=runtime.checkpoint.to_cpu, **cases[name]) for name in names}
    return {
        "seconds": seconds,
        "consolidation_rise_bytes": rise,
        "state_bytes": state_bytes,
        "num_params": training.profile.get_num_params(),
    }


def _time_once(training: Training, **kwargs: Any) -> tuple[float, int]:
    """One consolidation between barriers: (seconds on this rank, bytes of state it got)."""
    gc.collect()
    dist.barrier()
    start = time.perf_counter()
    model_sd, optim_sd = consolidate_state(training.model, training.optimizer, **kwargs)
    elapsed = time.perf_counter() - start
    state_bytes = _count_tensor_bytes(model_sd) + _count_tensor_bytes(optim_sd)
    del model_sd, optim_sd
    dist.barrier()
    return elapsed, state_bytes


def _measure_rise_once(training: Training, **kwargs: Any) -> int | None:
    """One consolidation between barriers: the rise of this process's peak RSS, in bytes."""
    gc.collect()
    dist.barrier()
    baseline = _reset_peak_rss() if _trim_heaps() else None
    state = consolidate_state(training.model, training.optimizer, **kwargs)
    peak = _read_status_bytes("VmHWM") - baseline if baseline is not None else None
    del state
    dist.barrier()
    return peak


def _trim_heaps() -> bool:
    """glibc: give every free page of every malloc arena back to the kernel."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    libc.malloc_trim(0)
    return True


def _reset_peak_rss() -> int | None:
    """Reset the peak RSS to the current RSS (Linux >= 4.0); returns the RSS, or None."""
    try:
        _CLEAR_REFS.write_text("5")
        return _read_status_bytes("VmRSS")
    except OSError:
        return None


def _read_status_bytes(key: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"{key} not in {_STATUS}")


def _count_tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_count_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_count_tensor_bytes(v) for v in value)
    return 0


def time_consolidation(ctx: SearchContext, config: RuntimeConfig) -> dict[str, Any]:
    """Seconds to consolidate the full model + optimizer state of ``config`` onto rank 0, once per method.

    The config's own method is listed first; the others are timed beside it so the report
    can show what the choice saves. Runs on the search's rank pool when it has one. A
    failure is recorded, never raised.
    """
    own = config.checkpoint.consolidation
    if config.mesh.pp > 1:
        # fsdp_runtime.consolidate gathers one FSDP2 model onto rank 0; a pipeline's stages
        # live on other ranks (each a model of Passthroughs around its own blocks).
        return {"method": own, "skipped": "pipeline stages (it gathers one sharded model onto rank 0, not stages)"}
    ctx.round = "consolidation"
    methods = [own, *(m for m in TIMED_METHODS if m != own)]
    kwargs = {
        "model": ctx.plan.trial_model,
        "config": config_to_dict(config),
        "methods": methods,
        "seed": ctx.settings.seed,
    }
    # A build and a few gathers per method: priced as a short trial's steps ([Note: trial timeouts]).
    target, timeout_s = "autotune.search.consolidation:consolidation_timing", ctx.timeouts.get(4 * len(methods))
    if ctx.pool is not None:
        run = ctx.pool.run(target, kwargs, timeout_s=timeout_s)
    else:
        run = run_ranks(target, world_size=ctx.settings.world_size, kwargs=kwargs, timeout_s=timeout_s)
    # one build and one step, as ``estimate_search_cost`` counts them ([Note: round costs])
    ran = (CONSOLIDATION_STEPS, 1) if run.ok else (0, 0)
    ctx.ledger.add(
        RunCost(
            round="consolidation",
            name="consolidation",
            status=run.status,
            steps=ran[0],
            builds=ran[1],
            wall_s=run.wall_s,
            max_steps=CONSOLIDATION_STEPS,
            max_builds=1,
        )
    )
    if not run.ok:
        return {"method": own, "error": f"{run.status}: {run.reason}"}
    seconds = {m: max(r["seconds"][m][0] for r in run.results) for m in methods}
    return {"method": own, "seconds": seconds, "state_bytes": run.results[0]["state_bytes"]}
