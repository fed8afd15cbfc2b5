"""The program one rank runs in a trial (:func:`run_trial_rank`).

Local trials call it through :func:`autotune.trials.launch.run_ranks` or a
:class:`autotune.trials.pool.RankPool`; several nodes through :mod:`autotune.trials.torchrun`.

[Note: what a trial measures]
- *Step time* comes from unprofiled steps only. Before each measured step each rank makes
  the step's microbatches and puts them on its device (pinned memory and a non-blocking copy
  on CUDA), then all ranks meet at a barrier (and synchronize the device on CUDA, which also
  completes the copies), so a step times the model and not the data path; each rank then times its own step
  with ``perf_counter`` and also records, for the step, its training thread's CPU time
  (``time.thread_time``) and the process's minor page faults (``getrusage``). The trial's
  step time per step is the slowest rank's; each rank keeps its own times too.
- *Traces* come from a separate window after the measured steps: ``torch.profiler`` with
  ``schedule(wait=0, warmup=1, active=num_profiled)``, CPU activity (+ CUDA on GPU), no
  shapes or stacks, one gzipped chrome trace per rank; the traced steps are timed the same
  way. ``metrics.json`` records how far they are from the timed ones: ``profiler_overhead``
  (profiled / unprofiled median step, slowest rank), ``profiler_cpu_overhead`` (the same
  for CPU time, ranks summed) and ``profiler`` (page faults, and per rank its own wall,
  CPU and fault figures and ``trace_scale``); the report scales trace times by
  ``trace_scale`` where the wall overhead is beyond 3% and the scale is plausible ([Note: scaled trace times] in
  :mod:`autotune.report.model`).
- *Where the profiler's cost comes from* (``benchmarks/profiler_overhead.py``, ``small``,
  2 ranks, 4 microbatches, the configs a search trials, at load 4-10 on 2 cores). Per
  recorded op: 0.48 us of CPU with the trial's settings (0.25 us of it the RecordFunction
  callbacks alone, ``emit_itt``), 0.71 with ``record_shapes``, 0.81 with ``with_stack``,
  1.00 with both; ~18.4-19.5k ops per rank and step make ~9 ms (~1% of the step's CPU).
  ``record_shapes`` also adds 2.5-9k page faults per step. Stopping the profiler (0.2-0.4 s)
  and the gzipped export (3-5 s) fall outside the timed steps. The dominant cost was page
  faults: the profiler's small allocations, between tensors, keep freed blocks from being
  reused, so the heap grows into fresh pages, each zeroed on first touch (1.84 us per
  4 KiB): a trial's one window, with glibc's defaults, took 28-50k faults per step (ranks
  summed; 7-19k unprofiled), ~30-45 ms per rank and step, and CPU overhead 0.81-1.27
  (median 1.06, 17 trials). Wall overhead on this shared box is mostly the load moving
  between the two windows (0.55-1.72), so no setting can be shown within 3% here.
- *The heap* (CPU, glibc; ``AUTOTUNE_GLIBC_MALLOC=default`` opts out): each trial fixes
  glibc's mmap threshold at 32 MiB and turns trimming off (``mallopt``), so freed memory
  stays mapped and is reused, and before the profiled window touches ``PREFAULT_BYTES``
  (512 MiB, at most a quarter of the free memory per rank) of heap and frees it, so the
  window's growth lands on resident pages; ``malloc_trim`` returns all of it at the end.
  With it (``benchmarks/profiler_overhead.py`` section 6: real trials, 4 configs, 9 trials)
  profiled steps take 2-4 page faults per step against 28-50k with glibc's defaults, and
  CPU overhead is 0.97-1.16 (median 1.04). It changes the measured steps too, in the same
  way for every config and every trial of a pool: glibc's dynamic trimming returns and
  re-faults 7-19k pages per step, an amount that depends on the process's history (0 to 23.5k
  per step for one config in different processes), against 5 to 1,557 with the fixed
  thresholds; unprofiled CPU per step is the same within the noise, and peak RSS 2% higher
  (freed memory is not returned during build and warm-up). The README's profiler-overhead
  table has the figures.
- *Peak memory*: the candidate's (``peak_bytes``), over its build and warm-up steps, before
  any reference exists; and the trial's (``trial_peak_bytes``, the rank result only), over
  everything up to the end of the measured steps, the reference included: what the device
  had to hold ([Note: one model for both sides] in :mod:`autotune.trials.paired`). Neither
  covers the profiled window, whose buffers would count against configs that were
  profiled. On CUDA ``torch.cuda.max_memory_allocated`` (reset at the trial's start). On CPU there is no allocator counter for all of
  torch's memory and ``ru_maxrss`` is a process-lifetime maximum (useless in a pool that
  ran a bigger trial before). After ``gc.collect()`` and glibc ``malloc_trim`` have returned
  the previous trial's freed memory, the kernel's own high-water mark of the resident set
  (``VmHWM`` in ``/proc/self/status``) is reset by writing 5 to ``/proc/self/clear_refs``
  (Linux 4.0+) and read where a peak is wanted: exact, and free. Where that file cannot be
  written, a thread samples ``/proc/self/statm`` every 5 ms instead; that thread took the GIL
  from the training thread 200 times a second, and steps ran ~4% slower with it (``small``,
  2 ranks, A/A trials alternating, 4 rounds: 712 vs 741 ms median, every round slower with
  it). The metric is the *absolute* peak RSS: it
  includes the Python/torch runtime (~0.3 GB here), but unlike a peak above the pre-build
  RSS it does not depend on the process's history (measured, small model: above-baseline
  peaks 210 MiB on a pool's first trial vs 135-168 MiB later, as one-time runtime
  allocations move into the baseline; absolute peaks 462-496 MiB, fresh or pooled).
  ``baseline_memory_bytes`` (RSS before the build) is recorded beside it. Sampled, spikes
  shorter than the interval can be missed; the number is for comparing configs.
- *Pruning*: with ``prune_if_slower_than_ms``, after the first ``PRUNE_AFTER`` measured
  steps every rank votes (an all-reduce of "my median is above the limit") so all ranks
  stop together; a pruned trial skips the profiled window.

[Note: the leading step]
A freshly built candidate took ``num_warmup`` (2) unmeasured steps: the first pays lazy
initialisation and first-touch page faults, and the second is the first with AdamW's state, so
the peak read after it is the steady one. Where the pairs start with the candidate (its reference
switched in place or kept warm: no step of the reference's comes between its warm-up and its
first measured step), that first measured step *is* a second step of the same config, so on CPU
the candidate warms up for one step fewer and its peak is read again right after its first
measured step, before any reference step (``run_pairs``' ``on_first_step``): the peak still
covers a step with AdamW's state. Is a second step already a steady one? Measured (``small``,
2 microbatches, 2 ranks, a pool, the defaults, the search's HSDP grouped winner and full
checkpointing, 3 fresh models each, steps 1-7; load under 1): step 1 took 1.12-1.47x the median
of steps 4-7, step 2 0.94-1.16x (median 1.04), step 3 0.94-1.13x (median 1.06): the second is
as steady as the third. On CUDA the warm-up is kept whole: the host-path probe times the last
warm-up step ([Note: host path probe]), and a GPU's second step was not measured. The record
says how many warm-up steps the candidate took (``candidate_warmup``, metrics v11).
"""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import socket
import statistics
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autotune.trials import kept as kept_models
from autotune.trials.host_probe import probe_host_path
from autotune.trials.in_turn import ModelsInTurn
from autotune.trials.kept import KeptModel
from autotune.trials.metrics import median_or_none
from autotune.trials.paired import (
    Side,
    StepTiming,
    activate,
    get_block_ratios,
    get_pair_steps,
    run_pairs,
    split_self_pairs,
    step_side,
)
from autotune.trials.precision import get_overlap_env
from autotune.trials.sequential import StoppingRule
from fsdp_runtime.files import atomic_path

