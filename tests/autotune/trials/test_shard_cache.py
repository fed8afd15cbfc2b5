"""A rank's shard cache ([Note: shard cache] in :mod:`profiles.chunked_init`): a later build of the
same model restores each parameter's rows with a copy, bitwise the rows a fresh draw gives, for
every mesh's rows; its bound, its eviction and its release; on real gloo ranks, sharded builds
through the cache against fresh and full builds, and a rank pool's trials that count what each
build drew and restored, across trials, until another seed releases it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autotune.trials.trialdir import to_rank_metrics
from fsdp_runtime import MeshConfig, UnitConfig, config_to_dict, default_config
from profiles import load_model_profile
from profiles.chunked_init import SHARD_CACHE_ENV, ShardCache, draw_rows, get_shard_rows
from profiles.llama import get_init_identity

SHAPES = [(101, 30), (7, 3), (3000, 700)]
"""Uneven rows, fewer rows than some meshes' shards, and rows over several chunks."""
MESHES = [[(1, 0)], [(2, 0)], [(2, 1)], [(3, 2)], [(4, 1)], [(2, 1), (2, 0)], [(2, 0), (4, 3)]]
"""Per mesh dim that shards dim 0, its size and the rank's coordinate: FSDP over 1-4 ranks and two-dim splits."""
BLOCKS = list(load_model_profile("tiny").block_names)
UNEVEN = {"name": "tiny", "dim": 30, "num_heads": 5, "num_kv_heads": 1, "ffn_hidden_dim": 75, "vocab_size": 101}


def _fill(cache: ShardCache, shape, rows, *, index: int = 0, seed: int = 5, scale: float = 0.02) -> torch.Tensor:
    local = torch.full((rows[1] - rows[0], *shape[1:]), float("nan"))
    cache.fill(local, shape, rows, index=index, seed=seed, first_chunk=11, scale=scale)
    return local


def _cache_for(shape, *, rows_numel: int, seed: int = 5, max_bytes: int = 1 << 40) -> ShardCache:
    cache = ShardCache(max_bytes=max_bytes)
    cache.start_build(get_init_identity(load_model_profile("tiny").shape, seed), 4 * rows_numel)
    return cache


@pytest.mark.parametrize("shape", SHAPES)
def test_a_restore_is_bitwise_the_fresh_draw_for_every_mesh_s_rows(shape):
    row = torch.Size(shape[1:]).numel()
    for mesh in MESHES:
        rows = get_shard_rows(shape[0], mesh)
        fresh = draw_rows(shape, rows, seed=5, first_chunk=11, scale=0.02)[0]
        cache = _cache_for(shape, rows_numel=(rows[1] - rows[0]) * row)
        drawn = _fill(cache, shape, rows)
        assert cache.counts == [1, 0] and len(cache) == 1, mesh
        drawn.add_(1.0)  # the model trains its own rows: the cache kept a copy of its own
        cache.start_build(cache.identity, 0)
        restored = _fill(cache, shape, rows)
        assert cache.counts == [0, 1], mesh  # restored, not drawn
        assert torch.equal(restored, fresh), mesh
        # another parameter or scale is an entry of its own: drawn, not restored
        _fill(cache, shape, rows, index=1)
        other = _fill(cache, shape, rows, scale=0.01)
        assert torch.equal(other, draw_rows(shape, rows, seed=5, first_chunk=11, scale=0.01)[0]), mesh
        assert cache.counts == [2, 1], mesh


def test_a_non_fp32_or_strided_shard_restores_the_same_values():
    shape, rows = (64, 48), (16, 48)
    fresh = draw_rows(shape, rows, seed=5, first_chunk=11, scale=0.02)[0]
    cache = _cache_for(shape, rows_numel=32 * 48)
    for local in (torch.empty(48, 32).t(), torch.empty(32, 48, dtype=torch.float64)):  # copied, not drawn in place
        cache.fill(local, shape, rows, index=0, seed=5, first_chunk=11, scale=0.02)
        assert torch.equal(local.float(), fresh)
    assert cache.counts == [1, 1]


