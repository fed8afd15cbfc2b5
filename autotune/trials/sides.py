"""The two sides of a trial on one rank, built and warmed up: the candidate, and the reference
it is paired with ([Note: paired measurement] in :mod:`autotune.trials.paired`).

The reference is held one of five ways (:meth:`SideBuilder.get_reference_kind`): the candidate
paired with itself, the candidate's own model switched in place ([Note: one model for both sides]
in :mod:`autotune.trials.paired`), models built in turn on CUDA ([Note: models built in turn] in
:mod:`autotune.trials.in_turn`), the model kept warm from the pool's previous trial ([Note: a warm
reference] in :mod:`autotune.trials.kept`), or a model of its own. The rank program
(:mod:`autotune.trials.program`) measures the sides; it hands its step timer to
:class:`SideBuilder`, so that warm-up steps are timed as measured ones are.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from autotune.trials import kept as kept_models
from autotune.trials.host_probe import probe_host_path
from autotune.trials.in_turn import ModelsInTurn
from autotune.trials.kept import KeptModel
from autotune.trials.paired import Side, StepTiming
from autotune.trials.rank_memory import RssSampler, get_peak_bytes, release_free_memory

PAIRED_MODELS_ENV = "AUTOTUNE_PAIRED_MODELS"
"""Unset: one model where the knobs switch in place ([Note: one model for both sides]), else a
second model on CPU and models built in turn on CUDA ([Note: models built in turn]). ``two``:
always a second model; ``turn``: in turn wherever the knobs do not switch in place (benchmarks and
tests compare them)."""
HOST_PROBE_ENV = "AUTOTUNE_HOST_PROBE"
"""``1``: time the host's path per block on CPU too (tests; [Note: host path probe])."""


@dataclass(frozen=True)
class SideBuilder:
    """Builds and warms up the sides of one trial (``spec`` is
    :meth:`autotune.trials.spec.TrialSpec.to_dict`) on this rank; ``timed_step`` is the rank
    program's step timer (:func:`autotune.trials.program.timed_step`)."""

    rank: int
    world_size: int
    spec: dict[str, Any]
    device: torch.device
    timed_step: Callable[..., StepTiming]

    def build_sides(
        self, emulators: tuple[Any, Any], rss: RssSampler, kept: KeptModel | None
    ) -> tuple[dict[str, Side], int, int]:
        """The candidate, warmed up, and with ``spec["reference"]`` the reference: on the candidate's
        own model where the two differ only in knobs switched in place, else the kept warm model
        ([Note: a warm reference] in :mod:`autotune.trials.kept`) or a model of its own, or on CUDA
        models built in turn ([Note: one model for both sides] in :mod:`autotune.trials.paired`).
        Returns the sides, the candidate's peak memory (its build and warm-up: no reference exists
        yet, the kept model's live bytes taken off) and its warm-up steps ([Note: the leading step]
        in :mod:`autotune.trials.program`)."""
        spec = self.spec
        if kept is not None and is_reference_config(spec):
            candidate = Side(training=kept.training, emulator=emulators[0], next_step=kept.next_step, kept=True)
            warmup = min(1, spec["num_warmup"])  # the trial's start returned its freed heap: one step re-faults it
            self.warm_up(candidate, warmup)
            return _with_reference(spec, {"candidate": candidate}), kept.peak_bytes, warmup
        candidate = Side(training=self.build(spec["config"]), emulator=emulators[0])
        kind = self.get_reference_kind(candidate, kept)
        warmup = spec["num_warmup"]
        if kind in ("in_place", "kept") and self.device.type == "cpu" and warmup >= 2:
            warmup -= 1  # its first measured step leads the pairs: [Note: the leading step]
        self.warm_up(candidate, warmup)
        candidate_peak = get_peak_bytes(self.device, rss) - (kept.live_bytes if kept is not None else 0)
        sides = {"candidate": candidate}
        if kind is not None:
            sides["reference"] = self.get_reference(candidate, emulators[1], kept, kind)
        return _with_reference(spec, sides), candidate_peak, warmup

    def get_reference_kind(self, candidate: Side, kept: KeptModel | None) -> str | None:
        """How the reference side is held: ``self`` (the candidate paired with itself, the defaults
        trial: alternate steps measure the noise), ``in_place`` (the candidate's model switched in
        place), ``in_turn`` (built in turn with the candidate's: on CUDA), ``kept`` (the kept warm
        model), ``own`` (a model of its own); None: no reference."""
        reference = self.spec.get("reference")
        if reference is None:
            return None
        if reference == self.spec["config"]:
            return "self"
        asked = os.environ.get(PAIRED_MODELS_ENV)
        if asked != "two" and not candidate.training.get_structural_differences(reference):
            return "in_place"
        if asked == "turn" or (asked is None and self.device.type == "cuda"):
            return "in_turn"
        return "kept" if kept is not None else "own"

    def get_reference(self, candidate: Side, emulator: Any, kept: KeptModel | None, kind: str) -> Side:
        """The reference side of ``kind`` (:meth:`get_reference_kind`), warmed up: switched in place
        and kept ones take no step of their own (the pairs start with the candidate, and the
        reference's first step is a settle step; [Note: a warm reference] in
        :mod:`autotune.trials.kept`), one built in turn is built when it first steps ([Note: models
        built in turn] in :mod:`autotune.trials.in_turn`), its own model takes ``num_warmup`` steps."""
        reference = self.spec["reference"]
        if kind == "self":
            return candidate
        if kind == "in_place":
            candidate.config = self.spec["config"]
            return Side(training=candidate.training, emulator=emulator, config=reference)
        if kind == "in_turn":
            in_turn = ModelsInTurn(self.build, self.warm_up, release_free_memory)
            in_turn.add(candidate, self.spec["config"], built=True)
            side = Side(training=None, emulator=emulator)
            in_turn.add(side, reference)
            return side
        if kind == "kept":
            return Side(training=kept.training, emulator=emulator, next_step=kept.next_step, kept=True)
        side = Side(training=self.build(reference), emulator=emulator)
        self.warm_up(side)
        return side

    def build(self, config: dict[str, Any]) -> Any:
        """A fresh training of ``config`` on this rank."""
        from autotune.trials.training import build_training

        spec = self.spec
        return build_training(
            self.rank, self.world_size, model=spec["model"], config=config, seed=spec["seed"], device=self.device
        )

    def warm_up(self, side: Side, steps: int | None = None) -> None:
        """``steps`` (default ``num_warmup``) steps of a freshly built side, not measured (their losses
        stay in its record); on CUDA (or with ``AUTOTUNE_HOST_PROBE=1``) the last one times the host's
        path per block pass ([Note: host path probe] in :mod:`autotune.trials.host_probe`)."""
        device = self.device
        probe = device.type == "cuda" or os.environ.get(HOST_PROBE_ENV) == "1"
        steps = self.spec["num_warmup"] if steps is None else steps
        for i in range(steps):
            last = i == steps - 1
            if probe and last and getattr(side.training, "pipeline", True) is None and side.emulator is None:
                loss, side.host_path_ms = probe_host_path(side.training, side.next_step, device)
                side.losses.append(loss)
            else:
                side.losses.append(self.timed_step(side.training, side.next_step, device, side.emulator).loss)
            side.next_step += 1


