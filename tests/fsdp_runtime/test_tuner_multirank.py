"""The in-job tuner in a job ([Note: in-job tuner]): 2 gloo ranks, tiny Llama, 2 microbatches,
the tuner around each optimizer step as a user's loop has it.

Losses bitwise those of the same job untuned where the moves keep the order of sums (prefetch,
reshard after forward and backward: [Note: in-job moves]), within the knob tests' tolerance with
``sync = "last"``. The guards ([Note: in-job guards]): a candidate out of memory on one rank
before its first collective is dropped on both and the job goes on as if that step's batch had
been skipped (bitwise again); out of memory mid-step ends both ranks in one line, not at the
process group's timeout; the job's own error propagates on both with the model on the best
config; a move a rank lacks the headroom for is skipped on both; ranks that disagree stop on
both. The chosen config loads and trains; ``FSDP_RUNTIME_TUNER=off`` leaves the job untouched."""

from __future__ import annotations

import math

import pytest

from fsdp_runtime import config_to_dict, default_config, load_config
from fsdp_runtime.tuning.walk import FINAL_WINDOW

pytestmark = [pytest.mark.multirank, pytest.mark.torch_matrix]

BLOCKS = [f"layers.{i}" for i in range(4)]
CONFIG = config_to_dict(default_config(BLOCKS, num_microbatches=2))
STEPS = 52
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


def test_a_candidate_out_of_memory_on_one_rank_before_its_first_collective_is_dropped_on_every_rank(pool2):
    """Rank 1 runs out of memory before the step's first collective; rank 0, already waiting at
    the gate, learns of it there. The step's batch is lost (never trained) and nothing else: the
    parameters and optimizer state after it are those before it, and every later loss equals that
    of the untuned job with that one step left out, bitwise."""
    name = ORDERED[1]
    ranks = _tuned(pool2, fail={"name": name, "where": "start", "rank": 1, "error": "oom"})
    failed = ranks[0]["ran"].index(name)
    reference = _untuned(pool2, skip=[failed])
    for rank, expected in zip(ranks, reference):
        assert rank["error"] is None and rank["finished"] and (name, "failed") in rank["decisions"]
        assert rank["ran"].count(name) == 1  # never tried again
        assert rank["losses"][failed] is None and rank["checksums"][failed] == rank["checksums"][failed - 1]
        assert rank["losses"] == expected


def test_a_candidate_out_of_memory_mid_step_ends_every_rank_with_one_line_not_at_the_timeout(pool2):
    """Rank 1 runs out of memory inside the forward, past the step's first collective: rank 0 is
    left waiting in a collective rank 1 never issues (the process group's timeout is 600 s). Rank 1
    raises TunerError naming the candidate; rank 0's watcher reads it from the store and ends its
    process with the same line and the tuner's exit code, well inside the job's limit."""
    from fsdp_runtime.tuning.guard import ABORT_EXIT_CODE

    name = ORDERED[1]
    job = {"model": "tiny", "config": CONFIG, "num_steps": STEPS, "moves": ORDERED, "tuner": TUNER}
    job["fail"] = {"name": name, "where": "forward", "rank": 1, "error": "oom"}
    run = pool2.run("_tuner_programs:train_tuned", job, timeout_s=120)
    assert run.status != "timeout" and run.returncodes[0] == ABORT_EXIT_CODE, (run.status, run.reason)
    line = f"rank 1 ran out of memory mid-step under candidate {name}"
    assert line in run.stderr_tails[0], run.stderr_tails[0]  # rank 0: stopping, with rank 1's line
    assert f"rank 1 stopped: TunerError: {line}" in run.stderr_tails[1], run.stderr_tails[1]


@pytest.mark.parametrize("where", ["start", "forward"])
def test_the_job_s_own_error_under_a_candidate_propagates_on_every_rank_with_the_model_on_the_best(pool2, where):
    """Before the first collective on rank 1 only: rank 1 raises its error, rank 0 PeerStepError;
    mid-step on every rank: each raises its own. Never the candidate's fault, never a hang."""
    name = ORDERED[1]
    fail = {"name": name, "where": where, "error": "value"} | ({"rank": 1} if where == "start" else {})
    ranks = _tuned(pool2, fail=fail)
    expected = ["PeerStepError", "ValueError"] if where == "start" else ["ValueError", "ValueError"]
    assert [rank["error"]["type"] for rank in ranks] == expected, [rank["error"] for rank in ranks]
    for rank in ranks:
        assert rank["error"]["on_best"] and (name, "failed") not in rank["decisions"]
        assert rank["ran"][-1] == name and len(rank["losses"]) == len(rank["ran"]) - 1


def test_a_move_no_rank_has_the_headroom_for_is_skipped_on_every_rank(pool2, untuned):
    """Rank 1 reports no headroom: every move that raises memory ([Note: in-job memory]) is skipped
    on both ranks before it runs; the one that does not (backward prefetch depth 1, FSDP2's own
    depth) is tried; the job's losses stay bitwise the untuned job's."""
    ranks = _tuned(pool2, headroom={"rank": 1, "bytes": 0})
    for rank, expected in zip(ranks, untuned):
        outcomes = dict(rank["decisions"])
        raising = [m for m in ORDERED if m != "backward_prefetch=depth1" and m not in rank["refused"]]
        assert {outcomes[m] for m in raising} == {"no headroom"}, outcomes
        assert outcomes["backward_prefetch=depth1"] != "no headroom"
        # depth 1 adopted (a noisy pair can adopt it) adds the final window, which runs the seed
        allowed = {None, "backward_prefetch=depth1", FINAL_WINDOW}
        assert {None, "backward_prefetch=depth1"} <= set(rank["ran"]) <= allowed, rank["ran"]
        assert rank["losses"] == expected


def test_ranks_whose_tuners_disagree_stop_together(pool2):
    ranks = _tuned(pool2, disagree=True)  # rank 1 tries forward prefetch depth 2 first, rank 0 depth 1
    for rank in ranks:
        assert rank["error"] is not None and "disagree" in rank["error"]["message"], rank["error"]
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
