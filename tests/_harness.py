"""Test-only multi-rank harness: rank programs and a single-process reference.

Ranks import this module by name (``_harness:train_configs``): ``tests/conftest.py`` puts
``tests/`` on ``sys.path`` and the launchers pass ``sys.path`` on to the ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autotune.trials.training import LEARNING_RATE, Training, build_training, make_microbatch, resolve_profile
from fsdp_runtime._fsdp_private import count_separate_reduce_scatter_groups
from profiles import build_model
from profiles.factory import compute_loss


def train_losses(
    rank: int, world_size: int, *, model: str | dict[str, Any], config: dict[str, Any], num_steps: int, seed: int = 0
) -> list[float]:
    """Rank program: train ``num_steps`` steps and return this rank's per-step losses."""
    training = build_training(rank, world_size, model=model, config=config, seed=seed)
    return [training.step(s) for s in range(num_steps)]


def train_full_and_sharded(
    rank: int, world_size: int, *, model: str, configs: list[dict[str, Any]], num_steps: int, seed: int = 0
) -> list[dict[str, list[float]]]:
    """Rank program: per config, this rank's losses of a full build and of a sharded one
    ([Note: sharded build]), and the sharded build's parameters' devices (none left on meta)."""
    from torch.distributed.tensor import DTensor

    from profiles.llama import Llama

    original, inits = Llama.init_weights, []

    def init_weights(self, seed: int, **kwargs: Any) -> int:  # what the init saw: sharded parameters or full ones
        inits.append(all(isinstance(p, DTensor) for p in self.parameters()))
        return original(self, seed, **kwargs)

    Llama.init_weights = init_weights
    results = []
    try:
        for config in configs:
            run = {}
            for name, sharded in (("full", False), ("sharded", True)):
                training = build_training(rank, world_size, model=model, config=config, seed=seed, sharded=sharded)
                run[name] = [training.step(s) for s in range(num_steps)]
                run[f"{name}_devices"] = sorted({p.device.type for p in training.model.parameters()})
                run[f"{name}_init_sharded"] = inits.pop()
                del training
            results.append(run)
    finally:
        Llama.init_weights = original
    return results


def reference_losses(
    *, model: str | dict[str, Any], world_size: int, num_microbatches: int, num_steps: int, seed: int = 0
) -> list[list[float]]:
    """Single-process, non-FSDP run on the combined batch; per-step losses as each rank would see them."""
    profile = resolve_profile(model)
    torch.manual_seed(seed)
    module = build_model(profile, seed=seed)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE)
    per_rank: list[list[float]] = [[] for _ in range(world_size)]
    for s in range(num_steps):
        totals = [0.0] * world_size
        for m in range(num_microbatches):
            batches = [make_microbatch(profile, seed=seed, step=s, microbatch=m, dp_rank=r) for r in range(world_size)]
            losses = [compute_loss(module, b) / num_microbatches for b in batches]
            # FSDP averages gradients over ranks: the global loss is the mean of rank losses.
            (torch.stack(losses).mean()).backward()
            for r, loss in enumerate(losses):
                totals[r] += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for r in range(world_size):
            per_rank[r].append(totals[r])
    return per_rank


def _collective_kinds() -> dict[Any, str]:
    """The op packets of c10d's collectives (c10d ops and functional collectives) -> the kinds the tests assert on."""
    c10d, funcol = torch.ops.c10d, torch.ops.c10d_functional
    return {
        c10d._allgather_base_: "all_gather",
        c10d.allgather_: "all_gather",
        c10d.allgather_into_tensor_coalesced_: "all_gather",
        funcol.all_gather_into_tensor: "all_gather",
        funcol.all_gather_into_tensor_coalesced: "all_gather",
        c10d._reduce_scatter_base_: "reduce_scatter",
        c10d.reduce_scatter_: "reduce_scatter",
        c10d.reduce_scatter_tensor_coalesced_: "reduce_scatter",
        funcol.reduce_scatter_tensor: "reduce_scatter",
        funcol.reduce_scatter_tensor_coalesced: "reduce_scatter",
        c10d.allreduce_: "all_reduce",
        c10d.allreduce_coalesced_: "all_reduce",
        funcol.all_reduce: "all_reduce",
        funcol.all_reduce_coalesced: "all_reduce",
    }


