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

A trial whose process peak exceeds ``--memory-budget-gib`` is infeasible
(``autotune.search.loop``: ``memory_over_budget`` is an Optuna constraint, and the best
trial is feasible), which is what makes checkpointing and grouping a trade-off.

The defaults trial (trial 0) is the point in this space that equals FSDP2's defaults as
torchtitan uses them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import optuna

from fsdp_runtime import ROOT_UNIT, MeshConfig, MixedPrecisionConfig, RuntimeConfig, UnitConfig

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
    """Search activation checkpointing (``ac_units``, ``ac_kind``): turn on with a memory budget."""
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
        """One line per knob left out of the space."""
        return [f"{name} not searched: {why}" for name, why in self.unsupported_knobs]

    def _asks(self, param: str) -> bool:
        unsupported = {name for name, _ in self.unsupported_knobs}
        return _FIELD_OF_PARAM.get(param) not in unsupported

    def get_mesh_choices(self) -> list[str]:
        if self.fixed_mesh is not None:
            return [self.fixed_mesh]
        choices = ["fsdp"]
        for replicate in range(2, self.world_size + 1):
            if self.world_size % replicate == 0:
                choices.append(f"hsdp:{replicate}x{self.world_size // replicate}")
        return choices

    def get_default_params(self) -> dict[str, Any]:
        """Parameters of the defaults trial (FSDP2 defaults as torchtitan uses them)."""
        params: dict[str, Any] = {
            "mesh": "fsdp" if "fsdp" in self.get_mesh_choices() else self.get_mesh_choices()[0],
            "forward_prefetch": "implicit",
            "backward_prefetch": "implicit",
            **({"reduce_scatter_buffers": 1} if self._asks("reduce_scatter_buffers") else {}),
        }
        params[self._get_reshard_key(self._get_shard_size(params["mesh"]))] = "true"
        if self.search_reduce_dtype:
            params["reduce_dtype"] = self._get_default_reduce_dtype()
        if self.device_type == "cpu" and self._asks("unshard_async"):
            params["unshard_async"] = "off"
        if self.num_microbatches > 1:
            params.update(nosync_blocks="none")
        if self.grouping:
            params["blocks_per_unit"] = 1
        if self.checkpointing:
            params["ac_units"] = "none"
        if self.root_knobs:
            params["root_reshard_after_forward"] = "false"
            if self.num_microbatches > 1:
                params[f"root_sync_{self.get_sync_suffix(params['mesh'])}"] = "every"
            if self.can_split:
                params["root_split"] = "none"
        return params

    def get_sync_suffix(self, mesh: str) -> str:
        """``hsdp`` where ``mesh`` offers ``replica_last`` (the ``*_hsdp`` sync parameters), else
        ``fsdp`` ([Note: search-space parametrization]: not on a shard group of one)."""
        replica_level = mesh.startswith("hsdp") and (self._get_shard_size(mesh) > 1 or self.reduce_dtype_differs)
        return "hsdp" if replica_level else "fsdp"

    @property
    def can_split(self) -> bool:
        return self.root_knobs and bool(self.embedding_names) and bool(self.head_names)

    def suggest(self, trial: optuna.Trial) -> RuntimeConfig:
        """Sample one config (define-by-run: conditional knobs only when they matter)."""
        mesh = trial.suggest_categorical("mesh", self.get_mesh_choices())
        shard = self._get_shard_size(mesh)
        params: dict[str, Any] = {
            "mesh": mesh,
            "forward_prefetch": trial.suggest_categorical("forward_prefetch", PREFETCH_CHOICES),
            "backward_prefetch": trial.suggest_categorical("backward_prefetch", PREFETCH_CHOICES),
            self._get_reshard_key(shard): trial.suggest_categorical(
                self._get_reshard_key(shard), self._get_reshard_choices(shard)
            ),
        }
        if self._asks("reduce_scatter_buffers"):
            params["reduce_scatter_buffers"] = trial.suggest_categorical("reduce_scatter_buffers", [1, 2])
        if self.search_reduce_dtype:
            params["reduce_dtype"] = trial.suggest_categorical("reduce_dtype", REDUCE_DTYPES)
        if self.device_type == "cpu" and self._asks("unshard_async"):
            params["unshard_async"] = trial.suggest_categorical("unshard_async", ["off", "on"])
        if self.num_microbatches > 1:
            params["nosync_blocks"] = trial.suggest_categorical("nosync_blocks", NOSYNC_PATTERNS)
            if params["nosync_blocks"] != "none":
                suffix = self.get_sync_suffix(mesh)
                levels = ["last", "replica_last"] if suffix == "hsdp" else ["last"]
                level_key = f"nosync_level_{suffix}"
                params["nosync_level"] = trial.suggest_categorical(level_key, levels)
                params["keep_unsharded"] = trial.suggest_categorical("keep_unsharded", [False, True])
                if params["nosync_level"] == "last":
                    params["defer_concat"] = trial.suggest_categorical("defer_concat", [True, False])
        params.update(self._suggest_memory_knobs(trial, mesh))
        return self.build_config(params)

    def _suggest_memory_knobs(self, trial: optuna.Trial, mesh: str) -> dict[str, Any]:
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
                suffix = self.get_sync_suffix(mesh)
                key = f"root_sync_{suffix}"
                params[key] = trial.suggest_categorical(
                    key, ["every", "replica_last", "last"] if suffix == "hsdp" else ["every", "last"]
                )
                if params[key] != "every":
                    params["root_keep_unsharded"] = trial.suggest_categorical("root_keep_unsharded", [False, True])
            if self.can_split:
                params["root_split"] = trial.suggest_categorical("root_split", ["none", "split"])
        return params

    def _get_shard_size(self, mesh: str) -> int:
        if mesh == "fsdp":
            return self.world_size
        return int(mesh.split(":")[1].split("x")[1])

    @staticmethod
    def _get_reshard_choices(shard: int) -> list[str]:
        return ["true", "false", "last_block_false", *(f"int:{d}" for d in range(2, shard) if shard % d == 0)]

    @classmethod
    def _get_reshard_key(cls, shard: int) -> str:
        """One parameter name per choice list (see [Note: search-space parametrization])."""
        return (
            "reshard_after_forward"
            if len(cls._get_reshard_choices(shard)) == 3
            else f"reshard_after_forward_shard{shard}"
        )

    def build_config(self, params: dict[str, Any]) -> RuntimeConfig:
        """Expand pattern parameters into an explicit per-unit config."""
        params = dict(params)
        for key in ("nosync_level_fsdp", "nosync_level_hsdp"):
            if key in params:
                params["nosync_level"] = params.pop(key)
        mesh = params["mesh"]
        if mesh == "fsdp":
            mesh_config = MeshConfig()
        else:
            replicate, shard = (int(x) for x in mesh.split(":")[1].split("x"))
            mesh_config = MeshConfig(kind="hsdp", replicate=replicate, shard=shard)
        shard = self._get_shard_size(mesh)
        reshard = params.get(self._get_reshard_key(shard), "true")
        groups = _group_blocks(list(self.block_names), params.get("blocks_per_unit", 1))
        names = [name for name, _ in groups]
        edges = self._get_edge_units() if params.get("root_split", "none") == "split" else []
        order = [*(u.name for u in edges[:1]), *names, *(u.name for u in edges[1:])]
        fwd = _prefetch_lists(order, params["forward_prefetch"])
        bwd = _prefetch_lists(list(reversed(order)), params["backward_prefetch"])
        nosync = _select_blocks(names, params.get("nosync_blocks", "none"))
        checkpointed = _select_blocks(names, params.get("ac_units", "none"))
        units = []
        for i, (name, modules) in enumerate(groups):
            unit = UnitConfig(
                name=name,
                modules=modules,
                reshard_after_forward=_reshard_value(reshard, i, len(groups), shard),
                forward_prefetch=fwd.get(name),
                backward_prefetch=bwd.get(name),
                activation_checkpointing=params["ac_kind"] if name in checkpointed else "none",
            )
            if name in nosync:
                unit = dataclasses.replace(
                    unit,
                    sync=params["nosync_level"],
                    reshard_after_backward=not params.get("keep_unsharded", False),
                    defer_concat=params.get("defer_concat", True),
                )
            units.append(unit)
        units += self._build_root_units(params, edges, fwd, bwd)
        buffers = params.get("reduce_scatter_buffers", 1)
        return RuntimeConfig(
            mesh=mesh_config,
            units=units,
            num_microbatches=self.num_microbatches,
            unshard_async=params.get("unshard_async", "auto"),
            reduce_scatter_max_input_buffers=None if buffers == 1 else buffers,
            mixed_precision=dataclasses.replace(
                self.mixed_precision, reduce_dtype=params.get("reduce_dtype", self.mixed_precision.reduce_dtype)
            ),
        )

    def _get_edge_units(self) -> list[UnitConfig]:
        """The embeddings unit and the head unit (kept after forward: its backward runs first)."""
        embeddings = _group_unit(list(self.embedding_names))
        head = _group_unit(list(self.head_names))
        return [embeddings, dataclasses.replace(head, reshard_after_forward=False)]

    def _build_root_units(
        self, params: dict[str, Any], edges: list[UnitConfig], fwd: dict[str, list[str]], bwd: dict[str, list[str]]
    ) -> list[UnitConfig]:
        """The split-off edge units (if any) and the root, with the root's sync level and reshard."""
        sync = params.get("root_sync_fsdp", params.get("root_sync_hsdp", "every"))
        keep = sync != "every" and params.get("root_keep_unsharded", False)
        state = {"sync": sync, "reshard_after_backward": not keep}
        out = [
            dataclasses.replace(u, forward_prefetch=fwd.get(u.name), backward_prefetch=bwd.get(u.name), **state)
            for u in edges
        ]
        root_reshard = (
            True if params.get("root_reshard_after_forward", "false") == "true" else None
        )  # None: FSDP2's root default (False)
        out.append(UnitConfig(name=ROOT_UNIT, reshard_after_forward=root_reshard, **state))
        return out