def test_the_bound_is_twice_the_largest_shard_and_the_least_recently_used_go_first():
    shape = (100, 10)
    halves = [get_shard_rows(100, [(2, c)]) for c in range(2)]  # 50 rows each: 2000 bytes
    cache = _cache_for(shape, rows_numel=500)
    assert cache.limit_bytes == 4000
    for rows in [*halves, (0, 100)]:  # the whole parameter (4000 bytes) fits alone: both halves go
        _fill(cache, shape, rows)
    assert (len(cache), cache.nbytes) == (1, 4000)
    cache.start_build(cache.identity, 1000)  # a smaller build never lowers the bound
    assert cache.limit_bytes == 4000
    _fill(cache, shape, halves[0])
    assert len(cache) == 1 and cache.counts == [1, 0]  # the whole one went: it was the least recently used
    _fill(cache, shape, halves[1])
    _fill(cache, shape, halves[0])  # now the most recently used
    _fill(cache, shape, (20, 30))  # 400 bytes: the least recently used half goes
    assert cache.counts == [3, 1] and len(cache) == 2 and cache.nbytes == 2400
    _fill(cache, shape, halves[0])
    assert cache.counts == [3, 2]
    # rows bigger than the bound are drawn and not kept
    big = _cache_for((1000, 10), rows_numel=100)
    _fill(big, (1000, 10), (0, 1000))
    assert (len(big), big.nbytes) == (0, 0)


def test_another_model_or_seed_releases_the_cache_and_a_zero_bound_keeps_nothing(monkeypatch):
    shape, rows = (40, 8), (0, 20)
    cache = _cache_for(shape, rows_numel=160)
    _fill(cache, shape, rows)
    cache.use(cache.identity)  # the same model: kept
    assert len(cache) == 1
    other_seed = get_init_identity(load_model_profile("tiny").shape, 6)
    cache.start_build(other_seed, 640)
    assert (len(cache), cache.nbytes, cache.identity) == (0, 0, other_seed)
    _fill(cache, shape, rows, seed=6)
    cache.use(None)  # a model the cache never holds (a factory's)
    assert (len(cache), cache.limit_bytes, cache.identity) == (0, 0, None)
    monkeypatch.setenv(SHARD_CACHE_ENV, "0")
    off = ShardCache()
    off.start_build(other_seed, 640)
    _fill(off, shape, rows, seed=6)
    _fill(off, shape, rows, seed=6)
    assert off.counts == [2, 0] and len(off) == 0
    monkeypatch.setenv(SHARD_CACHE_ENV, "1000")
    assert ShardCache().max_bytes == 1000
    monkeypatch.delenv(SHARD_CACHE_ENV)
    assert ShardCache().max_bytes > 0


def test_a_full_init_through_the_cache_is_the_init_without_it():
    profile = load_model_profile("tiny")
    cache = ShardCache(max_bytes=1 << 40)
    plain = profile.build(device="cpu", seed=3)
    weights = [n for n, _ in plain.named_parameters() if not n.endswith("norm.weight")]
    first, again = (profile.build(device="meta", seed=3).to_empty(device="cpu") for _ in range(2))
    assert first.init_weights(3, cache=cache) == sum(p.numel() for n, p in plain.named_parameters() if n in weights)
    assert cache.counts == [len(weights), 0]
    assert again.init_weights(3, cache=cache) == 0  # nothing drawn
    assert cache.counts == [0, len(weights)]
    for (name, a), b, c in zip(plain.named_parameters(), first.parameters(), again.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c), name
    other = profile.build(device="meta", seed=4).to_empty(device="cpu")
    other.init_weights(4, cache=cache)
    assert cache.counts == [len(weights), 0]  # another seed: drawn anew
    assert not torch.equal(other.output.weight, plain.output.weight)


