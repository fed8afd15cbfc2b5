"""Numerics checks that can fail: bf16 against fp32 on a task whose loss must move, and a model
switched in place against a fresh build, bitwise and collective by collective.

[Note: numerics checks]
*Memorisation* (:func:`check_memorisation`). Every step trains on the same batch (AdamW at
:attr:`MemoriseTask.lr`): rows that alternate two tokens ``a b a b ...``, the pair drawn per row
from an alphabet of :attr:`MemoriseTask.alphabet` tokens spread over the vocabulary. A token
follows different partners in different rows, so the next token is the one *before* the current
one: a model that sees only the current token (its blocks skipped: embedding, norm, output)
cannot go below the batch's *context-free floor*, the conditional entropy of the next token
given the current one over the rank's batch (the best mean cross-entropy of any function of the
current token; :func:`~autotune.trials.numerics_criteria.get_context_free_floor`), while a
decoder whose blocks run learns to copy the token two back and goes far below it. Criteria, for
the fp32 run and for the bf16-params / fp32-reduce run, on every rank: the last loss is at most
half the first (*fell by half*) and at most half the floor (*beat the floor*); and at every step
the bf16 loss is within the tolerance of fp32's (*bf16 tracks fp32*). Measured on CPU (2 gloo
ranks, tiny Llama, 2 blocks, the default task, 32 steps, seeds 0-2): losses 6.2 -> 0.06-0.13
against floors of 0.70-0.99 (limits 0.35-0.49); with the blocks skipped the loss stays above
its floor, twice the limit.

The tolerance. bf16 keeps 8 significant bits: a rounding changes a value by at most
``u = 2**-8`` of it. A step's bf16 loss departs from fp32's (a) by the forward's own roundings,
``u`` of the loss per rounding a value passes through, and (b) by the drift of the trajectory:
each earlier step's gradients were off by as much, so each step's progress ``|L[i] - L[i+1]|``
along the fp32 curve may be off by the same share. A value passes through ``r`` roundings in a
step (:func:`~autotune.trials.numerics_criteria.get_roundings`: per block seven matmuls,
attention and two norms, then the output and the loss's input; backward twice as many); with
independent signs they add up to ``u * sqrt(r)`` of the quantity (one standard deviation). So at
step ``s``, from the measured fp32 curve ``L32``::

    tol[s] = K * u * sqrt(r) * (L32[s] + sum(|L32[i] - L32[i+1]| for i < s)),   K = 3

``K`` (:data:`~autotune.trials.numerics_criteria.TOLERANCE_FACTOR`) is three standard deviations,
room for the chaotic amplification the sum leaves out. For 2 blocks (``r = 66``) that is
``0.095 * (L32[s] + travel)``: 0.6 at the end of a curve from 6.2 to 0.1. Measured on CPU (the
runs above): the bf16 curve used 1-3% of it (largest ``|L16 - L32| / tol``), 17% in a harsher
run (learning rate 1e-2, 4 blocks). Loose on purpose: a false alarm on a GPU box costs a rerun,
and a broken model or optimizer fails *fell by half* or *beat the floor* long before it strays
this far.

*Switch* (:func:`check_switch`). One model built as config A trains a step, is switched in place
(:func:`fsdp_runtime.switch_config`) to config B and trains on; a fresh build of B trains the
same steps from the same weights, both in fp32 (deterministic algorithms on). Criteria: (1) the
losses are bitwise equal on every rank and step (the in-place knobs change when and where, not
what is computed); (2) each step's counts of all-gathers and reduce-scatters after the switch
equal the fresh build's
(:class:`~autotune.trials.collective_count.CollectiveCounter`, on the live process group); (3)
A's counts (the switched model's first step) differ from B's, so that a switch that did nothing
fails (2). A and B (:func:`keep_and_prefetch`): FSDP2's defaults, and no reshard after forward
with the next block prefetched; A all-gathers every block again in backward, B does not (tiny
Llama, 4 blocks: 9 all-gathers a step against 5).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from autotune.trials.collective_count import CollectiveCounter
from autotune.trials.launch import RankRun, run_ranks
from autotune.trials.numerics_criteria import (
    NumericsCheck,
    evaluate_comm_buffers,
    evaluate_memorisation,
    evaluate_switch,
    get_context_free_floor,
)
from autotune.trials.training import Training, build_training, resolve_profile
from fsdp_runtime import (
    ROOT_UNIT,
    MixedPrecisionConfig,
    RuntimeConfig,
    config_to_dict,
    default_config,
    get_knob,
    get_unsupported_knobs,
)
from profiles import compute_loss

if TYPE_CHECKING:
    from autotune.trials.pools import Pool

__all__ = [
    "BF16",
    "FP32",
    "ONE_RANK",
    "ONE_RANK_BUFFERS",
    "COMM_BUFFER_KNOBS",
    "MemoriseTask",
    "check_comm_buffers",
    "check_memorisation",
    "get_comm_buffer_configs",
    "check_switch",
    "get_default_config",
    "keep_and_prefetch",
    "make_alternating_batch",
    "memorise_ranks",
    "switch_ranks",
]

BF16 = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")
FP32 = MixedPrecisionConfig()
ONE_RANK = "FSDP2 issues no collectives on one rank, so the switch check cannot count them: it needs 2 ranks or more"
ONE_RANK_BUFFERS = "FSDP2 issues no collectives on one rank, so their buffers are never used: it needs 2 ranks or more"
MEMORISE_TARGET = "autotune.trials.numerics:memorise_ranks"
SWITCH_TARGET = "autotune.trials.numerics:switch_ranks"


@dataclass(frozen=True, kw_only=True)
class MemoriseTask:
    """The fixed batch every step trains on, and how."""

    rows: int = 16
    """Rows per rank (split over the config's microbatches)."""
    length: int = 32
    """Tokens per row (inputs ``[:, :-1]``, targets ``[:, 1:]``)."""
    alphabet: int = 16
    """Distinct tokens the rows draw their pairs from."""
    lr: float = 5e-3
    """AdamW's learning rate: 5e-3 memorises the batch in ~25 steps 64 wide (tiny Llama, fp32)."""
    num_steps: int = 32
    seed: int = 0
    """The model's init and the batch (each data-parallel rank its own rows)."""


# -- the task --------------------------------------------------------------------------------


def make_alternating_batch(vocab_size: int, task: MemoriseTask, *, dp_rank: int) -> torch.Tensor:
    """``(task.rows, task.length)`` token ids on CPU: row ``i`` alternates two distinct tokens of the
    task's alphabet (``alphabet`` ids spread over ``[0, vocab_size)``), the same for every step."""
    gen = torch.Generator().manual_seed(task.seed * 1_000_003 + dp_rank)
    alphabet = torch.randperm(vocab_size, generator=gen)[: task.alphabet]
    pairs = torch.stack([torch.randperm(task.alphabet, generator=gen)[:2] for _ in range(task.rows)])
    return alphabet[pairs].repeat(1, (task.length + 1) // 2)[:, : task.length].contiguous()


# -- rank programs ---------------------------------------------------------------------------


def _get_device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _build(rank: int, world_size: int, model: Any, config: dict, task: MemoriseTask, backend: str) -> Training:
    training = build_training(rank, world_size, model=model, config=config, seed=task.seed, device=_get_device(backend))
    for group in training.optimizer.param_groups:
        group["lr"] = task.lr
    return training


def _train_step(
    training: Training, tokens: torch.Tensor, *, count: bool = False
) -> tuple[float, dict[str, int], float]:
    """One optimizer step on ``tokens`` (split over the microbatches); this rank's loss, when
    ``count`` the collectives the step issued by kind (a dispatch mode slows every op: off
    otherwise), and the squared norm of this rank's gradient shards before the update."""
    num = training.accumulator.num_microbatches
    total = torch.zeros((), device=training.device)
    counter = CollectiveCounter()
    with counter if count else contextlib.nullcontext():
        for m, chunk in enumerate(tokens.chunk(num)):
            with training.accumulator.microbatch(m):
                loss = compute_loss(training.model, chunk) / num
                loss.backward()
            total += loss.detach()
        grads = [p.grad for p in training.model.parameters() if p.grad is not None]
        grad_sq = sum(float(g.to_local().double().square().sum()) if hasattr(g, "to_local") else 0.0 for g in grads)
        training.optimizer.step()
        training.optimizer.zero_grad(set_to_none=True)
    return total.item(), dict(counter.counts), grad_sq


def memorise_ranks(
    rank: int, world_size: int, *, model: Any, config: dict, task: dict, backend: str = "gloo"
) -> dict[str, Any]:
    """Rank program: ``task.num_steps`` steps on the rank's fixed batch; its losses and context-free floor."""
    memorise = MemoriseTask(**task)
    training = _build(rank, world_size, model, config, memorise, backend)
    tokens = make_alternating_batch(training.profile.vocab_size, memorise, dp_rank=training.dp_rank)
    batch = tokens.to(training.device)
    steps = [_train_step(training, batch) for _ in range(memorise.num_steps)]
    return {
        "losses": [loss for loss, _, _ in steps],
        "grad_sq": [grad_sq for _, _, grad_sq in steps],
        "floor": get_context_free_floor(tokens),
    }


def switch_ranks(
    rank: int, world_size: int, *, model: Any, config_a: dict, config_b: dict, task: dict, backend: str = "gloo"
) -> dict[str, Any]:
    """Rank program: a fresh build of B, then a build of A switched to B after its first step
    (:meth:`~autotune.trials.training.Training.use_config`); each run's losses and per-step
    collectives. Deterministic algorithms on (CUDA's memory-efficient attention backward is not by
    default), restored after."""
    memorise = MemoriseTask(**task)
    if backend == "nccl":  # cuBLAS's deterministic workspace; read when this fresh rank's first matmul makes its handle
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return {
            name: _run_switched(rank, world_size, model, config, config_b, memorise, backend)
            for name, config in (("fresh", config_b), ("switched", config_a))
        }
    finally:
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])


