"""The paired measurement's schedule and estimator ([Note: paired measurement], [Note: switch cost]).

A synthetic switch cost: a stand-in training whose step takes longer when the step before it
ran *another* training, driven through the real ``run_pairs`` on a one-rank gloo group with a
stand-in clock (no sleeping: the times are exact, so the checks are about the estimator).
"""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.distributed as dist

from autotune.trials.paired import (
    Side,
    StepTiming,
    get_block_ratios,
    get_pair_order,
    run_pairs,
    summarize_pairs,
)

pytestmark = pytest.mark.torch_matrix

CANDIDATE_MS, REFERENCE_MS, SWITCH_MS = 30.0, 60.0, 20.0
TRUE_RATIO = CANDIDATE_MS / REFERENCE_MS


@pytest.fixture
def one_rank_group():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Clock:
    """Step times of stand-in trainings: ``ms``, plus ``SWITCH_MS`` when the previous step was
    another training's (the cost measured by studies/switch_cost.py, exaggerated)."""

    def __init__(self) -> None:
        self.last = None
        self.order: list[str] = []

    def timed_step(self, training, step, device, emulator=None) -> StepTiming:
        ms = training["ms"] + (SWITCH_MS if self.last not in (None, training["name"]) else 0.0)
        self.last = training["name"]
        self.order.append(training["name"])
        return StepTiming(ms=ms, loss=float(step), cpu_ms=ms, page_faults=0)


def _measure(num_pairs: int, *, settle: bool, same_model: bool = False) -> tuple[dict, _Clock]:
    clock = _Clock()
    candidate = Side(training={"name": "c", "ms": CANDIDATE_MS})
    reference = candidate if same_model else Side(training={"name": "r", "ms": REFERENCE_MS})
    clock.last = "r"  # the reference warmed up last, as in the rank program
    sides = {"candidate": candidate, "reference": reference}
    run_pairs(
        sides,
        num_pairs=num_pairs,
        device=torch.device("cpu"),
        timed_step=clock.timed_step,
        prune_if_ratio_above=None,
        settle=settle,
    )
    if same_model:
        return {}, clock
    return summarize_pairs(candidate.step_ms, reference.step_ms, candidate.settle_ms, reference.settle_ms), clock


def test_one_step_pairs_alternate_with_their_position_and_miss_the_ratio(one_rank_group):
    """The measurement before settle steps: the switched step lands on the candidate in even
    pairs and on the reference in odd ones, so the pair ratios take two values and their median
    lies between them, far from the truth."""
    paired, _ = _measure(6, settle=False)
    even, odd = paired["pair_ratios"][0::2], paired["pair_ratios"][1::2]
    assert even == pytest.approx([(CANDIDATE_MS + SWITCH_MS) / REFERENCE_MS] * 3)
    assert odd == pytest.approx([CANDIDATE_MS / (REFERENCE_MS + SWITCH_MS)] * 3)
    old_estimate = statistics.median(paired["pair_ratios"])  # the median of single pairs
    assert abs(old_estimate / TRUE_RATIO - 1) > 0.15


def test_settle_steps_and_blocks_measure_the_config_alone(one_rank_group):
    paired, clock = _measure(6, settle=True)
    assert paired["estimator"] == "blocks"
    assert paired["pair_ratios"] == pytest.approx([TRUE_RATIO] * 6)
    assert paired["block_ratios"] == pytest.approx([TRUE_RATIO] * 3) and paired["num_blocks"] == 3
    assert paired["ratio"] == pytest.approx(TRUE_RATIO) and paired["ratio_spread"] == pytest.approx(0.0)
    assert paired["order_ratios"] == pytest.approx({"reference_first": TRUE_RATIO, "candidate_first": TRUE_RATIO})
    assert paired["first"] == "reference"
    # the switch cost is measured on the settle steps, one per pair (candidate in even pairs, reference in odd)
    assert paired["switch_cost"] == pytest.approx(
        {"candidate": SWITCH_MS / CANDIDATE_MS, "reference": SWITCH_MS / REFERENCE_MS}
    )
    # r c* c | c r* r | r c* c ... (* settle): every measured step follows a step of its own
    # config, and a pair costs 3 steps, not 4
    assert "".join(clock.order) == "rcccrr" * 3
    assert len(clock.order) == 3 * 6


