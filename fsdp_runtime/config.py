"""The runtime config: one versioned schema for every FSDP2 knob fsdp-autotune tunes.

A config is plain data. It is written by ``autotune search`` (or by hand), saved as
TOML or JSON (:mod:`fsdp_runtime.serialize`), and applied to a model with
:func:`fsdp_runtime.apply_fsdp`. Every artifact the project writes (trial dirs, emitted
configs, reports) embeds it with its ``schema_version``.

Its checks are in :mod:`fsdp_runtime.validation`: structural ones in ``validate_config`` (no
model needed), those that need the world size in ``validate_for_world``; those that need the
model happen in ``apply_fsdp``. Every error names the exact field path, e.g.
``units[3].forward_prefetch[0]``.

Schema history: version 2 added ``units[].modules`` (several blocks in one unit) and
``units[].activation_checkpointing``; version 3 added pipeline stages (``mesh.pp`` and the
``pipeline`` table: a ``pp x replicate x shard`` mesh, FSDP2 inside each stage); version 4 the
method knobs of FSDP2's newer releases, each declared in :mod:`fsdp_runtime.knobs` with the
release that has it. An older file reads as the current version with the new fields at their
defaults (:mod:`fsdp_runtime.serialize` migrates it); a config that sets none of a version's new
fields is written in the version before it.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any, Literal

SCHEMA_VERSION = 4
"""The schema version this release writes and reads; an older file is migrated, a newer one refused."""
ROOT_UNIT = "root"
"""Name of the unit that is the model itself (``fully_shard(model)``)."""
ConsolidationMethod = Literal["all_gather", "broadcast", "dcp"]
CONSOLIDATION_METHODS: tuple[str, ...] = typing.get_args(ConsolidationMethod)
"""How a checkpoint is consolidated onto rank 0 (see ``fsdp_runtime.consolidate``)."""

SyncLevel = Literal["every", "replica_last", "last"]
CheckpointingKind = Literal["none", "selective", "full"]
CHECKPOINTING_KINDS: tuple[str, ...] = typing.get_args(CheckpointingKind)
"""Activation checkpointing of a unit's modules (see ``fsdp_runtime.checkpointing``)."""
DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")
PipelineScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b"]
PIPELINE_SCHEDULES: tuple[str, ...] = typing.get_args(PipelineScheduleName)
"""Pipeline schedules (``torch.distributed.pipelining``): ``gpipe`` (all forwards, then all
backwards), ``1f1b``, and the looped ``interleaved_1f1b``, which holds
``pipeline.virtual_stages`` >= 2 stages per pipeline rank. Not offered: torch's zero-bubble
schedules (``ScheduleInterleavedZeroBubble``): with FSDP2 stages on torch 2.13 their losses
left the same model's without stages by 2e-4 relative after one step (4 microbatches,
tiny model, gloo), an error in the math, not rounding ([Note: pipeline stages])."""
INTERLEAVED_SCHEDULES = ("interleaved_1f1b",)


@dataclass(kw_only=True, slots=True)
class MeshConfig:
    """The data-parallel device mesh."""

    kind: Literal["fsdp", "hsdp"] = "fsdp"
    """``fsdp``: 1-D mesh, shard over all ranks. ``hsdp``: 2-D ``(replicate, shard)`` mesh."""
    replicate: int = 1
    """Size of the replicate dimension (HSDP only; 1 for FSDP)."""
    shard: int | None = None
    """Size of the shard dimension; ``None`` means ``world_size // (pp * replicate)``."""
    pp: int = 1
    """Pipeline-parallel degree: the outermost mesh dimension, ``pp x replicate x shard`` =
    world size. Each pipeline rank holds ``pipeline.virtual_stages`` stages of the model,
    each sharded with FSDP2 over its ``replicate x shard`` ranks. 1: no pipeline. (Schema 3.)"""

    def get_shape(self, world_size: int) -> tuple[int, int]:
        """The data-parallel shape ``(replicate, shard)`` of each pipeline stage."""
        dp_world = world_size // self.pp
        shard = self.shard if self.shard is not None else dp_world // self.replicate
        return self.replicate, shard


@dataclass(kw_only=True, slots=True)
class PipelineConfig:
    """Pipeline stages (with ``mesh.pp`` > 1): the schedule and how blocks split into stages."""

    schedule: PipelineScheduleName = "1f1b"
    """Order of the microbatches' forwards and backwards on each pipeline rank."""
    virtual_stages: int = 1
    """Stages per pipeline rank: 1, or >= 2 for the interleaved schedules (stage ``s`` of
    ``pp * virtual_stages`` is held by pipeline rank ``s % pp``, torch's looped placement)."""
    blocks_per_stage: list[int] | None = None
    """Blocks of each stage, in model order (``pp * virtual_stages`` entries summing to the
    model's blocks). ``None``: an even split, refused where the blocks do not divide. The
    first stage also runs what comes before the blocks (embeddings), the last what comes
    after (final norm, output head)."""

    def get_num_stages(self, pp: int) -> int:
        """Stages in all, over ``pp`` pipeline ranks: ``pp * virtual_stages``."""
        return pp * self.virtual_stages