def _run_switched(
    rank: int, world_size: int, model: Any, build: dict, target: dict, task: MemoriseTask, backend: str
) -> dict[str, list]:
    """Build as ``build``, switch to ``target`` before the second step (a no-op where they are equal)."""
    training = _build(rank, world_size, model, build, task, backend)
    batch = make_alternating_batch(training.profile.vocab_size, task, dp_rank=training.dp_rank).to(training.device)
    losses, counts = [], []
    for step in range(task.num_steps):
        if step == 1:
            training.use_config(target)
        loss, count, _ = _train_step(training, batch, count=True)
        losses.append(loss)
        counts.append(count)
    return {"losses": losses, "collectives": counts}


# -- the checks ------------------------------------------------------------------------------


def keep_and_prefetch(config: RuntimeConfig) -> RuntimeConfig:
    """``config`` with every block unit keeping its parameters after forward and prefetching the
    next block: knobs a sharded model switches in place ([Note: knobs switched in place])."""
    blocks = [u.name for u in config.units if u.name != ROOT_UNIT]
    units = [
        dataclasses.replace(u, reshard_after_forward=False, forward_prefetch=blocks[i + 1 : i + 2])
        if u.name != ROOT_UNIT
        else u
        for i, u in enumerate(config.units)
    ]
    return dataclasses.replace(config, units=units)


