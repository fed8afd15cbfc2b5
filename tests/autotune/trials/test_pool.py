"""The persistent rank pool: different configs back to back, restarts after failures, clean shutdown."""

from __future__ import annotations

import dataclasses
import json

import pytest
from _trial_programs import CRASH_MESSAGE, get_survivors

from autotune.trials import RankPool, TrialSpec, run_trial
from fsdp_runtime import MeshConfig, config_to_dict, default_config
from profiles import load_model_profile

UNITS = load_model_profile("tiny").unit_names
pytestmark = [pytest.mark.multirank, pytest.mark.torch_matrix]


def _spec(tmp_path, name: str, config, *, world_size: int = 2, **overrides) -> TrialSpec:
    base = dict(
        model="tiny",
        config=config,
        world_size=world_size,
        out_dir=tmp_path / name,
        num_warmup=1,
        num_measured=2,
        profile=False,
        timeout_s=90,
        backend="gloo",
    )
    return TrialSpec(**{**base, **overrides})


def _with_units(config, **unit_overrides):
    return dataclasses.replace(config, units=[dataclasses.replace(u, **unit_overrides) for u in config.units])


def _prefetch_depth1(config):
    blocks = [u.name for u in config.units if u.name != "root"]
    units = [
        dataclasses.replace(u, forward_prefetch=blocks[i + 1 : i + 2]) if u.name != "root" else u
        for i, u in enumerate(config.units)
    ]
    return dataclasses.replace(config, units=units)


def test_pool_runs_different_configs_back_to_back(pool2, tmp_path):
    configs = {
        "default": default_config(UNITS),
        "accumulate": _with_units(default_config(UNITS, num_microbatches=2), sync="last"),
        "prefetch_no_reshard": _prefetch_depth1(_with_units(default_config(UNITS), reshard_after_forward=False)),
        "hsdp_2x1": dataclasses.replace(default_config(UNITS), mesh=MeshConfig(kind="hsdp", replicate=2)),
    }
    groups = pool2.run("_trial_programs:count_process_groups", timeout_s=90).results  # (re)starts the ranks
    starts, pids = pool2.num_starts, pool2.pids
    for i, (name, config) in enumerate(configs.items()):
        result = run_trial(_spec(tmp_path, name, config, profile=i == 0, num_profiled=1), pool=pool2)
        assert result.status == "ok", f"{name}: {result.reason}"
        assert result.rank_pids == pids and len(result.metrics.ranks) == 2
        assert all(ms > 0 for r in result.metrics.ranks for ms in r.step_ms)
    # The same spec again after other configs: bitwise-equal losses, so no state leaks between jobs.
    again = run_trial(_spec(tmp_path, "default_again", configs["default"]), pool=pool2)
    first = json.loads((tmp_path / "default" / "metrics.json").read_text())
    assert [r.losses for r in again.metrics.ranks] == [r["losses"][:3] for r in first["ranks"]]
    assert (tmp_path / "default" / "trace_rank1.json.gz").exists()
    assert not (tmp_path / "accumulate" / "trace_rank0.json.gz").exists()
    assert pool2.num_starts == starts, "the pool restarted although every trial succeeded"
    # One mesh per shape is kept ([Note: reused meshes]); every other group a job made is
    # destroyed after it: hundreds of trials must not pile up gloo threads or NCCL communicators.
    kept = pool2.run("_trial_programs:get_kept_group_names", timeout_s=90).results
    # FSDP's 1-D mesh (over the world: torch reuses the default group), HSDP's replicate and shard groups.
    assert [len(names) for names in kept] == [3, 3]
    after = pool2.run("_trial_programs:count_process_groups", timeout_s=90).results
    # At most the kept groups more than before this test (none more where the shared pool's
    # earlier jobs already kept these shapes).
    assert all(n <= a <= n + 3 for n, a in zip(groups, after))
    for name in ("hsdp_again", "default_again_2"):
        config = configs["hsdp_2x1"] if name.startswith("hsdp") else configs["default"]
        assert run_trial(_spec(tmp_path, name, config), pool=pool2).status == "ok"
    assert pool2.run("_trial_programs:get_kept_group_names", timeout_s=90).results == kept
    assert pool2.run("_trial_programs:count_process_groups", timeout_s=90).results == after


def test_pool_restarts_after_a_crash(pool2, tmp_path):
    before = pool2.run("_trial_programs:get_rank_pid", timeout_s=90)
    assert before.ok and before.results == pool2.pids
    crashed = pool2.run("_trial_programs:crash_on_rank1", timeout_s=60)
    assert crashed.status == "crash" and crashed.reason.startswith("rank 1 exited with 1:")
    assert CRASH_MESSAGE in crashed.reason
    assert pool2.pids == [] and get_survivors(before.results) == []
    after = pool2.run("_trial_programs:get_rank_pid", timeout_s=90)
    assert after.ok and set(after.results).isdisjoint(before.results)