@dataclass(kw_only=True, slots=True)
class UnitConfig:
    """One ``fully_shard`` call and its runtime knobs."""

    name: str
    """Module FQN inside the model (``layers.3``), or ``root`` for the model itself. With
    ``modules``, the unit's label (``layers.0-1``): prefetch lists refer to units by name."""
    modules: list[str] | None = None
    """The modules this unit shards together in one ``fully_shard([...])`` call, e.g. two
    consecutive blocks ``["layers.0", "layers.1"]`` (fewer, larger all-gathers and
    reduce-scatters; more memory in flight). ``None``: the module ``name``. (Schema 2.)"""
    reshard_after_forward: bool | int | None = None
    """Free the unsharded params after forward (True), keep them (False), or reshard to a
    smaller group of this many ranks (int, a divisor of the shard size). ``None``: FSDP2's
    default (True for inner units, False for the root)."""
    forward_prefetch: list[str] | None = None
    """Units whose all-gather this unit issues at the start of its forward. ``None``:
    FSDP2's implicit prefetch; ``[]``: explicitly none."""
    backward_prefetch: list[str] | None = None
    """Units whose all-gather this unit issues at the start of its backward. ``None``:
    FSDP2's default (the previous unit in reverse post-forward order)."""
    sync: SyncLevel = "every"
    """Gradient sync on non-final microbatches: ``every`` reduce-scatters every microbatch
    (sharded accumulation, least memory); ``last`` reduces only on the last microbatch
    (unsharded accumulation, least comm); ``replica_last`` (HSDP) reduce-scatters every
    microbatch but all-reduces across replicas only on the last."""
    reshard_after_backward: bool = True
    """Reshard after backward on non-final microbatches (the final one always reshards).
    False keeps params unsharded across microbatches: fewer all-gathers, more memory."""
    defer_concat: bool = True
    """With ``sync = "last"``: pack gradients into the reduce-scatter layout once, on the
    sync microbatch (True, FSDP2's own behaviour), or every microbatch into a flat
    accumulator (False, FSDP1's eager concat). See [Note: concat deferral]."""
    activation_checkpointing: CheckpointingKind = "none"
    """Per module of the unit, applied before sharding: ``none`` keeps every activation for
    backward; ``full`` keeps only the module's inputs and recomputes its forward in backward;
    ``selective`` keeps the outputs of matmuls and attention and recomputes the rest
    (element-wise ops, norms). Not for the root or a unit holding another unit. (Schema 2.)"""

    def get_modules(self) -> list[str]:
        """Module paths this unit shards (``[name]`` unless ``modules`` is set)."""
        return list(self.modules) if self.modules is not None else [self.name]


@dataclass(kw_only=True, slots=True)
class MixedPrecisionConfig:
    """FSDP2 ``MixedPrecisionPolicy`` by dtype name (``float32``, ``bfloat16``, ...)."""

    param_dtype: str | None = None
    """Dtype of unsharded params in forward/backward; ``None`` keeps the param dtype."""
    reduce_dtype: str | None = None
    """Dtype of gradient reduction and accumulation; ``None`` uses ``param_dtype``."""


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """How a full (consolidated) checkpoint is gathered onto rank 0."""

    consolidation: ConsolidationMethod = "all_gather"
    """``all_gather``: coalesced all-gathers; ``broadcast``: one broadcast per tensor
    (baseline); ``dcp``: ``torch.distributed.checkpoint.state_dict`` full-state path."""
    to_cpu: bool = True
    """Place the consolidated tensors in CPU memory."""


@dataclass(kw_only=True, slots=True)
class Provenance:
    """Who produced this config and from what; filled by ``autotune``."""

    produced_by: str = "user"
    """``user`` (hand-written) or ``autotune <version> <command>``."""
    model: str | None = None
    """Model profile the config was tuned for (e.g. ``llama8b``)."""
    proxy_model: str | None = None
    """When trials ran on a scaled-down proxy: what actually ran (e.g. ``llama8b@dim256``)."""
    world_size: int | None = None
    """World size the config was tuned for."""
    backend: str | None = None
    """Process-group backend of the trials (``gloo``, ``nccl``)."""
    torch_version: str | None = None
    """The torch the config was tuned under (``torch.__version__``)."""
    measured: bool = False
    """True when the knobs were chosen from measured trials."""
    created_at: str | None = None
    """ISO-8601 UTC time of emission."""
    notes: list[str] = field(default_factory=list)
    """Free-form facts a reader must know (e.g. that times come from a proxy)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Headline measurements (e.g. ``speedup_vs_default``, ``step_ms``)."""


