"""A config's pipeline and the cut of a model into its stages ([Note: pipeline schedules] in
:mod:`autotune.sim.pipeline`): the :class:`PipelineSpec` a config asks for and its check against the
model (:func:`check_pipeline`: each stage's blocks), then what one stage holds: its units
(:func:`split_units`), their knobs (:func:`slice_knobs`), its share of the model's work
(:func:`get_stage_work`) and, for zero bubble, its weight-gradient compute (:func:`get_weight_seconds`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from autotune.sim.hardware import Hardware
from autotune.sim.knobs import Knobs
from autotune.sim.model_work import ModelWork, PassWork
from autotune.sim.pipeline_order import INTERLEAVED, SCHEDULES
from fsdp_runtime import ROOT_UNIT, RuntimeConfig
from fsdp_runtime.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class PipelineSpec:
    """A config's pipeline (schema 3's ``mesh.pp`` and ``[pipeline]``, read by :func:`get_pipeline_spec`)."""

    pp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    blocks_per_stage: tuple[int, ...] | None = None
    """Blocks of each stage, in stage order; None: an even split."""
    num_microbatches: int = 1
    """The schedule's ``n_microbatches`` (the config's ``num_microbatches``)."""

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def to_dict(self) -> dict[str, Any]:
        return {
            "pp": self.pp,
            "schedule": self.schedule,
            "virtual_stages": self.virtual_stages,
            "blocks_per_stage": list(self.blocks_per_stage) if self.blocks_per_stage else None,
            "num_microbatches": self.num_microbatches,
        }


def get_pipeline_spec(config: RuntimeConfig) -> PipelineSpec:
    """The pipeline a config asks for (schema 3's ``mesh.pp`` and ``[pipeline]``; read with defaults, so
    that a config object without them is one without a pipeline)."""
    pipeline = getattr(config, "pipeline", None)
    blocks = getattr(pipeline, "blocks_per_stage", None)
    return PipelineSpec(
        pp=getattr(config.mesh, "pp", 1),
        schedule=getattr(pipeline, "schedule", "1f1b"),
        virtual_stages=getattr(pipeline, "virtual_stages", 1),
        blocks_per_stage=tuple(blocks) if blocks else None,
        num_microbatches=config.num_microbatches,
    )


def check_pipeline(spec: PipelineSpec, num_blocks: int) -> list[range]:
    """The blocks of each stage; a pipeline the schedule or the model cannot run is refused in one line."""
    if spec.schedule not in SCHEDULES:
        raise ConfigError(
            "pipeline.schedule", f"unknown schedule {spec.schedule!r}", fix=f"one of {', '.join(SCHEDULES)}"
        )
    if spec.pp < 1:
        raise ConfigError("mesh.pp", f"must be >= 1, got {spec.pp}")
    interleaved = spec.schedule in INTERLEAVED
    if interleaved != (spec.virtual_stages >= 2):
        need = ">= 2" if interleaved else "1"
        raise ConfigError(
            "pipeline.virtual_stages",
            f"is {spec.virtual_stages}, schedule {spec.schedule!r} needs {need}",
            fix="interleaved schedules hold >= 2 stages per pp rank, gpipe and 1f1b one",
        )
    if spec.schedule == "1f1b" and spec.num_microbatches < spec.pp:
        raise ConfigError(
            "num_microbatches",
            f"is {spec.num_microbatches}, 1f1b needs at least mesh.pp = {spec.pp} (torch refuses fewer)",
        )
    rounds = max(1, spec.num_microbatches // spec.pp)
    if interleaved and spec.num_microbatches % rounds:
        raise ConfigError(
            "num_microbatches",
            f"{spec.num_microbatches} is not a multiple of its {rounds} rounds of mesh.pp = {spec.pp} (torch's interleaved schedules)",
        )
    return _get_stage_ranges(spec, num_blocks)


def _get_stage_ranges(spec: PipelineSpec, num_blocks: int) -> list[range]:
    stages = spec.num_stages
    if spec.blocks_per_stage is None:  # the field and words of fsdp_runtime.pipeline's own check
        if num_blocks % stages:
            raise ConfigError(
                "mesh.pp",
                f"{num_blocks} blocks do not split evenly into {stages} stages (mesh.pp {spec.pp} x "
                f"pipeline.virtual_stages {spec.virtual_stages})",
                fix=f"choose stages dividing {num_blocks}, or list pipeline.blocks_per_stage",
            )
        sizes: tuple[int, ...] = (num_blocks // stages,) * stages
    else:
        sizes = spec.blocks_per_stage
        if len(sizes) != stages or sum(sizes) != num_blocks or min(sizes) < 1:
            raise ConfigError(
                "pipeline.blocks_per_stage",
                f"{list(sizes)} does not give each of the {stages} stages >= 1 of the model's {num_blocks} blocks",
                fix="one positive count per stage, summing to the blocks",
            )
    starts = [sum(sizes[:s]) for s in range(stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def split_units(knobs: Knobs, ranges: list[range], block_names: tuple[str, ...]) -> list[list[int]]:
    """The units (indices into ``knobs``' non-root units) each stage holds; a unit across two stages is refused."""
    stage_of = {b: s for s, blocks in enumerate(ranges) for b in blocks}
    groups = knobs.unit_blocks or tuple((b,) for b in range(len(block_names)))
    units: list[list[int]] = [[] for _ in ranges]
    for u, blocks in enumerate(groups):
        first, last = stage_of[blocks[0]], stage_of[blocks[-1]]
        if first != last:
            raise ConfigError(
                "units",
                f"a unit holds {block_names[blocks[0]]}..{block_names[blocks[-1]]}, blocks of pipeline stages {first} and {last}",
                fix="group only blocks of one stage (pipeline.blocks_per_stage)",
            )
        units[first].append(u)
    return units


def slice_knobs(knobs: Knobs, units: list[int], first_block: int) -> Knobs:
    """One stage's knobs: its units, then the root (the stage module); prefetch stays within the stage."""
    root = len(knobs.sync) - 1
    keep = [*units, root]
    index = {u: i for i, u in enumerate(keep)}

    def pick(values: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(values[u] for u in keep)

    def targets(lists: tuple[tuple[int, ...] | None, ...]) -> tuple[tuple[int, ...] | None, ...]:
        return tuple(None if t is None else tuple(index[v] for v in t if v in index) for t in pick(lists))

    return dataclasses.replace(
        knobs,
        reshard_after_forward=pick(knobs.reshard_after_forward),
        forward_prefetch=targets(knobs.forward_prefetch),
        backward_prefetch=targets(knobs.backward_prefetch),
        sync=pick(knobs.sync),
        reshard_after_backward=pick(knobs.reshard_after_backward),
        defer_concat=pick(knobs.defer_concat),
        unit_blocks=None
        if knobs.unit_blocks is None
        else tuple(tuple(b - first_block for b in knobs.unit_blocks[u]) for u in units),
        checkpointing=None if knobs.checkpointing is None else pick(knobs.checkpointing),
    )


def get_stage_work(work: ModelWork, blocks: tuple[str, ...], *, first: bool, last: bool) -> ModelWork:
    """The model as one stage holds it: its blocks; the embeddings on the first stage, the norm, output
    head and loss on the last; a later stage's input is a block's input."""
    head, tail = _split_root_shapes(work)
    nothing = PassWork()
    kept = {"block"} | ({"head"} if first else set()) | ({"tail"} if last else set())
    a = work.activations
    return dataclasses.replace(
        work,
        block_names=blocks,
        param_shapes={
            **{b: work.param_shapes[b] for b in blocks},
            ROOT_UNIT: (head if first else ()) + (tail if last else ()),
        },
        root_head_fraction=work.root_head_fraction if first and last else float(first),
        work={key: value if key[0] in kept else nothing for key, value in work.work.items()},
        activations=dataclasses.replace(
            a,
            head=a.head if first else a.block_input,
            # not the last stage: its output is kept for the backward and its gradient arrives
            tail_peak=a.tail_peak if last else a.block_saved + a.block_input,
        ),
    )


def _split_root_shapes(work: ModelWork) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """The root's parameters (registered in module order) cut where the head's share of elements ends:
    (embeddings, norm + output head). Tied embeddings have no head share: all go to the last stage."""
    shapes = work.param_shapes[ROOT_UNIT]
    sizes = [_numel(s) for s in shapes]
    target, total = work.root_head_fraction * sum(sizes), 0
    for i, size in enumerate(sizes):
        if total >= target * (1 - 1e-9):
            return shapes[:i], shapes[i:]
        total += size
    return shapes, ()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def get_weight_seconds(
    work: ModelWork, hardware: Hardware, backward_s: list[float], counts: list[int] | None
) -> list[float]:
    """Per unit, what zero bubble's W computes: the weight-gradient GEMMs, half of a backward's GEMM
    FLOPs (dW beside dX) in each block and the output head (the embeddings' backward is added to the root's W)."""
    block, tail = work.work["block", "backward"], work.work["tail", "backward"]
    counts = counts or [1] * (len(backward_s) - 1)
    if hardware.cluster.accelerator is not None:
        rate = hardware.get_gemm_flops_per_s(work.dtype)
        per_block, root = 0.5 * block.gemm_flops / rate, 0.5 * tail.gemm_flops / rate
        return [min(c * per_block, s) for c, s in zip(counts, backward_s)] + [min(root, backward_s[-1])]
    # a measured CPU profile has no GEMM rate: the GEMMs' share of the FLOPs
    share = 0.5 * block.gemm_flops / block.flops if block.flops else 0.0
    tail_share = 0.5 * tail.gemm_flops / tail.flops if tail.flops else 0.0
    return [share * s for s in backward_s[:-1]] + [tail_share * backward_s[-1]]