def get_default_config(model: Any, mixed_precision: MixedPrecisionConfig) -> RuntimeConfig:
    """FSDP2's defaults for ``model``'s units, in ``mixed_precision``."""
    return default_config(resolve_profile(model).unit_names, mixed_precision=mixed_precision)


def _launch(
    target: str, kwargs: dict[str, Any], *, world_size: int, backend: str, pool: Pool | None, timeout_s: float
) -> RankRun:
    if pool is not None:
        return pool.run(target, kwargs, timeout_s=timeout_s)
    return run_ranks(target, world_size=world_size, kwargs=kwargs, timeout_s=timeout_s, backend=backend)


def check_memorisation(
    model: Any,
    *,
    world_size: int,
    backend: str = "gloo",
    task: MemoriseTask = MemoriseTask(),
    pool: Pool | None = None,
    timeout_s: float = 600.0,
    target: str = MEMORISE_TARGET,
) -> NumericsCheck:
    """fp32, then bf16 params with fp32 reduce, on the fixed batch on ``world_size`` ranks (``pool``'s,
    else fresh ones); ``target`` is the rank program (:func:`memorise_ranks`, or a test's stand-in)."""
    configs = {name: get_default_config(model, mp) for name, mp in (("fp32", FP32), ("bf16", BF16))}
    runs = _memorise_each("memorisation", configs, model, task, backend, world_size, pool, timeout_s, target)
    if isinstance(runs, NumericsCheck):
        return runs
    return evaluate_memorisation(runs["fp32"], runs["bf16"], len(configs["fp32"].units) - 1)