def _with_reference(spec: dict[str, Any], sides: dict[str, Side]) -> dict[str, Side]:
    """The sides, the candidate paired with itself where the reference is its config; warm-up
    steps forgotten (they are not measurements; their losses stay: the run's record)."""
    if spec.get("reference") is not None and "reference" not in sides:
        sides["reference"] = sides["candidate"]
    for side in sides.values():
        side.clear()
    return sides


def is_reference_config(spec: dict[str, Any]) -> bool:
    """The candidate is the config a kept model is kept for: the reference paired with itself, or no reference."""
    return spec.get("reference") is None or spec["reference"] == spec["config"]


def take_kept(spec: dict[str, Any], device: torch.device) -> KeptModel | None:
    """The kept warm model of this trial's reference config, where every rank holds it and the
    trial may use it ([Note: a warm reference] in :mod:`autotune.trials.kept`); else it is dropped."""
    if not kept_models.can_keep(spec, device):
        kept_models.drop()
        return None
    kept = kept_models.take(kept_models.get_key(spec, device), device)
    if kept is not None and kept.peak_bytes is None and is_reference_config(spec):
        kept_models.drop()  # kept as a reference: its own peak was never measured, so build it afresh
        return None
    return kept


def get_side_to_keep(sides: dict[str, Side], spec: dict[str, Any], device: torch.device) -> Side | None:
    """The side whose model is the reference config's own, to keep for the next trial; None where
    there is none (switched in place, built in turn) or the trial may not keep one."""
    if not kept_models.can_keep(spec, device):
        return None
    if is_reference_config(spec):
        return sides["candidate"]
    reference = sides["reference"]
    own = reference.training is not sides["candidate"].training and reference.in_turn is None
    return reference if own else None
