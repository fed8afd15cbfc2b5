"""The program one rank runs in a trial (:func:`run_trial_rank`).

Local trials call it through :func:`autotune.trials.launch.run_ranks` or a
:class:`autotune.trials.pool.RankPool`; several nodes through :mod:`autotune.trials.torchrun`.
It times the steps, measures the pairs and profiles the candidate; the sides it measures are
built by :mod:`autotune.trials.sides`, and its memory is measured (and, on CPU, its heap tuned)
by :mod:`autotune.trials.rank_memory`.

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
- *Peak memory* and *the heap*: [Note: a trial's peak memory] and [Note: the profiler's cost and
  the heap] in :mod:`autotune.trials.rank_memory`.
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

import os
import resource
import socket
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autotune.trials import kept as kept_models
from autotune.trials.gather import get_node_dir, pack_trace
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
from autotune.trials.rank_memory import (
    RssSampler,
    get_memory,
    get_peak_bytes,
    prefault_heap,
    release_free_memory,
    reset_device_memory,
    tune_heap,
)
from autotune.trials.sides import SideBuilder, get_side_to_keep, take_kept
from autotune.trials.training import take_shard_inits
from fsdp_runtime.files import atomic_path
from fsdp_runtime.tuning.sequential import StoppingRule

PRUNE_AFTER = 2
"""Measured steps after which the ranks vote on pruning."""


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
        result = _run_trial_rank(rank, world_size, spec)
    except BaseException:
        kept_models.drop()  # a step may have stopped halfway: never step that model again
        raise
    if result["trace"] is not None and spec.get("send_files"):  # [Note: node-local files]
        result["sent_trace"] = pack_trace(get_node_dir(spec) / result["trace"])
    return result


def _build_and_measure(
    rank: int, world_size: int, spec: dict[str, Any], device: torch.device, emulators: tuple, kept: KeptModel | None
) -> tuple[dict[str, Side], str | None, dict[str, Any], int]:
    """The sides built and measured, with the memory they took: (sides, why the pairs stopped,
    :func:`~autotune.trials.rank_memory.get_memory`'s figures, the candidate's warm-up steps)."""
    offset = kept.live_bytes if kept is not None else 0
    builder = SideBuilder(rank, world_size, spec, device, timed_step)
    with RssSampler() as rss:
        sides, candidate_peak, warmup = builder.build_sides(emulators, rss, kept)
        peak = [candidate_peak]

        def after_leading_step() -> None:  # [Note: the leading step]: the candidate's peak covers it
            peak[0] = max(peak[0], get_peak_bytes(device, rss) - offset)

        leads = warmup < spec["num_warmup"] and not sides["candidate"].kept
        stopped = _measure(sides, spec, device, after_leading_step if leads else None)
    kept_used = any(side.kept for side in sides.values())
    return sides, stopped, get_memory(device, rss, peak[0], 0 if kept_used else offset), warmup


def _run_trial_rank(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    from autotune.trials.linkemu import LinkEmulator, check_emulation_backend
    from profiles import load_cluster_profile

    check_emulation_backend(spec["cluster"], spec["backend"])
    take_shard_inits()  # what builds of earlier jobs in this process left: this trial's builds only
    device = _get_device(spec["backend"], rank)
    cluster = load_cluster_profile(spec["cluster"]) if spec["cluster"] else None
    # One emulator per side: the candidate's link statistics are its own.
    emulators = (LinkEmulator.from_cluster(cluster), LinkEmulator.from_cluster(cluster)) if cluster else (None, None)
    reset_device_memory(device)
    libc = tune_heap(device)
    kept = take_kept(spec, device)
    sides, stopped, memory, warmup = _build_and_measure(rank, world_size, spec, device, emulators, kept)
    candidate_peak = memory["peak_bytes"]
    kept_used = int(any(side.kept for side in sides.values()))
    keep = get_side_to_keep(sides, spec, device)
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
    release_free_memory()  # the prefaulted heap too
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
        "shard_inits": take_shard_inits(),
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
    directory = get_node_dir(spec) if spec.get("send_files") else Path(spec["out_dir"])  # [Note: node-local files]
    trace_path = directory / f"trace_rank{rank}.json.gz"
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
        "node": int(os.environ.get("GROUP_RANK", "0")),  # torchrun's node rank ([Note: node pool]); 0 locally
    }