def _group_unit(modules: list[str]) -> UnitConfig:
    """One unit for ``modules``: the module itself, or a labelled group (``layers.0-1``, ``norm+output``)."""
    if len(modules) == 1:
        return UnitConfig(name=modules[0])
    split = [m.rpartition(".") for m in modules]
    indices = [index for _, _, index in split]
    if len({prefix for prefix, _, _ in split}) == 1 and split[0][0] and all(i.isdecimal() for i in indices):
        return UnitConfig(name=f"{split[0][0]}.{indices[0]}-{indices[-1]}", modules=modules)
    return UnitConfig(name="+".join(modules), modules=modules)


def _group_blocks(blocks: list[str], per_unit: int) -> list[tuple[str, list[str] | None]]:
    """``(unit name, modules)`` for consecutive groups of ``per_unit`` blocks (the last may be smaller)."""
    units = [_group_unit(blocks[i : i + per_unit]) for i in range(0, len(blocks), per_unit)]
    return [(u.name, u.modules) for u in units]


def _prefetch_lists(order: list[str], choice: str) -> dict[str, list[str]]:
    """Per unit, the units it prefetches, following ``order`` (execution order)."""
    if choice == "implicit":
        return {}
    if choice == "paired":
        return {name: (order[i + 1 : i + 3] if i % 2 == 0 else []) for i, name in enumerate(order)}
    depth = int(choice.removeprefix("depth"))
    return {name: order[i + 1 : i + 1 + depth] for i, name in enumerate(order)}


