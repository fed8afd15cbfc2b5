"""Rank program of ``studies/profiler_overhead.py`` (not run directly): unprofiled and profiled blocks, alternating.

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
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

_MALLINFO2_FIELDS = (
    "arena",
    "ordblks",
    "smblks",
    "hblks",
    "hblkhd",
    "usmblks",
    "fsmblks",
    "uordblks",
    "fordblks",
    "keepcost",
)


def _mallinfo2_type() -> Any:
    import ctypes

    return type("MallInfo2", (ctypes.Structure,), {"_fields_": tuple((n, ctypes.c_size_t) for n in _MALLINFO2_FIELDS)})


def _malloc_state() -> dict[str, int]:
    """glibc ``mallinfo2`` (main arena + mmapped) and the resident set size, in bytes."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _mallinfo2_type()
        info = libc.mallinfo2()
        state = {"arena": info.arena, "mmapped": info.hblkhd, "in_use": info.uordblks, "free": info.fordblks}
    except (OSError, AttributeError):
        state = {}
    state["rss"] = _rss()
    return state


def _rss() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """The resident set size sampled every 5 ms, after ``malloc_trim``: what a trial reports as
    ``process_peak_bytes`` (``autotune/trials/rank_memory.py``, [Note: a trial's peak memory])."""

    def __init__(self) -> None:
        import ctypes
        import threading

        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.baseline = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def measure_unit_costs(rounds: int = 15, num_ops: int = 4000) -> dict[str, float]:
    """In this process (no ranks), ``c_op_<setting>``: extra CPU per recorded op under each profiler
    setting (today's, record_shapes, with_stack, both, itt); ``c_fault``: CPU per first touch
    of a fresh 4 KiB page (fresh vs reused tensor memory)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    x = torch.ones(8)

    def ops_us() -> float:
        start = time.thread_time()
        for _ in range(num_ops):
            torch.add(x, x)
        return (time.thread_time() - start) / num_ops * 1e6

    makers = {
        "plain": nullcontext,
        "today": lambda: profile(activities=[ProfilerActivity.CPU]),
        "shapes": lambda: profile(activities=[ProfilerActivity.CPU], record_shapes=True),
        "stack": lambda: profile(activities=[ProfilerActivity.CPU], with_stack=True),
        "shapes_stack": lambda: profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True),
        "itt": lambda: torch.autograd.profiler.emit_itt(),
    }
    per_op: dict[str, list[float]] = {k: [] for k in makers}
    for _ in range(rounds):
        for name, make in makers.items():
            with make():
                per_op[name].append(ops_us())
    nbytes = 64 * 2**20
    fresh, reused = [], []
    for _ in range(rounds):
        t = torch.empty(nbytes, dtype=torch.uint8)  # >= glibc's mmap threshold: fresh pages
        start = time.thread_time()
        t.fill_(1)
        fresh.append(time.thread_time() - start)
        start = time.thread_time()
        t.fill_(2)
        reused.append(time.thread_time() - start)
        del t
    pages = nbytes // 4096
    base = statistics.median(per_op["plain"])
    return {
        "plain_us_per_op": base,
        **{f"c_op_{k}": statistics.median(v) - base for k, v in per_op.items() if k != "plain"},
        "c_fault": (statistics.median(fresh) - statistics.median(reused)) / pages * 1e6,
    }


def _step_record(training: Any, step: int, device: Any) -> dict[str, float]:
    import resource

    from autotune.trials.program import timed_step

    before = resource.getrusage(resource.RUSAGE_SELF)
    proc = time.process_time()
    thread = time.thread_time()
    wall = timed_step(training, step, device).ms
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


def _run_kineto(
    training: Any, variant: dict[str, Any], first_step: int, active: int, device: Any, trace_path: Path | None
) -> dict[str, Any]:
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
    heap: str = "glibc",
) -> dict[str, Any]:
    """Per round, one block of every variant (``plain`` included), in an order rotated by round.

    ``heap``: ``glibc`` (as the process starts) or ``trial`` (what a trial does: ``tune_heap``
    at the start, ``prefault_heap`` before each profiled window).
    Returns this rank's step records per (round, variant) and the traces written.
    """
    import torch

    from autotune.trials import build_training
    from autotune.trials.rank_memory import prefault_heap, tune_heap

    device = torch.device("cpu")
    libc = tune_heap(device) if heap == "trial" else None
    with PeakRss() as rss:  # as a trial samples its process peak: build and warm-up
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
                if libc is not None:  # no malloc_trim after it: a trial trims at its end, then warms up
                    prefault_heap(libc, world_size)
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
    return {
        "rank": rank,
        "blocks": blocks,
        "num_threads": torch.get_num_threads(),
        "peak_rss": rss.peak,
        "baseline_rss": rss.baseline,
    }
