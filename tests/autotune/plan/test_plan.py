"""``autotune plan``: the walk over the search space, the fast knobs, ranking, emission and the CLI."""

from __future__ import annotations

import itertools
import random

import optuna
import pytest
from torch.distributed.fsdp import FSDPModule

from autotune.plan import PlanError, PlanRecord, PlanSettings, run_plan
from autotune.search import SearchSpace
from autotune.search.ranking import KnobFactory, get_forward_key, iter_space_params
from autotune.sim.knobs import resolve_knobs
from fsdp_runtime import KNOBS, MixedPrecisionConfig, load_config
from profiles import load_model_profile

BF16 = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")
LLAMA8B_BLOCKS = tuple(load_model_profile("llama8b").block_names)


_UNPRICED = {k.search.param for k in KNOBS if not k.priced and k.search}


def _space(world_size: int = 8, **changes) -> SearchSpace:
    # As `autotune plan` builds it for BF16 (params bf16, reduction fp32).
    return SearchSpace(
        **{
            "block_names": LLAMA8B_BLOCKS,
            "world_size": world_size,
            "num_microbatches": 2,
            "device_type": "cuda",
            "mixed_precision": BF16,
            **changes,
        }
    )


def test_the_walk_visits_every_point_of_the_space_once():
    space = _space()
    points = list(iter_space_params(space))
    keys = {tuple(sorted(p.items())) for p in points}
    groups = 2 if hasattr(FSDPModule, "set_separate_reduce_scatter_group") else 1  # its own reduce-scatter group or not
    assert len(keys) == len(points) == 16750 * groups
    # In one dtype, HSDP 8x1 (a shard group of one) loses the dominated replica_last level:
    # 4 patterns x 2 keep x 5 x 5 prefetch x 3 reshard x 2 buffers fewer.
    one_dtype = _space(mixed_precision=MixedPrecisionConfig())
    assert len(list(iter_space_params(one_dtype))) == (16750 - 4 * 2 * 25 * 3 * 2) * groups
    assert tuple(sorted(space.get_default_params().items())) in keys
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    # whatever Optuna samples is a point of the walk, but for the knobs the simulator does not price
    # (the walk answers them with FSDP2's default: walking them would repeat every prediction)
    priced = {_priced(dict(key)) for key in keys}
    for _ in range(200):
        trial = study.ask()
        space.suggest(trial)
        assert _priced(trial.params) in priced
    unpriced = {k.search.param for k in KNOBS if not k.priced and k.search}
    assert unpriced == {"unshard_in_backward", "process_group_comm_buffers", "symmetric_memory"}
    assert all(p.get("process_group_comm_buffers") in (None, False) for p in points)  # their defaults only


def _priced(params: dict) -> tuple:
    """A point's params without those of the knobs the simulator does not price."""
    return tuple(sorted((k, v) for k, v in params.items() if k not in _UNPRICED))


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
            assert (
                other.replicate,
                other.shard,
                other.forward_prefetch,
                other.reshard_after_forward,
                other.unshard_async,
            ) == (
                first.replicate,
                first.shard,
                first.forward_prefetch,
                first.reshard_after_forward,
                first.unshard_async,
            )


