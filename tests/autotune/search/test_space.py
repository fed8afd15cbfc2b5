"""Search space: the defaults point is FSDP2's defaults; patterns expand to valid per-unit configs."""

from __future__ import annotations

import dataclasses

import optuna
import pytest
from torch.distributed.fsdp import FSDPModule

from autotune.search import SearchSpace, describe_params, describe_params_diff
from fsdp_runtime import (
    MixedPrecisionConfig,
    RuntimeConfig,
    default_config,
    get_knob,
    validate_config,
    validate_for_world,
)

BLOCKS = tuple(f"layers.{i}" for i in range(4))


def _space(**kw) -> SearchSpace:
    return SearchSpace(**{"block_names": BLOCKS, "world_size": 4, "num_microbatches": 2, **kw})


def test_defaults_point_is_fsdp2_defaults():
    space = _space()
    config = space.build_config(space.get_default_params())
    expected = dataclasses.replace(default_config(list(BLOCKS), num_microbatches=2), unshard_async="off")
    assert config == expected
    gpu = _space(device_type="cuda")
    assert gpu.build_config(gpu.get_default_params()) == default_config(list(BLOCKS), num_microbatches=2)


def test_a_trial_s_knobs_are_described_as_the_change_from_the_defaults():
    """Tables show a trial's knobs as what differs from the defaults trial's params, in the space's
    order whatever the params' own; a knob named per mesh (the reshard choice of a shard group of 4
    or 2, the HSDP sync level) compares as that knob; a knob asked only under another's choice counts
    as changed."""
    space = _space(grouping=True, root_knobs=True)
    defaults = space.get_default_params()
    rsgroup = " rsgroup=false" if hasattr(FSDPModule, "set_separate_reduce_scatter_group") else ""  # torch >= 2.13
    assert describe_params(defaults) == (
        "fsdp fwd=implicit bwd=implicit raf=true rsbuf=1 async=off nosync=none group=1 rootraf=false rootsync=every"
        + rsgroup
    )
    trial = {
        "root_reshard_after_forward": "true",
        "nosync_level_hsdp": "replica_last",
        "keep_unsharded": False,
        "reduce_scatter_buffers": 1,
        "nosync_blocks": "all",
        "reshard_after_forward": "true",
        "backward_prefetch": "paired",
        "mesh": "hsdp:2x2",
        "forward_prefetch": "implicit",
        "unshard_async": "off",
        "blocks_per_unit": 2,
        "root_sync_hsdp": "every",
    }
    assert describe_params_diff(trial, defaults) == (
        "hsdp:2x2 bwd=paired nosync=all level=replica_last keep=false group=2 rootraf=true"
    )
    assert (
        describe_params_diff(defaults, defaults) == describe_params_diff({**defaults, "pp": 1}, defaults) == "defaults"
    )
    assert describe_params_diff({**defaults, "pp": 2, "pp2_schedule": "gpipe"}, defaults) == "pp=2 sched=gpipe"


def test_mesh_choices_are_every_factorization():
    assert _space().get_mesh_choices() == ["fsdp", "hsdp:2x2", "hsdp:4x1"]
    assert _space(world_size=6).get_mesh_choices() == ["fsdp", "hsdp:2x3", "hsdp:3x2", "hsdp:6x1"]
    assert _space(fixed_mesh="fsdp").get_mesh_choices() == ["fsdp"]


