"""Switching knobs in place on a sharded model ([Note: knobs switched in place]).

Multi-rank (2 gloo ranks, tiny Llama, 2 microbatches): a model switched to a config trains
exactly as a fresh build of that config (losses bitwise: none of the in-place knobs changes
the order of a floating-point sum, and ``sync = "last"`` reorders the sums the same way in the
switched and the fresh run), and each switch takes effect (collective and eager-concat counts
per step equal the fresh build's). Single rank: which differences are structural, and that a
structural switch is refused by name.
"""

from __future__ import annotations

import dataclasses

import pytest

from fsdp_runtime import (
    RuntimeConfig,
    UnitConfig,
    apply_fsdp,
    config_to_dict,
    default_config,
    get_structural_differences,
    get_unsupported_knobs,
    switch_config,
)
from profiles import build_model, load_model_profile

pytestmark = pytest.mark.torch_matrix

BLOCKS = [f"layers.{i}" for i in range(load_model_profile("tiny").shape.num_layers)]
RS_BUFFERS = "reduce_scatter_max_input_buffers" not in get_unsupported_knobs()
RS_GROUP = "separate_reduce_scatter_group" not in get_unsupported_knobs()
"""The installed torch can give reduce-scatter its own process group (2.13 on)."""


def _config(**overrides) -> RuntimeConfig:
    return default_config(BLOCKS, num_microbatches=2, **overrides)


def _with_blocks(config: RuntimeConfig, **unit_overrides) -> RuntimeConfig:
    units = [dataclasses.replace(u, **unit_overrides) if u.name != "root" else u for u in config.units]
    return dataclasses.replace(config, units=units)


def _depth1(config: RuntimeConfig) -> RuntimeConfig:
    units = []
    for i, unit in enumerate(config.units):
        ahead = [BLOCKS[i + 1]] if i + 1 < len(BLOCKS) else []
        behind = [BLOCKS[i - 1]] if 0 < i < len(BLOCKS) else []
        units.append(dataclasses.replace(unit, forward_prefetch=ahead, backward_prefetch=behind))
    return dataclasses.replace(config, units=units)


DEFAULTS = _config()
# Every order-keeping knob away from its default at once.
KEEPING = _depth1(
    _with_blocks(
        _config(
            unshard_async="off",
            reduce_scatter_max_input_buffers=2 if RS_BUFFERS else None,
            separate_reduce_scatter_group=RS_GROUP,
        ),
        reshard_after_forward=False,
        reshard_after_backward=False,
    )
)
# Sums reordered (no sync on the first microbatch) and FSDP1's eager concat.
NOSYNC = _with_blocks(_config(), sync="last", defer_concat=False)


@pytest.fixture(scope="module")
def runs(pool2) -> dict[str, list[dict]]:
    d, k, n = (config_to_dict(c) for c in (DEFAULTS, KEEPING, NOSYNC))
    named = {
        "fresh_defaults": {"build": d, "steps": [d] * 4},
        "fresh_keeping": {"build": k, "steps": [k] * 4},
        "switched_keeping": {"build": d, "steps": [d, k, k, d]},
        "fresh_nosync": {"build": n, "steps": [n] * 3},
        "switched_nosync": {"build": d, "steps": [n, n, d]},
        "adopted_keeping": {"build": d, "adopt": k, "steps": [k] * 4},
        "adopted_nosync": {"build": d, "adopt": n, "steps": [n] * 3},
    }
    # One job on the session's pool (each run from a fresh build and seed); its hard limit kills every rank's tree.
    run = pool2.run("_harness:train_switched", {"model": "tiny", "runs": list(named.values())}, timeout_s=240)
    assert run.ok, f"{run.status}: {run.reason}\n{run.stderr_tails}"
    return {name: [run.results[r][i] for r in range(2)] for i, name in enumerate(named)}


def _field(runs: dict, name: str, field: str) -> list:
    return [r[field] for r in runs[name]]


def test_knobs_switched_in_place_train_as_fresh_builds(runs):
    losses = {name: _field(runs, name, "losses") for name in runs}
    assert losses["switched_keeping"] == losses["fresh_defaults"] == losses["fresh_keeping"]
    # A step's loss comes before its own update: the third step's is still the no-sync updates'.
    assert losses["switched_nosync"] == losses["fresh_nosync"]


