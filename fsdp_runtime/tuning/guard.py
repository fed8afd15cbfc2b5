"""The guards around a tuned step: every rank agrees before it, a failure before its first
collective is shared, and one after it ends the ranks it strands, in one line, instead of a hang.

[Note: in-job guards]
A step is a chain of collectives every rank must join in the same order. A rank that raises
inside it stops joining, and the others wait in the next collective until the process group's
timeout (gloo cannot abort one). So the tuner splits each step it runs during the walk at its
first collective, the root's first forward (a forward pre-hook that runs before FSDP2's own):

- *Before the step* (candidate steps: :meth:`~fsdp_runtime.tuning.InJobTuner.step`), one
  all-reduce gives every rank the plan every rank made, whether every rank's switch succeeded and
  whether every rank has the headroom for the move ([Note: in-job memory]). A switch that failed
  or a lack of headroom anywhere: every rank runs the best config; ranks that planned different
  candidates: :class:`TunerError` on every rank.
- *At the gate* (:class:`StepGate`), before the step's first collective, one all-reduce of each
  rank's state: fine, out of memory, or another exception. A rank that raised before the gate
  joins it from its exception handler, so every rank learns of it there, not in a collective the
  raising rank never issues. An out-of-memory error under a candidate drops the candidate on every
  rank (:class:`StepDropped` ends the others' steps; their batches are not trained, nothing of the
  model was touched); any other exception is the job's own: the raising rank raises it, every
  other rank :class:`PeerStepError`, the model back on the best config.
- *After the gate* a rank that fails cannot meet the others in a collective any more. It
  publishes one line through the process group's store (:class:`FailureChannel`) and raises:
  :class:`TunerError` for an out-of-memory or a collective error under a candidate, the job's own
  exception otherwise. Every rank's watcher thread reads the store; a rank still inside that step
  :data:`GRACE_S` later is waiting on the failed one and never gets out: it prints the line,
  aborts NCCL's communicators where torch allows, and exits with :data:`ABORT_EXIT_CODE`. A rank
  that fails alike within the grace (the same error on every rank) is left to raise its own.

Costs: two small all-reduces per candidate step and one per best step of the walk (the gate runs
on both sides of a pair, so their times stay comparable), and one store read per rank every
:data:`POLL_S` while the walk runs; nothing once the tuner has settled.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_runtime._torch_compat import abort_process_group
from fsdp_runtime.errors import AutotuneError

GATE_OK, GATE_OOM, GATE_ERROR = 0, 1, 2
"""Each rank's state at the gate; the all-reduce (MAX) gives the worst."""
_RANKS = 1 << 20
"""A gate code is ``state * _RANKS + rank``: the MAX names the worst state and a rank in it."""
GRACE_S = 3.0
"""How long a rank may take to fail alike before a published failure ends it."""
POLL_S = 0.5
"""How often each rank's watcher reads the store while the walk runs."""
ABORT_EXIT_CODE = 75
"""The exit code of a rank ended because another rank failed mid-step."""

_instances = 0


class TunerError(AutotuneError):
    """The ranks no longer agree on the config they run, or a candidate failed where it cannot be recovered."""


class PeerStepError(TunerError):
    """Another rank's step raised before the step's first collective: this rank stops with it."""


class StepDropped(BaseException):  # noqa: N818 - an outcome, like StopIteration: not an error of the job
    """Ends a step on a rank whose peer ran out of memory before the first collective: the
    candidate is dropped. A ``BaseException`` so that a user's ``except Exception`` in the step
    lets it through to the tuner."""


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError)


