"""The numerics checks can fail ([Note: numerics checks] in :mod:`autotune.trials.numerics`).

Multi-rank (2 gloo ranks of the session's pool, a 2-block tiny Llama, each job under a hard limit):
the honest memorisation and switch pass; a decoder whose blocks are skipped fails memorisation
(it cannot beat the context-free floor), and a ``switch_config`` that does nothing fails the switch
(its collectives after the switch are still config A's). Single process: the floor, the batch,
the tolerance and the criteria on made-up curves.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from autotune.trials.numerics import (
    FP32,
    MemoriseTask,
    check_comm_buffers,
    check_memorisation,
    check_switch,
    get_default_config,
    make_alternating_batch,
)
from autotune.trials.numerics_criteria import (
    BF16_UNIT_ROUNDOFF,
    GRAD_RTOL,
    TOLERANCE_FACTOR,
    evaluate_comm_buffers,
    evaluate_memorisation,
    get_bf16_tolerance,
    get_context_free_floor,
    get_roundings,
)

pytestmark = pytest.mark.torch_matrix

MODEL = {"name": "tiny", "num_layers": 2}
LIMIT_S = 60  # per job: the pool kills every rank's tree past it


def _criteria(check) -> dict[str, bool]:
    return {c.name: c.passed for c in check.criteria}


# -- single process --------------------------------------------------------------------------


def test_the_floor_is_the_conditional_entropy_of_the_next_token_given_the_current():
    # 'a' is followed by 'b' in one row and by 'c' in the other: ln 2 at those positions, 0 elsewhere.
    tokens = torch.tensor([[0, 1, 0, 1, 0], [0, 2, 0, 2, 0]])
    assert get_context_free_floor(tokens) == pytest.approx(4 * math.log(2) / 8)
    assert get_context_free_floor(torch.tensor([[3, 4, 3, 4]])) == 0.0


def test_the_batch_alternates_two_tokens_per_row_and_is_fixed():
    task = MemoriseTask(rows=64, length=9, alphabet=6)
    tokens = make_alternating_batch(512, task, dp_rank=1)
    assert tokens.shape == (64, 9)
    assert torch.equal(tokens[:, 2:], tokens[:, :-2]) and (tokens[:, 0] != tokens[:, 1]).all()
    assert len(tokens.unique()) == 6
    assert torch.equal(tokens, make_alternating_batch(512, task, dp_rank=1))
    assert not torch.equal(tokens, make_alternating_batch(512, task, dp_rank=0))
    assert get_context_free_floor(tokens) > 1.0  # each token follows several partners


def test_the_tolerance_grows_with_the_fp32_curves_travel():
    scale = TOLERANCE_FACTOR * BF16_UNIT_ROUNDOFF * math.sqrt(get_roundings(2))
    assert get_bf16_tolerance([6.0, 4.0, 5.0, 1.0], 2) == pytest.approx([scale * x for x in (6, 6, 8, 8)])


def _ranks(curves: list[list[float]], floor: float = 1.0) -> list[dict]:
    return [{"losses": c, "floor": floor} for c in curves]


def test_memorisation_criteria_on_made_up_curves():
    fp32 = [6.0, 3.0, 1.0, 0.3]
    passed = evaluate_memorisation(_ranks([fp32]), _ranks([[6.0, 3.01, 1.02, 0.31]]), num_blocks=2)
    assert passed.passed, passed.describe()
    drifted = evaluate_memorisation(_ranks([fp32]), _ranks([[6.0, 4.5, 3.0, 0.3]]), num_blocks=2)
    assert _criteria(drifted) == {**_criteria(passed), "bf16_tracks_fp32": False}
    stuck = evaluate_memorisation(_ranks([fp32, fp32]), _ranks([fp32, [6.0, 3.0, 1.0, 0.6]]), num_blocks=2)
    assert not _criteria(stuck)["bf16_beat_context_free_floor"] and _criteria(stuck)["bf16_fell_by_half"]
    nan = evaluate_memorisation(_ranks([fp32]), _ranks([[6.0, math.nan, 1.0, 0.3]]), num_blocks=2)
    assert not _criteria(nan)["bf16_tracks_fp32"]


# -- on ranks --------------------------------------------------------------------------------


def test_memorisation_passes_on_an_honest_model(pool2):
    honest = check_memorisation(MODEL, world_size=2, pool=pool2, timeout_s=LIMIT_S)
    assert honest.passed, honest.describe()
    assert honest.figures["tolerance_use"] < 0.5  # the measured share of the tolerance, with room


def test_memorisation_catches_a_model_whose_blocks_are_skipped(pool2):
    skipped = check_memorisation(
        MODEL, world_size=2, pool=pool2, timeout_s=LIMIT_S, target="_numerics_programs:memorise_without_blocks"
    )
    assert skipped.failure is None, skipped.failure
    criteria = _criteria(skipped)
    # Its loss falls (the tokens present are learnt) but never below what the current token alone explains.
    assert not criteria["fp32_beat_context_free_floor"] and not criteria["bf16_beat_context_free_floor"]
    assert not skipped.passed
    assert all(r[-1] >= f for r, f in zip(skipped.figures["fp32"], skipped.figures["floor"], strict=True))


def test_switch_passes_and_catches_a_switch_that_does_nothing(pool2):
    task = MemoriseTask(num_steps=3)
    honest = check_switch(MODEL, world_size=2, pool=pool2, task=task, timeout_s=LIMIT_S)
    assert honest.passed, honest.describe()
    noop = check_switch(
        MODEL, world_size=2, pool=pool2, task=task, timeout_s=LIMIT_S, target="_numerics_programs:switch_doing_nothing"
    )
    assert noop.failure is None, noop.failure
    assert _criteria(noop) == {
        "losses_bitwise": True,  # the knobs do not change the maths: only the counts can tell
        "collectives_after_switch_equal": False,
        "configs_differ_in_collectives": True,
    }


def test_the_comm_buffer_check_is_refused_off_nccl_and_on_one_rank_in_one_line():
    gloo = check_comm_buffers(MODEL, world_size=2, backend="gloo")
    assert not gloo.passed and gloo.failure == "backend gloo: these knobs need cuda and NCCL"
    one = check_comm_buffers(MODEL, world_size=1)
    assert not one.passed and one.failure.startswith("world size 1: FSDP2 issues no collectives on one rank")


def test_the_comm_buffer_criteria_catch_a_lost_divide_that_the_losses_do_not_show(pool2):
    # The knobs are CUDA/NCCL only; on gloo the criteria are run on what they must catch: every
    # gradient summed over the ranks instead of averaged. AdamW does not see a gradient's scale
    # (its losses track the defaults'), the first gradient does (off by the world size squared).
    from fsdp_runtime import config_to_dict

    task = MemoriseTask(num_steps=8)
    kwargs = {
        "model": MODEL,
        "config": config_to_dict(get_default_config(MODEL, FP32)),
        "task": dataclasses.asdict(task),
    }
    runs = {
        "defaults": pool2.run("autotune.trials.numerics:memorise_ranks", kwargs, timeout_s=LIMIT_S),
        "same": pool2.run("autotune.trials.numerics:memorise_ranks", kwargs, timeout_s=LIMIT_S),
        "summed": pool2.run("_numerics_programs:memorise_with_summed_gradients", kwargs, timeout_s=LIMIT_S),
    }
    assert all(run.ok for run in runs.values()), {k: run.reason for k, run in runs.items()}
    check = evaluate_comm_buffers({k: run.results for k, run in runs.items()}, num_blocks=2)
    criteria = {c.name: c for c in check.criteria}
    assert criteria["same_first_gradient"].passed and criteria["same_first_gradient"].value == 0.0
    assert criteria["same_tracks_defaults"].passed
    assert not criteria["summed_first_gradient"].passed
    assert criteria["summed_first_gradient"].value == pytest.approx(2**2 - 1, rel=1e-3)  # world 2: x4
    assert criteria["summed_first_gradient"].limit == GRAD_RTOL
    assert criteria["summed_tracks_defaults"].passed  # the losses alone would have let it through
    assert not check.passed