PRUNE_AFTER = 2
"""Measured steps after which the ranks vote on pruning."""
_SAMPLE_INTERVAL_S = 0.005


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


class _RssSampler:
    """This process's peak resident set size from here on: the kernel's high-water mark, reset
    here, or else a background thread sampling it; see [Note: what a trial measures]."""

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        _release_free_memory()
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

    def __enter__(self) -> _RssSampler:
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
        _release_free_memory()
        torch.cuda.reset_peak_memory_stats(device)


def _release_free_memory() -> None:
    """Return freed memory: glibc's heap on CPU, the caching allocator's blocks on CUDA (so a
    pool's next trial starts from an empty cache, not the last trial's fragments)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the baseline just includes freed-but-kept memory


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_MMAP_THRESHOLD = 32 * 2**20
"""The largest mmap threshold glibc accepts on 64-bit: smaller blocks come from the heap."""
_NO_TRIM = 2**31 - 1
PREFAULT_BYTES = 512 * 2**20
"""Heap touched before the profiled window (at most a quarter of the free memory per rank):
more than a ``small`` trial's window grows (28-50k pages per step, ranks summed)."""
PAIRED_MODELS_ENV = "AUTOTUNE_PAIRED_MODELS"
"""Unset: one model where the knobs switch in place ([Note: one model for both sides]), else a
second model on CPU and models built in turn on CUDA ([Note: models built in turn]). ``two``:
always a second model; ``turn``: in turn wherever the knobs do not switch in place (benchmarks and
tests compare them)."""
NO_HEAP_TUNING_ENV = "AUTOTUNE_GLIBC_MALLOC"
HOST_PROBE_ENV = "AUTOTUNE_HOST_PROBE"
"""``1``: time the host's path per block on CPU too (tests; [Note: host path probe])."""
"""Set to ``default`` to leave glibc's allocator as it is (benchmarks compare both)."""