@pytest.mark.multirank
@pytest.mark.torch_matrix
def test_sharded_builds_through_the_cache_are_the_fresh_and_full_builds_on_gloo_ranks(pool2):
    fsdp = default_config(BLOCKS)
    hsdp = dataclasses.replace(fsdp, mesh=MeshConfig(kind="hsdp", replicate=2))  # every rank all rows
    grouped = dataclasses.replace(
        fsdp, units=[UnitConfig(name="layers.0-1", modules=BLOCKS[:2]), *default_config(BLOCKS[2:]).units]
    )
    weights = sum(
        1
        for n, _ in load_model_profile("tiny").build(device="meta").named_parameters()
        if not n.endswith("norm.weight")
    )
    for model in ("tiny", UNEVEN):
        run = pool2.run(
            "_harness:build_sharded_cached_and_fresh",
            {"model": model, "configs": [config_to_dict(c) for c in (fsdp, fsdp, hsdp, grouped, fsdp)]},
            timeout_s=180,
        )
        assert run.ok, f"{run.status}: {run.reason}\n{run.stderr_tails}"
        for rank_results in run.results:
            assert [r["counts"] for r in rank_results] == [
                [[weights, 0]],
                [[0, weights]],  # the same rows: restored
                [[weights, 0]],  # HSDP's rows are others
                [[0, weights]],  # a grouped unit shards as FSDP does
                [[0, weights]],  # both meshes' rows fit the bound
            ], model
            assert all(r["as_fresh"] and r["as_full"] and r["cache_within_bound"] for r in rank_results), model
            assert [r["entries"] for r in rank_results] == [weights, weights, 2 * weights, 2 * weights, 2 * weights]


def _trial_spec(tmp_path, name: str, *, seed: int = 0):
    from autotune.trials import TrialSpec

    config = default_config(BLOCKS)
    units = [dataclasses.replace(u, activation_checkpointing="full") if u.name != "root" else u for u in config.units]
    spec = TrialSpec(
        model="tiny",
        config=dataclasses.replace(config, units=units),  # structural: the pair is built in turn
        reference=default_config(BLOCKS),
        world_size=2,
        out_dir=tmp_path / name,
        num_warmup=1,
        num_measured=1,
        profile=False,
        backend="gloo",
        seed=seed,
    )
    spec.out_dir.mkdir(parents=True)
    return spec


@pytest.mark.multirank
@pytest.mark.torch_matrix
def test_a_pool_s_trials_record_each_build_s_draws_and_restores_and_another_seed_draws_anew(tmp_path, pool2):
    """[Note: models built in turn] with sharded builds, as a CUDA search runs them: the first trial
    draws once and restores at every later build, the next trial in the same rank processes
    restores every build, and a trial of another seed releases the cache and draws once again."""
    for target in ("_harness:drop_kept_model", "_trial_programs:release_shard_cache"):
        assert pool2.run(target, timeout_s=120).ok
    weights = sum(
        1
        for n, _ in load_model_profile("tiny").build(device="meta").named_parameters()
        if not n.endswith("norm.weight")
    )
    drawn, restored = [weights, 0], [0, weights]
    expected = {"first": [drawn, restored, restored], "again": [restored] * 3, "seed1": [drawn, restored, restored]}
    try:
        for name, seed in (("first", 0), ("again", 0), ("seed1", 1)):
            spec = _trial_spec(tmp_path, name, seed=seed)
            run = pool2.run("_trial_programs:with_sharded_builds", {"spec": spec.to_dict()}, timeout_s=180)
            assert run.ok, f"{run.status}: {run.reason}\n{run.stderr_tails}"
            for result in run.results:
                assert (result["num_models"], result["num_builds"]) == (1, 3), name  # 1 pair: 1 + 2
                assert to_rank_metrics(result).shard_inits == expected[name], name
    finally:
        pool2.run("_trial_programs:release_shard_cache", timeout_s=120)