def test_patterns_expand_to_explicit_lists():
    space = _space()
    params = {
        **space.get_default_params(),
        "mesh": "hsdp:2x2",
        "forward_prefetch": "depth2",
        "backward_prefetch": "paired",
        "nosync_blocks": "every_2nd",
        "nosync_level_hsdp": "replica_last",
        "keep_unsharded": True,
        "reshard_after_forward": "last_block_false",
    }
    config = space.build_config(params)
    units = {u.name: u for u in config.units}
    assert units["layers.0"].forward_prefetch == ["layers.1", "layers.2"]
    assert units["layers.3"].forward_prefetch == []
    # Backward runs layers.3 first: paired means 3 -> [2, 1], 2 -> [], 1 -> [0], 0 -> [].
    assert [units[f"layers.{i}"].backward_prefetch for i in (3, 2, 1, 0)] == [
        ["layers.2", "layers.1"],
        [],
        ["layers.0"],
        [],
    ]
    assert [units[f"layers.{i}"].sync for i in range(4)] == ["replica_last", "every", "replica_last", "every"]
    assert units["layers.0"].reshard_after_backward is False and units["layers.1"].reshard_after_backward is True
    assert [units[f"layers.{i}"].reshard_after_forward for i in range(4)] == [None, None, None, False]
    assert config.mesh.kind == "hsdp" and (config.mesh.replicate, config.mesh.shard) == (2, 2)
    assert units["root"].forward_prefetch is None


def test_int_reshard_is_only_offered_where_it_divides_the_shard():
    space = _space()  # world 4: fsdp shards over 4 ranks, hsdp:2x2 over 2
    base = space.get_default_params()
    assert space.build_config({**base, "reshard_after_forward_shard4": "int:2"}).units[0].reshard_after_forward == 2
    # An int the mesh cannot use is an error, never a silent fall-back onto another point's config.
    with pytest.raises(ValueError, match="proper divisor"):
        space.build_config({**base, "mesh": "hsdp:2x2", "reshard_after_forward": "int:2"})
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    sampled_ints = 0
    for _ in range(80):
        trial = study.ask()
        config = space.suggest(trial)
        if trial.params["mesh"] == "hsdp:2x2":
            assert "reshard_after_forward_shard4" not in trial.params and trial.params["reshard_after_forward"] in (
                "true",
                "false",
                "last_block_false",
            )
        sampled_ints += any(
            isinstance(u.reshard_after_forward, int) and not isinstance(u.reshard_after_forward, bool)
            for u in config.units
        )
        study.tell(trial, 1.0)
    assert sampled_ints > 0, "int reshard never sampled where it is valid"


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_every_sampled_config_is_valid(world_size):
    space = _space(world_size=world_size)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=world_size))
    seen = set()
    for _ in range(60):
        trial = study.ask()
        config = space.suggest(trial)
        validate_config(config)
        validate_for_world(config, world_size)
        assert [u.name for u in config.units] == [*BLOCKS, "root"]
        seen.add(describe_params(trial.params))
        study.tell(trial, 1.0)
    assert len(seen) > 40, "the space is not being explored"


def test_single_microbatch_has_no_sync_knobs():
    space = _space(num_microbatches=1)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(10):
        trial = study.ask()
        assert all(u.sync == "every" for u in space.suggest(trial).units)
        assert "nosync_blocks" not in trial.params
        study.tell(trial, 1.0)


EDGES = {"embedding_names": ("tok_embeddings",), "head_names": ("norm", "output")}
MEMORY_KNOBS = {"grouping": True, "checkpointing": True, "root_knobs": True, **EDGES}
SCHEMA2_PARAMS = {
    "blocks_per_unit",
    "ac_units",
    "ac_kind",
    "root_reshard_after_forward",
    "root_sync_fsdp",
    "root_sync_hsdp",
    "root_keep_unsharded",
    "root_split",
}


def test_memory_knobs_are_off_unless_asked_and_their_defaults_are_fsdp2_defaults():
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(30):  # `autotune plan` walks this space: its points must not change
        trial = study.ask()
        config = _space().suggest(trial)
        assert not SCHEMA2_PARAMS & set(trial.params)
        assert all(u.modules is None and u.activation_checkpointing == "none" for u in config.units)
        study.tell(trial, 1.0)
    space = _space(**MEMORY_KNOBS)
    params = space.get_default_params()
    assert {k: params[k] for k in SCHEMA2_PARAMS if k in params} == {
        "blocks_per_unit": 1,
        "ac_units": "none",
        "root_reshard_after_forward": "false",
        "root_sync_fsdp": "every",
        "root_split": "none",
    }
    assert space.build_config(params) == dataclasses.replace(
        default_config(list(BLOCKS), num_microbatches=2), unshard_async="off"
    )


