"""The torch-version layer: each branch on stand-ins of each release's layout, then the live path on
the installed torch, and the refusal of a knob it cannot set (the search space leaving it out:
tests/autotune/test_space.py)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from fsdp_runtime import ConfigError, RuntimeConfig, apply_fsdp, knobs
from fsdp_runtime import _torch_compat as compat
from fsdp_runtime._fsdp_private import get_param_groups
from profiles import build_model, load_model_profile

pytestmark = pytest.mark.torch_matrix

# -- stand-ins of each release's layout ([Note: torch versions])


class _State211:
    """torch 2.11: one optional param group."""

    def __init__(self, group):
        self._fsdp_param_group = group


class _State212:
    """torch 2.12+: a list, and the singular a property that raises with several groups."""

    def __init__(self, groups):
        self._fsdp_param_groups = groups

    @property
    def _fsdp_param_group(self):
        if len(self._fsdp_param_groups) > 1:
            raise AssertionError("Expected at most 1 param group for backward compatibility")
        return self._fsdp_param_groups[0] if self._fsdp_param_groups else None


class _Module211:
    """An FSDPModule of 2.11: the async setter and the older public ones, no reduce-scatter buffer
    setter, no separate reduce-scatter group, no symmetric memory."""

    def __init__(self):
        self.calls = []

    def _set_unshard_async_op(self, async_op):
        self.calls.append(("unshard_async", async_op))

    def set_unshard_in_backward(self, unshard_in_backward):
        self.calls.append(("unshard_in_backward", unshard_in_backward))

    def set_allocate_memory_from_process_group_for_comm(self, enable):
        self.calls.append(("pg_alloc", enable))


class _Module213(_Module211):
    """An FSDPModule of 2.13+: every setter."""

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers, *, recurse=True):
        self.calls.append(("rs_buffers", max_input_buffers, recurse))

    def set_separate_reduce_scatter_group(self, enable=True, *, recurse=True):
        self.calls.append(("rs_group", enable, recurse))

    def set_symm_mem_for_comm(self, backend="NCCL"):
        self.calls.append(("symm_mem", backend))


class _ModuleWithoutSetters:
    """A release that dropped the private async setter too."""

    calls: list = []


def test_param_groups_of_2_11_singular_layout():
    group = object()
    assert compat.get_param_groups(_State211(group)) == [group]
    assert compat.get_param_groups(_State211(None)) == []


def test_param_groups_of_2_12_plural_layout_never_read_the_singular_property():
    groups = [object(), object()]  # two groups: the singular property would raise
    state = _State212(groups)
    got = compat.get_param_groups(state)
    assert got == groups and got is not groups
    assert compat.get_param_groups(_State212([])) == []


def test_param_groups_of_an_unknown_layout_fail_in_one_line():
    with pytest.raises(RuntimeError) as e:
        compat.get_param_groups(object())
    message = str(e.value)
    assert "\n" not in message and "_fsdp_param_groups (torch >= 2.12)" in message
    assert "_fsdp_param_group (torch 2.11)" in message and torch.__version__ in message


def test_unsupported_knobs_are_probed_on_the_class():
    assert knobs.get_unsupported_knobs(_Module213) == {}
    missing = knobs.get_unsupported_knobs(_Module211)
    assert set(missing) == {"reduce_scatter_max_input_buffers", "separate_reduce_scatter_group", "symmetric_memory"}
    assert missing["reduce_scatter_max_input_buffers"] == (
        f"needs torch >= 2.13 (pytorch #186000); torch {torch.__version__} has no "
        "FSDPModule.set_reduce_scatter_max_input_buffers"
    )
    assert missing["separate_reduce_scatter_group"].startswith("needs torch >= 2.13 (pytorch #186335)")
    assert missing["symmetric_memory"].startswith("needs torch >= 2.12 (pytorch #176613)")
    assert set(knobs.get_unsupported_knobs(_ModuleWithoutSetters)) == {
        "reduce_scatter_max_input_buffers",
        "separate_reduce_scatter_group",
        "unshard_async",
        "unshard_in_backward",
        "process_group_comm_buffers",
        "symmetric_memory",
    }
    assert "torch >= 2.6 (pytorch #135523)" in knobs.get_unsupported_knobs(_ModuleWithoutSetters)["unshard_async"]


def test_reduce_scatter_buffers_setter_with_and_without_it():
    module = _Module213()
    knobs.set_reduce_scatter_max_input_buffers(module, 2)
    assert module.calls == [("rs_buffers", 2, False)]  # this unit only: each unit sets its own
    old = _Module211()
    knobs.set_reduce_scatter_max_input_buffers(old, 1)  # one buffer is what FSDP2 did before the setter
    assert old.calls == []
    with pytest.raises(RuntimeError, match=r"^reduce_scatter_max_input_buffers: needs torch >= 2\.13 "):
        knobs.set_reduce_scatter_max_input_buffers(old, 2)


def test_unshard_async_setter_with_and_without_it():
    module = _Module211()
    knobs.set_unshard_async(module, True)
    assert module.calls == [("unshard_async", True)]
    with pytest.raises(RuntimeError, match=r"^unshard_async: needs torch >= 2\.6 "):
        knobs.set_unshard_async(_ModuleWithoutSetters(), True)


def test_the_package_floor_is_the_oldest_layout_covered():
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    (torch_req,) = [d for d in pyproject["project"]["dependencies"] if d.split(">")[0].strip() == "torch"]
    assert torch_req.replace(" ", "") == f"torch>={compat.MIN_TORCH},<{compat.BELOW_TORCH}"
    assert compat.TESTED_TORCH[0].startswith(compat.MIN_TORCH + ".")


def test_ci_runs_every_tested_torch_and_the_ceiling_is_the_next_release():
    """The range pyproject gives is what CI runs: the pinned CPU wheel and ``.ci/run``'s matrix."""
    root = Path(__file__).resolve().parents[2]
    (pin,) = [line.split("==")[1] for line in (root / "requirements-cpu.txt").read_text().splitlines() if "==" in line]
    (loop,) = [line for line in (root / ".ci" / "run").read_text().splitlines() if line.startswith("for version in")]
    matrix = loop.removeprefix("for version in").split(";")[0].split()
    assert sorted([pin, *matrix]) == sorted(compat.TESTED_TORCH)
    newest = max(compat.TESTED_TORCH, key=lambda v: tuple(map(int, v.split("."))))
    assert compat.BELOW_TORCH == f"2.{int(newest.split('.')[1]) + 1}"