def test_plan_ranks_emits_and_parallel_workers_agree(tmp_path):
    one = run_plan(
        PlanSettings(
            model="tiny", cluster="h100-node", num_nodes=2, fixed_mesh="hsdp:2x8", out_dir=tmp_path / "a", num_workers=1
        )
    )
    two = run_plan(
        PlanSettings(
            model="tiny", cluster="h100-node", num_nodes=2, fixed_mesh="hsdp:2x8", out_dir=tmp_path / "b", num_workers=2
        )
    )
    assert one.num_evaluated == two.num_evaluated == len(one.ranked) + len(one.dropped)
    assert [r.params for r in one.ranked[:20]] == [r.params for r in two.ranked[:20]]
    steps = [r.prediction.step_s for r in one.ranked]
    assert steps == sorted(steps) or all(round(a * 1e6) <= round(b * 1e6) for a, b in zip(steps, steps[1:]))
    assert one.ranked[0].prediction.step_s <= one.default.prediction.step_s
    config = load_config(tmp_path / "a" / "best.toml")
    assert config.provenance.measured is False and "simulated" in config.provenance.produced_by
    assert (
        config.mesh.kind == "hsdp" and config.mesh.replicate == 2 and config.mixed_precision.param_dtype == "bfloat16"
    )
    # Without the memory knobs: the core space only, checkpointing left to the script.
    core = run_plan(
        PlanSettings(
            model="tiny", cluster="h100-node", num_nodes=1, out_dir=tmp_path / "c", num_workers=1, memory_knobs=False
        )
    )
    assert not core.ac_in_config and core.ac_label in ("none", "full")
    assert all(k not in row.params for row in core.ranked for k in ("blocks_per_unit", "ac_units", "root_sync_fsdp"))
    assert one.ac_in_config and any("blocks_per_unit" in row.params for row in one.ranked)


def test_plan_settings_errors_name_the_setting(tmp_path):
    with pytest.raises(PlanError, match="nodes must be >= 1") as info:
        PlanSettings(num_nodes=0)
    assert info.value.field == "num_nodes"
    (tmp_path / "file").write_text("x")
    with pytest.raises(PlanError, match="is not a directory"):
        PlanSettings(out_dir=tmp_path / "file")


