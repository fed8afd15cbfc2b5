"""The knob registry (``fsdp_runtime.knobs``) against what it describes: the config's fields and
defaults, the installed torch's ``FSDPModule``, and the consumers that read it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from fsdp_runtime import (
    CONFIG_KNOBS_IN_PLACE,
    KNOBS,
    UNIT_KNOBS_IN_PLACE,
    RuntimeConfig,
    UnitConfig,
    get_knob,
    get_method_knobs,
    get_unsupported_knobs,
)
from fsdp_runtime.knobs import set_method_knobs
from fsdp_runtime.tuning.moves import get_moves

pytestmark = pytest.mark.torch_matrix


def _field_default(knob):
    """The dataclass default of the knob's field (the mesh's: its kind)."""
    owner = UnitConfig(name="x") if knob.scope == "unit" else RuntimeConfig()
    for part in knob.name.split("."):
        owner = getattr(owner, part)
    return owner.kind if knob.name == "mesh" else owner


def test_every_knob_names_a_config_field_of_its_scope_with_its_default():
    for knob in KNOBS:
        assert knob.scope in ("unit", "config", "world"), knob.name
        assert knob.scope != "world" or not knob.in_place, knob.name  # a world is never switched in place
        assert _field_default(knob) == knob.default, knob.name
    assert len({k.name for k in KNOBS}) == len(KNOBS)
    shorts = [k.short for k in KNOBS]
    assert len(set(shorts)) == len(shorts), "two knobs print alike"


def test_the_in_place_fields_are_the_registry_s():
    assert set(UNIT_KNOBS_IN_PLACE) == {k.name for k in KNOBS if k.scope == "unit" and k.in_place}
    assert set(CONFIG_KNOBS_IN_PLACE) == {k.name for k in KNOBS if k.scope == "config" and k.in_place}
    assert {f.name for f in dataclasses.fields(UnitConfig)} >= set(UNIT_KNOBS_IN_PLACE)


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def test_a_method_is_on_the_installed_torch_exactly_from_the_release_the_registry_names():
    """Run under every torch of the matrix: a knob's ``since`` is where its method appears."""
    for knob in KNOBS:
        if knob.method is None:
            continue
        has = hasattr(FSDPModule, knob.method)
        assert has == (_release(torch.__version__) >= _release(knob.since)), (knob.name, knob.since)
        assert (knob.name in get_unsupported_knobs()) == (not has)


def test_a_method_knob_s_defaults_trial_answer_leaves_fsdp2_s_default():
    for knob in get_method_knobs():
        assert knob.value(RuntimeConfig(), "cuda") == knob.fsdp_default, knob.name
        if knob.search is not None:  # the defaults trial's answer sets FSDP2's value on each device it is asked on
            answered = dataclasses.replace(RuntimeConfig(), **{knob.name: knob.search.to_field(knob.search.default)})
            for device_type in knob.search.devices:
                assert knob.value(answered, device_type) == knob.fsdp_default, (knob.name, device_type)
            assert knob.search.default in knob.search.choices
        for move in knob.moves:  # every move is a value the config takes
            dataclasses.replace(RuntimeConfig(), **{knob.name: move})


class _Module:
    """A unit with every method knob's method, recording what is set."""

    def __init__(self):
        self.calls = []

    def set_reduce_scatter_max_input_buffers(self, n, *, recurse=True):
        self.calls.append(("rs", n))

    def _set_unshard_async_op(self, enabled):
        self.calls.append(("async", enabled))


def test_apply_sets_only_what_leaves_fsdp2_s_value_a_switch_what_either_side_sets_adopt_every_one():
    module, plain, tuned = _Module(), RuntimeConfig(), RuntimeConfig(reduce_scatter_max_input_buffers=2)
    set_method_knobs(module, plain, "cuda")
    assert module.calls == []  # FSDP2's own values need no call
    set_method_knobs(module, tuned, "cuda")
    assert module.calls == [("rs", 2)]
    module.calls.clear()
    set_method_knobs(module, plain, "cuda", before=tuned)  # back: the knob the old side set is reset
    assert module.calls == [("rs", 1)]
    module.calls.clear()
    set_method_knobs(module, plain, "cuda", before=plain, every=True)
    assert sorted(module.calls) == [("async", False), ("rs", 1)]
    module.calls.clear()
    set_method_knobs(module, plain, "cpu")  # auto: async on for CPU where this torch has the setter
    assert module.calls == ([("async", True)] if hasattr(FSDPModule, "_set_unshard_async_op") else [])