def _select_blocks(blocks: list[str], pattern: str) -> set[str]:
    half = len(blocks) // 2
    match pattern:
        case "none":
            return set()
        case "all":
            return set(blocks)
        case "all_but_last":
            return set(blocks[:-1])
        case "every_2nd":
            return set(blocks[::2])
        case "first_half":
            return set(blocks[:half])
        case "second_half":
            return set(blocks[half:])
    raise ValueError(f"unknown block pattern {pattern!r}")


def _reshard_value(choice: str, index: int, num_blocks: int, shard: int) -> bool | int | None:
    if choice == "true":
        return None  # FSDP2's default for inner units (True); keeps the defaults trial exact
    if choice == "false":
        return False
    if choice == "last_block_false":
        return False if index == num_blocks - 1 else None
    divisor = int(choice.removeprefix("int:"))
    if not (1 < divisor < shard and shard % divisor == 0):
        raise ValueError(f"reshard_after_forward {choice!r} needs a proper divisor of the shard size {shard}")
    return divisor


_FIELD_OF_PARAM = {"reduce_scatter_buffers": "reduce_scatter_max_input_buffers", "unshard_async": "unshard_async"}
"""The config field each torch-dependent parameter sets (``fsdp_runtime.get_unsupported_knobs`` names fields)."""

_SHORT = {
    "forward_prefetch": "fwd",
    "backward_prefetch": "bwd",
    "reshard_after_forward": "raf",
    "reduce_scatter_buffers": "rsbuf",
    "unshard_async": "async",
    "nosync_blocks": "nosync",
    "nosync_level_fsdp": "level",
    "nosync_level_hsdp": "level",
    "keep_unsharded": "keep",
    "defer_concat": "defer",
    "blocks_per_unit": "group",
    "ac_units": "ac",
    "ac_kind": "ackind",
    "root_reshard_after_forward": "rootraf",
    "root_sync_fsdp": "rootsync",
    "root_sync_hsdp": "rootsync",
    "root_keep_unsharded": "rootkeep",
    "root_split": "split",
    "reduce_dtype": "reduce",
}


def describe_params(params: dict[str, Any]) -> str:
    """A compact one-line description of a trial's knobs, for tables."""
    parts = [str(params.get("mesh", "?"))]
    for key, value in params.items():
        if key != "mesh":
            short = "raf" if key.startswith("reshard_after_forward") else _SHORT.get(key, key)
            parts.append(f"{short}={str(value).lower() if isinstance(value, bool) else value}")
    return " ".join(parts)
