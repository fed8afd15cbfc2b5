"""Tune inside the training job: its first steps try the knobs a sharded model switches in place and keep the fastest.

    from fsdp_runtime import apply_fsdp
    from fsdp_runtime.tuning import InJobTuner

    applied = apply_fsdp(model, config, device_type="cuda")
    tuner = InJobTuner(applied, device_type="cuda", out="tuned.toml")
    for batch in loader:
        with tuner.step():                  # around the whole optimizer step
            loss = train_step(model, batch)
            optimizer.step()
            optimizer.zero_grad()

[Note: in-job tuner]
Before each step the tuner switches the model to the config its walk plans
(:class:`~fsdp_runtime.tuning.walk.TuningWalk`; [Note: in-job measurement]), between optimizer
steps only, with :func:`fsdp_runtime.switch_config`; after it, one all-reduce (MAX) of a few
numbers gives every rank the slowest rank's step time and the step and candidate each rank
planned. Every rank then feeds the same figures to the same walk, so every rank makes the same
decision without a broadcast of configs; where the planned steps differ between ranks the tuner
raises :class:`TunerError` on every rank (the ranks have stopped agreeing on the config they run).

What the walk may try is what this job can switch and recover ([Note: in-job memory] in
:mod:`~fsdp_runtime.tuning.safety`): a move asking for a knob the installed torch cannot set, or a
field this torch cannot switch in place on the model, is never offered: ``refused`` says which
and why, and so does one line of the log. No move is refused for want of
``FSDPModule.reset_iter_state`` (torch 2.13 on): no failure mid-step is recovered on any torch (it
ends the job, below), and one before the step's first collective has touched no FSDP2 state, so
it needs no reset. Where the job's own error comes mid-step, torch 2.11 cannot reset FSDP2's state
either: the tuner puts the model back on the best config's knobs, and a unit the error caught
unsharded stays so (as it would without the tuner).

A candidate's step is guarded ([Note: in-job guards] in :mod:`~fsdp_runtime.tuning.guard`): every
rank agrees on it, its switch and its headroom before it runs; an out-of-memory error before its
first collective drops it on every rank (that step's batch is not trained: it is dropped, and one
line says so; nothing of the parameters or the optimizer state is touched) and the job goes on
under the best config; a switch that fails is rolled back and the candidate dropped. Any other
exception in a step is the job's own: it propagates on every rank (the others raise
:class:`PeerStepError` where it came before the first collective), the model back on the best
config. An out-of-memory or a collective error mid-step under a candidate cannot be recovered
collectively: :class:`TunerError` names the candidate and the best config (rank 0 writes it to
``out``, to resume from), and every rank it stranded ends within seconds with that line.

Once the walk is done (no move left, or ``max_steps`` spent, then its final window: [Note: final
window] in :mod:`~fsdp_runtime.tuning.walk`), the model runs the best config for good, one line
says what it is and its speedup over the seed as the final window measured it, and rank 0 writes
it to ``out`` (a runtime config, provenance ``in-job tuner``) so that the next run starts from it.
``FSDP_RUNTIME_TUNER=off`` turns the tuner into a no-op without a change to the code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_runtime._torch_compat import can_reset_iter_state, get_default_store
from fsdp_runtime.apply import AppliedFsdp
from fsdp_runtime.config import ROOT_UNIT, Provenance, RuntimeConfig
from fsdp_runtime.serialize import save_config
from fsdp_runtime.switch import switch_config
from fsdp_runtime.tuning.guard import (
    GATE_ERROR,
    GATE_OOM,
    FailureChannel,
    PeerStepError,
    StepDropped,
    StepGate,
    TunerError,
    all_reduce_max,
    end_stranded_rank,
    is_collective_error,
    is_oom,
)
from fsdp_runtime.tuning.moves import Move, get_moves
from fsdp_runtime.tuning.safety import (
    HEADROOM_MARGIN,
    get_default_headroom,
    get_extra_bytes,
    get_refusals,
    get_unit_bytes,
)
from fsdp_runtime.tuning.walk import Decision, TuningWalk

__all__ = ["TUNER_ENV", "InJobTuner", "PeerStepError", "TunerError", "is_tuner_enabled"]

TUNER_ENV = "FSDP_RUNTIME_TUNER"
"""``off`` (or ``0``, ``false``, ``no``) turns the tuner off: ``step()`` then does nothing."""
log = logging.getLogger("fsdp_runtime.tuner")


def is_tuner_enabled() -> bool:
    return os.environ.get(TUNER_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


class InJobTuner:
    """The in-job tuner ([Note: in-job tuner]): ``with tuner.step(): ...`` around each optimizer step.

    ``get_headroom``: the bytes this rank can still allocate beyond its peak, or None for no
    check ([Note: in-job memory]); CUDA's by default, none on CPU."""

    def __init__(
        self,
        applied: AppliedFsdp,
        *,
        device_type: str,
        out: str | Path | None = None,
        moves: list[Move] | None = None,
        max_steps: int = 200,
        num_pairs: int = 6,
        precision: float = 0.05,
        slow_bound: float = 1.5,
        warmup_steps: int = 2,
        group: dist.ProcessGroup | None = None,
        get_headroom: Callable[[], int | None] | None = None,
    ) -> None:
        self.applied, self.device_type, self.group = applied, device_type, group
        self.out = Path(out) if out is not None else None
        self.enabled = is_tuner_enabled()
        self.seed = applied.config
        asked = moves if moves is not None else get_moves(applied.config, device_type=device_type)
        self.refused = get_refusals(applied, asked)
        """The moves not offered on this job, each with why ([Note: in-job tuner])."""
        self.walk = TuningWalk(
            applied.config,
            [m for m in asked if m.name not in self.refused],
            max_steps=max_steps,
            num_pairs=num_pairs,
            precision=precision,
            slow_bound=slow_bound,
            warmup_steps=warmup_steps,
        )
        self._sizes = get_unit_bytes(applied)
        self._get_headroom = get_headroom or get_default_headroom(device_type)
        self.finished = not self.enabled
        self.running: str | None = None
        """The candidate the step in progress runs (None: the best config, or no step in progress)."""
        self.gate: StepGate | None = None
        self.channel: FailureChannel | None = None
        if self.enabled:
            self._start_guards()

    @property
    def best(self) -> RuntimeConfig:
        """The fastest config found so far (the seed until a move is adopted)."""
        return self.walk.best

    @property
    def decisions(self) -> list[Decision]:
        """What was decided of each candidate so far, in order (each one line of the log)."""
        return self.walk.decisions

    def _start_guards(self) -> None:
        self.gate = StepGate(self.applied.model, self._all_reduce, self._rank())
        store = get_default_store() if dist.is_initialized() and dist.get_world_size(self.group) > 1 else None
        if store is not None:
            self.channel = FailureChannel(store, rank=self._rank(), on_stranded=self._end_stranded)
        if self.refused and self._is_rank0():
            log.info("tuner: not trying %s", "; ".join(f"{name} ({why})" for name, why in self.refused.items()))

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One optimizer step of the job, run on the config the tuner plans, guarded and timed."""
        if self.finished:
            yield
            return
        name = self.running = self._begin()
        self.gate.arm(name)
        self._set_in_step(self.walk.step)
        start, dropped = self._now(), False
        try:
            yield
            if not self.gate.passed:
                self.gate.cross_ok()  # a step that never ran the root's forward still meets the others
        except StepDropped as e:
            dropped = self._drop(name, str(e))
        except BaseException as e:
            dropped = self._on_error(name, e)
        finally:
            self.running = None
            self.gate.disarm()
            self._set_in_step(None)
        step_ms = self._exchange((self._now() - start) * 1e3, name)
        self._say(self.walk.record(step_ms, failed=dropped))
        if self.walk.done:
            self._finish()

    def _begin(self) -> str | None:
        """Switch to the planned config; before a candidate's step every rank agrees on it, on its
        switch and on its headroom, else the best runs ([Note: in-job guards])."""
        config, name = self.walk.plan()
        if name is None:
            self._switch(config)
            return None
        fits = self._has_headroom(config)
        switched = fits and self._try_switch(config)
        key = float(zlib.crc32(f"{self.walk.step}:{name}".encode()))
        high, low, failed, short = self._all_reduce([key, -key, float(fits and not switched), float(not fits)])
        if high != -low:
            raise self._disagreement(name)
        if failed or short:
            self._switch(self.walk.best)
            self._say(self.walk.fail_switch("no headroom" if short else "failed"))
            return None
        return name

    def _has_headroom(self, config: RuntimeConfig) -> bool:
        extra = get_extra_bytes(self._sizes, self.applied.config, config)
        headroom = self._get_headroom() if extra > 0 else None
        if headroom is not None and headroom < extra * HEADROOM_MARGIN:
            log.info("tuner: rank %d has %d bytes of headroom, the move needs ~%d", self._rank(), headroom, extra)
            return False
        return True

    def _try_switch(self, config: RuntimeConfig) -> bool:
        """Switch to a candidate; False where it raised (rolled back: the model is on the config before it)."""
        try:
            self._switch(config)
        except (ValueError, RuntimeError, TypeError) as e:  # a knob this torch or model refuses
            log.info("tuner: switching to a candidate failed and was rolled back: %s", e)
            return False
        return True

    def _switch(self, config: RuntimeConfig) -> None:
        if config is not self.applied.config and config != self.applied.config:
            switch_config(self.applied, config, device_type=self.device_type)

    def _drop(self, name: str | None, why: str) -> bool:
        """A candidate dropped on every rank before its step's first collective: its batch is not trained."""
        if self._is_rank0():
            log.warning("tuner: %s; candidate %s dropped, step %d's batch not trained", why, name, self.walk.step)
        self._switch(self.walk.best)
        return True

    def _on_error(self, name: str | None, error: BaseException) -> bool:
        """A step that raised on this rank ([Note: in-job guards]): True where the candidate is dropped
        on every rank (the step then ends quietly), else the error is raised on."""
        if isinstance(error, PeerStepError):
            self._back_to_best()
            raise error
        if not self.gate.passed:  # before the first collective: every rank learns of it at the gate
            mine = GATE_OOM if is_oom(error) and name is not None else GATE_ERROR
            worst, rank = self.gate.cross(mine)
            if worst == GATE_OOM:
                return self._drop(name, f"rank {rank} ran out of memory before the step's first collective")
            self._back_to_best()
            raise error
        if name is None:
            raise error  # the best config's step, mid-flight: the job's own error, as without the tuner
        line = self._describe_failure(name, error)
        if self.channel is not None:
            self.channel.publish(self.walk.step, line)
        self._back_to_best()
        if is_oom(error) or is_collective_error(error):
            self._save_best(line)
            raise TunerError(line) from error
        raise error

    def _describe_failure(self, name: str, error: BaseException) -> str:
        what = (
            "ran out of memory"
            if is_oom(error)
            else ("failed in a collective" if is_collective_error(error) else f"raised {type(error).__name__}")
        )
        resume = f"; rank 0 writes the best config so far to {self.out}" if self.out is not None else ""
        return (
            f"rank {self._rank()} {what} mid-step under candidate {name} (step {self.walk.step}), which cannot be "
            f"recovered on every rank; the best config so far: {self._describe_best()}{resume}"
        )

    def _back_to_best(self) -> None:
        """After a failed step: FSDP2's iteration state reset where torch can, the model on the best config."""
        root = self.applied.units[ROOT_UNIT]
        if can_reset_iter_state(root):
            root.reset_iter_state()
        try:
            self._switch(self.walk.best)
        except (ValueError, RuntimeError) as e:
            log.error("tuner: switching back to the best config failed: %s", e)

    def _end_stranded(self, line: str) -> None:
        end_stranded_rank(line, rank=self._rank(), save=lambda: self._save_best(line))

    def _set_in_step(self, step: int | None) -> None:
        if self.channel is not None:
            self.channel.in_step = step

    def _now(self) -> float:
        if self.device_type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def _all_reduce(self, values: list[float]) -> list[float]:
        return all_reduce_max(values, device_type=self.device_type, group=self.group)

    def _exchange(self, step_ms: float, name: str | None) -> float:
        """The slowest rank's step; :class:`TunerError` where ranks planned different steps."""
        key = float(zlib.crc32(f"{self.walk.step}:{name}".encode()))  # the same on every rank that plans alike
        slowest, high, low = self._all_reduce([step_ms, key, -key])
        if high != -low:
            raise self._disagreement(name)
        return slowest

    def _disagreement(self, name: str | None) -> TunerError:
        return TunerError(
            f"the ranks planned different steps at step {self.walk.step} (this rank: {name or 'the best config'}): "
            "their tuners disagree, so the config each rank runs may differ; stopping"
        )

    def _say(self, decision: Decision | None) -> None:
        if decision is not None and self._is_rank0():
            log.info("tuner: %s", decision.describe())

    def _describe_best(self) -> str:
        adopted = [d.name for d in self.walk.decisions if d.outcome == "adopted"]
        if not adopted or self.walk.best == self.seed:  # none adopted, or reverted by the final window
            return "the seed config"
        return " + ".join(adopted)

    def _finish(self) -> None:
        """The best config for good, said in one line and written where asked (rank 0)."""
        self.finished = True
        self._switch(self.walk.best)
        self.gate.remove()
        if self.channel is not None:
            self.channel.close()
        if self._is_rank0():
            log.info("tuner: settled after %d steps on %s, %s", self.walk.step, self._describe_best(), self._figure())
            self._save_best(None)

    def _figure(self) -> str:
        """The speedup over the seed as the final window measured it ([Note: final window])."""
        interval = self.walk.speedup_interval
        if not self.walk.speedup_measured:
            return f"{self.walk.speedup:.3f}x the seed's speed (not measured in a final window)"
        spread = f"90% {interval[0]:.3f}-{interval[1]:.3f}" if interval is not None else "no interval"
        return f"{self.walk.speedup:.3f}x the seed's speed ({spread}, measured in a final window)"

    def _save_best(self, stopped: str | None) -> None:
        """The best config so far to ``out`` (rank 0); ``stopped``: why the tuner stopped the job."""
        if self.out is None or not self._is_rank0():
            return
        config = self._with_provenance()
        if stopped is not None:
            notes = [*config.provenance.notes, f"the tuner stopped the job: {stopped}"]
            config = dataclasses.replace(config, provenance=dataclasses.replace(config.provenance, notes=notes))
        save_config(config, self.out)

    def _with_provenance(self) -> RuntimeConfig:
        provenance = Provenance(
            produced_by="in-job tuner",
            model=self.seed.provenance.model,
            world_size=dist.get_world_size(self.group) if dist.is_initialized() else 1,
            backend=dist.get_backend(self.group) if dist.is_initialized() else None,
            torch_version=torch.__version__,
            measured=True,
            created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            notes=[f"tuned in the job: {d.describe()}" for d in self.decisions]
            or ["tuned in the job: no move was tried"],
            metrics={"speedup_over_seed": self.walk.speedup, "steps": float(self.walk.step)},
        )
        return dataclasses.replace(self.walk.best, provenance=provenance)

    def _rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    def _is_rank0(self) -> bool:
        return self._rank() == 0