# -- the installed torch, real FSDP on a one-rank gloo group


@pytest.fixture(scope="module", autouse=True)
def single_rank_group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _tiny():
    return build_model(load_model_profile("tiny"), seed=0)


@pytest.mark.skipif(
    not hasattr(FSDPModule, "set_reduce_scatter_max_input_buffers"), reason="torch < 2.13: refused, tested below"
)
def test_live_param_groups_and_setters_on_the_installed_torch():
    model = _tiny()
    applied = apply_fsdp(model, RuntimeConfig(reduce_scatter_max_input_buffers=2, unshard_async="on"))
    for name, module in applied.units.items():
        groups = get_param_groups(module)
        assert len(groups) == 1, name  # one mesh per unit: one group in either layout
        unit_params = {id(p) for p in module.parameters()}
        assert {id(p.sharded_param) for p in groups[0].fsdp_params} <= unit_params
        assert groups[0].reduce_scatter_max_input_buffers == 2 and groups[0].unshard_async_op, name
    # The config's run survives a forward and backward with both knobs set.
    model(torch.zeros(2, 8, dtype=torch.long)).sum().backward()


def _drop(monkeypatch, method):
    monkeypatch.delattr(FSDPModule, method, raising=False)  # the installed torch as an older one would be


def test_a_knob_this_torch_cannot_set_is_refused_in_one_line_before_sharding(monkeypatch):
    _drop(monkeypatch, "set_reduce_scatter_max_input_buffers")
    model = _tiny()
    with pytest.raises(ConfigError) as e:
        apply_fsdp(model, RuntimeConfig(reduce_scatter_max_input_buffers=2))
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("reduce_scatter_max_input_buffers: needs torch >= 2.13 (pytorch #186000); ")
    assert f"torch {torch.__version__} has no FSDPModule.set_reduce_scatter_max_input_buffers" in message
    assert not any(isinstance(m, FSDPModule) for m in model.modules())
    # One buffer is FSDP2's behaviour on every release: met, not refused.
    applied = apply_fsdp(_tiny(), RuntimeConfig(reduce_scatter_max_input_buffers=1))
    assert all(get_param_groups(m) for n, m in applied.units.items() if n != "root")


def test_async_unshard_without_its_setter_refuses_on_and_leaves_auto_off(monkeypatch):
    _drop(monkeypatch, "_set_unshard_async_op")
    with pytest.raises(ConfigError, match=r"^unshard_async: needs torch >= 2\.6 \(pytorch #135523\)"):
        apply_fsdp(_tiny(), RuntimeConfig(unshard_async="on"))
    applied = apply_fsdp(_tiny(), RuntimeConfig(unshard_async="auto"), device_type="cpu")
    assert not any(g.unshard_async_op for m in applied.units.values() for g in get_param_groups(m))


def test_the_accumulated_grad_slot_is_read_only_where_torch_keeps_none():
    """Through 2.14 ``FSDPParam.unsharded_accumulated_grad`` is an attribute eager concat reads and
    clears; in 2.15 a read-only property returning the parameter's ``.grad`` (setting it raises)."""

    class Attribute:  # <= 2.14: set in __init__
        def __init__(self) -> None:
            self.unsharded_accumulated_grad = None

    class Property:  # 2.15
        @property
        def unsharded_accumulated_grad(self):
            return None

    assert compat.has_accumulated_grad_slot(Attribute())
    assert not compat.has_accumulated_grad_slot(Property())
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    installed = isinstance(getattr(FSDPParam, "unsharded_accumulated_grad", None), property)
    assert installed == (tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])) >= (2, 15))