def is_collective_error(error: BaseException) -> bool:
    """A collective's own failure (a peer gone, a timeout): its communicator is unusable."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(word in str(error) for word in ("gloo", "NCCL", "ProcessGroup"))


def all_reduce_max(values: list[float], *, device_type: str, group: Any = None) -> list[float]:
    """``values`` MAX-reduced over the ranks (as they are without a process group)."""
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else None
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


class StepGate:
    """The step's first collective, held back for one all-reduce of each rank's state ([Note: in-job guards])."""

    def __init__(self, root: nn.Module, exchange: Callable[[list[float]], list[float]], rank: int) -> None:
        self.exchange, self.rank = exchange, rank
        self.armed = self.passed = False
        self.name: str | None = None
        """The candidate the armed step runs (None: the best config)."""
        self._handle = root.register_forward_pre_hook(self._hook, prepend=True)

    def arm(self, name: str | None) -> None:
        """The next step, under candidate ``name``, passes the gate (once, at the root's first forward)."""
        self.armed, self.passed, self.name = True, False, name

    def disarm(self) -> None:
        self.armed = False

    def remove(self) -> None:
        self._handle.remove()

    def cross(self, state: int) -> tuple[int, int]:
        """Join the gate with this rank's ``state``: the worst state of any rank, and a rank in it."""
        self.passed = True
        worst = int(self.exchange([float(state * _RANKS + self.rank)])[0])
        return divmod(worst, _RANKS)

    def cross_ok(self) -> None:
        """Cross as a rank that is fine; a peer's failure before the gate raises here."""
        state, rank = self.cross(GATE_OK)
        if state == GATE_OOM and self.name is not None:
            raise StepDropped(f"rank {rank} ran out of memory before the step's first collective under {self.name}")
        if state != GATE_OK:
            what = "ran out of memory" if state == GATE_OOM else "raised"
            raise PeerStepError(f"rank {rank} {what} before the step's first collective; stopping with it")

    def _hook(self, module: nn.Module, args: Any) -> None:
        if self.armed and not self.passed:
            self.cross_ok()


class FailureChannel:
    """A failure after the gate, published through the store; a watcher thread that ends this rank
    when a peer's failure strands it ([Note: in-job guards])."""

    def __init__(self, store: Any, *, rank: int, on_stranded: Callable[[str], None]) -> None:
        global _instances
        _instances += 1  # the same count on every rank that builds its tuners alike
        self.store, self.rank, self.on_stranded = store, rank, on_stranded
        self.prefix = f"fsdp_runtime/tuner/{_instances}"
        self.in_step: int | None = None
        """The step this rank's training thread is inside (None: between steps, or handling a failure)."""
        self._seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="fsdp_runtime tuner watcher", daemon=True)
        self._thread.start()

    def publish(self, step: int, line: str) -> None:
        """Tell every rank that this one failed inside ``step``, in ``line``."""
        n = self.store.add(f"{self.prefix}/failures", 1)
        self.store.set(f"{self.prefix}/failure/{n}", json.dumps({"rank": self.rank, "step": step, "line": line}))

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                count = self.store.add(f"{self.prefix}/failures", 0)
                while self._seen < count:
                    self._seen += 1
                    failure = json.loads(self.store.get(f"{self.prefix}/failure/{self._seen}"))
                    if failure["rank"] != self.rank:
                        self._wait_out(failure)
            except (RuntimeError, ValueError):  # the store went away: the job is ending
                return

    def _wait_out(self, failure: dict[str, Any]) -> None:
        """End this rank if it is still inside the failed step after the grace: it waits on the peer."""
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            if self.in_step != failure["step"]:
                return
            time.sleep(0.05)
        if self.in_step == failure["step"] and not self._stop.is_set():
            self.on_stranded(failure["line"])


def end_stranded_rank(line: str, *, rank: int, save: Callable[[], None]) -> None:
    """What a stranded rank does: say why, save what it can, abort NCCL where torch allows, exit."""
    print(f"fsdp_runtime tuner, rank {rank}: stopping: {line}", file=sys.stderr, flush=True)
    try:
        save()
    finally:
        if abort_process_group():
            time.sleep(1.0)  # the training thread's collective returns with an error; it may raise first
        os._exit(ABORT_EXIT_CODE)