def test_grouping_makes_units_of_consecutive_blocks_and_patterns_follow_units():
    blocks = tuple(f"layers.{i}" for i in range(6))
    space = _space(block_names=blocks, grouping=True, checkpointing=True)
    base = space.get_default_params()
    config = space.build_config(
        {
            **base,
            "blocks_per_unit": 4,
            "forward_prefetch": "depth1",
            "nosync_blocks": "first_half",
            "nosync_level_fsdp": "last",
        }
    )
    assert [(u.name, u.modules) for u in config.units] == [
        ("layers.0-3", [f"layers.{i}" for i in range(4)]),
        ("layers.4-5", ["layers.4", "layers.5"]),
        ("root", None),
    ]
    assert [u.forward_prefetch for u in config.units[:2]] == [["layers.4-5"], []]
    assert [u.sync for u in config.units] == ["last", "every", "every"]
    pairs = space.build_config(
        {
            **base,
            "blocks_per_unit": 2,
            "reshard_after_forward_shard4": "last_block_false",
            "ac_units": "all_but_last",
            "ac_kind": "full",
        }
    )
    assert [u.name for u in pairs.units] == ["layers.0-1", "layers.2-3", "layers.4-5", "root"]
    assert [u.reshard_after_forward for u in pairs.units] == [None, None, False, None]
    assert [u.activation_checkpointing for u in pairs.units] == ["full", "full", "none", "none"]
    assert space.build_config({**base, "blocks_per_unit": 1}).units[0].modules is None


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("none", [0, 0, 0, 0]),
        ("all", [1, 1, 1, 1]),
        ("all_but_last", [1, 1, 1, 0]),
        ("every_2nd", [1, 0, 1, 0]),
        ("first_half", [1, 1, 0, 0]),
    ],
)
def test_checkpointing_patterns(pattern, expected):
    space = _space(checkpointing=True)
    params = {**space.get_default_params(), "ac_units": pattern, "ac_kind": "selective"}
    kinds = [u.activation_checkpointing for u in space.build_config(params).units]
    assert kinds == [("selective" if on else "none") for on in expected] + ["none"]  # never the root


def test_root_knobs_and_split_edges():
    space = _space(root_knobs=True, **EDGES)
    base = space.get_default_params()
    config = space.build_config(
        {**base, "root_sync_fsdp": "last", "root_keep_unsharded": True, "root_reshard_after_forward": "true"}
    )
    root = config.get_unit("root")
    assert (root.sync, root.reshard_after_backward, root.reshard_after_forward) == ("last", False, True)
    assert config.unit_names == [*BLOCKS, "root"]
    split = space.build_config(
        {
            **base,
            "root_split": "split",
            "forward_prefetch": "depth1",
            "backward_prefetch": "depth1",
            "root_sync_fsdp": "last",
        }
    )
    assert split.unit_names == [*BLOCKS, "tok_embeddings", "norm+output", "root"]
    units = {u.name: u for u in split.units}
    assert units["norm+output"].modules == ["norm", "output"] and units["norm+output"].reshard_after_forward is False
    assert units["tok_embeddings"].forward_prefetch == ["layers.0"] and units["layers.3"].forward_prefetch == [
        "norm+output"
    ]
    assert units["norm+output"].backward_prefetch == ["layers.3"] and units["layers.0"].backward_prefetch == [
        "tok_embeddings"
    ]
    assert [units[n].sync for n in ("tok_embeddings", "norm+output", "root", "layers.0")] == [
        "last",
        "last",
        "last",
        "every",
    ]
    # No edge modules known (or one microbatch): no split, no sync level.
    assert "root_split" not in _space(root_knobs=True).get_default_params()
    assert "root_sync_fsdp" not in _space(root_knobs=True, num_microbatches=1).get_default_params()


