"""Full-state consolidation (fsdp_runtime.consolidate) on real gloo ranks.

One launch per world size runs every check that does not kill a rank: the three methods
(plus all_gather with 4 KiB buckets: many buckets, and big tensors alone in theirs, e.g.
w2, evenly sharded at world 2, gathered straight into its full tensor) give
bitwise-identical model and optimizer state; a fresh model + optimizer loaded from the
saved checkpoint (world 2, FSDP) or from rank 0's in-memory state (world 4, HSDP)
continues training with bitwise-identical losses; a failed write or an unreadable file
fails on every rank; and autotune.search.consolidation's timing program (the search's)
runs, on a model big enough for its memory measurement to be checked. Two more launches
kill rank 1 mid-consolidation (world 2) and rank 0 mid-write (world 1) and check that no
file ever appears at the checkpoint path.

The model is the tiny Llama resized so that no dim-0 size divides by 4 and the vocab
and FFN sizes are odd: rows 101, 75, 30 and 6 (wk/wv), so shards are uneven at world 2
and 4, and at world 4 rank 3's shard of wk/wv is empty (6 rows -> 2, 2, 2, 0).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from autotune.search.consolidation import consolidation_timing
from autotune.trials import RankPool, Training, build_training, run_ranks
from fsdp_runtime import (
    CheckpointError,
    ConfigError,
    consolidate_state,
    load_consolidated_checkpoint,
    save_consolidated_checkpoint,
)
from fsdp_runtime import consolidate as consolidate_module
from fsdp_runtime.consolidate import CHECKPOINT_VERSION

pytestmark = [pytest.mark.multirank, pytest.mark.torch_matrix]

MODEL = {"name": "tiny", "dim": 30, "num_heads": 5, "num_kv_heads": 1, "ffn_hidden_dim": 75, "vocab_size": 101}
TIMING_MODEL = {"name": "tiny", "dim": 256}
"""For the timing program: a ~20 MB consolidated state, well above what RSS resolves
(pages, allocator slack: ~0.2 MB of rise beyond the state on rank 0 with broadcast)."""
FSDP = {"schema_version": 1}
HSDP = {"schema_version": 1, "mesh": {"kind": "hsdp", "replicate": 2}}
NUM_STEPS = 2
"""Steps trained before consolidating (optimizer state is non-trivial)."""
NUM_MORE_STEPS = 2
"""Steps trained after the checkpoint, by the original and by the reloaded model."""
TINY_BUCKET_BYTES = 4096
METHODS = {
    "all_gather": {"method": "all_gather"},
    "all_gather_tiny_buckets": {"method": "all_gather", "bucket_bytes": TINY_BUCKET_BYTES},
    "broadcast": {"method": "broadcast"},
    "dcp": {"method": "dcp"},
}
_TARGET = f"{__name__}:{{}}"


# ---------------------------------------------------------------------------
# Rank programs (run in each rank's process by run_ranks or a rank pool)


def _check_config(
    rank: int, world_size: int, *, config: dict, reload_from: str | None, ckpt: Path
) -> tuple[dict[str, Any], Training]:
    """Consolidate with every method; with ``reload_from`` ("file": the saved checkpoint,
    "memory": rank 0's consolidated state), load a fresh model and train on."""
    training = build_training(rank, world_size, model=MODEL, config=config)
    for step in range(NUM_STEPS):
        training.step(step)
    states = {name: consolidate_state(training.model, training.optimizer, **kw) for name, kw in METHODS.items()}
    results = {
        "states": states,
        "everywhere": consolidate_state(training.model, training.optimizer, rank0_only=False, to_cpu=False),
    }
    if reload_from is None:
        return results, training
    save_consolidated_checkpoint(ckpt, training.model, training.optimizer, metadata={"step": NUM_STEPS})
    results["continued"] = [training.step(s) for s in range(NUM_STEPS, NUM_STEPS + NUM_MORE_STEPS)]

    fresh = build_training(rank, world_size, model=MODEL, config=config)
    with torch.no_grad():
        for param in fresh.model.parameters():
            param.to_local().add_(1.0)  # so that a load that does nothing cannot pass
    source = ckpt if reload_from == "file" else states["all_gather"]
    load_consolidated_checkpoint(fresh.model, fresh.optimizer, source if rank == 0 else None)
    results["reloaded"] = consolidate_state(fresh.model, fresh.optimizer)
    results["resumed"] = [fresh.step(s) for s in range(NUM_STEPS, NUM_STEPS + NUM_MORE_STEPS)]
    return results, fresh


def _check_failures(rank: int, training: Training, ckpt_dir: Path) -> dict[str, str]:
    """A write that fails on rank 0, and an unreadable file: every rank must raise."""
    errors = {}
    real_save = torch.save
    if rank == 0:
        torch.save = _write_half_then(OSError, "disk full (simulated)")
    try:
        save_consolidated_checkpoint(ckpt_dir / "failed.pt", training.model, training.optimizer)
    except Exception as e:
        errors["save"] = f"{type(e).__name__}: {e}"
    finally:
        torch.save = real_save
    if rank == 0:
        (ckpt_dir / "garbage.pt").write_bytes(b"not a checkpoint")
    try:
        load_consolidated_checkpoint(training.model, training.optimizer, ckpt_dir / "garbage.pt")
    except Exception as e:
        errors["load"] = f"{type(e).__name__}: {e}"
    return errors


def _checks(
    rank: int, world_size: int, *, configs: dict[str, tuple[dict, str | None]], ckpt_dir: str, check_failures: bool
) -> dict[str, Any]:
    results = {}
    for name, (config, reload_from) in configs.items():
        results[name], training = _check_config(
            rank, world_size, config=config, reload_from=reload_from, ckpt=Path(ckpt_dir) / f"{name}.pt"
        )
    if check_failures:
        results["failures"] = _check_failures(rank, training, Path(ckpt_dir))
        # The search's rank program, here to share this launch: times the config's method.
        config = {"schema_version": 1, "checkpoint": {"consolidation": "broadcast"}}
        results["timing"] = consolidation_timing(
            rank, world_size, model=TIMING_MODEL, config=config, num_repeats=2, measure_memory=True
        )
    return results


def _die_mid_consolidation(rank: int, world_size: int, *, ckpt: str) -> None:
    """Rank 1 exits hard as it issues its second all-gather (of the model state's buckets),
    after the first one completed on every rank."""
    training = build_training(rank, world_size, model=MODEL, config=FSDP)
    if rank == 1:
        calls = []

        def die_on_second_call(real):
            def all_gather(*args, **kwargs):
                calls.append(args)
                if len(calls) == 2:
                    os._exit(1)
                return real(*args, **kwargs)

            return all_gather

        # Whichever name consolidation calls (torch 2.13 renamed all_gather_into_tensor).
        for name in ("all_gather_single", "all_gather_into_tensor"):
            if hasattr(torch.distributed, name):
                setattr(torch.distributed, name, die_on_second_call(getattr(torch.distributed, name)))
    save_consolidated_checkpoint(ckpt, training.model, bucket_bytes=TINY_BUCKET_BYTES)


def _die_mid_write(rank: int, world_size: int, *, ckpt: str) -> None:
    """Rank 0 exits hard after writing part of the file.

    Rank 0 writes after every collective is done, so what the other ranks do cannot
    matter here: one rank (no FSDP) exercises the same write path, in a second less.
    """
    model = nn.Linear(3, 2)
    torch.save = _write_half_then(SystemExit, None)
    save_consolidated_checkpoint(ckpt, model)


def _write_half_then(error: type[BaseException], message: str | None):
    """A torch.save that writes a few bytes, then fails (raises, or exits the process)."""

    def save(obj: Any, f: Any) -> None:
        f.write(b"PK\x03\x04 partial checkpoint")
        f.flush()
        if error is SystemExit:
            os._exit(1)
        raise error(message)

    return save


# ---------------------------------------------------------------------------
# Assertions


def _assert_same_state(actual: tuple[dict, dict], expected: tuple[dict, dict], what: str) -> None:
    (model_a, optim_a), (model_e, optim_e) = actual, expected
    assert model_a.keys() == model_e.keys(), what
    for fqn in model_e:
        assert torch.equal(model_a[fqn], model_e[fqn]), f"{what}: model {fqn}"
    assert optim_a["param_groups"] == optim_e["param_groups"], what
    assert optim_a["state"].keys() == optim_e["state"].keys(), what
    for fqn, entry in optim_e["state"].items():
        assert optim_a["state"][fqn].keys() == entry.keys(), f"{what}: optimizer {fqn}"
        for name, value in entry.items():
            assert torch.equal(optim_a["state"][fqn][name], value), f"{what}: optimizer {fqn}.{name}"


def _assert_config_ok(per_rank: list[dict[str, Any]], world_size: int, what: str) -> None:
    rank0 = per_rank[0]
    reference = rank0["states"]["dcp"]
    model_sd, optim_sd = reference
    shapes = {fqn: tuple(t.shape) for fqn, t in model_sd.items()}
    assert shapes["tok_embeddings.weight"] == (101, 30) and shapes["layers.0.attention.wk.weight"] == (6, 30)
    assert set(optim_sd["state"]) == set(model_sd) and optim_sd["param_groups"][0]["params"] == list(model_sd)
    for entry in optim_sd["state"].values():
        assert (
            entry["step"].item() == NUM_STEPS
            and entry["exp_avg"].abs().sum() > 0
            and entry["exp_avg_sq"].abs().sum() > 0
        )
    for name in METHODS:
        _assert_same_state(rank0["states"][name], reference, f"{what}: {name} vs dcp")
        for rank in range(1, world_size):
            assert per_rank[rank]["states"][name] == ({}, {}), f"{what}: rank {rank} got state from {name}"
    for rank in range(world_size):
        _assert_same_state(per_rank[rank]["everywhere"], reference, f"{what}: rank0_only=False on rank {rank}")
    if "reloaded" in rank0:
        _assert_same_state(rank0["reloaded"], rank0["states"]["all_gather"], f"{what}: reloaded vs saved")
        for rank, result in enumerate(per_rank):
            assert result["resumed"] == result["continued"], (
                f"{what}: rank {rank} resumed {result['resumed']} != continued {result['continued']}"
            )


def _run_checks(
    world_size: int,
    configs: dict[str, dict],
    tmp_path: Path,
    *,
    check_failures: bool,
    timeout_s: float,
    pool: RankPool | None = None,
) -> list[dict]:
    """``_checks`` on ``pool`` (warm ranks) or, without one, on fresh ranks, whose RSS figures start
    from a process that ran nothing before; either way the hard limit kills every rank's tree."""
    kwargs = {"configs": configs, "ckpt_dir": str(tmp_path), "check_failures": check_failures}
    if pool is None:
        run = run_ranks(_TARGET.format("_checks"), world_size=world_size, kwargs=kwargs, timeout_s=timeout_s)
    else:
        assert pool.world_size == world_size
        run = pool.run(_TARGET.format("_checks"), kwargs, timeout_s=timeout_s)
    assert run.ok, f"{run.status}: {run.reason}\n" + "\n".join(run.stderr_tails)
    return run.results


# ---------------------------------------------------------------------------
# Tests


def test_world2_fsdp_methods_agree_reload_resumes_and_failures_are_collective(tmp_path: Path) -> None:
    results = _run_checks(2, {"fsdp": (FSDP, "file")}, tmp_path, check_failures=True, timeout_s=120)
    _assert_config_ok([r["fsdp"] for r in results], 2, "world 2 fsdp")
    saved = torch.load(tmp_path / "fsdp.pt", weights_only=True)
    assert (saved["format"], saved["schema_version"], saved["world_size"], saved["metadata"]) == (
        consolidate_module.CHECKPOINT_FORMAT,
        CHECKPOINT_VERSION,
        2,
        {"step": NUM_STEPS},
    )
    _assert_same_state(
        (saved["model"], saved["optimizer"]), results[0]["fsdp"]["states"]["all_gather"], "file vs state"
    )
    assert results[0]["failures"]["save"] == "OSError: disk full (simulated)"
    assert results[1]["failures"]["save"].startswith("CheckpointError: rank 0 failed to write")
    assert not (tmp_path / "failed.pt").exists()
    assert not [p for p in tmp_path.iterdir() if "tmp" in p.name], "a failed save left its temporary file"
    for rank in range(2):
        assert results[rank]["failures"]["load"].startswith("CheckpointError:"), results[rank]["failures"]
    timing = results[0]["timing"]
    assert list(timing["seconds"]) == ["broadcast"] and len(timing["seconds"]["broadcast"]) == 2
    assert all(s > 0 for s in timing["seconds"]["broadcast"])
    # Rank 0 receives params + exp_avg + exp_avg_sq + one float32 step per param (TIMING_MODEL
    # has MODEL's blocks, so as many param tensors as the saved checkpoint); rank 1 nothing.
    assert timing["state_bytes"] == 4 * 3 * timing["num_params"] + 4 * len(saved["optimizer"]["state"])
    assert results[1]["timing"]["state_bytes"] == 0
    # Rank 0's RSS rises by about the state it now holds (every page of it is written and
    # still alive when the peak is read); rank 1, which keeps nothing, by far less. 10% slack
    # below: the allocator may reuse pages freed earlier in the process (a CI run measured
    # 11 KB of 19.7 MB already resident), so "at least every byte" would be flaky.
    rise0, rise1 = (
        timing["consolidation_rise_bytes"]["broadcast"],
        results[1]["timing"]["consolidation_rise_bytes"]["broadcast"],
    )
    assert timing["state_bytes"] > 5 * 2**20, timing["state_bytes"]
    assert rise0 >= 0.9 * timing["state_bytes"], (rise0, timing["state_bytes"])
    assert rise1 < timing["state_bytes"] / 2, (rise1, timing["state_bytes"])


def test_world4_fsdp_and_hsdp_methods_agree_and_reload_resumes(tmp_path: Path, pool4) -> None:
    """FSDP (with an empty shard) compares methods only; HSDP also reloads, from memory."""
    results = _run_checks(
        4, {"fsdp": (FSDP, None), "hsdp": (HSDP, "memory")}, tmp_path, check_failures=False, timeout_s=180, pool=pool4
    )
    assert "reloaded" in results[0]["hsdp"]
    for name in ("fsdp", "hsdp"):
        _assert_config_ok([r[name] for r in results], 4, f"world 4 {name}")


def test_rank_dying_mid_consolidation_leaves_no_file(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt.pt"
    run = run_ranks(_TARGET.format("_die_mid_consolidation"), world_size=2, kwargs={"ckpt": str(ckpt)}, timeout_s=60)
    assert run.status == "crash" and run.returncodes[1] == 1, f"{run.status}: {run.reason}"
    assert list(tmp_path.iterdir()) == []


def test_rank0_dying_mid_write_leaves_only_temporary_files(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt.pt"
    run = run_ranks(_TARGET.format("_die_mid_write"), world_size=1, kwargs={"ckpt": str(ckpt)}, timeout_s=60)
    assert run.status == "crash" and run.returncodes[0] == 1, f"{run.status}: {run.reason}"
    # fsdp_runtime.files.atomic_path's hidden names: the reserved ".ckpt.<random>.pt.tmp"
    # and the partial ".ckpt.<random>.pt" beside it; nothing at the checkpoint path.
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert len(leftovers) == 2 and all(name.startswith(".ckpt.") for name in leftovers), leftovers
    assert leftovers[1] == leftovers[0] + ".tmp", leftovers
    assert not ckpt.exists()


def test_bad_input_raises_one_line_config_error(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    for kwargs, field in (({"method": "gather"}, "checkpoint.consolidation"), ({"bucket_bytes": 0}, "bucket_bytes")):
        with pytest.raises(ConfigError) as info:
            consolidate_state(model, **kwargs)
        assert info.value.path == field and "\n" not in str(info.value)
    with pytest.raises(
        ConfigError, match="unknown consolidation method 'gather'.*use one of all_gather, broadcast, dcp"
    ):
        save_consolidated_checkpoint(tmp_path / "x.pt", model, method="gather")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_consolidated_checkpoint(model, None, tmp_path / "missing.pt")
    with pytest.raises(CheckpointError, match="no optimizer state"):
        load_consolidated_checkpoint(model, torch.optim.AdamW(model.parameters()), (model.state_dict(), {}))


def test_unsharded_model_copies_state_without_aliasing() -> None:
    """Without a process group or DTensors, every method except dcp just copies the state."""
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    model_sd, optim_sd = consolidate_state(model, optimizer, method="broadcast")
    assert torch.equal(model_sd["weight"], model.weight) and model_sd["weight"].data_ptr() != model.weight.data_ptr()
    assert optim_sd["param_groups"][0]["params"] == ["weight", "bias"]
    live_step = optimizer.state[model.weight]["step"]
    assert (
        torch.equal(optim_sd["state"]["weight"]["step"], live_step)
        and optim_sd["state"]["weight"]["step"] is not live_step
    )
