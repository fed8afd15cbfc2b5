"""The pair schedule ([Note: pair schedule]): what ``run_pairs`` runs is what :func:`get_pair_schedule`
says, for every way a trial holds its reference, and where a two-step burst reaches."""

from __future__ import annotations

import pytest
import torch

from autotune.trials import paired
from autotune.trials.in_turn import ModelsInTurn
from autotune.trials.paired import Side, StepTiming, run_pairs
from autotune.trials.program import get_pairs_first
from fsdp_runtime.tuning.pair_schedule import ORDERS, ScheduledStep, get_burst_windows, get_order_schedule

WARMUP = 2


class _Training(dict):
    """A stand-in training whose knobs switch in place."""

    def use_config(self, config) -> None:
        self["config"] = config


def _sides(kind: str, record: list) -> dict[str, Side]:
    """The sides as ``SideBuilder.get_reference`` holds them for ``kind``, on stand-in trainings."""
    candidate = Side(training=_Training(name="candidate"))
    if kind == "self":
        return {"candidate": candidate, "reference": candidate}
    if kind == "in_place":
        candidate.config = {"knobs": "candidate"}
        return {"candidate": candidate, "reference": Side(training=candidate.training, config={"knobs": "reference"})}
    if kind == "kept":
        return {"candidate": candidate, "reference": Side(training={"name": "reference"}, kept=True)}
    if kind == "own":
        return {"candidate": candidate, "reference": Side(training={"name": "reference"})}
    reference = Side(training=None)
    names = {id(candidate): "candidate", id(reference): "reference"}

    def warm_up(side: Side) -> None:
        record.extend(ScheduledStep(names[id(side)], -1, "warmup") for _ in range(WARMUP))

    in_turn = ModelsInTurn(lambda config: {"name": config["name"]}, warm_up, lambda: None)
    in_turn.add(candidate, {"name": "candidate"}, built=True)
    in_turn.add(reference, {"name": "reference"})
    return {"candidate": candidate, "reference": reference}


@pytest.mark.parametrize("kind", sorted(ORDERS))
def test_run_pairs_steps_in_the_generated_schedule(kind, one_rank_group, monkeypatch):
    """Every step ``run_pairs`` takes (warm-ups of models built in turn included) is the next one
    of the schedule generated for the order the rank program hands it."""
    record: list[ScheduledStep] = []
    sides = _sides(kind, record)
    names = {id(side): name for name, side in sides.items()}
    pairs = {"candidate": 0, "reference": 0}
    step_side = paired.step_side

    def recording(side, device, timed_step, *, settle=False):
        name = names[id(side)] if kind != "self" else ("reference", "candidate")[len(record) % 4 in (1, 2)]
        ms = step_side(side, device, timed_step, settle=settle)  # a model built in turn warms up first
        record.append(ScheduledStep(name, pairs[name], "settle" if settle else "measured"))
        pairs[name] += not settle
        return ms

    monkeypatch.setattr(paired, "step_side", recording)
    first = get_pairs_first(sides)
    assert first == ORDERS[kind]["first"]
    clock = lambda training, step, device, emulator=None: StepTiming(ms=60.0, loss=0.0, cpu_ms=0.0, page_faults=0)  # noqa: E731
    device = torch.device("cpu")
    run_pairs(sides, num_pairs=4, device=device, timed_step=clock, prune_if_ratio_above=None, last=first, first=first)
    expected = get_order_schedule(kind, 4, warmup=WARMUP)
    # the recorder does not know a warm-up's pair nor which step ends a pair: compare the rest
    assert [(s.side, s.kind) for s in record] == [(s.side, s.kind) for s in expected]
    measured = [s for s in expected if s.kind == "measured"]
    assert [s.pair for s in record if s.kind == "measured"] == [s.pair for s in measured]
    assert [s.ends_pair for s in measured] == [False, True] * 4


def test_the_schedules_the_notes_write():
    def labels(kind: str) -> str:
        return " ".join(s.label for s in get_order_schedule(kind, 4, warmup=WARMUP))

    assert labels("kept") == labels("in_place") == "c0 r_s r0 r1 c_s c1 c2 r_s r2 r3 c_s c3"
    assert labels("own") == "r0 c_s c0 c1 r_s r1 r2 c_s c2 c3 r_s r3"
    assert labels("in_turn") == ("r_w r_w r0 c_w c_w c_s c0 c1 r_w r_w r_s r1 r2 c_w c_w c_s c2 c3 r_w r_w r_s r3")
    assert labels("self") == "r0 c0 c1 r1 r2 c2 c3 r3"


def test_a_burst_window_reaches_both_pairs_of_adjacent_steps():
    f = frozenset
    # The candidate leads: c1 c2 across the blocks, r0 r1 inside the first.
    kept = get_burst_windows(get_order_schedule("kept", 4))
    assert (f({1, 2}), f()) in kept and (f(), f({0, 1})) in kept and (f(), f({2, 3})) in kept
    # The reference leads: c0 c1 inside the first block, r1 r2 across the blocks.
    own = get_burst_windows(get_order_schedule("own", 4))
    assert (f({0, 1}), f()) in own and (f(), f({1, 2})) in own and (f({2, 3}), f()) in own
    assert (f({1, 2}), f()) not in own
    # One model in alternate steps: a burst over both steps of a pair leaves its ratio alone.
    self_paired = get_burst_windows(get_order_schedule("self", 2))
    assert self_paired == [(f({0, 1}), f())]
