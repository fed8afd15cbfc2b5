"""The FSDP2 training that trials and multi-rank tests build and step on every rank.

Any model ``--model`` names ([Note: model sources] in :mod:`profiles.sources`) trains here
with the batch and loss of [Note: model factory protocol] (:mod:`profiles.factory`): token
ids and next-token cross-entropy by default, the model's own ``make_autotune_batch`` /
``compute_autotune_loss`` where it has them. Data is synthetic and deterministic:
microbatch ``m`` of step ``s`` on data-parallel rank ``r`` is drawn from a generator
seeded by ``(seed, s, m, r)``, so a single-process reference can rebuild the exact global batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autotune.trials.meshes import get_mesh
from fsdp_runtime import (
    AppliedFsdp,
    AppliedPipeline,
    GradAccumulator,
    apply_fsdp,
    apply_pipeline,
    config_from_dict,
    get_structural_differences,
    resolve_units,
    switch_config,
)
from fsdp_runtime.errors import ConfigError
from profiles import BATCH_HOOK, LOSS_HOOK, SHARD_CACHE, ModelProfile, ModelSourceError, compute_loss, get_init_identity
from profiles.sources import ModelSource, load_model_source

LEARNING_RATE = 1e-3

_shard_inits: list[list[int]] = []
"""Per sharded build since the last :func:`take_shard_inits`: the parameters it drew and restored."""


def take_shard_inits() -> list[list[int]]:
    """Each sharded build's ``[drawn, restored]`` parameter counts since the last call, in build
    order ([Note: shard cache] in :mod:`profiles.chunked_init`); the log starts empty again."""
    taken = list(_shard_inits)
    _shard_inits.clear()
    return taken


def make_microbatch(
    profile: ModelSource, *, seed: int, step: int, microbatch: int, dp_rank: int, model: nn.Module | None = None
) -> Any:
    """Token ids ``(batch_size, seq_len + 1)`` (inputs ``[:, :-1]``, targets ``[:, 1:]``), or
    ``model.make_autotune_batch(...)`` where ``model`` has it; on CPU."""
    key = ((seed * 1_000_003 + step) * 1_000_003 + microbatch) * 1_000_003 + dp_rank
    gen = torch.Generator().manual_seed(key % (2**62))
    hook = getattr(model, BATCH_HOOK, None)
    if callable(hook):
        return hook(generator=gen, batch_size=profile.batch_size, seq_len=profile.seq_len)
    if profile.vocab_size is None:
        raise ModelSourceError(
            f"{profile.name}: the vocabulary size is unknown and the model has no {BATCH_HOOK} (see [Note: model factory protocol])"
        )
    return torch.randint(0, profile.vocab_size, (profile.batch_size, profile.seq_len + 1), generator=gen)


def move_batch(batch: Any, device: torch.device) -> Any:
    """A tensor, or a tuple/list/dict of them, on ``device`` (to CUDA: from pinned memory, without
    blocking the host; the copy is ordered before the step's kernels on the current stream)."""
    if isinstance(batch, torch.Tensor):
        if device.type == "cuda" and batch.device.type == "cpu":
            return batch.pin_memory().to(device, non_blocking=True)
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: move_batch(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(move_batch(v, device) for v in batch)
    return batch


@dataclass(kw_only=True)
class Training:
    """A sharded model, its optimizer and accumulation driver, ready to step."""

    profile: ModelSource
    """Where the model came from (a Llama profile, a factory or an HF config)."""
    applied: AppliedFsdp
    optimizer: torch.optim.Optimizer
    accumulator: GradAccumulator
    seed: int
    dp_rank: int
    device: torch.device = torch.device("cpu")
    pipeline: AppliedPipeline | None = None
    """With ``mesh.pp`` > 1: this rank's stages and their schedule (``applied`` is its first stage's)."""
    active_config: dict[str, Any] | None = None
    """The config (as given) whose knobs the model has now: the build's, or the last :meth:`use_config`'s."""

    @property
    def model(self) -> nn.Module:
        return self.applied.model

    def get_structural_differences(self, config: dict[str, Any]) -> list[str]:
        """What keeps this model from switching to ``config`` in place (empty: nothing); a
        model with pipeline stages never switches."""
        if self.pipeline is not None:
            return ["mesh.pp"]
        resolved = resolve_units(self.model, config_from_dict(config))
        return get_structural_differences(self.applied.config, resolved)

    def use_config(self, config: dict[str, Any]) -> None:
        """Switch this model's in-place knobs to ``config`` unless it has them (a structural
        difference raises ``ValueError``): [Note: knobs switched in place] in :mod:`fsdp_runtime.switch`."""
        if config == self.active_config:
            return
        switch_config(self.applied, config_from_dict(config), device_type=self.device.type)
        self.active_config = config

    def prepare(self, step: int) -> None:
        """Make step ``step``'s microbatches and put them on the device now, so that the step
        itself times the model, not the data path (:func:`~autotune.trials.program.timed_step`
        calls this before its barrier)."""
        self._prepared = (step, [self._make_microbatch(step, m) for m in range(self.accumulator.num_microbatches)])

    def get_microbatch(self, step: int, microbatch: int) -> Any:
        """Microbatch ``microbatch`` of step ``step`` on the device (the prepared one, if prepared)."""
        prepared = getattr(self, "_prepared", None)
        if prepared is not None and prepared[0] == step:
            return prepared[1][microbatch]
        return self._make_microbatch(step, microbatch)

    def _make_microbatch(self, step: int, microbatch: int) -> Any:
        batch = make_microbatch(
            self.profile, seed=self.seed, step=step, microbatch=microbatch, dp_rank=self.dp_rank, model=self.model
        )
        return move_batch(batch, self.device)

    def step(self, step: int, probe: Any = None) -> float:
        """One optimizer step over all microbatches; returns this rank's loss (sum of microbatch losses).
        ``probe`` (:class:`~autotune.trials.host_probe.HostProbe`) is told before the first
        microbatch's forward and backward ([Note: host path probe])."""
        if self.pipeline is not None:
            return self._step_pipeline(step)
        total = torch.zeros((), device=self.device)
        num = self.accumulator.num_microbatches
        for m in range(num):
            batch = self.get_microbatch(step, m)
            probing = probe is not None and m == 0
            with self.accumulator.microbatch(m):
                if probing:
                    probe.before_forward()
                loss = compute_loss(self.model, batch) / num
                if probing:
                    probe.before_backward()
                loss.backward()
            total += loss.detach()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total.item()

    def _step_pipeline(self, step: int) -> float:
        """The schedule over the whole batch (the microbatches along dim 0, as without stages);
        the last stage's loss is broadcast over the pipeline group, so every rank of a
        data-parallel column returns the same number a rank without stages would."""
        pipeline = self.pipeline
        assert pipeline is not None
        batch = torch.cat([self.get_microbatch(step, m) for m in range(self.accumulator.num_microbatches)])
        loss = pipeline.step(batch[:, :-1], target=batch[:, 1:])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        total = loss if loss is not None else torch.zeros((), device=self.device)
        last = pipeline.split.num_stages - 1
        src = (last % pipeline.config.mesh.pp) * (dist.get_world_size() // pipeline.config.mesh.pp) + self.dp_rank
        dist.broadcast(total, src=src, group=pipeline.mesh.get_group("pp"))
        return total.item()


def resolve_profile(model: str | dict[str, Any]) -> ModelSource:
    """The model ``model`` names: a profile name/path, a factory, an HF config, or
    ``{"name": ..., **overrides}`` for a resized proxy (:func:`profiles.sources.load_model_source`)."""
    return load_model_source(model)


def build_training(
    rank: int,
    world_size: int,
    *,
    model: str | dict[str, Any],
    config: dict[str, Any],
    seed: int = 0,
    device: str | torch.device = "cpu",
    sharded: bool | None = None,
) -> Training:
    """Build the model on ``device``, shard it as ``config`` says, and add AdamW. ``sharded``:
    build it on the meta device, shard it, then materialise each rank's shards only
    ([Note: sharded build]); None: so on CUDA for a Llama profile, in full elsewhere."""
    source = resolve_profile(model)
    runtime_config = config_from_dict(config)
    torch.manual_seed(seed)
    device = torch.device(device)
    # the rank's shard cache holds this model only: another model or seed releases it
    SHARD_CACHE.use(get_init_identity(source.shape, seed) if isinstance(source, ModelProfile) else None)
    if runtime_config.mesh.pp == 1 and _builds_sharded(source, device, sharded):
        return _build_sharded(rank, source, runtime_config, config, seed=seed, device=device)
    module = source.build(device=str(device), seed=seed)
    if runtime_config.mesh.pp > 1:
        return _build_pipeline_training(source, module, runtime_config, seed=seed, device=device)
    applied = apply_fsdp(module, runtime_config, mesh=get_mesh(runtime_config, device.type))
    return _with_optimizer(rank, source, applied, config, seed=seed, device=device)


def _with_optimizer(
    rank: int, source: ModelSource, applied: AppliedFsdp, given: dict[str, Any], *, seed: int, device: torch.device
) -> Training:
    """The training of a sharded model: AdamW over its parameters and the accumulation driver."""
    return Training(
        profile=source,
        applied=applied,
        optimizer=torch.optim.AdamW(applied.model.parameters(), lr=LEARNING_RATE),
        accumulator=GradAccumulator(applied),
        seed=seed,
        dp_rank=rank,
        device=device,
        active_config=given,
    )


def _builds_sharded(source: ModelSource, device: torch.device, sharded: bool | None) -> bool:
    """[Note: sharded build]: asked for, or by default on CUDA where the model can (a Llama profile)."""
    can = isinstance(source, ModelProfile)
    if sharded and not can:
        raise ConfigError("model", f"{source.name}: only a Llama profile is built sharded (its init is per parameter)")
    return bool(sharded) if sharded is not None else (can and device.type == "cuda")


def _build_sharded(
    rank: int, source: ModelSource, config: Any, given: dict[str, Any], *, seed: int, device: torch.device
) -> Training:
    """[Note: sharded build]
    A full build puts the whole fp32 model on every GPU before ``fully_shard`` frees all but
    each rank's shard: 32 GB per GPU for llama8b, on top of what the trial measures, at the
    moment it starts. So on CUDA a Llama profile is built on the meta device (no memory),
    sharded, given uninitialised memory for its shards only (``to_empty``), and initialised
    shard by shard with the values of a full build (``Llama.init_weights``: each parameter drawn
    on the host in row chunks, a generator per chunk; a rank draws only the chunks that overlap
    its rows: [Note: chunked init] in :mod:`profiles.chunked_init`). So a build's init costs the
    rank's shard, not the model: 1/N of the draw on N ranks (plus at most a partial chunk at each
    end of each shard), which matters where models are built in turn, ``n + 2`` builds a trial
    ([Note: models built in turn]); a rank keeps the rows it drew, so the same model's later
    builds restore them with a copy ([Note: shard cache]). ``benchmarks/sharded_build.py`` at 8B
    width (llama8b's vocabulary and 2 of its blocks, 1.49B parameters; gloo, a 2-core box at load 3-7): 7.5 s a
    build on 2 ranks against 27.8 s with the full draw (0.27x), 7.9 s against 13.6 s on one
    (``normal_`` scales as it draws, in place: one pass, where ``randn`` then a multiply made two). The
    losses are the full build's, bitwise on CPU for FSDP, HSDP, grouped units and uneven shards
    (tests/autotune/trials/test_sharded_build.py), and the values do not depend on the world size
    or the mesh. Factories and Hugging Face configs bring their own init, which only a full build
    runs: they are built in full."""
    module = source.build(device="meta", seed=seed)
    applied = apply_fsdp(module, config, mesh=get_mesh(config, device.type), device_type=device.type)
    module.to_empty(device=device)
    module.init_weights(seed, cache=SHARD_CACHE)
    _shard_inits.append(list(SHARD_CACHE.counts))
    return _with_optimizer(rank, source, applied, given, seed=seed, device=device)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The causal-LM default of :func:`profiles.compute_loss` on a stage's logits: fp32 cross-entropy."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _build_pipeline_training(
    source: ModelSource, module: nn.Module, config: Any, *, seed: int, device: torch.device
) -> Training:
    """Stages of ``module`` on this rank, each sharded (:func:`fsdp_runtime.apply_pipeline`)."""
    if callable(getattr(module, LOSS_HOOK, None)) or callable(getattr(module, BATCH_HOOK, None)):
        raise ConfigError(
            "mesh.pp",
            f"{source.name} brings its own {LOSS_HOOK}/{BATCH_HOOK}: pipeline trials train token ids with the next-token loss only",
            fix="set mesh.pp = 1 for this model",
        )
    pipeline = apply_pipeline(module, config, loss_fn=next_token_loss, device_type=device.type)
    optimizer = torch.optim.AdamW(list(pipeline.parameters()), lr=LEARNING_RATE)
    return Training(
        profile=source,
        applied=pipeline.applied[0],
        optimizer=optimizer,
        accumulator=GradAccumulator(pipeline.applied[0], num_microbatches=config.num_microbatches),
        seed=seed,
        dp_rank=pipeline.dp_rank,
        device=device,
        pipeline=pipeline,
    )
