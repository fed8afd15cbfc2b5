"""``autotune plan``: the walk over the search space, the fast knobs, ranking, emission and the CLI."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from autotune.plan import PlanError, PlanSettings, run_plan
from autotune.plan.points import KnobFactory, get_forward_key, iter_space_params
from autotune.search import SearchSpace
from autotune.sim.knobs import resolve_knobs
from fsdp_runtime import MixedPrecisionConfig, load_config
from profiles import load_model_profile

REPO = Path(__file__).resolve().parents[2]
BF16 = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")
LLAMA8B_BLOCKS = tuple(load_model_profile("llama8b").block_names)


def _space(world_size: int = 8, **changes) -> SearchSpace:
    return SearchSpace(block_names=LLAMA8B_BLOCKS, world_size=world_size, num_microbatches=2, device_type="cuda", **changes)


def test_the_walk_visits_every_point_of_the_space_once():
    space = _space()
    points = list(iter_space_params(space))
    keys = {tuple(sorted(p.items())) for p in points}
    assert len(keys) == len(points) == 16750
    assert tuple(sorted(space.get_default_params().items())) in keys
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(200):  # whatever Optuna samples is a point of the walk
        trial = study.ask()
        space.suggest(trial)
        assert tuple(sorted(trial.params.items())) in keys or _normalized(trial.params) in keys


def _normalized(params: dict) -> tuple:
    return tuple(sorted(params.items()))


def test_fast_knobs_equal_the_knobs_of_the_built_config():
    for world_size in (8, 32):
        space = _space(world_size)
        factory = KnobFactory(space, world_size=world_size, device="cuda", mixed_precision=BF16)
        points = list(iter_space_params(space))
        for params in random.Random(world_size).sample(points, 400):
            slow = resolve_knobs(factory.build_config(params), LLAMA8B_BLOCKS, world_size=world_size, device="cuda")
            assert factory.get_knobs(params) == slow, params


def test_points_sharing_a_forward_key_share_the_forward_knobs():
    space = _space()
    factory = KnobFactory(space, world_size=8, device="cuda", mixed_precision=BF16)
    groups: dict = {}
    for params in iter_space_params(space):
        groups.setdefault(get_forward_key(params), []).append(params)
    for group in list(groups.values())[:40]:
        first = factory.get_knobs(group[0])
        for params in group[1:]:
            other = factory.get_knobs(params)
            assert (other.replicate, other.shard, other.forward_prefetch, other.reshard_after_forward, other.unshard_async) == (
                first.replicate, first.shard, first.forward_prefetch, first.reshard_after_forward, first.unshard_async,
            )  # fmt: skip


def test_plan_ranks_emits_and_parallel_workers_agree(tmp_path):
    one = run_plan(PlanSettings(model="tiny", cluster="h100-node", num_nodes=2, fixed_mesh="hsdp:2x8", out_dir=tmp_path / "a", num_workers=1))
    two = run_plan(PlanSettings(model="tiny", cluster="h100-node", num_nodes=2, fixed_mesh="hsdp:2x8", out_dir=tmp_path / "b", num_workers=2))
    assert one.num_evaluated == two.num_evaluated == len(one.ranked) + len(one.dropped)
    assert [r.params for r in one.ranked[:20]] == [r.params for r in two.ranked[:20]]
    steps = [r.prediction.step_s for r in one.ranked]
    assert steps == sorted(steps) or all(round(a * 1e6) <= round(b * 1e6) for a, b in zip(steps, steps[1:]))
    assert one.ranked[0].prediction.step_s <= one.default.prediction.step_s
    config = load_config(tmp_path / "a" / "best.toml")
    assert config.provenance.measured is False and "simulated" in config.provenance.produced_by
    assert config.mesh.kind == "hsdp" and config.mesh.replicate == 2 and config.mixed_precision.param_dtype == "bfloat16"


def test_plan_settings_errors_name_the_setting(tmp_path):
    with pytest.raises(PlanError, match="nodes must be >= 1") as info:
        PlanSettings(num_nodes=0)
    assert info.value.field == "num_nodes"
    (tmp_path / "file").write_text("x")
    with pytest.raises(PlanError, match="is not a directory"):
        PlanSettings(out_dir=tmp_path / "file")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import cli; cli.main()", "plan", *args], cwd=REPO, capture_output=True, text=True, timeout=600)


def test_cli_plan_emits_a_config_for_llama8b_units(tmp_path):
    done = _cli("--model", "llama8b", "--cluster", "h100-node", "--nodes", "1", "--microbatches", "1", "--mesh", "fsdp", "--workers", "1", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "configs/s" in done.stdout and "best:" in done.stdout
    config = load_config(tmp_path / "best.toml")
    assert config.unit_names == [*LLAMA8B_BLOCKS, "root"]
    assert config.provenance.model == "llama8b" and config.provenance.world_size == 8
    assert any("simulated" in note and "h100-node" in note for note in config.provenance.notes)
    assert config.provenance.metrics["predicted_step_ms"] > 0
    assert (tmp_path / "plan.json").exists() and load_config(tmp_path / "best.json") == config


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--nodes", "0"), "error: --nodes: nodes must be >= 1, got 0"),
        (("--cluster", "cpu-gloo"), "error: --cluster: cluster profile 'cpu-gloo' has no accelerator table"),
        (("--mesh", "hsdp:3x3"), "error: --mesh: mesh 'hsdp:3x3' spans 9 ranks but the world size is 8"),
        (("--ac", "some"), "error: --ac: activation checkpointing must be auto, none or full, got 'some'"),
    ],
)
def test_cli_plan_bad_input_is_one_line(args, message, tmp_path):
    done = _cli(*args, "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and done.stderr.startswith(message)
    assert not (tmp_path / "out").exists()
