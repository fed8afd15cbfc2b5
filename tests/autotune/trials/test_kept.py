"""The reference's model kept warm in a rank pool from one trial to the next ([Note: a warm reference]).

2 gloo ranks in one pool (the session's, with nothing kept in it at the start), the tiny model, its
defaults as the reference and a structural candidate (full activation checkpointing: a model of its
own). What each rank's record says of each trial: how many models it built (``num_builds``), which
side stepped first, which steps ran.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autotune.trials import TrialSpec, run_trial
from autotune.trials.kept import get_live_bytes
from autotune.trials.training import build_training
from fsdp_runtime import default_config

pytestmark = [pytest.mark.multirank, pytest.mark.torch_matrix]

UNITS = [f"layers.{i}" for i in range(4)]
WORLD = 2


def _checkpointed():
    config = default_config(UNITS)
    units = [dataclasses.replace(u, activation_checkpointing="full") if u.name != "root" else u for u in config.units]
    return dataclasses.replace(config, units=units)


def _spec(tmp_path, name, config, *, reference=True, keep=True, pairs=2, program=None) -> TrialSpec:
    extra = {"rank_program": program} if program else {}
    return TrialSpec(
        model="tiny",
        config=config,
        reference=default_config(UNITS) if reference else None,
        world_size=WORLD,
        out_dir=tmp_path / name,
        num_warmup=2,
        num_measured=pairs,
        profile=False,
        backend="gloo",
        keep_reference=keep,
        **extra,
    )


@pytest.fixture
def pool(pool2):
    """The session's 2-rank pool with no model kept in its ranks, as a pool of the test's own starts."""
    dropped = pool2.run("_harness:drop_kept_model", timeout_s=120)
    assert dropped.ok, f"{dropped.status}: {dropped.reason}"
    return pool2


def _ranks(pool, spec) -> list[dict]:
    result = run_trial(spec, pool=pool)
    assert result.status == "ok", f"{spec.out_dir.name}: {result.status}: {result.reason}"
    return result.metrics.ranks


def test_the_reference_is_built_once_and_stepped_warm_by_the_next_trials(tmp_path, pool):
    defaults, candidate = default_config(UNITS), _checkpointed()
    warm_up = _ranks(pool, _spec(tmp_path, "warmup", defaults, reference=False))
    assert [(r.num_builds, r.candidate_warmup) for r in warm_up] == [(1, 2), (1, 2)]  # builds the model it keeps

    self_paired = _ranks(pool, _spec(tmp_path, "defaults", defaults))
    assert [(r.num_builds, r.num_models, r.candidate_warmup) for r in self_paired] == [(0, 1, 1), (0, 1, 1)]
    # one warm-up step (the trimmed heap re-faulted), then its 2 pairs of 2 steps
    assert all(len(r.losses) == 1 + 4 for r in self_paired)

    kept = _ranks(pool, _spec(tmp_path, "kept", candidate))
    for r in kept:
        assert (r.num_builds, r.num_models, r.pairs_first) == (1, 2, "candidate")
        # C | Rs R, then R | Cs C: no warm-up step of the reference's, one settle step a side
        assert len(r.step_ms) == len(r.reference_step_ms) == 2
        assert len(r.settle_step_ms) == len(r.reference_settle_step_ms) == 1
        # the candidate's first measured step leads the pairs: one warm-up step ([Note: the leading step])
        assert r.candidate_warmup == 1 and len(r.losses) == 1 + 2 + 1

    # A trial without keep_reference builds its own reference and drops the kept model...
    outside = _ranks(pool, _spec(tmp_path, "outside", candidate, keep=False))
    assert [(r.num_builds, r.pairs_first, r.candidate_warmup) for r in outside] == [(2, "reference", 2)] * 2
    # ...so the next keeping trial builds again (and keeps its reference, built after the candidate)
    rebuilt = _ranks(pool, _spec(tmp_path, "rebuilt", candidate))
    assert [(r.num_builds, r.pairs_first) for r in rebuilt] == [(2, "reference"), (2, "reference")]
    again = _ranks(pool, _spec(tmp_path, "again", candidate))
    assert [(r.num_builds, r.pairs_first) for r in again] == [(1, "candidate"), (1, "candidate")]
    # kept as a reference, it has no candidate peak of its own: the defaults trial builds afresh
    fresh = _ranks(pool, _spec(tmp_path, "fresh_defaults", defaults))
    assert [r.num_builds for r in fresh] == [1, 1]


def test_a_rank_without_the_kept_model_makes_every_rank_build(tmp_path, pool):
    """One rank lost the kept model (as a rank restarted alone would): a rank that skipped the
    build and its warm-up steps while the other ran them would wait in a collective forever."""
    defaults, candidate = default_config(UNITS), _checkpointed()
    _ranks(pool, _spec(tmp_path, "warmup", defaults, reference=False))
    lost = _ranks(pool, _spec(tmp_path, "lost", candidate, program="_trial_programs:forget_kept_on_rank1"))
    assert [(r.num_builds, r.pairs_first) for r in lost] == [(2, "reference"), (2, "reference")]


def test_the_kept_model_s_live_bytes_are_its_shards_gradients_and_optimizer_state():
    """What a kept model holds between steps, counted by storage: taken off the peaks of trials it
    is not part of. One rank (world 1) of the tiny model after a step: parameters, AdamW's two
    moments and a step count per parameter (gradients are freed by ``zero_grad``)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        training = build_training(0, 1, model="tiny", config=config_dict(), seed=0, device=torch.device("cpu"))
        before = get_live_bytes(training)
        training.step(0)
        params = [p.to_local() if hasattr(p, "to_local") else p for p in training.model.parameters()]
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        buffer_bytes = sum(b.numel() * b.element_size() for b in training.model.buffers())
        assert before == param_bytes + buffer_bytes
        steps = sum(s["step"].untyped_storage().nbytes() for s in training.optimizer.state.values())
        assert get_live_bytes(training) == 3 * param_bytes + buffer_bytes + steps
    finally:
        dist.destroy_process_group()


def config_dict():
    from fsdp_runtime import config_to_dict

    return config_to_dict(default_config(UNITS))
