"""Pipeline stages keep the math: real gloo ranks, tiny Llama (4 blocks), 3 steps x 4 microbatches.

World 4 = 2 pipeline ranks x 2 data-parallel ranks against the same model without stages at
world 2 (the same data-parallel degree, so every gradient element is the same sum of two
per-rank values). Bitwise equal for every schedule: a stage runs its blocks' CPU kernels on
the same inputs (activations cross stages exactly, by send/recv), each microbatch's loss is
divided by the microbatch count before its backward as without stages
(``scale_grads=False``), and each stage accumulates its microbatches' gradients in
microbatch order under GPipe, 1F1B and interleaved 1F1B alike. The collective counts prove
each unit's sync level took effect per microbatch (torch's own stage would reduce once).
"""

from __future__ import annotations

import dataclasses

import pytest

from autotune.trials import RankPool
from fsdp_runtime import MeshConfig, PipelineConfig, RuntimeConfig, config_to_dict, default_config

pytestmark = pytest.mark.torch_matrix

NUM_STEPS = 3
NUM_MICROBATCHES = 4
BLOCKS = [f"layers.{i}" for i in range(4)]
BASE = default_config(BLOCKS, num_microbatches=NUM_MICROBATCHES)
LAST = dataclasses.replace(
    BASE, units=[dataclasses.replace(u, sync="last", reshard_after_backward=False) for u in BASE.units]
)


def _staged(config: RuntimeConfig, schedule: str = "1f1b", virtual_stages: int = 1) -> RuntimeConfig:
    return dataclasses.replace(
        config, mesh=MeshConfig(pp=2), pipeline=PipelineConfig(schedule=schedule, virtual_stages=virtual_stages)
    )


def _tuned(config: RuntimeConfig) -> RuntimeConfig:
    """Prefetch one unit ahead within each stage (layers.0-1 | layers.2-3), params kept after forward."""
    prefetch = {"layers.0": ["layers.1"], "layers.2": ["layers.3"]}
    units = [
        dataclasses.replace(u, forward_prefetch=prefetch.get(u.name), reshard_after_forward=False)
        if u.name != "root"
        else u
        for u in config.units
    ]
    return dataclasses.replace(config, units=units)


def _run(pool: RankPool, target: str, configs: dict[str, RuntimeConfig]) -> dict[str, list[dict]]:
    """Every config in turn in one job on a session pool; the job's hard limit kills every rank's tree."""
    run = pool.run(
        target,
        {"model": "tiny", "configs": [config_to_dict(c) for c in configs.values()], "num_steps": NUM_STEPS},
        timeout_s=240,
    )
    assert run.ok, f"{run.status}: {run.reason}\n{run.stderr_tails}"
    return {name: [run.results[r][i] for r in range(pool.world_size)] for i, name in enumerate(configs)}


@pytest.fixture(scope="module")
def unstaged(pool2) -> dict[str, list[dict]]:
    return _run(pool2, "_harness:train_pipeline_configs", {"every": BASE, "last": LAST})


@pytest.fixture(scope="module")
def staged(pool4) -> dict[str, list[dict]]:
    return _run(
        pool4,
        "_harness:train_pipeline_configs",
        {
            "gpipe": _staged(BASE, "gpipe"),
            "1f1b": _staged(BASE),
            "interleaved_1f1b": _staged(BASE, "interleaved_1f1b", 2),
            "1f1b_last": _staged(LAST),
            "interleaved_last": _staged(LAST, "interleaved_1f1b", 2),
            "1f1b_tuned": _staged(_tuned(BASE)),
        },
    )


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("name", "reference"),
    [
        ("gpipe", "every"),
        ("1f1b", "every"),
        ("interleaved_1f1b", "every"),
        ("1f1b_last", "last"),
        ("interleaved_last", "last"),
        ("1f1b_tuned", "every"),
    ],
)
def test_each_schedule_trains_the_same_numbers_as_the_model_without_stages(staged, unstaged, name, reference):
    # Global rank r = pipeline rank r // 2, data-parallel rank r % 2: both pipeline ranks of a
    # data-parallel column report that column's loss.
    want = [r["losses"] for r in unstaged[reference]]
    got = [r["losses"] for r in staged[name]]
    assert got == [want[0], want[1], want[0], want[1]]
    assert want[0] != want[1], "each data-parallel rank trains on its own data"


@pytest.mark.multirank
def test_stages_are_placed_looped_over_pipeline_ranks(staged):
    assert [r["stages"] for r in staged["1f1b"]] == [[0], [0], [1], [1]]
    assert [r["stages"] for r in staged["interleaved_1f1b"]] == [[0, 2], [0, 2], [1, 3], [1, 3]]


@pytest.mark.multirank
def test_each_units_sync_level_holds_per_microbatch_inside_a_stage(staged):
    """sync = "every": each unit of the stage (2 blocks + the stage's root) reduce-scatters in
    every microbatch's backward; sync = "last": once per step, in the last one. torch's own
    PipelineStage would give the second count for both."""
    per_step = {name: staged[name][0]["collectives"]["reduce_scatter"] / NUM_STEPS for name in ("1f1b", "1f1b_last")}
    units_per_stage = 3  # layers.0, layers.1 and the first stage's root (the embeddings)
    assert per_step == {"1f1b": NUM_MICROBATCHES * units_per_stage, "1f1b_last": units_per_stage}
    sends = staged["1f1b"][0]["collectives"]
    assert any("send" in kind for kind in sends), sends


@pytest.mark.multirank
def test_only_the_last_backward_of_a_step_waits_for_its_reduce_scatters(staged):
    """FSDP2's "last backward" ends with the compute stream waiting for the reduce-scatters;
    earlier microbatches' backwards must not, so their reductions run under the next forward.
    Per step: False for each of the first three backwards, True for the fourth, then (before
    torch 2.15) True again from torch's reduction after the schedule."""
    per_step = [False] * (NUM_MICROBATCHES - 1) + [True]
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, "set_manual_backward_finalization"):
        per_step.append(True)  # torch < 2.15: the reduction after the schedule says so again
    # (2.15: the stage finalizes FSDP2's backward itself and waits there, once, after the last)
    assert staged["1f1b"][0]["last_backward"] == per_step * NUM_STEPS