def test_cli_plan_emits_a_config_for_llama8b_units(tmp_path, cli_main):
    # In-process (``cli.main()``, the console script's entry point): a process of its own would
    # spend seconds importing the CLI first.
    done = cli_main(
        "plan",
        "--model",
        "llama8b",
        "--cluster",
        "h100-node",
        "--nodes",
        "1",
        "--microbatches",
        "1",
        "--mesh",
        "fsdp",
        "--workers",
        "1",
        "--out",
        str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "configs/s" in done.stdout and "best:" in done.stdout
    config = load_config(tmp_path / "best.toml")
    assert config.unit_names == [*LLAMA8B_BLOCKS, "root"]
    assert config.provenance.model == "llama8b" and config.provenance.world_size == 8
    assert any("simulated" in note and "h100-node" in note for note in config.provenance.notes)
    # One microbatch of llama8b (batch 1 x 8192 tokens) per device. Its FLOPs by hand: 6 per matmul weight and
    # token (32 blocks of 218,103,808 weights and the 128,256 x 4096 head), and per block attention's 4 x s^2 x dim
    # forward, 2.5x that backward.
    metrics = config.provenance.metrics
    step_s, tokens, peak = metrics["predicted_step_ms"] / 1e3, 8192, 989.4e12  # h100-node's dense bfloat16
    gemm_flops = 6 * (32 * 218_103_808 + 128_256 * 4096) * tokens
    flops = gemm_flops + 3.5 * 32 * 4 * tokens**2 * 4096
    assert metrics["predicted_mfu"] * step_s * peak == pytest.approx(flops, rel=1e-9)
    assert metrics["predicted_tokens_per_s_per_device"] * step_s == pytest.approx(tokens, rel=1e-9)
    # The compute stream runs the matmuls alone at no more than their achievable 80% of peak (the profile's
    # gemm_efficiency); attention, copies, recomputed forwards and exposed collectives only add to that.
    assert step_s >= gemm_flops / (0.80 * peak), metrics
    assert (tmp_path / "plan.json").exists() and load_config(tmp_path / "best.json") == config
    # llama8b's defaults do not fit one node: checkpointing is searched per unit and written into the config.
    assert PlanRecord.read(tmp_path / "plan.json").activation_checkpointing == "per_unit"
    assert any(u.activation_checkpointing != "none" for u in config.units)
    assert any("set per unit in this config" in note for note in config.provenance.notes)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--nodes", "0"), "error: --nodes: nodes must be >= 1, got 0"),
        (("--cluster", "cpu-gloo"), "error: --cluster: cluster profile 'cpu-gloo' has no accelerator table"),
        (("--mesh", "hsdp:3x3"), "error: --mesh: mesh 'hsdp:3x3' spans 9 ranks but the world size is 8"),
        (("--ac", "some"), "error: --ac: activation checkpointing must be auto, none or full, got 'some'"),
        (("--pp", "1,x"), "error: --pp: PP degrees must be integers separated by commas (1,2,4), got '1,x'"),
        (("--pp", "3"), "error: --pp: PP degree 3 does not divide the world size 8 and the model's 32 blocks"),
    ],
)
def test_cli_plan_bad_input_is_one_line(args, message, tmp_path, cli_main):
    done = cli_main("plan", *args, "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and done.stderr.startswith(message)
    assert not (tmp_path / "out").exists()


def _deep_tiny_pricers(depths=None):
    from autotune.plan.evaluate import make_pricer
    from autotune.sim import Hardware, get_model_work
    from profiles import load_cluster_profile

    work = get_model_work(load_model_profile("tiny").with_overrides(num_layers=40), "bfloat16")
    hardware = Hardware(load_cluster_profile("h100-node"), 1)
    space = SearchSpace(
        block_names=work.block_names, world_size=8, num_microbatches=2, device_type="cuda", fixed_mesh="fsdp"
    )

    def make(depth=None):
        return make_pricer(work, hardware, space, mixed_precision=BF16, activation_checkpointing=False, depth=depth)

    return space, make(), tuple(make(d) for d in (depths or (8, 16)))


def test_depth_extrapolation_matches_full_depth_simulations():
    # [Note: plan speed]: each block adds the same time and memory in the steady state, so two shallow
    # simulations extrapolate to 40 blocks, whatever the pattern over the blocks. This tiny model's blocks
    # compute for microseconds, so collective latencies keep some schedules from a steady state within 8
    # blocks: 29 of 300 points land up to 0.3% off (none of 400 for llama70b on 128 ranks).
    from autotune.plan.evaluate import extrapolate, is_dominated

    space, full, (shallow, deep) = _deep_tiny_pricers()
    points = [p for p in iter_space_params(space) if not is_dominated(p)]
    num_exact = 0
    for params in random.Random(0).sample(points, 150):
        exact = full.simulator.simulate_knobs([full.factory.get_knobs(params)])[0]
        a, b = (p.simulator.simulate_knobs([p.factory.get_knobs(params)])[0] for p in (shallow, deep))
        guess = extrapolate(a, b, (40 - 16) / (16 - 8), full.simulator, 2)
        assert guess.step_s == pytest.approx(exact.step_s, rel=5e-3), params
        num_exact += guess.step_s == pytest.approx(exact.step_s, rel=1e-9)
        assert guess.peak_memory_bytes == pytest.approx(exact.peak_memory_bytes, rel=1e-6), params
        assert guess.tokens_per_s_per_device * guess.step_s == pytest.approx(
            exact.tokens_per_s_per_device * exact.step_s, rel=1e-9
        )
    assert num_exact >= 0.8 * 150


def test_evaluation_prunes_dominated_points_and_simulates_equal_knobs_once():
    from autotune.plan.evaluate import evaluate_space, get_identity, is_dominated

    space, full, reduced = _deep_tiny_pricers()
    points = list(iter_space_params(space))
    default = space.get_default_params()
    exact = evaluate_space(points, full, default=default, reporter=_Silent(), num_workers=1)
    dominated = [p for p in points if is_dominated(p)]
    assert dominated and exact.num_pruned == len(dominated) and len(exact.rows) == len(points) - len(dominated)
    # backward prefetch "implicit" is FSDP2's previous unit, which "depth1" lists: the same knobs, one simulation
    twin = {**default, "backward_prefetch": "depth1"}
    assert get_identity(full.factory.get_knobs(twin)) == get_identity(full.factory.get_knobs(default))
    by_params = {tuple(sorted(r.params.items())): r.prediction for r in exact.rows}
    assert by_params[tuple(sorted(twin.items()))] is by_params[tuple(sorted(default.items()))]
    assert exact.num_simulated < len(exact.rows)
    # extrapolated: the fastest and the defaults re-simulated at full depth give the same ranking's top
    fast = evaluate_space(points, full, default=default, reporter=_Silent(), num_workers=1, reduced=reduced)
    top = lambda ev: sorted((r for r in ev.rows if r.exact), key=lambda r: r.prediction.step_s)[0]  # noqa: E731
    assert top(fast).prediction.step_s == pytest.approx(top(exact).prediction.step_s, rel=1e-9)
    assert next(r for r in fast.rows if r.params == default).exact and fast.num_exact < len(fast.rows)


class _Silent:
    def on_phase(self, message): ...
    def on_start(self, total): ...
    def on_advance(self, count): ...


def test_fast_knobs_equal_the_built_config_with_grouping_checkpointing_and_root_knobs():
    """The memory knobs change the units every other expansion is over (grouping) or the root's
    entries (its reshard and sync level): the assembled knobs still equal the built config's."""
    space = _space(8, grouping=True, checkpointing=True, root_knobs=True)
    factory = KnobFactory(space, world_size=8, device="cuda", mixed_precision=BF16)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=5))
    seen = set()
    for _ in range(300):
        trial = study.ask()
        space.suggest(trial)
        params = trial.params
        seen |= {
            (k, str(v))
            for k, v in params.items()
            if k in ("blocks_per_unit", "ac_kind", "root_sync_hsdp", "root_reshard_after_forward")
        }
        slow = resolve_knobs(factory.build_config(params), LLAMA8B_BLOCKS, world_size=8, device="cuda")
        assert factory.get_knobs(params) == slow, params
        study.tell(trial, 1.0)
    assert {
        ("blocks_per_unit", "4"),
        ("ac_kind", "selective"),
        ("root_sync_hsdp", "replica_last"),
        ("root_reshard_after_forward", "true"),
    } <= seen