class _CollectiveCounter(TorchDispatchMode):
    """Counts c10d ops by kind while active: a dispatch mode sees every c10d op, however FSDP2
    reaches it (no module tracker: stages run each module once per microbatch, which
    CommDebugMode's tracker does not survive, and its hooks keep every model it saw alive)."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds = _collective_kinds()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet in self.kinds or str(packet).startswith(("c10d.", "_c10d_functional.")):
            kind = self.kinds.get(packet, str(packet))
            self.counts[kind] = self.counts.get(kind, 0) + 1
        return func(*args, **(kwargs or {}))


# Collectives are counted by a dispatch mode (``_CollectiveCounter``): it sees every c10d op,
# however FSDP2 reaches it. Measured on torch 2.13, tiny model, 2 microbatches: it counts every
# all-gather, every reduce-scatter (also with set_requires_gradient_sync(False) on non-final
# microbatches) and HSDP's replica all-reduce (also with replica_last), as many as torch's
# CommDebugMode and a monkeypatch of the torch.distributed functions FSDP2 calls. Not
# CommDebugMode itself: its module tracker's hooks keep every model it saw alive (measured:
# each config's whole model and ~19k objects stayed after the training was deleted), which a
# pooled rank would carry from job to job, slower each time; it also took nearly twice the
# counter's time. One counter per microbatch, entered inside the accumulator's microbatch
# context, which holds the microbatch's forward and backward (FSDP2's root post-backward
# callback included): the model build and the optimizer step issue no collectives (measured:
# the per-microbatch sum equals a whole-run count of the torch.distributed functions).
@contextlib.contextmanager
def count_collectives(training: Training) -> Iterator[dict[str, int]]:
    """Count, by kind, the collectives of ``training``'s microbatches (forward + backward) while active.

    Kinds: ``all_gather``, ``reduce_scatter``, ``all_reduce``; any other c10d op is
    counted under its op name, so nothing is silently dropped.
    """
    counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    accumulator = training.accumulator
    original = accumulator.microbatch

    @contextlib.contextmanager
    def counted_microbatch(index: int) -> Iterator[None]:
        counter = _CollectiveCounter()
        with original(index), counter:
            yield
        for kind, n in counter.counts.items():
            counts[kind] = counts.get(kind, 0) + n

    accumulator.microbatch = counted_microbatch  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        del accumulator.microbatch  # the instance attribute; the class method shows through again


def refit_loss(training: Training, step: int) -> float:
    """This rank's loss on step ``step``'s microbatches, re-evaluated (no grad) with the current
    parameters: comparable to what ``training.step(step)`` returned (sum of microbatch losses / count)."""
    num = training.accumulator.num_microbatches
    total = 0.0
    with torch.no_grad():
        for m in range(num):
            tokens = make_microbatch(
                training.profile, seed=training.seed, step=step, microbatch=m, dp_rank=training.dp_rank
            ).to(training.device)
            total += (compute_loss(training.model, tokens) / num).item()
    return total


def train_configs(
    rank: int,
    world_size: int,
    *,
    model: str | dict[str, Any],
    configs: list[dict[str, Any]],
    num_steps: int,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Rank program: train each config from the same init in turn (one launch, many configs).

    Returns per config this rank's losses, the collectives its training steps issued, how
    many eager concats and activation recomputations ran (diagnostics that prove a knob did
    something), and
    ``refit_loss``: the last step's loss re-evaluated after training (proof that the
    updates descend on the data they came from).
    """
    results = []
    for config in configs:
        training = build_training(rank, world_size, model=model, config=config, seed=seed)
        with count_collectives(training) as counts:
            losses = [training.step(s) for s in range(num_steps)]
        refit = refit_loss(training, num_steps - 1)  # after counting: its all-gathers are not training traffic
        eager = sum(e.num_eager_concats for e in training.applied.eager_concat.values())
        recomputes = sum(f.num_recomputes for f in training.applied.checkpointed.values())
        results.append(
            {
                "losses": losses,
                "collectives": dict(counts),
                "eager_concats": eager,
                "recomputes": recomputes,
                "refit_loss": refit,
            }
        )
        del training
    return results


def train_switched(
    rank: int, world_size: int, *, model: str, runs: list[dict[str, Any]], seed: int = 0
) -> list[dict[str, Any]]:
    """Rank program: per run, build one model as ``run["build"]`` (from the same init; where the
    run has ``adopt``, take it over with ``adopt_fsdp`` and that config, as if other code had
    sharded it), then
    before step ``s`` switch it in place to ``run["steps"][s]`` (:meth:`Training.use_config`)
    where that differs from the config it has (a run whose steps are all its build config never
    switches: a fresh build). Per run this rank's losses, and per step its collectives and
    eager concats (proof that each switch took effect)."""
    results = []
    for run in runs:
        training = build_training(rank, world_size, model=model, config=run["build"], seed=seed)
        if "adopt" in run:  # the model as sharded by other code: adopt_fsdp sets run["adopt"]'s knobs on it
            training = _adopted(training, run["adopt"])
        active, losses, collectives, eager, rs_groups = run.get("adopt", run["build"]), [], [], [], []
        for s, config in enumerate(run["steps"]):
            if config != active:
                training.use_config(config)
                active = config
            before = sum(e.num_eager_concats for e in training.applied.eager_concat.values())
            with count_collectives(training) as counts:
                losses.append(training.step(s))
            collectives.append(dict(counts))
            eager.append(sum(e.num_eager_concats for e in training.applied.eager_concat.values()) - before)
            rs_groups.append(count_units_on_own_rs_group(training))
        results.append(
            {
                "losses": losses,
                "collectives": collectives,
                "eager_concats": eager,
                "rs_groups": rs_groups,
                "rs_groups_made": count_separate_reduce_scatter_groups(),
            }
        )
        del training
    return results


