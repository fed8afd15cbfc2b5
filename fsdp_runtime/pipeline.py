"""Pipeline stages with FSDP2 inside each: ``apply_pipeline`` builds them from a config with ``mesh.pp`` > 1.

    applied = apply_pipeline(model, load_config("best.toml"), loss_fn=cross_entropy)
    optimizer = torch.optim.AdamW(applied.parameters())
    for step in range(num_steps):
        loss = applied.step(inputs, target=targets)  # the whole batch: num_microbatches x microbatch
        optimizer.step()
        optimizer.zero_grad()

[Note: pipeline stages]
The mesh is ``pp x replicate x shard`` with ``pp`` outermost (torchtitan's order): global
rank ``r`` is pipeline rank ``r // dp`` and data-parallel rank ``r % dp``, ``dp = world / pp``.
The blocks (:func:`fsdp_runtime.find_block_names`) split into ``pp x virtual_stages``
stages in model order (``pipeline.blocks_per_stage``, or evenly); stage ``s`` lives on
pipeline rank ``s % pp`` (torch's looped placement). A stage is the model with every block
it does not hold, and the parameter-holding modules outside the blocks that are not its
own, replaced by :class:`Passthrough` (returns its first argument): the first stage keeps
the embeddings (``nn.Embedding`` modules), the last the other parameter-holding modules
(final norm, output head), and modules without parameters (rotary tables, dropout) stay
on every stage. So the model's own ``forward`` runs each stage unchanged, for any decoder
whose forward is embeddings -> blocks -> head over one hidden state; module paths stay
(``layers.3`` is ``layers.3`` in its stage), so the config's unit names apply. Tied
embeddings (one parameter in the first and the last stage) are refused.

Each stage is sharded by :func:`fsdp_runtime.apply_fsdp` over its data-parallel mesh with
the config's units that lie in it (a unit spanning two stages, or a prefetch list reaching
into another stage, is refused) and ``root`` as the stage module. torch's
``PipelineStage`` turns gradient sync off for every microbatch but the last and reduces
all gradients after the last backward; :class:`TunedStage` instead sets each unit's sync
and reshard-after-backward per microbatch exactly as :class:`~fsdp_runtime.GradAccumulator`
does without a pipeline, so ``sync = "every"`` units reduce-scatter during each
microbatch's backward, behind the other microbatches' compute (the overlap Paddle #57446
built by hand). torch's zero-bubble schedules split backward into input and weight passes
outside FSDP2's hooks; with FSDP2 stages they did not keep the math on torch 2.13 (losses
2e-4 relative off the model without stages after one step, with torch's own deferral), so
the schema does not offer them.

Loss: ``loss_fn(output, target)`` is the microbatch's loss; the schedule backpropagates
``loss / num_microbatches`` (``scale_grads=False``), the same operations as a
``GradAccumulator`` loop, so a pipeline trains the same numbers as the model without one.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from fsdp_runtime._fsdp_private import run_pending_post_backwards
from fsdp_runtime.accumulation import GradAccumulator
from fsdp_runtime.apply import AppliedFsdp, apply_fsdp
from fsdp_runtime.blocks import find_block_names, resolve_units, split_edge_modules
from fsdp_runtime.config import ROOT_UNIT, PipelineConfig, RuntimeConfig, UnitConfig
from fsdp_runtime.errors import ConfigError
from fsdp_runtime.validation import validate_config, validate_for_world

__all__ = ["AppliedPipeline", "Passthrough", "StageSplit", "TunedStage", "apply_pipeline", "split_stages"]

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}


class Passthrough(nn.Module):
    """Stands in for a module another stage holds: returns its first argument (the hidden state)."""

    def __init__(self, held_by: int) -> None:
        super().__init__()
        self.held_by = held_by

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x

    def extra_repr(self) -> str:
        return f"held_by=stage {self.held_by}"


@dataclass(frozen=True, kw_only=True)
class StageSplit:
    """Which modules each stage holds."""

    blocks: tuple[tuple[str, ...], ...]
    """Block paths of each stage, in model order."""
    first: tuple[str, ...]
    """Parameter-holding modules outside the blocks that the first stage runs (embeddings)."""
    last: tuple[str, ...]
    """Those that the last stage runs (final norm, output head)."""

    @property
    def num_stages(self) -> int:
        """Stages in all (over every pipeline rank)."""
        return len(self.blocks)

    def get_modules(self, stage: int) -> tuple[str, ...]:
        """Module paths stage ``stage`` holds: its blocks, plus the first or last stage's modules outside them."""
        edges = (self.first if stage == 0 else ()) + (self.last if stage == self.num_stages - 1 else ())
        return self.blocks[stage] + edges

    def get_stage_of(self, module: str) -> int | None:
        """The stage holding module path ``module`` (or a module above it); None where no stage's modules do."""
        for stage in range(self.num_stages):
            if any(module == m or module.startswith(m + ".") for m in self.get_modules(stage)):
                return stage
        return None