def test_the_simulated_space_keeps_the_edges_in_the_root():
    """The simulator's units are blocks and the root: a presearch walks the space without the
    embeddings/head split, and a split trial gets no prediction instead of an error."""
    from autotune.search.presearch import Predictor
    from autotune.search.ranking import get_simulated_space

    space = _space(8, root_knobs=True, embedding_names=("tok_embeddings",), head_names=("norm", "output"))
    simulated = get_simulated_space(space)
    assert space.can_split and not simulated.can_split and simulated.root_knobs
    assert all("root_split" not in p for p in itertools.islice(iter_space_params(simulated), 2000))
    predictor = Predictor(space=space, simulator=None, default_step_s=1.0)  # type: ignore[arg-type]
    assert predictor.predict({**space.get_default_params(), "root_split": "split"}) == {}


@pytest.mark.parametrize(
    "changes",
    [
        {"grouping": True, "root_knobs": True},
        {"grouping": True, "root_knobs": True, "checkpointing": True, "fixed_mesh": "fsdp"},
    ],
)
def test_staged_ranking_finds_the_exhaustive_fastest(changes):
    """[Note: staged ranking]: the memory knobs' variants of the fastest core configs hold the
    fastest point of the whole space (one microbatch keeps the exhaustive walk to seconds)."""
    from _measured_profiles import get_measured_profile

    from autotune.search.ranking import STAGED_TOP, rank_space, simulate_points
    from autotune.sim import Hardware, Simulator, get_model_work
    from autotune.sim.measured import CollectiveFit
    from profiles import load_cluster_profile

    measured = get_measured_profile(
        world_size=2,
        collectives={
            kind: CollectiveFit(latency_s=1e-4, seconds_per_byte=1e-9, group_size=2)
            for kind in ("all_gather", "reduce_scatter", "all_reduce")
        },
    )
    work = get_model_work(load_model_profile("tiny"), "float32")
    simulator = Simulator(work, Hardware(load_cluster_profile("cpu-gloo"), num_ranks=2, measured=measured))
    space = SearchSpace(block_names=work.block_names, world_size=2, num_microbatches=1, **changes)
    staged = rank_space(space, simulator, world_size=2, device="cpu")
    factory = KnobFactory(space, world_size=2, device="cpu", mixed_precision=MixedPrecisionConfig())
    exhaustive = sorted(
        simulate_points(iter_space_params(space), factory, simulator), key=lambda p: p.prediction.step_s
    )
    assert STAGED_TOP < len(staged) < len(exhaustive) / 2
    assert staged[0].prediction.step_s == pytest.approx(exhaustive[0].prediction.step_s, rel=1e-9)
    keys = {tuple(sorted(p.items())) for p in iter_space_params(space)}
    assert all(
        tuple(sorted(p.params.items())) in keys for p in staged
    )  # every staged point is a point of the space, all its knobs set