def count_units_on_own_rs_group(training: Training) -> int:
    """How many of the model's units reduce-scatter on a process group of their own (``separate_reduce_scatter_group``)."""
    from fsdp_runtime._fsdp_private import get_param_groups

    units = training.applied.units.values()
    return sum(
        any(getattr(g.mesh_info, "reduce_scatter_process_group", None) is not None for g in get_param_groups(u))
        for u in units
    )


def _adopted(training: Training, config: dict[str, Any]) -> Training:
    from fsdp_runtime import GradAccumulator, adopt_fsdp, config_from_dict

    applied = adopt_fsdp(training.model, config_from_dict(config), device_type="cpu")
    return dataclasses.replace(training, applied=applied, accumulator=GradAccumulator(applied), active_config=config)


def train_pipeline_configs(
    rank: int, world_size: int, *, model: str, configs: list[dict[str, Any]], num_steps: int, seed: int = 0
) -> list[dict[str, Any]]:
    """Rank program: each config (with pipeline stages or without) in turn; per config this
    rank's losses (with stages: the last stage's, broadcast over its pipeline group), its
    stage indices and the collectives of its training steps by kind. The same counter runs
    with and without stages (a dispatch mode can change the last bits of a result)."""
    results = []
    for config in configs:
        training = build_training(rank, world_size, model=model, config=config, seed=seed)
        last_backward: list[bool] = []  # what each backward of the first stage told FSDP2
        if training.pipeline is not None:
            stage = training.pipeline.stages[0]
            original = stage.submod.set_is_last_backward
            stage.submod.set_is_last_backward = lambda flag, log=last_backward, call=original: (
                log.append(flag),
                call(flag),
            )[1]
        counter = _CollectiveCounter()
        with counter:
            losses = [training.step(s) for s in range(num_steps)]
        stages = training.pipeline.stage_indices if training.pipeline is not None else None
        results.append(
            {"losses": losses, "stages": stages, "collectives": counter.counts, "last_backward": last_backward}
        )
        del training
    return results


def drop_kept_model(rank: int, world_size: int) -> None:
    """Rank program: forget the warm reference a pooled rank kept from an earlier search's trials
    ([Note: a warm reference] in :mod:`autotune.trials.kept`) and return its memory, so that the
    next search starts as on ranks of its own."""
    from autotune.trials import kept
    from autotune.trials.rank_memory import release_free_memory

    kept.drop()
    release_free_memory()


def build_sharded_cached_and_fresh(
    rank: int, world_size: int, *, model: str | dict[str, Any], configs: list[dict[str, Any]], seed: int = 0
) -> list[dict[str, Any]]:
    """Rank program: ``configs`` built sharded one after another through this rank's shard cache
    ([Note: shard cache]), each compared, parameter by parameter, with a fresh sharded build that
    draws every row itself (no cache) and with a full build's shards; per config the build's
    ``[drawn, restored]`` counts, what the cache held after it, and whether every local shard is
    bitwise the fresh draw's and the full build's. The cache starts empty and is emptied after."""
    from autotune.trials.meshes import get_mesh
    from autotune.trials.training import take_shard_inits
    from fsdp_runtime import apply_fsdp, config_from_dict
    from profiles.chunked_init import SHARD_CACHE

    def local_values(training: Training) -> list[torch.Tensor]:
        return [p.to_local().detach().clone() for p in training.model.parameters()]

    SHARD_CACHE.release()
    take_shard_inits()
    results = []
    try:
        for config in configs:
            cached = build_training(rank, world_size, model=model, config=config, seed=seed, sharded=True)
            counts = take_shard_inits()
            values = local_values(cached)
            del cached
            source = resolve_profile(model)
            fresh = source.build(device="meta", seed=seed)  # what _build_sharded does, with no cache
            runtime = config_from_dict(config)
            apply_fsdp(fresh, runtime, mesh=get_mesh(runtime, "cpu"), device_type="cpu")
            fresh.to_empty(device="cpu")
            fresh.init_weights(seed)
            fresh_values = [p.to_local().detach() for p in fresh.parameters()]
            full = build_training(rank, world_size, model=model, config=config, seed=seed, sharded=False)
            full_values = local_values(full)
            del full
            results.append(
                {
                    "counts": counts,
                    "entries": len(SHARD_CACHE),
                    "cache_within_bound": 0 < SHARD_CACHE.nbytes <= SHARD_CACHE.limit_bytes,
                    "as_fresh": all(torch.equal(a, b) for a, b in zip(values, fresh_values, strict=True)),
                    "as_full": all(torch.equal(a, b) for a, b in zip(values, full_values, strict=True)),
                }
            )
    finally:
        SHARD_CACHE.release()
    return results