def test_root_sync_levels_follow_the_mesh():
    space = _space(root_knobs=True, fixed_mesh="hsdp:2x2")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    levels = set()
    for _ in range(40):
        trial = study.ask()
        levels.add(space.suggest(trial).get_unit("root").sync)
        assert "root_sync_fsdp" not in trial.params
        study.tell(trial, 1.0)
    assert levels == {"every", "replica_last", "last"}


@pytest.mark.parametrize(
    ("precision", "reduce_dtype_differs"),
    [
        ({}, False),
        ({"mixed_precision": MixedPrecisionConfig(param_dtype="float32", reduce_dtype="float32")}, False),
        ({"mixed_precision": MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")}, True),
        ({"search_reduce_dtype": True}, True),
    ],
)
def test_replica_level_is_offered_only_where_it_is_not_dominated(precision, reduce_dtype_differs):
    # HSDP 4x1 replicates over a shard group of one: replica_last would copy and accumulate every
    # microbatch's gradients for nothing, unless it accumulates in a wider reduce dtype than last does.
    space = _space(root_knobs=True, fixed_mesh="hsdp:4x1", **precision)
    assert space.reduce_dtype_differs == reduce_dtype_differs
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=5))
    levels, root_levels, keys = set(), set(), set()
    for _ in range(60):
        trial = study.ask()
        config = space.suggest(trial)
        levels |= {u.sync for u in config.units if u.name != "root"}
        root_levels.add(config.get_unit("root").sync)
        keys |= {k for k in trial.params if k.startswith(("nosync_level", "root_sync"))}
        study.tell(trial, 1.0)
    suffix = "hsdp" if reduce_dtype_differs else "fsdp"
    assert keys == {f"nosync_level_{suffix}", f"root_sync_{suffix}"}
    assert levels == ({"every", "last", "replica_last"} if reduce_dtype_differs else {"every", "last"})
    assert root_levels == levels
    assert space.get_sync_suffix("hsdp:2x2") == "hsdp" and space.get_sync_suffix("fsdp") == "fsdp"
    # The defaults trial names the parameter the sampler asks for on its mesh.
    assert f"root_sync_{suffix}" in space.get_default_params()


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_sampled_config_with_memory_knobs_is_valid(world_size):
    space = _space(world_size=world_size, **MEMORY_KNOBS)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=world_size))
    seen_params: set[str] = set()
    for _ in range(80):
        trial = study.ask()
        config = space.suggest(trial)
        validate_config(config)
        validate_for_world(config, world_size)
        modules = [m for u in config.units if u.name != "root" for m in u.get_modules()]
        assert sorted(m for m in modules if m.startswith("layers.")) == list(BLOCKS)  # every block in exactly one unit
        seen_params |= set(trial.params)
        assert "ac=" in describe_params(trial.params) and "group=" in describe_params(trial.params)
        study.tell(trial, 1.0)
    # On 2 ranks HSDP is 2x1, which has no replica level: the root's level is the FSDP parameter there.
    assert SCHEMA2_PARAMS - ({"root_sync_hsdp"} if world_size == 2 else set()) <= seen_params


UNSUPPORTED = {  # config field -> (the parameter it is searched as, why this torch cannot set it)
    "reduce_scatter_max_input_buffers": (
        "reduce_scatter_buffers",
        "needs torch >= 2.13 (pytorch #186000); torch 2.12.0 has no FSDPModule.set_reduce_scatter_max_input_buffers",
    ),
    "unshard_async": (
        "unshard_async",
        "needs torch >= 2.6 (pytorch #135523); torch 2.99 has no FSDPModule._set_unshard_async_op",
    ),
}


