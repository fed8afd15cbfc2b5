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
- ``reshard_after_forward``: ``true``, ``false``, ``last_block_false`` (the block whose
  backward runs first keeps its params), or ``int:d`` for proper divisors d of the shard size.
  Optuna needs one fixed choice list per parameter name, and the valid ``int:d`` depend on
  the mesh's shard size, so meshes whose shard size has proper divisors get their own
  parameter (``reshard_after_forward_shard4``): an int that this mesh cannot use is never
  sampled, instead of silently running as another point's config.
- ``unshard_async`` (CPU only: ``off`` is torchtitan's default, ``on`` makes prefetch real)
  and ``reduce_scatter_max_input_buffers``.

The defaults trial (trial 0) is the point in this space that equals FSDP2's defaults as
torchtitan uses them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import optuna

from fsdp_runtime import ROOT_UNIT, MeshConfig, RuntimeConfig, UnitConfig

PREFETCH_CHOICES = ("implicit", "depth1", "depth2", "depth3", "paired")
NOSYNC_PATTERNS = ("none", "all", "every_2nd", "first_half", "second_half")


@dataclass(kw_only=True, frozen=True)
class SearchSpace:
    """The knobs for one model's units on one world size, under the user's fixed choices."""

    block_names: tuple[str, ...]
    world_size: int
    num_microbatches: int = 1
    device_type: str = "cpu"
    fixed_mesh: str | None = None
    """Restrict the mesh to one choice (e.g. ``fsdp``)."""

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
            "reduce_scatter_buffers": 1,
        }
        params[self._get_reshard_key(self._get_shard_size(params["mesh"]))] = "true"
        if self.device_type == "cpu":
            params["unshard_async"] = "off"
        if self.num_microbatches > 1:
            params.update(nosync_blocks="none")
        return params

    def suggest(self, trial: optuna.Trial) -> RuntimeConfig:
        """Sample one config (define-by-run: conditional knobs only when they matter)."""
        mesh = trial.suggest_categorical("mesh", self.get_mesh_choices())
        shard = self._get_shard_size(mesh)
        params: dict[str, Any] = {
            "mesh": mesh,
            "forward_prefetch": trial.suggest_categorical("forward_prefetch", PREFETCH_CHOICES),
            "backward_prefetch": trial.suggest_categorical("backward_prefetch", PREFETCH_CHOICES),
            self._get_reshard_key(shard): trial.suggest_categorical(self._get_reshard_key(shard), self._get_reshard_choices(shard)),
            "reduce_scatter_buffers": trial.suggest_categorical("reduce_scatter_buffers", [1, 2]),
        }
        if self.device_type == "cpu":
            params["unshard_async"] = trial.suggest_categorical("unshard_async", ["off", "on"])
        if self.num_microbatches > 1:
            params["nosync_blocks"] = trial.suggest_categorical("nosync_blocks", NOSYNC_PATTERNS)
            if params["nosync_blocks"] != "none":
                levels = ["last", "replica_last"] if mesh.startswith("hsdp") else ["last"]
                level_key = "nosync_level_hsdp" if mesh.startswith("hsdp") else "nosync_level_fsdp"
                params["nosync_level"] = trial.suggest_categorical(level_key, levels)
                params["keep_unsharded"] = trial.suggest_categorical("keep_unsharded", [False, True])
                if params["nosync_level"] == "last":
                    params["defer_concat"] = trial.suggest_categorical("defer_concat", [True, False])
        return self.build_config(params)

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
        return "reshard_after_forward" if len(cls._get_reshard_choices(shard)) == 3 else f"reshard_after_forward_shard{shard}"

    def build_config(self, params: dict[str, Any]) -> RuntimeConfig:
        """Expand pattern parameters into an explicit per-unit config."""
        params = dict(params)
        for key in ("nosync_level_fsdp", "nosync_level_hsdp"):
            if key in params:
                params["nosync_level"] = params.pop(key)
        blocks = list(self.block_names)
        mesh = params["mesh"]
        if mesh == "fsdp":
            mesh_config = MeshConfig()
        else:
            replicate, shard = (int(x) for x in mesh.split(":")[1].split("x"))
            mesh_config = MeshConfig(kind="hsdp", replicate=replicate, shard=shard)
        shard = self._get_shard_size(mesh)
        reshard = params.get(self._get_reshard_key(shard), "true")
        fwd = _prefetch_lists(blocks, params["forward_prefetch"])
        bwd = _prefetch_lists(list(reversed(blocks)), params["backward_prefetch"])
        nosync = _select_blocks(blocks, params.get("nosync_blocks", "none"))
        units = []
        for i, name in enumerate(blocks):
            unit = UnitConfig(
                name=name,
                reshard_after_forward=_reshard_value(reshard, i, len(blocks), shard),
                forward_prefetch=fwd.get(name),
                backward_prefetch=bwd.get(name),
            )
            if name in nosync:
                unit = dataclasses.replace(
                    unit,
                    sync=params["nosync_level"],
                    reshard_after_backward=not params.get("keep_unsharded", False),
                    defer_concat=params.get("defer_concat", True),
                )
            units.append(unit)
        units.append(UnitConfig(name=ROOT_UNIT))
        buffers = params.get("reduce_scatter_buffers", 1)
        return RuntimeConfig(
            mesh=mesh_config,
            units=units,
            num_microbatches=self.num_microbatches,
            unshard_async=params.get("unshard_async", "auto"),
            reduce_scatter_max_input_buffers=None if buffers == 1 else buffers,
        )


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
}


def describe_params(params: dict[str, Any]) -> str:
    """A compact one-line description of a trial's knobs, for tables."""
    parts = [str(params.get("mesh", "?"))]
    for key, value in params.items():
        if key != "mesh":
            short = "raf" if key.startswith("reshard_after_forward") else _SHORT.get(key, key)
            parts.append(f"{short}={str(value).lower() if isinstance(value, bool) else value}")
    return " ".join(parts)