def _memorise_each(
    check: str,
    configs: dict[str, RuntimeConfig],
    model: Any,
    task: MemoriseTask,
    backend: str,
    world_size: int,
    pool: Pool | None,
    timeout_s: float,
    target: str,
) -> dict[str, list[dict[str, Any]]] | NumericsCheck:
    """The memorisation task under each of ``configs`` in turn: each one's rank results, or the failed
    check ``check`` naming the first config whose ranks failed."""
    runs = {}
    for name, config in configs.items():
        kwargs = {
            "model": model,
            "config": config_to_dict(config),
            "task": dataclasses.asdict(task),
            "backend": backend,
        }
        run = _launch(target, kwargs, world_size=world_size, backend=backend, pool=pool, timeout_s=timeout_s)
        if not run.ok:
            return NumericsCheck(name=check, failure=f"{name}: {run.status}: {run.reason}")
        runs[name] = run.results
    return runs


def check_switch(
    model: Any,
    *,
    world_size: int,
    backend: str = "gloo",
    task: MemoriseTask = MemoriseTask(num_steps=4),
    pool: Pool | None = None,
    timeout_s: float = 600.0,
    target: str = SWITCH_TARGET,
) -> NumericsCheck:
    """FSDP2's defaults switched in place to :func:`keep_and_prefetch` of them after a step, against
    a fresh build of that, in fp32 on ``world_size`` ranks (2 or more: :data:`ONE_RANK`); ``target``
    as in :func:`check_memorisation`."""
    if world_size < 2:
        return NumericsCheck(name="switch", failure=f"world size {world_size}: {ONE_RANK}")
    config_a = get_default_config(model, FP32)
    kwargs = {
        "model": model,
        "config_a": config_to_dict(config_a),
        "config_b": config_to_dict(keep_and_prefetch(config_a)),
        "task": dataclasses.asdict(task),
        "backend": backend,
    }
    run = _launch(target, kwargs, world_size=world_size, backend=backend, pool=pool, timeout_s=timeout_s)
    if not run.ok:
        return NumericsCheck(name="switch", failure=f"{run.status}: {run.reason}")
    return evaluate_switch(run.results)


COMM_BUFFER_KNOBS = ("process_group_comm_buffers", "symmetric_memory")
"""The CUDA/NCCL-only knobs the GPU suite's numerics run (``fsdp_runtime.knobs``; not bitwise: sums only)."""


def get_comm_buffer_configs(model: Any) -> dict[str, RuntimeConfig]:
    """FSDP2's defaults in fp32, and each of :data:`COMM_BUFFER_KNOBS` this torch can set on them."""
    base = get_default_config(model, FP32)
    missing = get_unsupported_knobs()
    return {"defaults": base} | {
        k: dataclasses.replace(base, **{k: True}) for k in COMM_BUFFER_KNOBS if k not in missing
    }


def check_comm_buffers(
    model: Any,
    *,
    world_size: int,
    backend: str = "nccl",
    task: MemoriseTask = MemoriseTask(),
    pool: Pool | None = None,
    timeout_s: float = 600.0,
    target: str = MEMORISE_TARGET,
) -> NumericsCheck:
    """The memorisation task under FSDP2's defaults and under each communication-buffer knob, fp32,
    on ``world_size`` NCCL ranks (2 or more: :data:`ONE_RANK_BUFFERS`); criteria in
    :func:`~autotune.trials.numerics_criteria.evaluate_comm_buffers`."""
    devices = get_knob(COMM_BUFFER_KNOBS[0]).devices
    if backend != "nccl":
        return NumericsCheck(
            name="comm_buffers", failure=f"backend {backend}: these knobs need {'/'.join(devices)} and NCCL"
        )
    if world_size < 2:
        return NumericsCheck(name="comm_buffers", failure=f"world size {world_size}: {ONE_RANK_BUFFERS}")
    configs = get_comm_buffer_configs(model)
    runs = _memorise_each("comm_buffers", configs, model, task, backend, world_size, pool, timeout_s, target)
    if isinstance(runs, NumericsCheck):
        return runs
    return evaluate_comm_buffers(runs, len(configs["defaults"].units) - 1)