def _fake_prediction(params: dict, *, fast_ones_fit: bool):
    from autotune.sim import StepPrediction

    step = random.Random(repr(sorted(params.items()))).random()
    fits = (step >= 0.5) != fast_ones_fit  # the faster half fits, or the slower half
    return StepPrediction(
        step_s=step,
        compute_s=step,
        comm_s=0.0,
        exposed_comm_s=0.0,
        tokens_per_s_per_device=1.0,
        mfu=0.0,
        peak_memory_bytes=1.0 if fits else 3.0,
        memory_capacity_bytes=2.0,
    )


@pytest.mark.parametrize("top_fitting", [False, True])
def test_staged_ranking_takes_its_top_its_fitting_seeds_and_its_key_as_parameters(top_fitting):
    """[Note: staged ranking]'s parameters, with a made-up evaluation: the second stage holds every
    memory-knob variant of the ``num_top`` fastest core points, and with ``top_fitting`` of the
    ``num_top`` fastest that fit (here slower than the fastest, which do not fit); ``key`` orders the result."""
    from autotune.search.ranking import RankedPoint, get_core_space, iter_memory_variants, rank_staged
    from autotune.search.space import BLOCKS_PER_UNIT

    space = SearchSpace(block_names=tuple(f"layers.{i}" for i in range(4)), world_size=2, grouping=True)
    calls = []

    def evaluate(points, second_stage):
        calls.append((second_stage, points))
        return [RankedPoint(params=p, prediction=_fake_prediction(p, fast_ones_fit=False)) for p in points]

    ranked = rank_staged(space, evaluate, num_top=2, top_fitting=top_fitting, key=lambda r: -r.prediction.step_s)
    (first, core), (second, varied) = calls
    assert (first, second) == (False, True)
    assert len(core) == len(list(iter_space_params(get_core_space(space))))
    by_step = sorted(core, key=lambda p: _fake_prediction(p, fast_ones_fit=False).step_s)
    fastest = by_step[:2]
    fitting = [p for p in by_step if _fake_prediction(p, fast_ones_fit=False).fits][:2]
    seeds = fastest + (fitting if top_fitting else [])
    num_variants = len(list(iter_memory_variants(space, "fsdp"))) - 1
    assert num_variants == len(BLOCKS_PER_UNIT) - 1 and len(varied) == len(seeds) * num_variants
    assert {p["blocks_per_unit"] for p in varied} == set(BLOCKS_PER_UNIT[1:])
    assert [{**p, "blocks_per_unit": 1} for p in varied[::num_variants]] == seeds
    assert [r.prediction.step_s for r in ranked] == sorted((r.prediction.step_s for r in ranked), reverse=True)
    assert len(ranked) == len(core) + len(varied)