def test_each_switch_takes_effect(runs):
    fresh_d, fresh_k = runs["fresh_defaults"][0], runs["fresh_keeping"][0]
    switched = runs["switched_keeping"][0]
    assert fresh_k["collectives"][1]["all_gather"] < fresh_d["collectives"][1]["all_gather"]  # the knobs differ
    expected = [
        fresh_d["collectives"][0],
        fresh_k["collectives"][1],
        fresh_k["collectives"][2],
        fresh_d["collectives"][3],
    ]
    assert switched["collectives"] == expected

    fresh_n, switched_n = runs["fresh_nosync"][0], runs["switched_nosync"][0]
    assert fresh_n["collectives"][0]["reduce_scatter"] < fresh_d["collectives"][0]["reduce_scatter"]
    assert switched_n["collectives"] == [
        fresh_n["collectives"][0],
        fresh_n["collectives"][1],
        fresh_d["collectives"][2],
    ]
    assert switched_n["eager_concats"][:2] == fresh_n["eager_concats"][:2] and fresh_n["eager_concats"][0] > 0
    assert switched_n["eager_concats"][2] == 0  # switched back: FSDP2's own post-backward again


@pytest.mark.skipif(not RS_GROUP, reason="torch < 2.13: no set_separate_reduce_scatter_group")
def test_the_own_reduce_scatter_group_switches_in_place_and_the_groups_made_do_not_grow(runs):
    """Every unit reduce-scatters on its own group exactly on the steps whose config says so, and
    the runs' builds, switches on and off, and adoption made one group per process in all."""
    units = len(BLOCKS) + 1
    assert _field(runs, "switched_keeping", "rs_groups") == [[0, units, units, 0]] * 2
    assert _field(runs, "fresh_keeping", "rs_groups") == [[units] * 4] * 2
    assert _field(runs, "adopted_keeping", "rs_groups") == [[units] * 4] * 2
    assert _field(runs, "fresh_defaults", "rs_groups") == [[0] * 4] * 2
    made = [count for name in runs for count in _field(runs, name, "rs_groups_made")]
    assert max(made) == 1 and set(made) <= {0, 1}  # 0: a run before any group was made


def test_a_model_sharded_elsewhere_and_adopted_trains_as_a_fresh_build_of_the_config(runs):
    """adopt_fsdp on a model sharded at FSDP2's defaults sets every in-place knob of the config:
    losses bitwise and collectives per step those of a fresh build of it."""
    for adopted, fresh in (("adopted_keeping", "fresh_keeping"), ("adopted_nosync", "fresh_nosync")):
        assert _field(runs, adopted, "losses") == _field(runs, fresh, "losses")
        assert _field(runs, adopted, "collectives") == _field(runs, fresh, "collectives")
        assert _field(runs, adopted, "eager_concats") == _field(runs, fresh, "eager_concats")


STRUCTURAL = {
    "mesh": dataclasses.replace(DEFAULTS, mesh=dataclasses.replace(DEFAULTS.mesh, kind="hsdp", replicate=1)),
    "mixed_precision": dataclasses.replace(
        DEFAULTS, mixed_precision=dataclasses.replace(DEFAULTS.mixed_precision, param_dtype="bfloat16")
    ),
    "num_microbatches": dataclasses.replace(DEFAULTS, num_microbatches=4),
    "units": dataclasses.replace(
        DEFAULTS, units=[UnitConfig(name="layers.0-1", modules=BLOCKS[:2]), *DEFAULTS.units[2:]]
    ),
    "units[0].activation_checkpointing": _with_blocks(DEFAULTS, activation_checkpointing="full"),
    "units[0].reshard_after_forward": _with_blocks(DEFAULTS, reshard_after_forward=2),
}


@pytest.mark.parametrize("field", list(STRUCTURAL))
def test_structural_differences_are_named(field):
    differences = get_structural_differences(DEFAULTS, STRUCTURAL[field])
    assert field in differences
    assert get_structural_differences(DEFAULTS, KEEPING) == []
    assert get_structural_differences(DEFAULTS, NOSYNC) == []


def test_a_structural_switch_is_refused_and_changes_nothing(one_rank_group):
    applied = apply_fsdp(build_model(load_model_profile("tiny"), seed=0), DEFAULTS)
    before = applied.config
    with pytest.raises(ValueError, match="activation_checkpointing"):
        switch_config(applied, _with_blocks(DEFAULTS, activation_checkpointing="full"), device_type="cpu")
    assert applied.config is before
    switch_config(applied, NOSYNC, device_type="cpu")
    assert applied.config.units[0].sync == "last" and set(applied.eager_concat) == set(BLOCKS)
