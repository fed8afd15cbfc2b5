"""Rank program of ``benchmarks/profiler_overhead.py``: blocks of unprofiled and profiled steps, alternating.

Kept in its own module so the ranks (``python -m autotune.trials.rank``) import it by name
(``_profiler_probe:alternate``) without importing the benchmark's command line.

A *variant* is a dict (picklable, built by the benchmark):

- ``kind``: ``plain`` (no profiler), ``kineto`` (``torch.profiler.profile``) or ``itt``
  (``torch.autograd.profiler.emit_itt``: RecordFunction callbacks on, nothing recorded).
- ``warmup``: schedule warm-up steps before the active ones (kineto only; a trial uses 1).
- ``profile_kwargs``: keyword arguments of ``torch.profiler.profile`` (shapes, stacks, ...).
- ``experimental``: keyword arguments of ``torch._C._profiler._ExperimentalConfig`` or None.
- ``export``: ``gz`` / ``json`` (``export_chrome_trace`` to that suffix) or None.
"""

from __future__ import annotations

import gc
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

_MALLINFO2_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


def _mallinfo2_type() -> Any:
    import ctypes

    return type("MallInfo2", (ctypes.Structure,), {"_fields_": tuple((n, ctypes.c_size_t) for n in _MALLINFO2_FIELDS)})


def _malloc_state() -> dict[str, int]:
    """glibc ``mallinfo2`` (main arena + mmapped) and the resident set size, in bytes."""
    import ctypes
    import os

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _mallinfo2_type()
        info = libc.mallinfo2()
        state = {"arena": info.arena, "mmapped": info.hblkhd, "in_use": info.uordblks, "free": info.fordblks}
    except (OSError, AttributeError):
        state = {}
    with open("/proc/self/statm") as f:
        state["rss"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return state


M_TRIM_THRESHOLD = -1
_INT_MAX = 2**31 - 1


def reserve_heap(prefault_mb: int) -> None:
    """Keep freed heap memory resident and pre-fault ``prefault_mb`` MiB of the heap top (glibc).

    Under torch.profiler the recorded events (~200 bytes each, ~20k per step) are small
    mallocs interleaved with tensor allocations; they split freed tensor blocks, so new
    tensors come from fresh heap-top pages, each first touched through a page fault.
    With trimming off and the top pre-faulted, those pages are already resident.
    """
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    libc.mallopt(M_TRIM_THRESHOLD, _INT_MAX)
    chunk = 64 * 1024  # below glibc's smallest mmap threshold: served from the heap
    blocks = [libc.malloc(chunk) for _ in range(prefault_mb * 2**20 // chunk)]
    for block in blocks:
        if block:
            libc.memset(block, 0, chunk)
    for block in reversed(blocks):
        libc.free(block)


def release_heap(trim_threshold: int = 64 * 2**20) -> None:
    """Undo :func:`reserve_heap`: trim again (glibc's steady-state threshold) and return free memory."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_TRIM_THRESHOLD, trim_threshold)
    libc.malloc_trim(0)


def _step_record(training: Any, step: int, device: Any) -> dict[str, float]:
    import resource

    from autotune.trials.program import timed_step

    before = resource.getrusage(resource.RUSAGE_SELF)
    proc = time.process_time()
    thread = time.thread_time()
    wall = timed_step(training, step, device)[0]
    thread_cpu = (time.thread_time() - thread) * 1e3
    proc_cpu = (time.process_time() - proc) * 1e3
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "wall": wall,
        "thread_cpu": thread_cpu,
        "proc_cpu": proc_cpu,
        "minflt": after.ru_minflt - before.ru_minflt,
        "nivcsw": after.ru_nivcsw - before.ru_nivcsw,
        **{f"after_{k}": v for k, v in _malloc_state().items()},
    }


def _run_kineto(training: Any, variant: dict[str, Any], first_step: int, active: int, device: Any, trace_path: Path | None) -> dict[str, Any]:
    """One profiled window as a trial runs it (schedule, then on_trace_ready export)."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile, schedule

    costs: dict[str, float] = {}

    def export(prof: Any) -> None:
        start = time.perf_counter()
        if trace_path is not None:
            prof.export_chrome_trace(str(trace_path))
        costs["export_ms"] = (time.perf_counter() - start) * 1e3

    experimental = _ExperimentalConfig(**variant["experimental"]) if variant.get("experimental") else None
    warmup = variant.get("warmup", 1)
    steps: list[dict[str, float]] = []
    start = time.perf_counter()
    if variant.get("prefault_mb") is not None:
        reserve_heap(variant["prefault_mb"])
        costs["reserve_ms"] = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=warmup, active=active, repeat=1),
        on_trace_ready=export,
        experimental_config=experimental,
        **variant.get("profile_kwargs", {}),
    ) as prof:
        enter_ms = (time.perf_counter() - start) * 1e3
        for i in range(warmup + active):
            record = _step_record(training, first_step + i, device)
            record["phase"] = "warmup" if i < warmup else "active"
            steps.append(record)
            start = time.perf_counter()
            prof.step()  # after the last active step: stop, collect, on_trace_ready
            if i == warmup + active - 1:
                costs["stop_and_export_ms"] = (time.perf_counter() - start) * 1e3
    if variant.get("prefault_mb") is not None:
        release_heap()
    costs["enter_ms"] = enter_ms
    costs["stop_ms"] = costs.get("stop_and_export_ms", 0.0) - costs.get("export_ms", 0.0)
    return {"steps": steps, **costs}


def alternate(
    rank: int,
    world_size: int,
    *,
    model: Any,
    config: dict[str, Any],
    variants: dict[str, dict[str, Any]],
    rounds: int,
    block: int,
    warmup_steps: int,
    trace_dir: str,
    tag: str,
) -> dict[str, Any]:
    """Per round, one block of every variant (``plain`` included), in an order rotated by round.

    Returns this rank's step records per (round, variant) and the traces written.
    """
    import torch

    from autotune.trials import build_training

    device = torch.device("cpu")
    training = build_training(rank, world_size, model=model, config=config)
    step = 0
    for _ in range(warmup_steps):
        _step_record(training, step, device)
        step += 1
    names = list(variants)
    blocks: list[dict[str, Any]] = []
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            variant = variants[name]
            kind = variant["kind"]
            if kind == "kineto":
                suffix = {"gz": ".json.gz", "json": ".json"}.get(variant.get("export") or "", None)
                trace_path = Path(trace_dir) / f"{tag}_{name}_r{r}_rank{rank}{suffix}" if suffix else None
                result = _run_kineto(training, variant, step, block, device, trace_path)
                step += len(result["steps"])
                result["trace"] = str(trace_path) if trace_path else None
            else:
                ctx = torch.autograd.profiler.emit_itt() if kind == "itt" else nullcontext()
                steps = []
                with ctx:
                    for _ in range(block):
                        record = _step_record(training, step, device)
                        record["phase"] = "active"
                        steps.append(record)
                        step += 1
                result = {"steps": steps, "trace": None}
            gc.collect()  # outside the timed steps: no block inherits another's garbage
            result["after_block"] = _malloc_state()
            blocks.append({"round": r, "variant": name, **result})
    return {"rank": rank, "blocks": blocks, "num_threads": torch.get_num_threads()}
