"""A trial rank's memory: the peak it measures (:class:`RssSampler` on CPU, the caching
allocator's counter on CUDA; :func:`get_memory`) and, on CPU with glibc, the heap it tunes so that
the profiled window does not fault in fresh pages (:func:`tune_heap`, :func:`prefault_heap`).
The rank program (:mod:`autotune.trials.program`) calls these around its steps.

[Note: a trial's peak memory]
Two peaks: the candidate's (``peak_bytes``), over its build and warm-up steps, before any
reference exists; and the trial's (``trial_peak_bytes``, the rank result only), over everything
up to the end of the measured steps, the reference included: what the device had to hold
([Note: one model for both sides] in :mod:`autotune.trials.paired`). Neither covers the profiled
window, whose buffers would count against configs that were profiled. On CUDA
``torch.cuda.max_memory_allocated`` (reset at the trial's start). On CPU there is no allocator
counter for all of torch's memory and ``ru_maxrss`` is a process-lifetime maximum (useless in a
pool that ran a bigger trial before). After ``gc.collect()`` and glibc ``malloc_trim`` have
returned the previous trial's freed memory, the kernel's own high-water mark of the resident set
(``VmHWM`` in ``/proc/self/status``) is reset by writing 5 to ``/proc/self/clear_refs`` (Linux
4.0+) and read where a peak is wanted: exact, and free. Where that file cannot be written, a
thread samples ``/proc/self/statm`` every 5 ms instead; that thread took the GIL from the training
thread 200 times a second, and steps ran ~4% slower with it (``small``, 2 ranks, A/A trials
alternating, 4 rounds: 712 vs 741 ms median, every round slower with it). The metric is the
*absolute* peak RSS: it includes the Python/torch runtime (~0.3 GB on the 2-core CPU machine
measured), but unlike a peak above the pre-build RSS it does not depend on the process's history
(measured, small model: above-baseline peaks 210 MiB on a pool's first trial vs 135-168 MiB
later, as one-time runtime allocations move into the baseline; absolute peaks 462-496 MiB, fresh
or pooled). ``baseline_memory_bytes`` (RSS before the build) is recorded beside it. Sampled,
spikes shorter than the interval can be missed; the number is for comparing configs.

[Note: the profiler's cost and the heap]
Where the profiler's cost comes from (``studies/profiler_overhead.py``, ``small``, 2 ranks,
4 microbatches, the configs a search trials, at load 4-10 on 2 cores). Per recorded op: 0.48 us
of CPU with the trial's settings (0.25 us of it the RecordFunction callbacks alone,
``emit_itt``), 0.71 with ``record_shapes``, 0.81 with ``with_stack``, 1.00 with both;
~18.4-19.5k ops per rank and step make ~9 ms (~1% of the step's CPU). ``record_shapes`` also
adds 2.5-9k page faults per step. Stopping the profiler (0.2-0.4 s) and the gzipped export
(3-5 s) fall outside the timed steps. The dominant cost was page faults: the profiler's small
allocations, between tensors, keep freed blocks from being reused, so the heap grows into fresh
pages, each zeroed on first touch (1.84 us per 4 KiB): a trial's one window, with glibc's
defaults, took 28-50k faults per step (ranks summed; 7-19k unprofiled), ~30-45 ms per rank and
step, and CPU overhead 0.81-1.27 (median 1.06, 17 trials). Wall overhead on that shared 2-core
machine is mostly the load moving between the two windows (0.55-1.72), so no setting could be
shown within 3% there.

So the heap is tuned (CPU, glibc; ``AUTOTUNE_GLIBC_MALLOC=default`` opts out): each trial fixes
glibc's mmap threshold at 32 MiB and turns trimming off (``mallopt``), so freed memory stays
mapped and is reused, and before the profiled window touches ``PREFAULT_BYTES`` (512 MiB, at most
a quarter of the free memory per rank) of heap and frees it, so the window's growth lands on
resident pages; ``malloc_trim`` returns all of it at the end. With it
(``studies/profiler_overhead.py`` section 6: real trials, 4 configs, 9 trials) profiled steps
take 2-4 page faults per step against 28-50k with glibc's defaults, and CPU overhead is
0.97-1.16 (median 1.04). It changes the measured steps too, in the same way for every config
and every trial of a pool: glibc's dynamic trimming returns and re-faults 7-19k pages per step,
an amount that depends on the process's history (0 to 23.5k per step for one config in
different processes), against 5 to 1,557 with the fixed thresholds; unprofiled CPU per step is
the same within the noise, and peak RSS 2% higher (freed memory is not returned during build
and warm-up). docs/studies.md, "Profiler overhead", has the figures.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
from typing import Any

import torch

_SAMPLE_INTERVAL_S = 0.005
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_MMAP_THRESHOLD = 32 * 2**20
"""The largest mmap threshold glibc accepts on 64-bit: smaller blocks come from the heap."""
_NO_TRIM = 2**31 - 1
PREFAULT_BYTES = 512 * 2**20
"""Heap touched before the profiled window (at most a quarter of the free memory per rank):
more than a ``small`` trial's window grows (28-50k pages per step, ranks summed)."""
NO_HEAP_TUNING_ENV = "AUTOTUNE_GLIBC_MALLOC"
"""Set to ``default`` to leave glibc's allocator as it is (benchmarks compare both)."""


