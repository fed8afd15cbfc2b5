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
numbers gives every rank the slowest rank's step time, whether any rank's step failed, and the
step and candidate each rank planned. Every rank then feeds the same figures to the same walk, so
every rank makes the same decision without a broadcast of configs; the planned step and candidate
in the all-reduce are the check: where they differ between ranks the tuner raises
:class:`TunerError` on every rank (the ranks have stopped agreeing on the config they run).

A candidate whose switch raises is dropped before the step and the step runs on the best config.
A candidate whose step raises on every rank is dropped after it: FSDP2's iteration state is reset
(``FSDPModule.reset_iter_state`` on the root, torch 2.13 on: every unit resharded, in-flight
reductions dropped) and the step's gradients cleared; nothing of the parameters or the optimizer
state is touched where it raised before the optimizer step, the step's batch is lost, and the job
goes on under the best config. A torch without that reset recovers a step that failed before its
forward, not one caught mid-flight (:class:`TunerError`). A step that raises on some
ranks only cannot be told apart from ranks that have diverged: :class:`TunerError` on every rank
(a rank that fails inside a collective leaves the others waiting in it, as without the tuner).
An exception under the best config is the job's own and is raised as it is.

Once the walk is done (no move left, or ``max_steps`` spent), the model runs the best config for
good, one line says what it is and its speedup over the seed, and rank 0 writes it to ``out``
(a runtime config, provenance ``in-job tuner``) so that the next run starts from it.
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
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_runtime._torch_compat import RESET_ITER_STATE_SINCE, can_reset_iter_state
from fsdp_runtime.apply import AppliedFsdp
from fsdp_runtime.config import ROOT_UNIT, Provenance, RuntimeConfig
from fsdp_runtime.errors import AutotuneError
from fsdp_runtime.serialize import save_config
from fsdp_runtime.switch import switch_config
from fsdp_runtime.tuning.moves import Move, get_moves
from fsdp_runtime.tuning.walk import Decision, TuningWalk

TUNER_ENV = "FSDP_RUNTIME_TUNER"
"""``off`` (or ``0``, ``false``, ``no``) turns the tuner off: ``step()`` then does nothing."""
log = logging.getLogger("fsdp_runtime.tuner")


class TunerError(AutotuneError):
    """The ranks no longer agree on the config they run, or a step failed on some ranks only."""


def is_tuner_enabled() -> bool:
    return os.environ.get(TUNER_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


class InJobTuner:
    """The in-job tuner ([Note: in-job tuner]): ``with tuner.step(): ...`` around each optimizer step."""

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
    ) -> None:
        self.applied, self.device_type, self.group = applied, device_type, group
        self.out = Path(out) if out is not None else None
        self.enabled = is_tuner_enabled()
        self.seed = applied.config
        self.walk = TuningWalk(
            applied.config,
            moves if moves is not None else get_moves(applied.config, device_type=device_type),
            max_steps=max_steps,
            num_pairs=num_pairs,
            precision=precision,
            slow_bound=slow_bound,
            warmup_steps=warmup_steps,
        )
        self.finished = False
        self.running: str | None = None
        """The candidate the step in progress runs (None: the best config, or no step in progress)."""

    @property
    def best(self) -> RuntimeConfig:
        return self.walk.best

    @property
    def decisions(self) -> list[Decision]:
        return self.walk.decisions

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One optimizer step of the job, run on the config the tuner plans and timed."""
        if not self.enabled or self.finished:
            yield
            return
        name = self.running = self._switch_to_plan()
        start = self._now()
        failed = False
        try:
            yield
        except Exception as e:
            if name is None:
                raise  # the best config's step: the job's own error
            log.warning("tuner: the step under candidate %s raised %s: %s", name, type(e).__name__, e)
            failed = True
        finally:
            self.running = None
        step_ms, any_failed = self._exchange((self._now() - start) * 1e3, failed, name)
        if any_failed:
            self._recover()
        self._say(self.walk.record(step_ms, failed=any_failed))
        if self.walk.done:
            self._finish()

    def _switch_to_plan(self) -> str | None:
        """Switch the model to the planned config; a candidate whose switch raises is dropped (the best runs)."""
        config, name = self.walk.plan()
        try:
            self._switch(config)
        except Exception as e:  # a knob this torch or model refuses: not a config to run
            if name is None:
                raise
            log.debug("switch to %s failed: %s", name, e)
            self._say(self.walk.fail_switch())
            self._switch(self.walk.best)
            return None
        return name

    def _switch(self, config: RuntimeConfig) -> None:
        if config is not self.applied.config and config != self.applied.config:
            switch_config(self.applied, config, device_type=self.device_type)

    def _now(self) -> float:
        if self.device_type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def _exchange(self, step_ms: float, failed: bool, name: str | None) -> tuple[float, bool]:
        """The slowest rank's step and whether any rank failed; :class:`TunerError` where ranks disagree."""
        key = float(zlib.crc32(f"{self.walk.step}:{name}".encode()))  # the same on every rank that plans alike
        device = torch.device("cuda", torch.cuda.current_device()) if self.device_type == "cuda" else None
        figures = torch.tensor([step_ms, float(failed), -float(failed), key, -key], dtype=torch.float64, device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=self.group)
        slowest, any_failed, minus_min_failed, high, low = figures.tolist()
        if high != -low:
            raise TunerError(
                f"the ranks planned different steps at step {self.walk.step} (this rank: {name or 'the best config'}): "
                "their tuners disagree, so the config each rank runs may differ; stopping"
            )
        if any_failed and minus_min_failed == 0:  # some rank failed, some did not
            raise TunerError(
                f"the step under candidate {name} failed on some ranks only: the ranks may have diverged; stopping"
            )
        return slowest, bool(any_failed)

    def _recover(self) -> None:
        """After a candidate's failed step: FSDP2's iteration state reset (every unit resharded,
        in-flight reductions dropped), no gradient of the step kept. A torch without
        ``reset_iter_state`` (before 2.13) reshards each unit, which leaves a unit caught mid-forward
        unsharded: then :class:`TunerError`, as the job cannot go on safely."""
        root = self.applied.units[ROOT_UNIT]
        if can_reset_iter_state(root):
            root.reset_iter_state()
        else:
            for module in self.applied.units.values():
                module.reshard()
        self.applied.model.zero_grad(set_to_none=True)
        unsharded = [n for n, p in self.applied.model.named_parameters() if not isinstance(p, DTensor)]
        if unsharded:
            raise TunerError(
                f"a candidate's step failed mid-flight and torch {torch.__version__} cannot reset FSDP2's "
                f"iteration state (reset_iter_state, {RESET_ITER_STATE_SINCE} on): {unsharded[0]} is left unsharded; stopping"
            )

    def _say(self, decision: Decision | None) -> None:
        if decision is not None and self._is_rank0():
            log.info("tuner: %s", decision.describe())

    def _finish(self) -> None:
        """The best config for good, said in one line and written where asked (rank 0)."""
        self.finished = True
        self._switch(self.walk.best)
        if not self._is_rank0():
            return
        adopted = [d.name for d in self.walk.decisions if d.outcome == "adopted"]
        log.info(
            "tuner: settled after %d steps on %s, %.3fx the seed's speed",
            self.walk.step,
            " + ".join(adopted) or "the seed config",
            self.walk.speedup,
        )
        if self.out is not None:
            save_config(self._with_provenance(adopted), self.out)

    def _with_provenance(self, adopted: list[str]) -> RuntimeConfig:
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

    def _is_rank0(self) -> bool:
        return not dist.is_initialized() or dist.get_rank(self.group) == 0