def test_the_tuner_s_moves_of_the_method_knobs_come_from_the_registry_on_their_devices():
    config = RuntimeConfig(units=[UnitConfig(name="b0"), UnitConfig(name="root")])
    for device_type in ("cpu", "cuda"):
        names = [m.name for m in get_moves(config, device_type=device_type)]
        for knob in get_method_knobs():
            expected = [f"{knob.name}={v}" for v in knob.moves] if device_type in knob.move_devices else []
            assert [n for n in names if n.startswith(f"{knob.name}=")] == expected
    assert get_knob("unshard_async").move_devices == ("cuda",)


def test_a_schema_4_field_is_written_only_when_set_and_then_as_version_4():
    from fsdp_runtime import config_from_dict, config_to_dict, default_config, get_added_knobs

    assert [k.name for k in get_added_knobs(4)] == [
        "separate_reduce_scatter_group",
        "unshard_in_backward",
        "process_group_comm_buffers",
        "symmetric_memory",
    ]
    plain = default_config(["layers.0"], num_microbatches=2)
    data = config_to_dict(plain)
    assert data["schema_version"] == 1 and "separate_reduce_scatter_group" not in data  # as before, byte for byte
    tuned = dataclasses.replace(plain, separate_reduce_scatter_group=True)
    data = config_to_dict(tuned)
    assert data["schema_version"] == 4 and data["separate_reduce_scatter_group"] is True
    assert config_from_dict(data) == tuned
    assert config_from_dict({**config_to_dict(plain), "schema_version": 3}).separate_reduce_scatter_group is False


def test_a_config_asking_for_a_knob_this_torch_lacks_is_refused_in_one_line_naming_the_release(monkeypatch):
    from fsdp_runtime import ConfigError
    from fsdp_runtime.knob_checks import check_torch_supports

    monkeypatch.delattr(FSDPModule, "set_separate_reduce_scatter_group", raising=False)  # as torch 2.11 is
    with pytest.raises(ConfigError) as e:
        check_torch_supports(RuntimeConfig(separate_reduce_scatter_group=True))
    message = str(e.value)
    assert "\n" not in message and message.startswith("separate_reduce_scatter_group: needs torch >= 2.13 (pytorch")
    check_torch_supports(RuntimeConfig())  # FSDP2's own value: met on every release


class _Edges(torch.nn.Module):
    """An untied embedding, a tied one (its weight also the head's) and an embedding sharing a unit with a linear."""

    def __init__(self):
        super().__init__()
        self.untied, self.tied = torch.nn.Embedding(8, 4), torch.nn.Embedding(8, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.tied.weight
        self.emb, self.proj = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4)


@pytest.mark.usefixtures("one_rank_group")
def test_unshard_in_backward_is_set_only_on_units_holding_only_untied_embeddings():
    from torch.distributed.fsdp import fully_shard

    from fsdp_runtime._fsdp_private import get_param_groups

    model = _Edges()
    fully_shard(model.untied)
    fully_shard([model.emb, model.proj])  # an embedding in a unit with a linear
    fully_shard([model.tied, model.head])  # the tied pair in one unit
    units = {"untied": model.untied, "mixed": model.emb, "tied": model.tied}  # each unit's first module holds its state
    fully_shard(model)
    knob = get_knob("unshard_in_backward")
    for module in units.values():
        set_method_knobs(module, RuntimeConfig(unshard_in_backward=False), "cpu")
    flags = {name: [g.unshard_in_backward for g in get_param_groups(m)] for name, m in units.items()}
    assert flags == {"untied": [False], "mixed": [True], "tied": [True]}
    off, on = RuntimeConfig(unshard_in_backward=False), RuntimeConfig()
    set_method_knobs(units["untied"], on, "cpu", before=off)  # a switch in place back to FSDP2's value
    assert [g.unshard_in_backward for g in get_param_groups(units["untied"])] == [True]
    set_method_knobs(units["untied"], off, "cpu", before=on)  # and on again
    assert [g.unshard_in_backward for g in get_param_groups(units["untied"])] == [False]
    assert knob.in_place and "unshard_in_backward" in CONFIG_KNOBS_IN_PLACE


def test_unshard_in_backward_is_asked_only_where_the_embeddings_are_a_unit_of_their_own():
    from autotune.search.method_knobs import is_asked

    knob = get_knob("unshard_in_backward")
    assert not is_asked(knob, "cpu", set(), {"root_split": "none"})
    assert not is_asked(knob, "cpu", set(), {})
    assert is_asked(knob, "cpu", set(), {"root_split": "split"})
    assert not is_asked(knob, "cpu", {"unshard_in_backward"}, {"root_split": "split"})  # this torch lacks it