def get_blocks_per_stage(num_blocks: int, config: RuntimeConfig) -> list[int]:
    """Blocks of each stage: ``pipeline.blocks_per_stage``, or an even split (refused where it is not one)."""
    pipeline = config.pipeline
    stages = pipeline.get_num_stages(config.mesh.pp)
    if pipeline.blocks_per_stage is not None:
        if sum(pipeline.blocks_per_stage) != num_blocks:
            raise ConfigError(
                "pipeline.blocks_per_stage",
                f"sums to {sum(pipeline.blocks_per_stage)} blocks but the model has {num_blocks}",
                fix=f"list {stages} block counts summing to {num_blocks}",
            )
        return list(pipeline.blocks_per_stage)
    if num_blocks % stages:
        raise ConfigError(
            "mesh.pp",
            f"{num_blocks} blocks do not split evenly into {stages} stages (mesh.pp {config.mesh.pp} x pipeline.virtual_stages {pipeline.virtual_stages})",
            fix=f"choose stages dividing {num_blocks}, or list pipeline.blocks_per_stage",
        )
    return [num_blocks // stages] * stages


def split_stages(model: nn.Module, config: RuntimeConfig) -> StageSplit:
    """The stages of ``model`` as ``config`` asks, checked against its units (see [Note: pipeline stages])."""
    blocks = find_block_names(model)
    counts = get_blocks_per_stage(len(blocks), config)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    per_stage = tuple(tuple(blocks[s : s + n]) for s, n in zip(starts, counts, strict=True))
    first, last, tied = split_edge_modules(model, blocks)
    if tied:
        raise ConfigError(
            "mesh.pp",
            f"{type(model).__name__} ties a parameter of {', '.join(first)} to {', '.join(last)}: the first and the last stage would each hold a copy",
            fix="untie the embeddings to train with pipeline stages",
        )
    split = StageSplit(blocks=per_stage, first=tuple(first), last=tuple(last))
    _check_units(split, config)
    return split


def _check_units(split: StageSplit, config: RuntimeConfig) -> None:
    """Every unit in one stage; prefetch lists within it."""
    stage_of: dict[str, int] = {}
    for i, unit in enumerate(config.units):
        if unit.name == ROOT_UNIT:
            continue
        stages = {split.get_stage_of(m) for m in unit.get_modules()}
        if len(stages) > 1:
            where = ", ".join(
                f"{m} in stage {split.get_stage_of(m)}" for m in unit.get_modules() if split.get_stage_of(m) is not None
            )
            raise ConfigError(
                f"units[{i}].modules", f"spans pipeline stages ({where})", fix="group only blocks of one stage"
            )
        (stage,) = stages
        if stage is not None:
            stage_of[unit.name] = stage
    for i, unit in enumerate(config.units):
        for key in ("forward_prefetch", "backward_prefetch"):
            for j, target in enumerate(getattr(unit, key) or []):
                if unit.name != ROOT_UNIT and stage_of.get(target) != stage_of.get(unit.name):
                    raise ConfigError(
                        f"units[{i}].{key}[{j}]",
                        f"{target!r} is in stage {stage_of.get(target)}, {unit.name!r} in stage {stage_of.get(unit.name)}",
                        fix="prefetch only units of the same stage",
                    )


def get_stage_config(split: StageSplit, stage: int, config: RuntimeConfig) -> RuntimeConfig:
    """The FSDP2 config of one stage: its units and the root, over the data-parallel mesh."""

    def held(unit: UnitConfig) -> bool:
        return all(split.get_stage_of(m) == stage for m in unit.get_modules())

    units = [u for u in config.units if u.name != ROOT_UNIT and held(u)]
    names = {u.name for u in units}
    # The root's prefetch lists may name any stage's units: each stage's root keeps its own.
    root = [
        dataclasses.replace(
            u, forward_prefetch=_keep(u.forward_prefetch, names), backward_prefetch=_keep(u.backward_prefetch, names)
        )
        for u in config.units
        if u.name == ROOT_UNIT
    ]
    return dataclasses.replace(
        config,
        mesh=dataclasses.replace(config.mesh, pp=1),
        pipeline=PipelineConfig(),
        units=units + root,
        unlisted_blocks="root",  # the other stages' blocks are Passthroughs: nothing to shard
    )


def _keep(names: list[str] | None, held: set[str]) -> list[str] | None:
    return None if names is None else [n for n in names if n in held]


def build_stage_module(model: nn.Module, split: StageSplit, stage: int, *, copy_model: bool) -> nn.Module:
    """``model`` (or a deep copy) with what ``stage`` does not hold replaced by :class:`Passthrough`."""
    module = copy.deepcopy(model) if copy_model else model
    mine = set(split.get_modules(stage))
    others = [m for s in range(split.num_stages) if s != stage for m in split.get_modules(s) if m not in mine]
    for path in others:
        parent_path, _, name = path.rpartition(".")
        parent = module.get_submodule(parent_path) if parent_path else module
        setattr(parent, name, Passthrough(split.get_stage_of(path) or 0))
    return module


class TunedStage(PipelineStage):
    """A ``PipelineStage`` whose FSDP2 units sync and reshard per microbatch as the config says.

    torch's stage turns sync and reshard-after-backward off on the whole stage for every
    backward but the last and reduces afterwards; here each unit gets
    :class:`~fsdp_runtime.GradAccumulator`'s state instead (the last microbatch syncs and
    reshards every unit during its backward, so the reduction after it finds nothing left).
    Like torch's stage, only the last backward is FSDP2's "last backward" (the one whose
    end waits for the reduce-scatters).
    """

    def __init__(self, *args: Any, accumulator: GradAccumulator, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.accumulator = accumulator

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type != "full" or not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        from torch.distributed.pipelining._backward import stage_backward

        for unit in self.accumulator.applied.config.units:
            self.accumulator.set_unit_state(unit, is_last=last_backward)
        # Not the last backward: FSDP2's end-of-backward callback then does not make the
        # compute stream wait for this backward's reduce-scatters, so their tail runs under the
        # next action (another microbatch's forward), as torch's own stage allows.
        self.submod.set_is_last_backward(last_backward)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        if not last_backward:  # the last one's are the step's finalize_backward's (torch 2.15)
            run_pending_post_backwards(self.submod)
        return grads, None


@dataclass(kw_only=True)
class AppliedPipeline:
    """What ``apply_pipeline`` built on this rank: its stages, each sharded, and the schedule."""

    config: RuntimeConfig
    """The whole model's config, units resolved."""
    split: StageSplit
    """Which modules each stage holds."""
    mesh: DeviceMesh
    """``(pp, shard)`` or ``(pp, replicate, shard)``."""
    pp_rank: int
    """This rank's pipeline rank."""
    dp_rank: int
    """This rank's data-parallel rank inside its stages' mesh."""
    stage_indices: list[int]
    """The stages this rank holds (one, or ``virtual_stages`` with the interleaved schedules)."""
    modules: list[nn.Module]
    """This rank's stage modules, one per stage index."""
    applied: list[AppliedFsdp]
    """Each of this rank's stages as :func:`~fsdp_runtime.apply_fsdp` sharded it, one per stage index."""
    stages: list[TunedStage]
    schedule: Any
    """torch's pipeline schedule over this rank's stages."""
    loss_fn: Callable[..., torch.Tensor]
    microbatch_losses: list[torch.Tensor] = field(default_factory=list)
    """The last step's scaled microbatch losses (on the rank holding the last stage)."""

    @property
    def holds_first(self) -> bool:
        """Whether this rank holds the first stage (reads the inputs)."""
        return 0 in self.stage_indices

    @property
    def holds_last(self) -> bool:
        """Whether this rank holds the last stage (computes the loss)."""
        return self.split.num_stages - 1 in self.stage_indices

    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters of this rank's stages: what its optimizer steps."""
        for module in self.modules:
            yield from module.parameters()

    def step(self, *inputs: Any, target: Any = None) -> torch.Tensor | None:
        """One schedule step over the whole batch (``num_microbatches`` microbatches along dim 0).

        ``inputs`` are read on the rank holding the first stage and ``target`` on the one
        holding the last; returns the summed scaled microbatch losses there, ``None`` elsewhere."""
        losses: list[torch.Tensor] = []
        # torch 2.11's stages check an input's strides against the shapes they were built for,
        # so a view such as ``batch[:, :-1]`` (strides of the full batch) is refused there.
        args = tuple(_contiguous(x) for x in inputs) if self.holds_first else ()
        target = _contiguous(target) if self.holds_last else None
        self.schedule.step(*args, target=target, losses=losses)
        self.microbatch_losses = losses
        return torch.stack([loss.detach() for loss in losses]).sum() if self.holds_last else None


def _contiguous(x: Any) -> Any:
    return x.contiguous() if isinstance(x, torch.Tensor) else x


def build_pipeline_mesh(config: RuntimeConfig, device_type: str) -> DeviceMesh:
    """The ``(pp, shard)`` or ``(pp, replicate, shard)`` mesh over the default group."""
    replicate, shard = validate_for_world(config, dist.get_world_size())
    if config.mesh.kind == "hsdp":
        return init_device_mesh(
            device_type, (config.mesh.pp, replicate, shard), mesh_dim_names=("pp", "replicate", "shard")
        )
    return init_device_mesh(device_type, (config.mesh.pp, shard), mesh_dim_names=("pp", "shard"))


def apply_pipeline(
    model: nn.Module,
    config: RuntimeConfig,
    *,
    loss_fn: Callable[..., torch.Tensor],
    device_type: str | None = None,
) -> AppliedPipeline:
    """Split ``model`` into this rank's pipeline stages, shard each with FSDP2, build the schedule.

    Call after ``init_process_group`` on every rank with the same (whole) model, before
    building the optimizer over :meth:`AppliedPipeline.parameters`. See [Note: pipeline stages].
    """
    validate_config(config)
    if config.mesh.pp < 2:
        raise ConfigError("mesh.pp", f"is {config.mesh.pp}: no pipeline", fix="use apply_fsdp without pipeline stages")
    config = resolve_units(model, config)
    split = split_stages(model, config)
    if device_type is None:
        device_type = next((p.device.type for p in model.parameters()), "cpu")
    mesh = build_pipeline_mesh(config, device_type)
    pp = config.mesh.pp
    rank = dist.get_rank()
    dp_world = dist.get_world_size() // pp
    pp_rank, dp_rank = divmod(rank, dp_world)
    dp_mesh = mesh["replicate", "shard"] if config.mesh.kind == "hsdp" else mesh["shard"]
    pp_group = mesh.get_group("pp")
    device = (
        torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device(device_type)
    )
    indices = list(range(pp_rank, split.num_stages, pp))
    modules, applied, stages = [], [], []
    for k, index in enumerate(indices):
        module = build_stage_module(model, split, index, copy_model=k < len(indices) - 1)
        stage_applied = apply_fsdp(
            module, get_stage_config(split, index, config), mesh=dp_mesh, device_type=device_type
        )
        accumulator = GradAccumulator(stage_applied)
        stages.append(TunedStage(module, index, split.num_stages, device, group=pp_group, accumulator=accumulator))
        modules.append(module)
        applied.append(stage_applied)
    m = config.num_microbatches

    def scaled_loss(output: torch.Tensor, target: Any) -> torch.Tensor:
        return loss_fn(output, target) / m

    schedule_cls = SCHEDULE_CLASSES[config.pipeline.schedule]
    if len(stages) == 1 and config.pipeline.schedule not in ("gpipe", "1f1b"):
        raise ConfigError("pipeline.virtual_stages", "an interleaved schedule needs >= 2 stages per pipeline rank")
    schedule = schedule_cls(
        stages[0] if config.pipeline.schedule in ("gpipe", "1f1b") else stages,
        n_microbatches=m,
        loss_fn=scaled_loss,
        scale_grads=False,
    )
    return AppliedPipeline(
        config=config,
        split=split,
        mesh=mesh,
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        stage_indices=indices,
        modules=modules,
        applied=applied,
        stages=stages,
        schedule=schedule,
        loss_fn=loss_fn,
    )
