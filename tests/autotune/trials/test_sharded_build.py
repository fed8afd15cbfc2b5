"""A model built sharded (meta device, shard, materialise the shards: [Note: sharded build]) trains
exactly as a full build: losses bitwise on 2 gloo ranks, for FSDP, HSDP, a grouped unit and a
model whose dim 0 does not split evenly; and a rank draws only its own rows ([Note: chunked init])."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fsdp_runtime import MeshConfig, UnitConfig, config_to_dict, default_config
from profiles import chunked_init, load_model_profile
from profiles.chunked_init import count_chunks, draw_rows, get_chunk_rows, get_shard_rows

BLOCKS = list(load_model_profile("tiny").block_names)
UNEVEN = {"name": "tiny", "dim": 30, "num_heads": 5, "num_kv_heads": 1, "ffn_hidden_dim": 75, "vocab_size": 101}
"""Every weight's dim 0 odd: the second rank's shards are one row short."""


@pytest.mark.multirank
def test_a_sharded_build_trains_as_a_full_build(pool2):
    grouped = [UnitConfig(name="layers.0-1", modules=BLOCKS[:2]), *default_config(BLOCKS[2:]).units]
    configs = {
        "fsdp": default_config(BLOCKS, num_microbatches=2),
        "hsdp": dataclasses.replace(default_config(BLOCKS), mesh=MeshConfig(kind="hsdp", replicate=2)),
        "grouped": dataclasses.replace(default_config(BLOCKS), units=grouped),
    }
    runs = [
        (configs, "tiny"),
        ({"uneven": default_config(BLOCKS)}, UNEVEN),
    ]
    for named, model in runs:
        run = pool2.run(
            "_harness:train_full_and_sharded",
            {"model": model, "configs": [config_to_dict(c) for c in named.values()], "num_steps": 3},
            timeout_s=180,
        )
        assert run.ok, f"{run.status}: {run.reason}\n{run.stderr_tails}"
        for rank_results in run.results:
            for name, result in zip(named, rank_results, strict=True):
                assert result["sharded"] == result["full"], name
                assert result["sharded_devices"] == ["cpu"], name
                assert (result["full_init_sharded"], result["sharded_init_sharded"]) == (False, True), name
        assert run.results[0][0]["full"] != run.results[1][0]["full"]  # the ranks train on their own data


def test_shard_rows_split_as_torch_chunk():
    for num_rows in (1, 5, 7, 8, 101, 128256):
        for size in (1, 2, 3, 4, 8):
            expected = [len(c) for c in torch.arange(num_rows).chunk(size)]
            expected += [0] * (size - len(expected))  # torch.chunk leaves empty last shards out
            rows = [get_shard_rows(num_rows, [(size, c)]) for c in range(size)]
            assert [stop - start for start, stop in rows] == expected, (num_rows, size)
            assert rows[0][0] == 0 and all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
            # HSDP: a replicate dim adds no split; two dims sharding dim 0 split it in mesh order
            assert get_shard_rows(num_rows, [(size, 0)]) == rows[0]
            whole = get_shard_rows(num_rows, [(2, 1)])
            inner = [get_shard_rows(num_rows, [(2, 1), (size, c)]) for c in range(size)]
            assert inner[0][0] == whole[0] and max(stop for _, stop in inner) == whole[1]


@pytest.mark.parametrize("shape", [(101, 30), (7, 3), (128256 // 64, 4096 // 64), (3000, 700)])
def test_a_shard_is_the_full_draw_s_rows_and_costs_its_rows(shape):
    full, full_drawn = draw_rows(shape, (0, shape[0]), seed=5, first_chunk=11, scale=0.02)
    assert full_drawn == full.numel() and full.shape == shape
    chunk_numel = get_chunk_rows(shape) * full[0].numel()
    for world in (1, 2, 3, 4):
        for rank in range(world):
            rows = get_shard_rows(shape[0], [(world, rank)])
            local, drawn = draw_rows(shape, rows, seed=5, first_chunk=11, scale=0.02)
            assert torch.equal(local, full[rows[0] : rows[1]]), (world, rank)
            # its rows, plus at most one partial chunk at each end
            assert drawn <= local.numel() + 2 * chunk_numel, (world, rank)
    # a parameter's chunks draw apart: another first chunk or seed, other values
    assert not torch.equal(draw_rows(shape, (0, shape[0]), seed=5, first_chunk=12, scale=0.02)[0], full)
    assert not torch.equal(draw_rows(shape, (0, shape[0]), seed=6, first_chunk=11, scale=0.02)[0], full)


def test_a_rank_s_draw_scales_with_its_shard(monkeypatch):
    monkeypatch.setattr(chunked_init, "CHUNK_NUMEL", 1024)  # 16-row chunks: 63 of them
    shape = (1001, 64)
    assert count_chunks(shape) == 63
    full = draw_rows(shape, (0, shape[0]), seed=0, first_chunk=0, scale=1.0)[1]
    for world in (2, 4, 8):
        rows = [get_shard_rows(shape[0], [(world, r)]) for r in range(world)]
        drawn = [draw_rows(shape, r, seed=0, first_chunk=0, scale=1.0)[1] for r in rows]
        for (start, stop), n in zip(rows, drawn):
            assert n <= (stop - start + 2 * 16) * shape[1]  # its rows and at most a partial chunk at each end
        assert sum(drawn) <= full + 2 * world * 16 * shape[1]


def test_a_full_build_draws_each_weight_once_in_chunks():
    model = load_model_profile("tiny").build(device="cpu", seed=3)
    again = load_model_profile("tiny").build(device="cpu", seed=3)
    weights = [p for n, p in model.named_parameters() if not n.endswith("norm.weight")]
    assert model.init_weights(3) == sum(p.numel() for p in weights)
    for (name, a), b in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(a, b), name
        if name.endswith("norm.weight"):
            assert bool((a == 1).all()), name
    attention = model.layers[0].attention
    assert float(attention.wo.weight.detach().std()) < float(attention.wq.weight.detach().std())
