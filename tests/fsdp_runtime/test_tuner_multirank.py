"""The in-job tuner in a job ([Note: in-job tuner]): 2 gloo ranks, tiny Llama, 2 microbatches,
the tuner around each optimizer step as a user's loop has it.

Losses bitwise those of the same job untuned where the moves keep the order of sums (prefetch,
reshard after forward and backward: [Note: in-job moves]), within the knob tests' tolerance with
``sync = "last"``; a candidate that raises is dropped and the job goes on as if that step's batch
had been skipped (bitwise again; mid-forward only where torch can reset FSDP2's iteration state,
2.13 on, else it stops in one line); ranks that disagree stop on both; the chosen config loads and
trains; ``FSDP_RUNTIME_TUNER=off`` leaves the job untouched."""

from __future__ import annotations

import math

import pytest
from torch.distributed.fsdp import FSDPModule

from fsdp_runtime import config_to_dict, default_config, load_config
from fsdp_runtime._torch_compat import can_reset_iter_state

pytestmark = [pytest.mark.multirank, pytest.mark.torch_matrix]

BLOCKS = [f"layers.{i}" for i in range(4)]
CONFIG = config_to_dict(default_config(BLOCKS, num_microbatches=2))
STEPS = 40
TUNER = {"max_steps": 34, "num_pairs": 4, "warmup_steps": 2}
ORDERED = [
    "forward_prefetch=depth1",
    "forward_prefetch=depth2",
    "backward_prefetch=depth1",
    "reshard_after_forward=False@all",
    "reshard_after_backward=False@all",
]
"""Moves that keep the order of every floating-point sum: the losses must be bitwise."""
REORDER_RTOL = 1e-5
"""As the knob tests': ``sync = "last"`` sums the microbatch gradients before reducing them."""


def _tuned(pool, **kwargs) -> list[dict]:
    job = {"model": "tiny", "config": CONFIG, "num_steps": STEPS, "moves": ORDERED, "tuner": TUNER} | kwargs
    run = pool.run("_tuner_programs:train_tuned", job, timeout_s=240)
    assert run.ok, f"{run.status}: {run.reason}\n{run.stderr_tails}"
    return run.results


def _untuned(pool, skip: list[int] = ()) -> list[list[float | None]]:
    job = {"model": "tiny", "config": CONFIG, "num_steps": STEPS, "skip": list(skip)}
    run = pool.run("_tuner_programs:train_skipping", job, timeout_s=240)
    assert run.ok, f"{run.status}: {run.reason}\n{run.stderr_tails}"
    return run.results


@pytest.fixture(scope="module")
def untuned(pool2) -> list[list[float | None]]:
    return _untuned(pool2)


def test_the_tuner_tries_configs_settles_and_its_job_s_losses_are_bitwise_the_untuned_job_s(pool2, untuned):
    ranks = _tuned(pool2)
    for rank in ranks:
        assert rank["error"] is None and rank["finished"]
        tried = {name for name in rank["ran"] if name}
        assert len(tried) >= 3, rank["decisions"]
        assert rank["losses"] == untuned[ranks.index(rank)]  # bitwise, every step a real training step
    # every rank ran the same config each step and decided alike
    assert ranks[0]["ran"] == ranks[1]["ran"] and ranks[0]["decisions"] == ranks[1]["decisions"]
    assert ranks[0]["ran"][:2] == [None, None]  # the warm-up steps run the seed


def test_with_sync_skipped_the_losses_stay_within_the_stated_tolerance(pool2, untuned):
    ranks = _tuned(pool2, moves=["sync=last@all", "defer_concat=False@all", *ORDERED[:2]])
    assert "sync=last@all" in ranks[0]["ran"]
    for rank, expected in zip(ranks, untuned):
        assert all(math.isclose(a, b, rel_tol=REORDER_RTOL) for a, b in zip(rank["losses"], expected))


@pytest.mark.parametrize("where", ["start", "forward"])
def test_a_candidate_that_raises_is_dropped_and_the_job_goes_on_with_nothing_lost(pool2, where):
    """The step under the failing candidate is lost (its batch never trained) and nothing else:
    the parameters and optimizer state after it are those before it, and every later loss equals
    that of the untuned job with that one step left out, bitwise."""
    name = ORDERED[1]
    ranks = _tuned(pool2, fail={"name": name, "where": where})
    if where == "forward" and not can_reset_iter_state(FSDPModule):  # torch 2.11: no FSDP2 reset
        assert all("reset_iter_state" in rank["error"] for rank in ranks), ranks[0]["error"]
        return
    failed = ranks[0]["ran"].index(name)
    reference = _untuned(pool2, skip=[failed])
    for rank, expected in zip(ranks, reference):
        assert rank["error"] is None and (name, "failed") in rank["decisions"]
        assert rank["ran"].count(name) == 1  # never tried again
        assert rank["losses"][failed] is None and rank["checksums"][failed] == rank["checksums"][failed - 1]
        assert rank["losses"] == expected


def test_ranks_whose_tuners_disagree_stop_together(pool2):
    ranks = _tuned(pool2, disagree=True)  # rank 1 tries forward prefetch depth 2 first, rank 0 depth 1
    for rank in ranks:
        assert rank["error"] is not None and "disagree" in rank["error"], rank["error"]
        assert len(rank["losses"]) == TUNER["warmup_steps"]  # caught after the first step they differ on


def test_the_chosen_config_is_written_loads_and_trains(pool2, tmp_path, untuned):
    out = tmp_path / "tuned.toml"
    ranks = _tuned(pool2, tuner=TUNER | {"out": str(out)})
    chosen = load_config(out)
    assert chosen.provenance.produced_by == "in-job tuner" and chosen.provenance.measured
    assert chosen.units[0].forward_prefetch == ranks[0]["best"]
    assert len(chosen.provenance.notes) == len(ranks[0]["decisions"])
    run = pool2.run("_harness:train_losses", {"model": "tiny", "config": config_to_dict(chosen), "num_steps": 2})
    assert run.ok and all(0 < loss < 20 for losses in run.results for loss in losses)


def test_fsdp_runtime_tuner_off_leaves_the_job_untouched(pool2, untuned):
    ranks = _tuned(pool2, env={"FSDP_RUNTIME_TUNER": "off"})
    for rank, expected in zip(ranks, untuned):
        assert rank["ran"] == [None] * STEPS and rank["decisions"] == [] and rank["losses"] == expected