class _CommModule:
    """A unit with the communication-buffer methods, recording their calls in order."""

    def __init__(self):
        self.calls = []

    def set_force_sum_reduction_for_comms(self, enable):
        self.calls.append(("force_sum", enable))

    def set_allocate_memory_from_process_group_for_comm(self, enable):
        self.calls.append(("pg_alloc", enable))

    def set_symm_mem_for_comm(self, backend="NCCL"):
        self.calls.append(("symm_mem", backend))


def test_the_communication_buffer_knobs_set_sum_only_reductions_first_and_symmetric_memory_has_no_off():
    module = _CommModule()
    set_method_knobs(module, RuntimeConfig(process_group_comm_buffers=True), "cuda")
    assert module.calls == [("force_sum", True), ("pg_alloc", True)]
    module.calls.clear()
    set_method_knobs(module, RuntimeConfig(symmetric_memory=True), "cuda")
    # force-sum before symm mem: FSDP2 picks the symmetric reduce-scatter only for sum reductions
    assert module.calls == [("force_sum", True), ("symm_mem", "NCCL")]
    module.calls.clear()
    get_knob("symmetric_memory").setter(module, False)  # FSDP2's own state: no call (there is no off switch)
    get_knob("process_group_comm_buffers").setter(module, False)  # nor here: a model's own sum-only setting stays
    assert module.calls == []
    set_method_knobs(module, RuntimeConfig(), "cuda", before=RuntimeConfig(), every=True)  # adopt_fsdp's way
    assert module.calls == []  # torchtitan's own force-sum (which gloo needs) is never undone


def test_a_cuda_only_knob_on_cpu_and_the_refused_pair_are_each_one_line_naming_the_field():
    from fsdp_runtime import ConfigError, check_device_supports

    for name in ("process_group_comm_buffers", "symmetric_memory"):
        with pytest.raises(ConfigError) as e:
            check_device_supports(RuntimeConfig(**{name: True}), "cpu")
        assert str(e.value).startswith(f"{name}: FSDPModule.set_") and "needs a cuda device" in str(e.value)
        assert "\n" not in str(e.value)
        check_device_supports(RuntimeConfig(**{name: True}), "cuda")
    with pytest.raises(ConfigError, match=r"^process_group_comm_buffers: cannot be set together with symmetric_memory"):
        check_device_supports(RuntimeConfig(process_group_comm_buffers=True, symmetric_memory=True), "cuda")
    check_device_supports(RuntimeConfig(), "cpu")


@pytest.mark.usefixtures("one_rank_group")
def test_apply_fsdp_refuses_a_cuda_only_knob_on_gloo_before_sharding_anything():
    from fsdp_runtime import ConfigError, apply_fsdp, default_config

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    # process-group buffers: every torch of the matrix has the method (2.8 on), so the device is what refuses it
    config = dataclasses.replace(default_config([]), process_group_comm_buffers=True)
    with pytest.raises(ConfigError, match=r"^process_group_comm_buffers: .*needs a cuda device; this model is on cpu"):
        apply_fsdp(model, config)
    assert not isinstance(model, FSDPModule)


def test_the_cuda_only_knobs_are_asked_on_cuda_only_and_never_both():
    from autotune.search.method_knobs import is_asked

    pg, symm = get_knob("process_group_comm_buffers"), get_knob("symmetric_memory")
    assert not is_asked(pg, "cpu", set(), {}) and not is_asked(symm, "cpu", set(), {})
    assert is_asked(pg, "cuda", set(), {}) and is_asked(symm, "cuda", set(), {"process_group_comm_buffers": False})
    assert not is_asked(symm, "cuda", set(), {"process_group_comm_buffers": True})


def test_autotune_validate_refuses_a_knob_this_torch_lacks_in_one_line(tmp_path, monkeypatch, cli_main):
    from fsdp_runtime import config_to_dict, default_config

    monkeypatch.delattr(FSDPModule, "set_separate_reduce_scatter_group", raising=False)  # as torch 2.11 is
    path = tmp_path / "rs.json"
    path.write_text(
        __import__("json").dumps(
            config_to_dict(dataclasses.replace(default_config([]), separate_reduce_scatter_group=True))
        )
    )
    result = cli_main("validate", str(path))
    assert result.returncode != 0
    line = result.stderr.strip()
    assert "\n" not in line and f"{path}: separate_reduce_scatter_group: needs torch >= 2.13" in line