# --------------------------------------------------------------------------- peak memory


def _read_high_water_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def reset_high_water_mark() -> bool:
    """Reset the kernel's peak RSS of this process (``VmHWM``); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _read_high_water_bytes()
    except (OSError, StopIteration, ValueError):
        return False
    return True


class RssSampler:
    """This process's peak resident set size from here on: the kernel's high-water mark, reset
    here, or else a background thread sampling it; see [Note: a trial's peak memory]."""

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        release_free_memory()
        self.baseline_bytes = self.read()
        self._sampled_peak = self.baseline_bytes
        self.kernel_peak = reset_high_water_mark()
        self._thread = (
            None if self.kernel_peak else threading.Thread(target=self._loop, name="autotune-rss", daemon=True)
        )

    @property
    def peak_bytes(self) -> int:
        return _read_high_water_bytes() if self.kernel_peak else self._sampled_peak

    def read(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _loop(self) -> None:
        while not self._stop.wait(_SAMPLE_INTERVAL_S):
            self._sampled_peak = max(self._sampled_peak, self.read())

    def __enter__(self) -> RssSampler:
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self._sampled_peak = max(self._sampled_peak, self.read())


def reset_device_memory(device: torch.device) -> None:
    """On CUDA, before a trial: the cache emptied and the peak counter reset (a pool's rank ran
    other trials; this trial's peak is its own). Nothing on CPU (the RSS sampler starts afresh)."""
    if device.type == "cuda":
        release_free_memory()
        torch.cuda.reset_peak_memory_stats(device)


def release_free_memory() -> None:
    """Return freed memory: glibc's heap on CPU, the caching allocator's blocks on CUDA (so a
    pool's next trial starts from an empty cache, not the last trial's fragments)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the baseline just includes freed-but-kept memory


def get_peak_bytes(device: torch.device, rss: RssSampler) -> int:
    """The process peak so far (the sampler's RSS on CPU, the allocator's counter on CUDA)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return max(rss.peak_bytes, rss.read())


def get_memory(device: torch.device, rss: RssSampler, candidate_peak: int, other_bytes: int = 0) -> dict[str, Any]:
    """The candidate's peak (its build and warm-up) and the whole trial's, with the reference;
    ``other_bytes`` (a kept model that is neither side: [Note: a warm reference] in
    :mod:`autotune.trials.kept`) is not the trial's."""
    source = "cuda_max_allocated" if device.type == "cuda" else "peak_rss"
    baseline = 0 if device.type == "cuda" else rss.baseline_bytes
    trial_peak = max(candidate_peak, get_peak_bytes(device, rss) - other_bytes)
    reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
    return {
        "source": source,
        "peak_bytes": candidate_peak,
        "baseline_bytes": baseline,
        "trial_peak_bytes": trial_peak,
        "reserved_peak_bytes": reserved,
    }


# --------------------------------------------------------------------------- the heap


def tune_heap(device: torch.device) -> Any:
    """On CPU with glibc: fixed thresholds, so freed memory stays mapped (libc, or None: untouched);
    see [Note: the profiler's cost and the heap]."""
    if device.type != "cpu" or os.environ.get(NO_HEAP_TUNING_ENV) == "default":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, _NO_TRIM)
    except (OSError, AttributeError):
        return None
    return libc


def prefault_heap(libc: Any, world_size: int) -> None:
    """Touch heap pages and free them (kept resident: trimming is off) for the profiled window to reuse."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    chunk = 2**20  # below the mmap threshold: from the heap
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    blocks = [libc.malloc(chunk) for _ in range(min(PREFAULT_BYTES, available // (4 * world_size)) // chunk)]
    for block in blocks:
        if block:
            libc.memset(block, 0, chunk)
    for block in reversed(blocks):  # top first: the blocks merge back into the heap's top
        libc.free(block)