@pytest.mark.parametrize("field", sorted(UNSUPPORTED))
def test_a_knob_this_torch_cannot_set_is_never_asked_and_said_in_one_line(field):
    param, why = UNSUPPORTED[field]
    space = _space(unsupported_knobs=((field, why),))
    assert space.notes == [f"{field} not searched: {why}"]
    assert param not in space.get_default_params()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        trial = study.ask()
        config = space.suggest(trial)
        assert param not in trial.params
        assert getattr(config, field) == getattr(RuntimeConfig(), field)  # the field's default: FSDP2's own
        study.tell(trial, 1.0)
    full = _space()  # the installed torch's probe is not the space's business: nothing left out unless told
    assert param in full.get_default_params() and full.notes == []


PLAN_LINES = ("target", "model", "ranks", "baseline", "links", "rounds (at most)", "cost (at most)", "estimated wall")
"""The first words of the search plan's lines (``SearchPlan.describe``)."""


def test_the_search_takes_the_probe_and_prints_its_line(tmp_path, monkeypatch):
    """``run_search`` builds its space from ``fsdp_runtime.get_unsupported_knobs`` and says what it left
    out through the reporter before any trial (stopped here where the rank pool would open)."""
    from _search_fixtures import start_search
    from torch.distributed.fsdp import FSDPModule

    from autotune.search import SearchSettings

    monkeypatch.delattr(FSDPModule, "set_reduce_scatter_max_input_buffers", raising=False)
    space, phases = start_search(SearchSettings(model="tiny", world_size=2, out_dir=tmp_path / "run"), monkeypatch)
    assert "reduce_scatter_buffers" not in space.get_default_params()
    notes = [p for p in phases if p.split(":")[0] not in PLAN_LINES]  # the plan's lines come first
    assert notes == space.notes and notes[0].startswith(
        "reduce_scatter_max_input_buffers not searched: needs torch >= 2.13 (pytorch #186000); torch "
    )


def test_the_emitted_config_records_what_was_left_out(tmp_path):
    from types import SimpleNamespace

    from autotune.search.emit import emit_best
    from fsdp_runtime import load_config

    field = "reduce_scatter_max_input_buffers"
    space = _space(unsupported_knobs=((field, UNSUPPORTED[field][1]),))
    ctx = SimpleNamespace(
        space=space,
        settings=SimpleNamespace(sampler="tpe", num_trials=1, world_size=4, cluster=None),
        plan=SimpleNamespace(requested=SimpleNamespace(name="tiny"), proxy_name=None, is_proxy=False),
        write_dir=tmp_path,
    )
    config = space.build_config(space.get_default_params())
    best = SimpleNamespace(number=0, step_ms=1.0, ratio=1.0)
    path = emit_best(ctx, config, best=best, default=None, confirmation=None, consolidation={})
    assert load_config(path).provenance.notes[-1] == space.notes[0]


def test_every_config_of_the_space_runs_its_precision():
    """Defaults, sampled points and built points all carry the space's precision (the search's
    reference, its trials and the emitted config run what the user chose)."""
    bf16 = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")
    space = _space(mixed_precision=bf16, grouping=True, root_knobs=True)
    assert space.build_config(space.get_default_params()).mixed_precision == bf16
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    for _ in range(20):
        trial = study.ask()
        assert space.suggest(trial).mixed_precision == bf16
        assert "reduce_dtype" not in trial.params  # not a knob unless asked for
        study.tell(trial, 1.0)


def test_the_reduce_dtype_is_a_knob_only_when_asked_and_defaults_to_the_space_s():
    bf16 = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")
    space = _space(mixed_precision=bf16, search_reduce_dtype=True)
    defaults = space.get_default_params()
    assert defaults["reduce_dtype"] == "float32" and space.build_config(defaults).mixed_precision == bf16
    both = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="bfloat16")
    assert space.build_config({**defaults, "reduce_dtype": "bfloat16"}).mixed_precision == both
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=4))
    seen = set()
    for _ in range(30):
        trial = study.ask()
        config = space.suggest(trial)
        assert config.mixed_precision.reduce_dtype == trial.params["reduce_dtype"]
        assert config.mixed_precision.param_dtype == "bfloat16"
        seen.add(trial.params["reduce_dtype"])
        study.tell(trial, 1.0)
    assert seen == {"float32", "bfloat16"}
    assert "reduce" in describe_params({**defaults, "reduce_dtype": "bfloat16"})