def test_the_parent_asks_the_store_ten_times_a_second_while_a_job_runs(pool2, monkeypatch):
    """The store is asked for results every 100 ms, not every 5 ms (each a round trip through its
    server: ~7% of a core on 2 cores); the ranks' processes are still watched every 5 ms."""
    pool2.run("_trial_programs:get_rank_pid", timeout_s=90)
    jobs, calls = pool2._jobs, {"check": 0}

    class Counted:  # the pool's store, its checks counted
        def __getattr__(self, name):
            attr = getattr(jobs, name)
            if name in calls:

                def counted(*args, **kwargs):
                    calls[name] += 1
                    return attr(*args, **kwargs)

                return counted
            return attr

    monkeypatch.setattr(pool2, "_jobs", Counted())
    result = pool2.run("_trial_programs:sleep_then_pid", {"seconds": 1.5}, timeout_s=60)
    assert result.ok and result.results == pool2.pids
    assert 10 <= calls["check"] <= 25  # every 100 ms (310 when it was every 5 ms)


def test_pool_deadlock_times_out_then_recovers(pool2, tmp_path):
    pool2.run("_trial_programs:get_rank_pid", timeout_s=90)
    result = run_trial(
        _spec(tmp_path, "deadlock", default_config(UNITS), rank_program="_trial_programs:deadlock", timeout_s=4),
        pool=pool2,
    )
    assert result.status == "timeout"
    assert get_survivors(result.rank_pids) == []  # includes rank 1's sleeping child
    assert run_trial(_spec(tmp_path, "after", default_config(UNITS)), pool=pool2).status == "ok"


def test_slow_trial_is_pruned_after_two_steps(pool2, tmp_path):
    result = run_trial(
        _spec(tmp_path, "pruned", default_config(UNITS), num_measured=5, profile=True, prune_if_slower_than_ms=1e-3),
        pool=pool2,
    )
    assert result.status == "pruned"
    assert [len(r.step_ms) for r in result.metrics.ranks] == [2, 2]
    assert result.metrics.traces == [] and not list((tmp_path / "pruned").glob("trace_*"))


def test_rank_side_config_error_is_invalid_config(pool2, tmp_path):
    # Last of the pool2 tests: it leaves the pool to restart, which nobody needs after it.
    config = default_config([*UNITS, "layers.99"])
    result = run_trial(_spec(tmp_path, "bad_unit", config), pool=pool2)
    assert result.status == "invalid_config"
    assert "layers.99" in result.reason and "ConfigError" in result.reason


def test_world4_pool_runs_hsdp_then_fsdp_and_shuts_down_cleanly(tmp_path):
    hsdp = dataclasses.replace(default_config(UNITS), mesh=MeshConfig(kind="hsdp", replicate=2))
    with RankPool(4) as pool:
        first = run_trial(
            _spec(tmp_path, "hsdp", hsdp, world_size=4, num_warmup=0, num_measured=1, cluster="cpu-emulated-ib"),
            pool=pool,
        )
        second = run_trial(
            _spec(tmp_path, "fsdp", default_config(UNITS), world_size=4, num_warmup=0, num_measured=1), pool=pool
        )
        pids = pool.pids
    assert first.status == "ok", first.reason
    assert second.status == "ok", second.reason
    assert first.rank_pids == second.rank_pids == pids and pool.num_starts == 1
    # cpu-emulated-ib puts 2 ranks per node: shard groups {0,1},{2,3} stay inside a node,
    # replicate groups {0,2},{1,3} cross nodes.
    emulated = first.metrics.ranks[0].link_emulation
    assert set(emulated["all_gather"]["count_by_link"]) == {"intra_node"}
    assert set(emulated["reduce_scatter"]["count_by_link"]) == {"intra_node"}
    assert set(emulated["all_reduce"]["count_by_link"]) == {"inter_node"}
    assert get_survivors(pids) == []


def test_pool_consolidates_after_an_hsdp_job(pool2, tmp_path):
    """A pooled rank that ran an HSDP job can consolidate an HSDP model next: DTensor's sharding
    cache must not hand the new job the previous job's (destroyed) process groups."""
    hsdp = dataclasses.replace(default_config(UNITS), mesh=MeshConfig(kind="hsdp", replicate=2))
    trial = run_trial(_spec(tmp_path, "hsdp", hsdp, profile=False, num_warmup=0, num_measured=1), pool=pool2)
    assert trial.status == "ok", trial.reason
    kwargs = {"model": "tiny", "config": config_to_dict(hsdp), "methods": ["all_gather", "broadcast"]}
    run = pool2.run("autotune.search.consolidation:consolidation_timing", kwargs, timeout_s=120)
    assert run.ok, f"{run.status}: {run.reason}"
    assert run.results[0]["state_bytes"] > 0 and all(s[0] > 0 for s in run.results[0]["seconds"].values())


def test_a_torch_without_the_pool_s_private_helpers_is_refused_before_any_rank_starts(monkeypatch):
    """The pool clears DTensor's sharding caches after every job through a private helper of
    ``torch.distributed.tensor.debug``: a torch without it is refused in one line naming the
    releases that have it, not after the first trial."""
    from torch.distributed.tensor import debug

    from fsdp_runtime.errors import AutotuneError

    monkeypatch.delattr(debug, "_clear_sharding_prop_cache")
    with pytest.raises(AutotuneError) as refused:
        RankPool(2)
    message = str(refused.value)
    assert "\n" not in message and "_clear_sharding_prop_cache" in message and "torch 2.11 to 2.15" in message
