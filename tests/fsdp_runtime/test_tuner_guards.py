"""The in-job tuner's safety pieces on one rank ([Note: in-job memory], [Note: in-job guards]):
what a move adds to memory, the moves this torch cannot set never offered, a switch that fails
half-way rolled back, and the gate on one rank. The same guards across ranks:
tests/fsdp_runtime/test_tuner_multirank.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fsdp_runtime import apply_fsdp, default_config, get_unsupported_knobs, switch_config
from fsdp_runtime.tuning import InJobTuner, get_moves
from fsdp_runtime.tuning.safety import get_extra_bytes, get_refusals, get_unit_bytes
from profiles import build_model, load_model_profile

pytestmark = pytest.mark.torch_matrix

PROFILE = load_model_profile("tiny")
BLOCKS = [f"layers.{i}" for i in range(PROFILE.shape.num_layers)]


@pytest.fixture
def applied(one_rank_group):
    return apply_fsdp(build_model(PROFILE, seed=0), default_config(BLOCKS, num_microbatches=2))


def _moved(applied, name: str):
    return next(m for m in get_moves(applied.config, device_type="cpu") if m.name == name).apply(applied.config)


def test_a_unit_s_bytes_are_its_whole_parameters_and_a_move_adds_what_it_keeps(applied):
    sizes = get_unit_bytes(applied)
    block = applied.model.get_submodule("layers.0")
    whole = sum(p.numel() * p.dtype.itemsize for p in block.parameters())  # DTensor numel: the whole tensor
    assert sizes["layers.0"].params == whole and sizes["layers.0"].grads == whole  # fp32, no policy
    largest = max(s.params for n, s in sizes.items() if n != "root")
    seed = applied.config
    assert get_extra_bytes(sizes, seed, _moved(applied, "reshard_after_forward=False@all")) == sum(
        sizes[b].params for b in BLOCKS
    )
    assert get_extra_bytes(sizes, seed, _moved(applied, "forward_prefetch=depth2")) == 2 * largest
    assert get_extra_bytes(sizes, seed, _moved(applied, "backward_prefetch=depth1")) == 0  # FSDP2's own depth
    assert get_extra_bytes(sizes, seed, _moved(applied, "sync=last@all")) == sum(sizes[b].grads for b in BLOCKS)
    assert get_extra_bytes(sizes, _moved(applied, "forward_prefetch=depth2"), seed) == 0  # going back frees


def test_a_move_the_installed_torch_cannot_set_is_never_offered(applied):
    moves = get_moves(applied.config, device_type="cuda")
    refused = get_refusals(applied, moves)
    unsupported = get_unsupported_knobs()
    assert ("reduce_scatter_max_input_buffers=2" in refused) == ("reduce_scatter_max_input_buffers" in unsupported)
    assert ("unshard_async=on" in refused) == ("unshard_async" in unsupported)
    assert "forward_prefetch=depth1" not in refused
    tuner = InJobTuner(applied, device_type="cuda", moves=moves)
    assert {m.name for m in tuner.walk.moves} == {m.name for m in moves} - set(refused)
    assert tuner.refused == refused


def test_a_switch_that_fails_half_way_is_rolled_back_unit_by_unit(applied, monkeypatch):

    target = _moved(applied, "forward_prefetch=depth1")
    target = dataclasses.replace(
        target, units=[dataclasses.replace(u, sync="last", defer_concat=False) for u in target.units]
    )
    before = applied.config
    failing = applied.units[BLOCKS[2]]
    real = type(failing).set_reshard_after_forward

    def fail_once(module, *args, **kwargs):  # the third block's setter fails the first time it is called
        monkeypatch.setattr(failing, "set_reshard_after_forward", real.__get__(failing))
        raise RuntimeError("planted: a setter failed")

    monkeypatch.setattr(failing, "set_reshard_after_forward", fail_once.__get__(failing))
    with pytest.raises(RuntimeError, match="planted"):
        switch_config(applied, target, device_type="cpu")
    assert applied.config is before
    for name in BLOCKS:  # the two blocks set before the failure and the failing one: back to the seed's
        state = applied.units[name]._get_fsdp_state()
        assert state._states_to_forward_prefetch == [], name
    assert applied.eager_concat == {}  # no eager-concat wrapper left installed
    switch_config(applied, target, device_type="cpu")  # the same switch, once the setter works
    assert applied.config.units[0].forward_prefetch == [BLOCKS[1]] and set(applied.eager_concat) == {*BLOCKS, "root"}


def test_on_one_rank_a_candidate_out_of_memory_before_its_forward_is_dropped_and_the_job_goes_on(applied):
    model = applied.model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    moves = [m for m in get_moves(applied.config, device_type="cpu") if m.name == "forward_prefetch=depth1"]
    tuner = InJobTuner(applied, device_type="cpu", moves=moves, warmup_steps=1, num_pairs=2, max_steps=10)
    tokens = torch.randint(0, PROFILE.shape.vocab_size, (2, 8))
    ran = []
    for _ in range(4):
        with tuner.step():
            ran.append(tuner.running)
            if tuner.running is not None:
                raise torch.OutOfMemoryError("planted: CUDA out of memory")
            model(tokens).float().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert ran[:2] == [None, "forward_prefetch=depth1"] and ran[2:] == [None, None]
    assert [(d.name, d.outcome) for d in tuner.decisions] == [("forward_prefetch=depth1", "failed")]
    assert tuner.finished and applied.config == tuner.best