def test_the_simulator_s_knobs_follow_a_searched_reduce_dtype():
    from autotune.search.ranking import KnobFactory
    from autotune.sim import resolve_knobs

    space = _space(
        mixed_precision=MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32"),
        search_reduce_dtype=True,
    )
    factory = KnobFactory(space, world_size=4, device="cuda")
    for reduce in ("float32", "bfloat16"):
        params = {**space.get_default_params(), "reduce_dtype": reduce, "mesh": "hsdp:2x2"}
        knobs = factory.get_knobs(params)
        assert knobs.reduce_dtype == reduce
        assert knobs == resolve_knobs(factory.build_config(params), space.block_names, world_size=4, device="cuda")


def test_the_space_says_which_knobs_it_leaves_to_another_device_and_the_registry_s_notes():
    cpu, cuda = _space(), _space(device_type="cuda")
    assert "symmetric_memory not searched: asked on cuda only" in cpu.device_notes
    assert "process_group_comm_buffers not searched: asked on cuda only" in cpu.device_notes
    assert "unshard_async not searched: asked on cpu only" in cuda.device_notes
    assert not any(n.startswith(("symmetric_memory", "process_group_comm_buffers")) for n in cuda.device_notes)
    note = get_knob("unshard_in_backward").notes[0]
    assert f"unshard_in_backward: {note}" in cpu.device_notes and f"unshard_in_backward: {note}" in cuda.device_notes
    assert cpu.device_notes[0] == (
        "FSDP2 methods searched: unshard_async, reduce_scatter_max_input_buffers, separate_reduce_scatter_group, "
        "unshard_in_backward"
    )
    lacking = _space(unsupported_knobs=(("symmetric_memory", "needs torch >= 2.12"),), device_type="cuda")
    assert "symmetric_memory" not in lacking.device_notes[0] and "process_group_comm_buffers" in lacking.device_notes[0]
    assert not any(n.startswith("symmetric_memory") for n in lacking.device_notes)  # said once, in notes


def test_no_point_of_the_space_reshards_the_head_after_forward():
    # accelerate PR #4015: the head's backward runs first, so resharding it after forward only gathers it again
    space = _space(root_knobs=True, grouping=True, checkpointing=True, **EDGES)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    split = 0
    for _ in range(60):
        trial = study.ask()
        config = space.suggest(trial)
        heads = [u for u in config.units if u.name == "norm+output"]
        split += bool(heads)
        assert all(u.reshard_after_forward is False for u in heads)
        study.tell(trial, 1.0)
    assert split >= 10  # the split was sampled often enough to mean something


def test_across_nodes_the_int_reshard_is_the_node_s_size_under_a_name_of_its_own():
    from autotune.search.patterns import get_reshard_choices, get_reshard_key

    assert get_reshard_choices(16)[3:] == ["int:2", "int:4", "int:8"]
    assert get_reshard_choices(16, 8)[3:] == ["int:8"]  # 16 ranks over 2 nodes: reshard to one node
    assert get_reshard_choices(8, 8) == get_reshard_choices(8)  # a shard group inside one node: every divisor
    assert get_reshard_choices(12, 8) == get_reshard_choices(12)  # a node that does not divide the group
    assert (get_reshard_key(16), get_reshard_key(16, 8)) == (
        "reshard_after_forward_shard16",
        "reshard_after_forward_shard16_node8",
    )
    assert get_reshard_key(8, 8) == "reshard_after_forward_shard8"  # the same list, the same name
    space = _space(world_size=16, ranks_per_node=8)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(80):
        trial = study.ask()
        config = space.suggest(trial)
        if config.mesh.kind == "fsdp":
            seen |= {
                u.reshard_after_forward
                for u in config.units
                if isinstance(u.reshard_after_forward, int) and not isinstance(u.reshard_after_forward, bool)
            }
        study.tell(trial, 1.0)
    assert seen == {8}
