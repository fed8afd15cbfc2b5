"""Scale proxy: same depth and unit names, width shrunk to fit; the real model when it fits."""

from __future__ import annotations

from autotune.search.proxy import estimate_memory_per_rank, plan_model
from profiles import load_model_profile

GIB = 2**30


def test_llama8b_on_a_small_cpu_box_runs_a_same_depth_proxy():
    llama8b = load_model_profile("llama8b")
    plan = plan_model(llama8b, world_size=2, memory_per_rank=6 * GIB, flops_per_rank=20e9, step_budget_s=0.35)
    assert plan.is_proxy and "GiB per rank" in plan.reason
    assert plan.run.shape.num_layers == 32 and plan.run.unit_names == llama8b.unit_names
    shape = plan.run.shape
    assert shape.dim < llama8b.shape.dim and shape.dim % shape.num_heads == 0
    assert shape.num_heads // shape.num_kv_heads == llama8b.shape.num_heads // llama8b.shape.num_kv_heads
    assert plan.estimated_memory_per_rank <= 6 * GIB and plan.estimated_step_s <= 0.35
    assert plan.proxy_name.startswith("llama8b@dim=")
    assert plan.trial_model["dim"] == shape.dim


def test_real_model_when_it_fits():
    small = load_model_profile("small")
    plan = plan_model(small, world_size=2, memory_per_rank=64 * GIB, flops_per_rank=1e13, step_budget_s=1.0)
    assert not plan.is_proxy and plan.run is small and plan.proxy_name is None
    assert plan.trial_model.endswith("small.toml")


def test_memory_estimate_scales_with_sharding():
    llama8b = load_model_profile("llama8b")
    assert estimate_memory_per_rank(llama8b, 8) < estimate_memory_per_rank(llama8b, 2)
    # fp32 params + grads + AdamW alone are 16 bytes/param.
    assert estimate_memory_per_rank(llama8b, 1) > 16 * 8.03e9


def test_a_memory_budget_measures_the_real_model_however_slow():
    """A proxy's peak memory is not the model's: under a memory budget a slow model that fits
    memory runs as it is (a time-only shrink would compare the budget with the proxy's peaks)."""
    small = load_model_profile("small")
    slow = {"world_size": 2, "memory_per_rank": 64 * GIB, "flops_per_rank": 1e6, "step_budget_s": 1.0}
    assert plan_model(small, **slow).is_proxy
    plan = plan_model(small, **slow, memory_bound=True)
    assert not plan.is_proxy and plan.run is small and "a memory budget needs the model's own peaks" in plan.reason
    # Over memory there is no real model to run: still a proxy, which the search refuses (below).
    llama8b = load_model_profile("llama8b")
    assert plan_model(
        llama8b, world_size=2, memory_per_rank=6 * GIB, flops_per_rank=20e9, step_budget_s=1.0, memory_bound=True
    ).is_proxy
