"""What a CPU box charges that the calibration trials' traces do not show apart: page faults of
large fresh buffers and the speed of an in-place add, measured by probes on the box itself.

[Note: page faults of large buffers]
glibc's ``malloc`` serves an allocation above its mmap threshold with a fresh ``mmap`` and
returns it with ``munmap`` when freed; the threshold adapts upwards to the largest freed
mmapped chunk but never past ``DEFAULT_MMAP_THRESHOLD_MAX``, 32 MiB on 64-bit (glibc
``malloc/malloc.c``; ``mallopt(3)``, ``M_MMAP_THRESHOLD``). Every such buffer faults one
page per 4 KiB on its first touch, each call. A unit's buffers scale with its parameters, so
grouping blocks into one unit (``modules``) can push them past 32 MiB where one block's stay
below: on ``wide4`` (``benchmarks/sim_accuracy.py``: dim 640, 4.67 M parameters a block, 2
gloo ranks) page faults per step (both ranks) went 30,502 -> 351,135 -> 930,564 for 1, 2 and
4 blocks per unit, and the unprofiled step 1,974 -> 2,378 -> 3,413 ms; a fault costs 2.5 us
on this VM (:func:`measure_page_fault_s`), so about 1.1 s of the 1.4 s that 4 blocks per unit
added. The calibration anchor has one block per unit, so its measured hooks hold none of this.

Per call the buffers are: for an unshard on a shard group of more than one, FSDP2's
all-gather output and gloo's flat output (``AsyncAllgatherWork`` gathers into one flat tensor
and copies it out), each a unit's padded parameters in the param dtype; for a reduce, FSDP2's
reduce-scatter input, gloo's copy of it (gloo reduces a reduce-scatter as an all-reduce of the
whole buffer) and FSDP2's reduce output (the shard), in the reduce dtype. The simulator charges
a grouped unit the faults of those buffers beyond what its blocks' own (calibrated) hooks held:
``faults(c x b) - c x faults(b)`` per buffer, zero for one block per unit and for the root
(calibrated as itself).
"""

from __future__ import annotations

import functools
import os
import statistics
import time

PAGE_BYTES = 4096
MMAP_THRESHOLD_MAX_BYTES = 32 * 2**20
"""glibc's ``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit: 4 x 1024 x 1024 x sizeof(long)."""


def get_mmap_threshold_bytes() -> int:
    """The threshold above which every allocation is mmapped: ``MALLOC_MMAP_THRESHOLD_`` when set
    (a fixed threshold), else the dynamic threshold's ceiling."""
    value = os.environ.get("MALLOC_MMAP_THRESHOLD_", "")
    return int(value) if value.isdigit() else MMAP_THRESHOLD_MAX_BYTES


def get_fault_seconds(num_bytes: float, page_fault_s: float, threshold: int) -> float:
    """Faulting in a fresh buffer of ``num_bytes`` (0 at or below the mmap threshold)."""
    return num_bytes / PAGE_BYTES * page_fault_s if num_bytes > threshold else 0.0


def get_grouping_fault_seconds(
    block_buffers: list[float], num_blocks: int, page_fault_s: float, threshold: int
) -> float:
    """What a unit of ``num_blocks`` blocks pays in page faults per call beyond its blocks' own:
    ``faults(c x b) - c x faults(b)`` summed over one block's per-call buffers ``block_buffers`` (bytes)."""
    if num_blocks <= 1 or page_fault_s <= 0:
        return 0.0
    return sum(
        get_fault_seconds(num_blocks * b, page_fault_s, threshold)
        - num_blocks * get_fault_seconds(b, page_fault_s, threshold)
        for b in block_buffers
    )


@functools.lru_cache(maxsize=1)
def measure_page_fault_s(num_bytes: int = 64 * 2**20, reps: int = 7) -> float:
    """Seconds per page fault on this machine: filling a fresh (mmapped) buffer less filling one
    already faulted in, per 4 KiB page; the median of ``reps`` tries (about 0.4 s)."""
    import torch

    numel = num_bytes // 4
    warm = torch.empty(numel)
    warm.fill_(1.0)
    fresh, reused = [], []
    for _ in range(reps):
        started = time.perf_counter()
        buffer = torch.empty(numel)
        buffer.fill_(1.0)
        fresh.append(time.perf_counter() - started)
        del buffer
        started = time.perf_counter()
        warm.fill_(2.0)
        reused.append(time.perf_counter() - started)
    return max(0.0, (statistics.median(fresh) - statistics.median(reused)) / (num_bytes / PAGE_BYTES))


@functools.lru_cache(maxsize=1)
def measure_add_bytes_per_s(num_bytes: int = 64 * 2**20, reps: int = 7) -> float:
    """Bytes per second of an in-place float32 add (``a += b``: two reads, one write) over buffers
    already faulted in: what autograd's ``AccumulateGrad`` does to a grad a non-sync microbatch left.
    The calibration's memory speed comes from FSDP2's hooks, whose Python overhead is in it (a
    lower bound, 2.1 GB/s on ``wide4``); a bare add runs ~10x faster (19 GB/s here)."""
    import torch

    numel = num_bytes // 4
    a, b = torch.ones(numel), torch.ones(numel)
    a.add_(b)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        a.add_(b)
        times.append(time.perf_counter() - started)
    return 3 * num_bytes / statistics.median(times)