def test_the_defaults_paired_with_themselves_need_no_settle_steps(one_rank_group):
    _, clock = _measure(4, settle=True, same_model=True)
    assert clock.order == ["c"] * 8


def test_block_ratios_cancel_a_linear_drift_that_single_pairs_do_not():
    # the load rises 10% per step; the candidate is truly 0.5x the reference
    candidate, reference = [], []
    t = 0
    for i in range(4):
        for name in get_pair_order(i):
            load = 1.0 + 0.1 * t
            (candidate if name == "candidate" else reference).append(load * (30.0 if name == "candidate" else 60.0))
            t += 1
    pairs = [c / r for c, r in zip(candidate, reference)]
    assert max(abs(p / 0.5 - 1) for p in pairs) > 0.05  # each pair is off by the drift
    assert get_block_ratios(candidate, reference) == pytest.approx([0.5, 0.5])  # both orders together cancel it


def test_an_odd_last_pair_is_a_block_of_its_own():
    assert get_block_ratios([1.0, 3.0, 2.0], [2.0, 2.0, 4.0]) == pytest.approx([1.0, 0.5])
    assert summarize_pairs([], []) == {}


def test_one_block_takes_the_spread_of_its_two_pairs():
    paired = summarize_pairs([1.0, 3.0], [2.0, 2.0])
    assert paired["ratio"] == pytest.approx(1.0) and paired["num_blocks"] == 1
    assert (paired["ratio_min"], paired["ratio_max"]) == pytest.approx((0.5, 1.5))
    assert paired["ratio_spread"] == pytest.approx(0.5)  # quartiles 0.75-1.25 of the pairs: too noisy to rank


def test_pairs_that_start_with_the_candidate_label_their_orders_by_it():
    """Even pairs ran the candidate first ([Note: one model for both sides]): they are the
    candidate-first ones, and the pair order alternates from the candidate."""
    assert [get_pair_order(i, "candidate") for i in range(3)] == [
        ("candidate", "reference"),
        ("reference", "candidate"),
        ("candidate", "reference"),
    ]
    paired = summarize_pairs([0.9, 0.7, 0.9, 0.7], [1.0, 1.0, 1.0, 1.0], first="candidate")
    assert paired["first"] == "candidate"
    assert paired["order_ratios"] == pytest.approx({"reference_first": 0.7, "candidate_first": 0.9})
    assert summarize_pairs([0.9, 0.7], [1.0, 1.0])["order_ratios"] == pytest.approx(
        {"reference_first": 0.9, "candidate_first": 0.7}
    )


def test_the_leading_step_hook_runs_after_the_candidate_s_first_step_before_any_reference_step(one_rank_group):
    """[Note: the leading step]: the candidate's peak is read again after its first measured step,
    which must come before any step of the reference's, and only once."""
    clock = _Clock()
    candidate = Side(training={"name": "c", "ms": CANDIDATE_MS})
    reference = Side(training={"name": "r", "ms": REFERENCE_MS})
    clock.last = "c"  # the candidate warmed up last: the pairs start with it
    seen: list[str] = []
    run_pairs(
        {"candidate": candidate, "reference": reference},
        num_pairs=4,
        device=torch.device("cpu"),
        timed_step=clock.timed_step,
        prune_if_ratio_above=None,
        last="candidate",
        first="candidate",
        on_first_step=lambda: seen.append("".join(clock.order)),
    )
    assert seen == ["c"]  # once, right after the candidate's first (measured) step
    assert len(candidate.step_ms) == 4 and "".join(clock.order).startswith("crrrcc")