@dataclass(kw_only=True, slots=True)
class RuntimeConfig:
    """Root of the schema: everything ``apply_fsdp`` and the accumulation driver need."""

    schema_version: int = SCHEMA_VERSION
    """Version of this schema; readers refuse newer versions."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """The device mesh: FSDP or HSDP, its sizes, and the pipeline degree."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Pipeline stages; only read with ``mesh.pp`` > 1 (see :mod:`fsdp_runtime.pipeline`). (Schema 3.)"""
    units: list[UnitConfig] = field(default_factory=list)
    """The ``fully_shard`` units. Empty: one per transformer block plus ``root``, all at
    FSDP2 defaults (resolved against the model by ``apply_fsdp``)."""
    unlisted_blocks: Literal["error", "root"] = "error"
    """A block of the model (``fsdp_runtime.find_block_names``) in no unit: ``error`` refuses
    the config (it would silently shard that block with the root: another wrapping);
    ``root`` shards such blocks with the root on purpose. See [Note: unit names]."""
    num_microbatches: int = 1
    """Gradient-accumulation microbatches per optimizer step (with ``mesh.pp`` > 1: the
    pipeline schedule's microbatches)."""
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    """FSDP2's mixed precision, the same for every unit."""
    unshard_async: Literal["auto", "on", "off"] = "auto"
    """Issue all-gathers with ``async_op=True``. ``auto``: on for CPU devices, where it is
    what makes prefetch overlap at all (see [Note: async unshard on CPU]), if this torch has
    the private setter (every release read: [Note: torch versions]); off on GPU."""
    reduce_scatter_max_input_buffers: int | None = None
    """Reduce-scatter input buffers in flight (FSDP2 experimental setter, torch >= 2.13: ``apply_fsdp``
    refuses more than 1 on an older torch); ``None``: default (1)."""
    separate_reduce_scatter_group: bool = False
    """Run the gradient reduce-scatter on a process group of its own (the same shard ranks), so it
    can overlap the next all-gather in backward instead of queueing behind it on one communicator
    (``FSDPModule.set_separate_reduce_scatter_group``, torch >= 2.13, experimental). (Schema 4.)"""
    unshard_in_backward: bool = True
    """False: a unit that holds only untied ``nn.Embedding`` modules skips its all-gather in backward
    (``FSDPModule.set_unshard_in_backward(False)``): an embedding's weight gradient needs the
    indices and the output gradient, never the weight. Every other unit all-gathers as FSDP2 does;
    a unit is told apart by what its parameters belong to, so this is one switch per config. It
    matters where the embeddings are a unit of their own, resharded after forward (the search's
    ``root_split``, torchtitan's recipe). (Schema 4.)"""
    process_group_comm_buffers: bool = False
    """Allocate the collectives' staging buffers from the process group's own allocator (NCCL:
    zero-copy transfers over NVLink and InfiniBand SHARP), with sum-only reductions, which NCCL's
    zero-copy needs (``FSDPModule.set_allocate_memory_from_process_group_for_comm`` and
    ``set_force_sum_reduction_for_comms``). CUDA and NCCL only; a world-level choice, never switched
    in place; the gradient's divide moves out of the collective: not bitwise. (Schema 4.)"""
    symmetric_memory: bool = False
    """Allocate the staging buffers in NCCL symmetric memory (``FSDPModule.set_symm_mem_for_comm``),
    with sum-only reductions so the reduce-scatter uses it too: with the zero-CTA policy
    (``NCCL_CTA_POLICY=2``, or ``cta_policy`` in the process group's options at init) the
    all-gather runs on copy engines and takes no SMs from compute. CUDA and NCCL only; FSDP2 has no
    off switch, and it excludes ``process_group_comm_buffers``; a world-level choice, never switched
    in place; not bitwise (sum-only reductions). (Schema 4.)"""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """How a full checkpoint is consolidated (does not touch training)."""
    provenance: Provenance = field(default_factory=Provenance)
    """Where the config comes from (does not touch training)."""

    def get_unit(self, name: str) -> UnitConfig:
        """The unit named ``name``; ``KeyError`` where there is none."""
        for unit in self.units:
            if unit.name == name:
                return unit
        raise KeyError(name)

    @property
    def unit_names(self) -> list[str]:
        """The units' names, in config order."""
        return [u.name for u in self.units]


def default_config(unit_names: list[str], **overrides: Any) -> RuntimeConfig:
    """FSDP2's defaults (``fully_shard`` with its default arguments) with one explicit unit per name;
    torchtitan's own recipe departs from them ([Note: the torchtitan recipe] in :mod:`fsdp_runtime.recipes`)."""
    units = [UnitConfig(name=n) for n in unit_names]
    if ROOT_UNIT not in unit_names:
        units.append(UnitConfig(name=ROOT_UNIT))
    return RuntimeConfig(units=units, **overrides)
