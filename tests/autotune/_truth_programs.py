"""Rank programs whose communication and compute are known by construction, for test_analysis_truth.py.

Each case runs a few ``ProfilerStep#N`` steps on 2 gloo ranks under ``torch.profiler`` (CPU
activity, one chrome trace per rank) and lays out, per step, a collective of known duration
D against compute of known duration C:

- *compute* is one ``truth::compute`` op: a dispatcher op, so a ``cpu_op`` on the training
  thread, which is what [Note: trace metrics] counts as compute, whatever the op does
  inside. It holds the thread for C ms by sleeping (and copies a tensor): like a host
  waiting on an accelerator's kernel, it leaves the cores to the gloo threads and the
  peer, so that every duration stays what it was built to be on a busy 2-core box (see
  test_analysis_truth.py for what a spinning op did there);
- *D* comes from the peer: rank 1 sleeps D ms (no op: neither compute nor communication)
  before it joins a collective that rank 0 issued at once, so rank 0's gloo transfer
  lasts about D; or from link emulation (:class:`~autotune.trials.LinkEmulator` with a
  latency of D ms and no bandwidth term), which holds every collective until D ms after
  its issue, on both ranks.

Every step lines the ranks up with a barrier on a group of its own (``sync``: it does not
queue behind the default group's collectives; barriers are kept out of the communication
figures), at its start, or right before a collective left in flight across the boundary.
Ranks import this module by name (``_truth_programs:run_cases``): pytest puts this folder
on ``sys.path`` and the launcher passes ``sys.path`` on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

NUM_ACTIVE = 7
"""Profiled steps per case (after one untraced warm-up step of the profiler's schedule)."""
D_MS = 40.0
"""Duration of the collective, by construction (peer delay or emulated link latency)."""
C_LONG_MS = 80.0
"""Compute longer than D (hides it); D + 40 ms, beyond any tolerance."""
C_SHORT_MS = 20.0
"""Compute shorter than D (hides half of it)."""
C_STEP_MS = 10.0
"""Compute that fills out a step around the collective (counts as compute, not near the comm)."""

# Labels the emulated crossing case wraps around issue and wait: the hold belongs to the issuer's unit.
ISSUE_LABEL, WAIT_LABEL = "FSDP::pre_forward (layers.0)", "FSDP::pre_forward (layers.1)"


@torch.library.custom_op("truth::compute", mutates_args=())
def _compute_op(x: torch.Tensor, ms: float) -> torch.Tensor:
    time.sleep(ms / 1000.0)
    return x.clone()


def compute(ms: float) -> None:
    """Compute of ``ms`` milliseconds: one ``cpu_op`` (``truth::compute``) on this thread."""
    torch.ops.truth.compute(torch.zeros(1), ms)


def idle(ms: float) -> None:
    """Wait ``ms`` milliseconds without any op: neither compute nor communication in the trace."""
    time.sleep(ms / 1000.0)


class _Case:
    """State carried between the steps of one case (a collective left in flight, the emulator)."""

    def __init__(self, rank: int, world_size: int, sync: Any) -> None:
        self.rank, self.world_size, self.sync = rank, world_size, sync
        self.tensor = torch.ones(1024)
        self.pending: Any = None
        self.step = 0
        self.emulator = _make_emulator()

    def barrier(self) -> None:
        """Line the ranks up (on the ``sync`` group: it does not queue behind collectives in flight)."""
        dist.barrier(group=self.sync)

    def all_reduce(self, *, async_op: bool = False) -> Any:
        return dist.all_reduce(self.tensor, async_op=async_op)


# --- the cases: the body of one step each ----------------------------------------------


def exposed(case: _Case) -> None:
    """A blocking all-reduce of D (rank 1 joins late), then compute: nothing hides the comm."""
    case.barrier()
    if case.rank == 1:
        idle(D_MS)
    case.all_reduce()
    compute(C_SHORT_MS)


def hidden(case: _Case) -> None:
    """An async all-reduce of D issued, compute C > D, then the wait: all of it hidden."""
    case.barrier()
    if case.rank == 1:
        idle(D_MS)
    work = case.all_reduce(async_op=True)
    compute(C_LONG_MS)
    work.wait()


def partial(case: _Case) -> None:
    """An async all-reduce of D issued, compute C < D, then the wait: D - C exposed."""
    case.barrier()
    if case.rank == 1:
        idle(D_MS)
    work = case.all_reduce(async_op=True)
    compute(C_SHORT_MS)
    work.wait()


def crossing(case: _Case) -> None:
    """Rank 0 issues an async all-reduce as the last thing of a step (right after the
    barrier); rank 1 joins D into the next step, whose compute C > D hides it on rank 0."""
    if case.step > 0:  # the previous step's all-reduce is in flight
        if case.rank == 0:
            compute(C_LONG_MS)
            case.pending.wait()
        else:
            idle(D_MS)
            case.all_reduce()
            compute(C_LONG_MS - D_MS)
    compute(C_STEP_MS)
    case.barrier()
    if case.rank == 0:
        case.pending = case.all_reduce(async_op=True)


def emulated(case: _Case) -> None:
    """A blocking reduce-scatter held by the emulated link to D after its issue; rank 1 joins
    D/2 late, so rank 0's real gloo transfer is about half of D and the hold the rest."""
    case.barrier()
    compute(C_STEP_MS)
    if case.rank == 1:
        idle(D_MS / 2)
    out = torch.empty(case.tensor.numel() // case.world_size)
    with case.emulator:
        dist.reduce_scatter_tensor(out, case.tensor)
    compute(C_STEP_MS)


def emulated_partial(case: _Case) -> None:
    """An async all-reduce held to D, compute C < D, then the wait: the hold is D - C."""
    case.barrier()
    with case.emulator:
        work = case.all_reduce(async_op=True)
    compute(C_SHORT_MS)
    work.wait()


def emulated_crossing(case: _Case) -> None:
    """An async all-reduce held to D, issued as the last thing of a step in unit layers.0's
    label, waited first thing in the next step in layers.1's label: the hold is D."""
    if case.pending is not None:
        with torch.profiler.record_function(WAIT_LABEL):
            case.pending.wait()
        case.pending = None
    compute(C_STEP_MS)
    case.barrier()
    with torch.profiler.record_function(ISSUE_LABEL), case.emulator:
        case.pending = case.all_reduce(async_op=True)


CASES: dict[str, Callable[[_Case], None]] = {
    f.__name__: f for f in (exposed, hidden, partial, crossing, emulated, emulated_partial, emulated_crossing)
}


def _make_emulator() -> Any:
    from autotune.trials import LinkEmulator
    from profiles import LinkClass

    return LinkEmulator(links={"intra_node": LinkClass(latency_us=D_MS * 1000.0)}, ranks_per_node=2)


def run_case(rank: int, world_size: int, name: str, out_dir: Path, sync: Any) -> None:
    """One case: a profiler warm-up step and ``NUM_ACTIVE`` traced steps, then drain what is in flight."""
    from torch.profiler import ProfilerActivity, profile, schedule

    case = _Case(rank, world_size, sync)
    trace = out_dir / name / f"trace_rank{rank}.json"
    trace.parent.mkdir(parents=True, exist_ok=True)
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=schedule(wait=0, warmup=1, active=NUM_ACTIVE, repeat=1),
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(trace)),
    ) as prof:
        for _ in range(1 + NUM_ACTIVE):
            CASES[name](case)
            case.step += 1
            if case.step == 1 + NUM_ACTIVE:
                _drain(case, name)
            prof.step()
    case.barrier()


def _drain(case: _Case, name: str) -> None:
    """Finish the collective left in flight, inside the last traced step (which the tests leave out).

    A gloo collective issued under the profiler and still running when the profiler stops
    ends its ``record_function`` on a gloo thread after the profiler's state is gone: torch
    2.13's CPU profiler then corrupted the heap (SIGSEGV, or SIGABRT "corrupted
    double-linked list") in about one launch in six of 20 crossing cases (see test_truth.py).
    """
    if case.pending is not None:
        case.pending.wait()
        case.pending = None
    elif name == "crossing" and case.rank == 1:
        case.all_reduce()  # joins rank 0's last all-reduce


def run_cases(rank: int, world_size: int, *, out_dir: str, cases: list[str]) -> list[str]:
    """Rank program: run each case in turn, writing ``OUT_DIR/<case>/trace_rank<R>.json``."""
    sync = dist.new_group(backend="gloo")
    for _ in range(3):  # connect both groups before anything is traced
        dist.barrier(group=sync)
        dist.all_reduce(torch.ones(1))
    for name in cases:
        run_case(rank, world_size, name, Path(out_dir), sync)
    return cases
