"""A paired trial holds one model where the knobs switch in place ([Note: one model for both sides]).

2 gloo ranks on a model whose state (parameters, gradients, AdamW's two moments: 16 bytes per
parameter, sharded over the ranks) is ~750 MB per rank, far above what the heap grows after
two warm-up steps (measured: 30-70 MB with one model; 700 MB with two; with a 185 MB model
and one warm-up step the heap still grew 200-250 MB and drowned the difference). The candidate differs from the reference (the defaults) only in knobs switched
in place; the same trial with ``AUTOTUNE_PAIRED_MODELS=two`` builds the reference a model of
its own. What the ranks held over the whole trial (``trial_peak_bytes``) above the candidate's
own peak is the reference's cost: under a third of a model's state with one model, over two
thirds with two. On the tiny model: which trials get one model and which two (the rank
result's ``num_models``), and that every kind measures its pairs.
"""

from __future__ import annotations

import dataclasses

import pytest

from autotune.trials import RankPool, TrialSpec, run_ranks
from autotune.trials.sides import PAIRED_MODELS_ENV
from fsdp_runtime import default_config
from profiles import load_model_source

pytestmark = [pytest.mark.multirank, pytest.mark.torch_matrix]

BIG = {"name": "tiny", "dim": 1024, "ffn_hidden_dim": 3072, "vocab_size": 32768, "num_layers": 1}
UNITS = ["layers.0"]
TINY_UNITS = [f"layers.{i}" for i in range(4)]
WORLD = 2


def _state_bytes_per_rank() -> float:
    module = load_model_source(BIG).build(device="cpu", seed=0)
    return 16 * sum(p.numel() for p in module.parameters()) / WORLD


def _keep_unsharded(units=UNITS):
    config = default_config(units)
    units = [dataclasses.replace(u, reshard_after_forward=False) if u.name != "root" else u for u in config.units]
    return dataclasses.replace(config, units=units)


def _checkpointed(units):
    config = default_config(units)
    units = [dataclasses.replace(u, activation_checkpointing="full") if u.name != "root" else u for u in config.units]
    return dataclasses.replace(config, units=units)


def _run(
    tmp_path,
    name: str,
    config,
    model=BIG,
    units=UNITS,
    pairs: int = 1,
    *,
    pool: RankPool | None = None,
    paired_models: str | None = None,
) -> list[dict]:
    """One trial's rank results: on ``pool`` (the session's warm ranks; ``paired_models`` set for
    the trial alone) or, without one, on fresh ranks, whose memory figures start from a process
    that ran nothing before. Either way a hard limit kills every rank's tree."""
    spec = TrialSpec(
        model=model,
        config=config,
        reference=default_config(units),
        world_size=WORLD,
        out_dir=tmp_path / name,
        num_warmup=2,
        num_measured=pairs,
        profile=False,
        backend="gloo",
    )
    spec.out_dir.mkdir(parents=True)
    if pool is None:
        assert paired_models is None, "fresh ranks take it from the environment"
        run = run_ranks(
            "autotune.trials.program:run_trial_rank", world_size=WORLD, kwargs={"spec": spec.to_dict()}, timeout_s=180
        )
    else:
        kwargs = {"spec": spec.to_dict(), "paired_models": paired_models}
        run = pool.run("_trial_programs:with_paired_models", kwargs, timeout_s=180)
    assert run.ok, f"{run.status}: {run.reason}\n{run.stderr_tails}"
    for result in run.results:
        assert len(result["step_ms"]) == len(result["reference_step_ms"]) == pairs  # the pairs were measured
    return run.results


def _reference_cost(results: list[dict]) -> float:
    """The most any rank held over the trial above its candidate's own peak."""
    return max(r["memory"]["trial_peak_bytes"] - r["memory"]["peak_bytes"] for r in results)


def test_the_reference_costs_one_model_s_memory_only_where_it_needs_its_own(tmp_path, monkeypatch):
    state = _state_bytes_per_rank()
    assert state > 600e6
    one = _reference_cost(_run(tmp_path, "one", _keep_unsharded()))
    monkeypatch.setenv(PAIRED_MODELS_ENV, "two")
    two = _reference_cost(_run(tmp_path, "two", _keep_unsharded()))
    assert one < state / 3, (one, state)
    assert two > 2 * state / 3, (two, state)


def test_one_model_where_the_knobs_switch_in_place_two_where_they_do_not(tmp_path, pool2):
    cases = {
        "self": default_config(TINY_UNITS),  # the defaults trial: one model paired with itself
        "switched": _keep_unsharded(TINY_UNITS),
        "structural": _checkpointed(TINY_UNITS),
    }
    models = {
        name: _run(tmp_path, name, c, model="tiny", units=TINY_UNITS, pool=pool2)[0]["num_models"]
        for name, c in cases.items()
    }
    assert models == {"self": 1, "switched": 1, "structural": 2}


def test_structural_pairs_take_turns_on_one_model(tmp_path, pool2):
    """[Note: models built in turn] (on CUDA by default; here asked for): one model held at a time,
    built anew at each switch: the candidate's, then one per switch (before the pair and in it)."""
    results = _run(
        tmp_path, "turn", _checkpointed(TINY_UNITS), model="tiny", units=TINY_UNITS, pool=pool2, paired_models="turn"
    )
    assert [(r["num_models"], r["num_builds"]) for r in results] == [(1, 3), (1, 3)]  # 1 pair: 1 + 2
    # The candidate's record: 2 builds x 2 warm-up steps, the settle step after its second
    # build, its measured step (every step's loss is kept).
    assert all(len(r["losses"]) == 2 * 2 + 1 + 1 for r in results)


def test_a_reference_switched_in_place_takes_no_warm_up_step_the_pairs_start_with_the_candidate(tmp_path, pool2):
    """The candidate stepped last (its warm-up), so the first pair runs it first with no switch:
    the reference's first step is the pair's settle step, in place of a warm-up step of its own
    (one step fewer per trial). The record says so, and a two-model trial keeps the reference first."""
    spec_steps = 2  # 2 pairs: C | Rs R, then R | Cs C
    switched = _run(
        tmp_path, "switched", _keep_unsharded(TINY_UNITS), model="tiny", units=TINY_UNITS, pairs=spec_steps, pool=pool2
    )
    for r in switched:
        assert r["pairs_first"] == "candidate"
        assert len(r["settle_step_ms"]) == 1 and len(r["reference_settle_step_ms"]) == 1
        # one warm-up step: the first measured step leads the pairs ([Note: the leading step])
        assert r["candidate_warmup"] == 1 and len(r["losses"]) == 1 + 2 + 1  # warm-up, measured, one settle step
    structural = _run(
        tmp_path, "structural", _checkpointed(TINY_UNITS), model="tiny", units=TINY_UNITS, pairs=spec_steps, pool=pool2
    )
    for r in structural:
        assert r["pairs_first"] == "reference" and r["candidate_warmup"] == 2  # the reference's warm-up comes between
        assert len(r["settle_step_ms"]) == 1 and len(r["reference_settle_step_ms"]) == 1  # Cs in pair 0, Rs in pair 1