def tune_heap(device: torch.device) -> Any:
    """On CPU with glibc: fixed thresholds, so freed memory stays mapped (libc, or None: untouched);
    see [Note: what a trial measures]."""
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


def _get_device(backend: str, rank: int) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed_step(training: Any, step: int, device: torch.device, emulator: Any = None) -> StepTiming:
    """``training.step(step)`` timed (:class:`~autotune.trials.paired.StepTiming`: wall ms, loss,
    training-thread CPU ms, page faults), started together on all ranks (a barrier) and, with a
    :class:`~autotune.trials.linkemu.LinkEmulator`, under link emulation. The step's input is made
    and put on the device first, outside the timing."""
    prepare = getattr(training, "prepare", None)
    if prepare is not None:  # custom rank programs' trainings may not have it
        prepare(step)
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    faults, cpu, start = _minor_faults(), time.thread_time(), time.perf_counter()
    with emulator if emulator is not None else nullcontext():
        loss = training.step(step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ms = (time.perf_counter() - start) * 1e3
    return StepTiming(ms, loss, (time.thread_time() - cpu) * 1e3, _minor_faults() - faults)


def _vote_prune(step_ms: list[float], limit_ms: float, device: torch.device) -> bool:
    """True on every rank when any rank's median so far is above ``limit_ms``."""
    slow = torch.tensor([1.0 if median_or_none(step_ms) > limit_ms else 0.0], device=device)
    dist.all_reduce(slow, op=dist.ReduceOp.MAX)
    return bool(slow.item() > 0)


def _profiled_window(
    training: Any, first_step: int, num_active: int, device: torch.device, emulator: Any, trace_path: Path
) -> list[StepTiming]:
    """The traced steps (after one untraced warm-up step of the schedule, whose loss is kept too)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    def export(prof: Any) -> None:
        with atomic_path(trace_path) as tmp:  # keeps the .gz suffix: export gzips by name
            prof.export_chrome_trace(str(tmp))

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    steps = []
    with profile(
        activities=activities, schedule=schedule(wait=0, warmup=1, active=num_active, repeat=1), on_trace_ready=export
    ) as prof:
        for i in range(1 + num_active):
            steps.append(timed_step(training, first_step + i, device, emulator))
            prof.step()
    return steps


def _get_peak_bytes(device: torch.device, rss: _RssSampler) -> int:
    """The process peak so far (the sampler's RSS on CPU, the allocator's counter on CUDA)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return max(rss.peak_bytes, rss.read())


def _get_memory(device: torch.device, rss: _RssSampler, candidate_peak: int, other_bytes: int = 0) -> dict[str, Any]:
    """The candidate's peak (its build and warm-up) and the whole trial's, with the reference;
    ``other_bytes`` (a kept model that is neither side: [Note: a warm reference] in
    :mod:`autotune.trials.kept`) is not the trial's."""
    source = "cuda_max_allocated" if device.type == "cuda" else "peak_rss"
    baseline = 0 if device.type == "cuda" else rss.baseline_bytes
    trial_peak = max(candidate_peak, _get_peak_bytes(device, rss) - other_bytes)
    reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
    return {
        "source": source,
        "peak_bytes": candidate_peak,
        "baseline_bytes": baseline,
        "trial_peak_bytes": trial_peak,
        "reserved_peak_bytes": reserved,
    }


def _build_sides(
    rank: int,
    world_size: int,
    spec: dict[str, Any],
    device: torch.device,
    emulators: tuple[Any, Any],
    rss: _RssSampler,
    kept: KeptModel | None,
) -> tuple[dict[str, Side], int, int]:
    """The candidate, warmed up, and with ``spec["reference"]`` the reference: on the candidate's
    own model where the two differ only in knobs switched in place, else the kept warm model
    ([Note: a warm reference] in :mod:`autotune.trials.kept`) or a model of its own, or on CUDA
    models built in turn ([Note: one model for both sides] in :mod:`autotune.trials.paired`).
    Returns the sides, the candidate's peak memory (its build and warm-up: no reference exists
    yet, the kept model's live bytes taken off) and its warm-up steps ([Note: the leading step])."""
    if kept is not None and _is_reference_config(spec):
        candidate = Side(training=kept.training, emulator=emulators[0], next_step=kept.next_step, kept=True)
        warmup = min(1, spec["num_warmup"])  # the trial's start returned its freed heap: one step re-faults it
        _warm_up(candidate, spec, device, warmup)
        return _with_reference(spec, {"candidate": candidate}), kept.peak_bytes, warmup
    candidate = Side(training=_build(rank, world_size, spec, device, spec["config"]), emulator=emulators[0])
    kind = _get_reference_kind(spec, device, candidate, kept)
    warmup = spec["num_warmup"]
    if kind in ("in_place", "kept") and device.type == "cpu" and warmup >= 2:
        warmup -= 1  # its first measured step leads the pairs: [Note: the leading step]
    _warm_up(candidate, spec, device, warmup)
    candidate_peak = _get_peak_bytes(device, rss) - (kept.live_bytes if kept is not None else 0)
    sides = {"candidate": candidate}
    if kind is not None:
        sides["reference"] = _get_reference(rank, world_size, spec, device, candidate, emulators[1], kept, kind)
    return _with_reference(spec, sides), candidate_peak, warmup


def _with_reference(spec: dict[str, Any], sides: dict[str, Side]) -> dict[str, Side]:
    """The sides, the candidate paired with itself where the reference is its config; warm-up
    steps forgotten (they are not measurements; their losses stay: the run's record)."""
    if spec.get("reference") is not None and "reference" not in sides:
        sides["reference"] = sides["candidate"]
    for side in sides.values():
        side.clear()
    return sides


def _is_reference_config(spec: dict[str, Any]) -> bool:
    """The candidate is the config a kept model is kept for: the reference paired with itself, or no reference."""
    return spec.get("reference") is None or spec["reference"] == spec["config"]


def _get_reference_kind(
    spec: dict[str, Any], device: torch.device, candidate: Side, kept: KeptModel | None
) -> str | None:
    """How the reference side is held: ``self`` (the candidate paired with itself, the defaults
    trial: alternate steps measure the noise), ``in_place`` (the candidate's model switched in
    place), ``in_turn`` (built in turn with the candidate's: on CUDA), ``kept`` (the kept warm
    model), ``own`` (a model of its own); None: no reference."""
    reference = spec.get("reference")
    if reference is None:
        return None
    if reference == spec["config"]:
        return "self"
    asked = os.environ.get(PAIRED_MODELS_ENV)
    if asked != "two" and not candidate.training.get_structural_differences(reference):
        return "in_place"
    if asked == "turn" or (asked is None and device.type == "cuda"):
        return "in_turn"
    return "kept" if kept is not None else "own"


def _get_reference(
    rank: int,
    world_size: int,
    spec: dict[str, Any],
    device: torch.device,
    candidate: Side,
    emulator: Any,
    kept: KeptModel | None,
    kind: str,
) -> Side:
    """The reference side of ``kind`` (:func:`_get_reference_kind`), warmed up: switched in place
    and kept ones take no step of their own (the pairs start with the candidate, and the
    reference's first step is a settle step; [Note: a warm reference] in
    :mod:`autotune.trials.kept`), one built in turn is built when it first steps ([Note: models
    built in turn] in :mod:`autotune.trials.in_turn`), its own model takes ``num_warmup`` steps."""
    reference = spec["reference"]
    if kind == "self":
        return candidate
    if kind == "in_place":
        candidate.config = spec["config"]
        return Side(training=candidate.training, emulator=emulator, config=reference)
    if kind == "in_turn":
        in_turn = ModelsInTurn(
            lambda config: _build(rank, world_size, spec, device, config),
            lambda side: _warm_up(side, spec, device),
            _release_free_memory,
        )
        in_turn.add(candidate, spec["config"], built=True)
        side = Side(training=None, emulator=emulator)
        in_turn.add(side, reference)
        return side
    if kind == "kept":
        return Side(training=kept.training, emulator=emulator, next_step=kept.next_step, kept=True)
    side = Side(training=_build(rank, world_size, spec, device, reference), emulator=emulator)
    _warm_up(side, spec, device)
    return side


def _build(rank: int, world_size: int, spec: dict[str, Any], device: torch.device, config: dict[str, Any]) -> Any:
    from autotune.trials.training import build_training

    return build_training(rank, world_size, model=spec["model"], config=config, seed=spec["seed"], device=device)


def _warm_up(side: Side, spec: dict[str, Any], device: torch.device, steps: int | None = None) -> None:
    """``steps`` (default ``num_warmup``) steps of a freshly built side, not measured (their losses
    stay in its record); on CUDA (or with ``AUTOTUNE_HOST_PROBE=1``) the last one times the host's
    path per block pass ([Note: host path probe] in :mod:`autotune.trials.host_probe`)."""
    probe = device.type == "cuda" or os.environ.get(HOST_PROBE_ENV) == "1"
    steps = spec["num_warmup"] if steps is None else steps
    for i in range(steps):
        last = i == steps - 1
        if probe and last and getattr(side.training, "pipeline", True) is None and side.emulator is None:
            loss, side.host_path_ms = probe_host_path(side.training, side.next_step, device)
            side.losses.append(loss)
        else:
            side.losses.append(timed_step(side.training, side.next_step, device, side.emulator).loss)
        side.next_step += 1


def _measure(
    sides: dict[str, Side], spec: dict[str, Any], device: torch.device, on_first_step: Any = None
) -> str | None:
    """The timed steps: paired with the reference when there is one (``on_first_step`` is called
    after the first); returns why they stopped early (``pruned``, or a stopping rule's reason:
    [Note: sequential measurement]), None: every step ran."""
    if "reference" in sides:
        stopping = spec.get("stopping")
        first = get_pairs_first(sides)  # the candidate stepped last where the pairs start with it
        return run_pairs(
            sides,
            num_pairs=spec["num_measured"],
            device=device,
            timed_step=timed_step,
            prune_if_ratio_above=spec.get("prune_if_ratio_above"),
            stopping=StoppingRule.from_dict(stopping) if stopping else None,
            last=first,
            first=first,
            on_first_step=on_first_step,
        )
    candidate, limit = sides["candidate"], spec["prune_if_slower_than_ms"]
    for i in range(spec["num_measured"]):
        step_side(candidate, device, timed_step)
        if limit is not None and i + 1 == PRUNE_AFTER and _vote_prune(candidate.step_ms, limit, device):
            return "pruned"
    return None


def get_pairs_first(sides: dict[str, Side]) -> str:
    """The side that steps first in the even pairs: the candidate where the reference took no step
    of its own in this trial (the candidate's model switched in place, or the kept warm model:
    the candidate stepped last, its warm-up, so no switch and no settle step before the first
    pair; one step fewer than a warm-up step of the reference's own), else the reference."""
    reference = sides["reference"]
    if reference is sides["candidate"]:
        return "reference"
    shared = reference.training is sides["candidate"].training
    switched = shared and reference.config is not None and reference.in_turn is None
    return "candidate" if switched or reference.kept else "reference"


def _is_below(sides: dict[str, Side], limit: float | None) -> bool:
    """The candidate's median ABBA block ratio is below ``limit`` (None: no limit; same on every rank)."""
    if limit is None or "reference" not in sides:
        return True
    blocks = get_block_ratios(*get_pair_steps(sides))
    return bool(blocks) and statistics.median(blocks) < limit


def run_trial_rank(rank: int, world_size: int, *, spec: dict[str, Any]) -> dict[str, Any]:
    """Rank program of a trial (``spec`` is :meth:`autotune.trials.spec.TrialSpec.to_dict`); returns this rank's measurements."""
    try:
        return _run_trial_rank(rank, world_size, spec)
    except BaseException:
        kept_models.drop()  # a step may have stopped halfway: never step that model again
        raise


def _take_kept(spec: dict[str, Any], device: torch.device) -> KeptModel | None:
    """The kept warm model of this trial's reference config, where every rank holds it and the
    trial may use it ([Note: a warm reference] in :mod:`autotune.trials.kept`); else it is dropped."""
    if not kept_models.can_keep(spec, device):
        kept_models.drop()
        return None
    kept = kept_models.take(kept_models.get_key(spec, device), device)
    if kept is not None and kept.peak_bytes is None and _is_reference_config(spec):
        kept_models.drop()  # kept as a reference: its own peak was never measured, so build it afresh
        return None
    return kept


def _get_side_to_keep(sides: dict[str, Side], spec: dict[str, Any], device: torch.device) -> Side | None:
    """The side whose model is the reference config's own, to keep for the next trial; None where
    there is none (switched in place, built in turn) or the trial may not keep one."""
    if not kept_models.can_keep(spec, device):
        return None
    if _is_reference_config(spec):
        return sides["candidate"]
    reference = sides["reference"]
    own = reference.training is not sides["candidate"].training and reference.in_turn is None
    return reference if own else None


def _build_and_measure(
    rank: int, world_size: int, spec: dict[str, Any], device: torch.device, emulators: tuple, kept: KeptModel | None
) -> tuple[dict[str, Side], str | None, dict[str, Any], int]:
    """The sides built and measured, with the memory they took: (sides, why the pairs stopped,
    :func:`_get_memory`'s figures, the candidate's warm-up steps)."""
    offset = kept.live_bytes if kept is not None else 0
    with _RssSampler() as rss:
        sides, candidate_peak, warmup = _build_sides(rank, world_size, spec, device, emulators, rss, kept)
        peak = [candidate_peak]

        def after_leading_step() -> None:  # [Note: the leading step]: the candidate's peak covers it
            peak[0] = max(peak[0], _get_peak_bytes(device, rss) - offset)

        leads = warmup < spec["num_warmup"] and not sides["candidate"].kept
        stopped = _measure(sides, spec, device, after_leading_step if leads else None)
    kept_used = any(side.kept for side in sides.values())
    return sides, stopped, _get_memory(device, rss, peak[0], 0 if kept_used else offset), warmup


def _run_trial_rank(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    from autotune.trials.linkemu import LinkEmulator
    from profiles import load_cluster_profile

    device = _get_device(spec["backend"], rank)
    cluster = load_cluster_profile(spec["cluster"]) if spec["cluster"] else None
    # One emulator per side: the candidate's link statistics are its own.
    emulators = (LinkEmulator.from_cluster(cluster), LinkEmulator.from_cluster(cluster)) if cluster else (None, None)
    reset_device_memory(device)
    libc = tune_heap(device)
    kept = _take_kept(spec, device)
    sides, stopped, memory, warmup = _build_and_measure(rank, world_size, spec, device, emulators, kept)
    candidate_peak = memory["peak_bytes"]
    kept_used = int(any(side.kept for side in sides.values()))
    keep = _get_side_to_keep(sides, spec, device)
    in_turn = sides["candidate"].in_turn
    num_models = 1 if in_turn is not None else len({id(side.training) for side in sides.values()})
    num_builds = in_turn.num_builds if in_turn is not None else num_models - kept_used
    pruned = stopped in ("pruned", "slower")
    # A candidate slower than the search's best is never the config whose traces a report or a
    # calibration reads: its profiled window is skipped with ``profile_below``.
    profile = spec["profile"] and _is_below(sides, spec.get("profile_below"))
    candidate = sides["candidate"]
    steps = _get_steps(sides)
    pairs_first = get_pairs_first(sides) if "reference" in sides else "reference"
    profiled, trace = _profile(sides, spec, device, libc, rank) if profile and not pruned else ([], None)
    if keep is not None:
        kept_models.keep(
            kept_models.get_key(spec, device),
            keep.training,
            keep.next_step,
            candidate_peak if keep is candidate else None,
        )
    losses = list(candidate.losses)
    host_path = candidate.host_path_ms
    del sides, candidate, keep
    _release_free_memory()  # the prefaulted heap too
    return {
        "rank": rank,
        **steps,
        "pairs_first": pairs_first,
        "candidate_warmup": warmup,
        "profiled_step_ms": [s.ms for s in profiled],
        "profiled_cpu_ms": [s.cpu_ms for s in profiled],
        "profiled_page_faults": [s.page_faults for s in profiled],
        "losses": losses,
        "pruned": pruned,
        "stopped": stopped,
        "memory": memory,
        "num_models": num_models,
        "num_builds": num_builds,
        "host_path_ms": host_path,
        "trace": trace,
        "link_emulation": emulators[0].summary() if emulators[0] is not None else None,
        "env": _get_rank_env(device),
    }


def _profile(
    sides: dict[str, Side], spec: dict[str, Any], device: torch.device, libc: Any, rank: int
) -> tuple[list[StepTiming], str]:
    """The candidate's profiled window: its traced steps (the schedule's warm-up step not among
    them; every step's loss joins the candidate's) and the trace's file name."""
    candidate = sides["candidate"]
    sides.pop("reference", None)  # its own model, unless kept, is freed before the window
    trace_path = Path(spec["out_dir"]) / f"trace_rank{rank}.json.gz"
    if libc is not None:
        prefault_heap(libc, world_size=spec["world_size"])
    activate(candidate)  # one model: the reference's knobs, or the reference's build, may be what the ranks hold
    window = _profiled_window(
        candidate.training, candidate.next_step, spec["num_profiled"], device, candidate.emulator, trace_path
    )
    candidate.next_step += len(window)
    candidate.losses += [s.loss for s in window]
    return window[1:], trace_path.name


def _get_steps(sides: dict[str, Side]) -> dict[str, list[Any]]:
    """The measured steps of this rank's record: the candidate's (time, own time, CPU, faults),
    the reference's and both sides' settle steps; a side paired with itself split by pair order."""
    candidate = sides["candidate"]
    reference = sides.get("reference")
    unprofiled = {
        "step_ms": candidate.step_ms,
        "own_step_ms": candidate.own_ms,
        "step_cpu_ms": candidate.cpu_ms,
        "step_page_faults": candidate.page_faults,
    }
    reference_ms = list(reference.step_ms) if reference is not None else []
    if reference is candidate:  # one model alternating: split its steps by pair order
        reference_ms = split_self_pairs(candidate.step_ms)[1]
        unprofiled = {key: split_self_pairs(steps)[0] for key, steps in unprofiled.items()}
    return {
        **{key: list(steps) for key, steps in unprofiled.items()},
        "reference_step_ms": reference_ms,
        "settle_step_ms": list(candidate.settle_ms),
        "reference_settle_step_ms": list(reference.settle_ms) if reference is not None else [],
    }


def _get_rank_env(device: torch.device) -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "torch_version": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "device": str(device),
        "cuda_device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "overlap_env": get_overlap_env(),  # what the ranks saw (env.json)
    }
