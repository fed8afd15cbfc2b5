"""The search space: Optuna parameters -> a per-unit :class:`RuntimeConfig`.

[Note: search-space parametrization]
A Llama 8B has 33 units; sampling each unit's seven knobs independently would give
~230 blind dimensions that no sampler learns from in tens of trials. Instead every knob is
a *pattern over the block index*, a few categorical choices that expand into explicit
per-unit values, and the emitted config lists every unit explicitly, so a user can
still hand-edit single units afterwards:

- ``mesh``: ``fsdp`` or ``hsdp:RxS`` for every factorization R*S of the world size.
- ``forward_prefetch`` / ``backward_prefetch``: ``implicit`` (FSDP2's default),
  ``depth1..3`` (each block prefetches the next k blocks in execution order), or
  ``paired`` (even blocks prefetch the next two blocks, odd blocks nothing: all-gathers
  issued in batches of two, a list no depth expresses).
- ``nosync_blocks``: which blocks skip gradient sync on non-final microbatches (``none``,
  ``all``, ``every_2nd`` -- the interleaving suggested in torchtune #1275 so the fewer
  reduce-scatters still overlap -- ``first_half``, ``second_half``), with ``nosync_level``
  ``last`` or, under HSDP, ``replica_last``; ``keep_unsharded`` (no reshard after backward
  for those blocks) and ``defer_concat`` apply to them. Only sampled with >1 microbatch.
  ``replica_last`` is not offered on a shard group of one (HSDP Nx1, plain replication)
  unless the reduce dtype differs from the param dtype: there FSDP2's ``foreach_reduce``
  skips the reduce-scatter but still copies every microbatch's gradients into a flat buffer
  and accumulates them in a second one, work that ``last`` does not do, for the same memory
  (the accumulated gradient is the full size either way) and the same single all-reduce.
  A dominated choice only spends a short search's trials, and a noisy search can emit it (the
  copies are cheap: 1.005x ``last``'s step on ``small``, ``benchmarks/knobs.py``). The level (and the
  root's) then takes the FSDP parameter, whose choices are the same (:meth:`SearchSpace.get_sync_suffix`).
- ``reshard_after_forward``: ``true``, ``false``, ``last_block_false`` (the block whose
  backward runs first keeps its params), or ``int:d`` for proper divisors d of the shard size.
  Optuna needs one fixed choice list per parameter name, and the valid ``int:d`` depend on
  the mesh's shard size, so meshes whose shard size has proper divisors get their own
  parameter (``reshard_after_forward_shard4``): an int that this mesh cannot use is never
  sampled, instead of silently running as another point's config.
- ``reduce_dtype`` (only with ``search_reduce_dtype``: ``float32`` or ``bfloat16``, the defaults
  trial's being the space's own): bf16 reduction halves the reduce-scatter's bytes and changes
  the sums. Every config the space builds carries :attr:`SearchSpace.mixed_precision` (the
  reduce dtype from the parameter where it is searched): the defaults trial, the calibration
  and presearch points, the refinement and the emitted config all run the chosen precision.
- ``unshard_async`` (CPU only: ``off`` is torchtitan's default, ``on`` makes prefetch real)
  and ``reduce_scatter_max_input_buffers``. A knob the installed torch cannot set
  (``fsdp_runtime.get_unsupported_knobs``) is not asked, and :attr:`SearchSpace.notes` says so.

Memory knobs (schema 2), each family switched on by a :class:`SearchSpace` field (off by
default: ``autotune plan``'s simulator does not model them yet):

- ``blocks_per_unit`` (``grouping``): 1, 2 or 4 consecutive blocks per ``fully_shard`` unit
  (fewer, larger collectives; more parameters unsharded at once). Every pattern above and
  below is then over the *units*, in order: depth-1 prefetch prefetches the next group.
- ``ac_units`` (``checkpointing``): which block units recompute their activations in
  backward: ``none``, ``all``, ``all_but_last`` (the last unit's backward runs first, so
  its recomputation buys memory only while the head and the loss run; measured, small at
  seq 256 x batch 8: peak -22% vs -27% for ``all``, at the same +25% step time),
  ``every_2nd``, ``first_half``; with ``ac_kind`` ``selective`` (save matmul and attention
  outputs) or ``full``. It only costs time, so the caller turns it on under a memory budget, where a
  trial over the budget is infeasible and the sampler learns the trade-off from that.
- ``root_reshard_after_forward``, ``root_sync_{fsdp,hsdp}`` (the root's sync level on
  non-final microbatches, like a block's) and ``root_keep_unsharded`` (``root_knobs``);
  with the model's edge modules given (``fsdp_runtime.find_edge_modules``), ``root_split``
  shards the embeddings and the head (final norm + output) as units of their own, as
  torchtitan does (the head keeps its parameters after forward: its backward runs first);
  they take the root's sync level and keep-unsharded.

Pipeline stages (``pipeline_degrees`` beyond ``(1,)``; [Note: pipeline stages] in
``fsdp_runtime.pipeline``): ``pp``, the pipeline degree, from the degrees that divide both
the world size and the blocks; then the data-parallel mesh over ``world / pp`` ranks
(``mesh_pp{pp}``: its own choice list per degree) and the schedule (``pp{pp}_schedule``:
``gpipe``; ``1f1b`` with at least ``pp`` microbatches; ``interleaved_1f1b``, two stages per
pipeline rank, where ``2 pp`` divides the blocks and ``pp`` the microbatches). Every block
pattern then runs within each stage: grouping, prefetch lists (a stage's units in its own
execution order: the first stage's embeddings, the last stage's head) and
``last_block_false`` (each stage's last block: its backward runs first there).

A trial whose process peak exceeds ``--memory-budget-gib`` is infeasible
(``autotune.search.loop``: ``memory_over_budget`` is an Optuna constraint, and the best
trial is feasible), which is what makes checkpointing and grouping a trade-off.

The defaults trial (trial 0) is the point in this space that equals FSDP2's defaults
(torchtitan's recipe departs from them: [Note: the torchtitan recipe] in ``fsdp_runtime.recipes``),
with :attr:`SearchSpace.baseline_checkpointing` on every block where the defaults alone do not fit:
the search's baseline ([Note: the search plan] in ``autotune.search.search_plan``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import optuna

from autotune.search.method_knobs import ask, get_default_answers, get_method_fields, get_notes
from autotune.search.patterns import (
    DEFAULTS_DESCRIPTION,
    describe_params,
    describe_params_diff,
    get_mesh_key,
    get_reshard_choices,
    get_reshard_key,
    group_blocks,
    split_even,
)
from autotune.search.space_units import build_block_units, build_root_units, get_edge_units
from fsdp_runtime import (
    MeshConfig,
    MixedPrecisionConfig,
    PipelineConfig,
    RuntimeConfig,
    get_added_knobs,
    get_knob,
)
from fsdp_runtime.tuning import get_prefetch_lists

__all__ = ["DEFAULTS_DESCRIPTION", "SearchSpace", "describe_params", "describe_params_diff"]

PREFETCH_CHOICES = ("implicit", "depth1", "depth2", "depth3", "paired")
NOSYNC_PATTERNS = ("none", "all", "every_2nd", "first_half", "second_half")
AC_PATTERNS = ("none", "all", "all_but_last", "every_2nd", "first_half")
AC_KINDS = ("selective", "full")
BLOCKS_PER_UNIT = (1, 2, 4)
REDUCE_DTYPES = ("float32", "bfloat16")


@dataclass(kw_only=True, frozen=True)
class SearchSpace:
    """The knobs for one model's units on one world size, under the user's fixed choices."""

    block_names: tuple[str, ...]
    world_size: int
    num_microbatches: int = 1
    device_type: str = "cpu"
    fixed_mesh: str | None = None
    """Restrict the mesh to one choice (e.g. ``fsdp``)."""
    grouping: bool = False
    """Search ``blocks_per_unit`` (see [Note: search-space parametrization])."""
    checkpointing: bool = False
    """Search activation checkpointing (``ac_units``, ``ac_kind``): turn on with a memory budget, or where
    the baseline needs it."""
    baseline_checkpointing: str = "none"
    """The baseline's activation checkpointing on every block (``none``, ``selective``, ``full``): where
    FSDP2's defaults do not fit, the defaults trial and every pair's reference carry it ([Note: the
    search plan] in :mod:`autotune.search.search_plan`); anything but ``none`` needs ``checkpointing``."""
    root_knobs: bool = False
    """Search the root's reshard, sync level and keep-unsharded (and ``root_split``)."""
    embedding_names: tuple[str, ...] = ()
    """The model's embedding modules (``find_edge_modules``): with ``head_names`` and
    ``root_knobs``, ``root_split`` is offered."""
    head_names: tuple[str, ...] = ()
    """The model's final norm and output modules, sharded together when split."""
    mixed_precision: MixedPrecisionConfig = dataclasses.field(default_factory=MixedPrecisionConfig, hash=False)
    """The precision every config of the space runs (``autotune.trials.resolve_precision``)."""
    search_reduce_dtype: bool = False
    """Search ``reduce_dtype`` (``REDUCE_DTYPES``); the defaults keep :attr:`mixed_precision`'s."""
    pipeline_degrees: tuple[int, ...] = (1,)
    """Pipeline degrees to search (``pp``); those dividing the world size and the blocks are offered."""
    ranks_per_node: int | None = None
    """The ranks of one node where the world spans nodes (the cluster profile's); None: one node.
    The int reshard after forward is then the node's size (``patterns.get_reshard_choices``)."""
    unsupported_knobs: tuple[tuple[str, str], ...] = ()
    """``(config field, why)`` for each knob the installed torch cannot set (``fsdp_runtime.get_unsupported_knobs``):
    its parameter is never asked, so the config keeps FSDP2's default for it."""

    @property
    def reduce_dtype_differs(self) -> bool:
        """Gradients may be reduced and accumulated in another dtype than the params': ``replica_last``
        (which accumulates in the reduce dtype) then stays a choice on a shard group of one, where
        ``last`` accumulates in the param dtype ([Note: search-space parametrization])."""
        param = self.mixed_precision.param_dtype or "float32"
        return self.search_reduce_dtype or (self.mixed_precision.reduce_dtype or param) != param

    def _get_default_reduce_dtype(self) -> str:
        return self.mixed_precision.reduce_dtype or self.mixed_precision.param_dtype or "float32"

    @property
    def notes(self) -> list[str]:
        """One line per knob left out of the space because this torch cannot set it."""
        return [f"{name} not searched: {why}" for name, why in self.unsupported_knobs]

    device_notes = property(lambda self: get_notes(self.device_type, self._unsupported))
    """The knobs asked on another device only, and the registry's notes of those asked here (the dry run)."""

    @property
    def _unsupported(self) -> set[str]:
        return {name for name, _ in self.unsupported_knobs}

    def get_pp_choices(self) -> list[int]:
        """Pipeline degrees offered: dividing the world size and the blocks (1 always divides)."""
        blocks = len(self.block_names)
        return [p for p in self.pipeline_degrees if self.world_size % p == 0 and blocks % p == 0 and blocks >= p]

    def get_schedule_choices(self, pp: int) -> list[str]:
        """Schedules for ``pp`` stages (see [Note: search-space parametrization])."""
        choices = ["gpipe"]
        if self.num_microbatches >= pp:
            choices.append("1f1b")
        if len(self.block_names) % (2 * pp) == 0 and self.num_microbatches % pp == 0:
            choices.append("interleaved_1f1b")
        return choices

    def get_mesh_choices(self, pp: int = 1) -> list[str]:
        if self.fixed_mesh is not None:
            return [self.fixed_mesh]
        dp = self.world_size // pp
        choices = ["fsdp"]
        for replicate in range(2, dp + 1):
            if dp % replicate == 0:
                choices.append(f"hsdp:{replicate}x{dp // replicate}")
        return choices

    def get_default_params(self) -> dict[str, Any]:
        """Parameters of the defaults trial (FSDP2's defaults, not torchtitan's recipe: [Note: the torchtitan recipe]; with stages
        forced, the least pipeline degree offered under torchtitan's default schedule, 1F1B)."""
        pp = min(self.get_pp_choices())
        pp_params: dict[str, Any] = {}
        if len(self.get_pp_choices()) > 1 or pp > 1:
            pp_params["pp"] = pp
        if pp > 1:
            schedules = self.get_schedule_choices(pp)
            pp_params[f"pp{pp}_schedule"] = "1f1b" if "1f1b" in schedules else schedules[0]
        meshes = self.get_mesh_choices(pp)
        params: dict[str, Any] = {
            **pp_params,
            get_mesh_key(pp): "fsdp" if "fsdp" in meshes else meshes[0],
            "forward_prefetch": "implicit",
            "backward_prefetch": "implicit",
            **get_default_answers(_RS_BUFFERS, self.device_type, self._unsupported, {}),
        }
        mesh = params[get_mesh_key(pp)]
        params[self._get_reshard_key(self._get_shard_size(mesh, pp))] = "true"
        if self.search_reduce_dtype:
            params["reduce_dtype"] = self._get_default_reduce_dtype()
        params.update(get_default_answers(_ASYNC, self.device_type, self._unsupported, params))
        if self.num_microbatches > 1:
            params.update(nosync_blocks="none")
        if self.grouping:
            params["blocks_per_unit"] = 1
        if self.checkpointing:
            params["ac_units"] = "none" if self.baseline_checkpointing == "none" else "all"
            if self.baseline_checkpointing != "none":
                params["ac_kind"] = self.baseline_checkpointing
        if self.root_knobs:
            params["root_reshard_after_forward"] = "false"
            if self.num_microbatches > 1:
                params[f"root_sync_{self.get_sync_suffix(mesh, pp)}"] = "every"
            if self.can_split:
                params["root_split"] = "none"
        for knob in get_added_knobs(4):
            params.update(get_default_answers(knob, self.device_type, self._unsupported, params))
        return params

    def __post_init__(self) -> None:
        if self.baseline_checkpointing not in ("none", *AC_KINDS):
            raise ValueError(
                f"baseline_checkpointing must be none, {' or '.join(AC_KINDS)}, got {self.baseline_checkpointing!r}"
            )
        if self.baseline_checkpointing != "none" and not self.checkpointing:
            raise ValueError("a baseline with activation checkpointing needs the space to search checkpointing")

    def get_sync_suffix(self, mesh: str, pp: int = 1) -> str:
        """``hsdp`` where ``mesh`` offers ``replica_last`` (the ``*_hsdp`` sync parameters), else
        ``fsdp`` ([Note: search-space parametrization]: not on a shard group of one)."""
        replica_level = mesh.startswith("hsdp") and (self._get_shard_size(mesh, pp) > 1 or self.reduce_dtype_differs)
        return "hsdp" if replica_level else "fsdp"

    @property
    def can_split(self) -> bool:
        return self.root_knobs and bool(self.embedding_names) and bool(self.head_names)

    def suggest(self, trial: optuna.Trial) -> RuntimeConfig:
        """Sample one config (define-by-run: conditional knobs only when they matter)."""
        pp_choices = self.get_pp_choices()
        pp = trial.suggest_categorical("pp", pp_choices) if len(pp_choices) > 1 else pp_choices[0]
        mesh = trial.suggest_categorical(get_mesh_key(pp), self.get_mesh_choices(pp))
        shard = self._get_shard_size(mesh, pp)
        params: dict[str, Any] = {
            "pp": pp,
            get_mesh_key(pp): mesh,
            "forward_prefetch": trial.suggest_categorical("forward_prefetch", PREFETCH_CHOICES),
            "backward_prefetch": trial.suggest_categorical("backward_prefetch", PREFETCH_CHOICES),
            self._get_reshard_key(shard): trial.suggest_categorical(
                self._get_reshard_key(shard), self._get_reshard_choices(shard)
            ),
        }
        params.update(ask(trial, _RS_BUFFERS, self.device_type, self._unsupported, params))
        if self.search_reduce_dtype:
            params["reduce_dtype"] = trial.suggest_categorical("reduce_dtype", REDUCE_DTYPES)
        params.update(ask(trial, _ASYNC, self.device_type, self._unsupported, params))
        if pp > 1:
            params[f"pp{pp}_schedule"] = trial.suggest_categorical(f"pp{pp}_schedule", self.get_schedule_choices(pp))
        if self.num_microbatches > 1:
            params["nosync_blocks"] = trial.suggest_categorical("nosync_blocks", NOSYNC_PATTERNS)
            if params["nosync_blocks"] != "none":
                suffix = self.get_sync_suffix(mesh, pp)
                levels = ["last", "replica_last"] if suffix == "hsdp" else ["last"]
                level_key = f"nosync_level_{suffix}"
                params["nosync_level"] = trial.suggest_categorical(level_key, levels)
                params["keep_unsharded"] = trial.suggest_categorical("keep_unsharded", [False, True])
                if params["nosync_level"] == "last":
                    params["defer_concat"] = trial.suggest_categorical("defer_concat", [True, False])
        params.update(self._suggest_memory_knobs(trial, mesh, pp))
        for knob in get_added_knobs(4):  # schema-4 method knobs, after every older question (same sequences)
            params.update(ask(trial, knob, self.device_type, self._unsupported, params))
        return self.build_config(params)

    def _suggest_memory_knobs(self, trial: optuna.Trial, mesh: str, pp: int = 1) -> dict[str, Any]:
        """Schema-2 knobs, asked after the others so that the questions above keep their order."""
        params: dict[str, Any] = {}
        if self.grouping:
            params["blocks_per_unit"] = trial.suggest_categorical("blocks_per_unit", BLOCKS_PER_UNIT)
        if self.checkpointing:
            params["ac_units"] = trial.suggest_categorical("ac_units", AC_PATTERNS)
            if params["ac_units"] != "none":
                params["ac_kind"] = trial.suggest_categorical("ac_kind", AC_KINDS)
        if self.root_knobs:
            params["root_reshard_after_forward"] = trial.suggest_categorical(
                "root_reshard_after_forward", ["false", "true"]
            )
            if self.num_microbatches > 1:
                suffix = self.get_sync_suffix(mesh, pp)
                key = f"root_sync_{suffix}"
                params[key] = trial.suggest_categorical(
                    key, ["every", "replica_last", "last"] if suffix == "hsdp" else ["every", "last"]
                )
                if params[key] != "every":
                    params["root_keep_unsharded"] = trial.suggest_categorical("root_keep_unsharded", [False, True])
            if self.can_split:
                params["root_split"] = trial.suggest_categorical("root_split", ["none", "split"])
        return params

    def _get_shard_size(self, mesh: str, pp: int = 1) -> int:
        if mesh == "fsdp":
            return self.world_size // pp
        return int(mesh.split(":")[1].split("x")[1])

    def _get_reshard_choices(self, shard: int) -> list[str]:
        return get_reshard_choices(shard, self.ranks_per_node)

    def _get_reshard_key(self, shard: int) -> str:
        return get_reshard_key(shard, self.ranks_per_node)

    def build_config(self, params: dict[str, Any]) -> RuntimeConfig:
        """Expand pattern parameters into an explicit per-unit config."""
        params = dict(params)
        for key in ("nosync_level_fsdp", "nosync_level_hsdp"):
            if key in params:
                params["nosync_level"] = params.pop(key)
        pp = params.get("pp", min(self.get_pp_choices()))  # not asked where one degree is offered
        mesh = params[get_mesh_key(pp)] if get_mesh_key(pp) in params else params["mesh"]
        if mesh == "fsdp":
            mesh_config = MeshConfig(pp=pp)
        else:
            replicate, shard = (int(x) for x in mesh.split(":")[1].split("x"))
            mesh_config = MeshConfig(kind="hsdp", replicate=replicate, shard=shard, pp=pp)
        schedule = params.get(f"pp{pp}_schedule", "1f1b") if pp > 1 else "1f1b"
        virtual = 2 if schedule == "interleaved_1f1b" else 1
        shard = self._get_shard_size(mesh, pp)
        reshard = params.get(self._get_reshard_key(shard), "true")
        per_unit = params.get("blocks_per_unit", 1)
        stages = split_even(list(self.block_names), pp * virtual)
        stage_groups = [group_blocks(blocks, per_unit) for blocks in stages]
        groups = [g for stage in stage_groups for g in stage]
        names = [name for name, _ in groups]
        split = params.get("root_split", "none") == "split"
        edges = get_edge_units(self.embedding_names, self.head_names) if split else []
        fwd: dict[str, list[str]] = {}
        bwd: dict[str, list[str]] = {}
        for k, stage in enumerate(stage_groups):  # prefetch within each stage, in its execution order
            order = [
                *(u.name for u in edges[:1] if k == 0),
                *(name for name, _ in stage),
                *(u.name for u in edges[1:] if k == len(stage_groups) - 1),
            ]
            fwd.update(get_prefetch_lists(order, params["forward_prefetch"]))
            bwd.update(get_prefetch_lists(list(reversed(order)), params["backward_prefetch"]))
        units = build_block_units(params, stage_groups, names, fwd, bwd, reshard, shard)
        units += build_root_units(params, edges, fwd, bwd)
        return RuntimeConfig(
            mesh=mesh_config,
            pipeline=PipelineConfig(schedule=schedule, virtual_stages=virtual) if pp > 1 else PipelineConfig(),
            units=units,
            num_microbatches=self.num_microbatches,
            **get_method_fields(params),
            mixed_precision=dataclasses.replace(
                self.mixed_precision, reduce_dtype=params.get("reduce_dtype", self.mixed_precision.reduce_dtype)
            ),
        )


_RS_BUFFERS, _ASYNC = (get_knob(name) for name in ("reduce_scatter_max_input_buffers", "unshard_async"))
