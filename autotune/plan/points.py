"""Every point of the search space, and its knobs for the simulator, without building a config per point.

[Note: enumerating the search space]
The space is defined once, in :class:`autotune.search.SearchSpace`: ``suggest(trial)`` asks
its define-by-run questions and ``build_config(params)`` expands the answers (patterns over
the block index) into a per-unit :class:`RuntimeConfig`. ``autotune plan`` walks every
answer path depth-first with a replaying trial (each new question answered with its first
choice, every other choice pushed for later). The questions and their choices depend on the
world size, microbatches, device and fixed mesh, not on the number of blocks, so the walk
runs on a two-block copy of the space, where building a config costs nothing.

Building a 33-unit (81-unit) config, then validating and indexing it, takes longer than
simulating it; so the knobs of a point are assembled from each pattern parameter's
per-unit expansion, taken from ``build_config`` on the real space once per distinct value
(per mesh where the value depends on it). The expansions are independent of each other by
the space's construction ([Note: search-space parametrization]); ``tests/autotune/test_sim_plan.py``
checks the assembled knobs equal those of the built config for points across the space.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from autotune.search import SearchSpace
from autotune.sim import Knobs, resolve_knobs
from fsdp_runtime import MixedPrecisionConfig, RuntimeConfig

_FORWARD_KEYS = ("mesh", "forward_prefetch", "unshard_async")


class _ReplayTrial:
    """Answers ``suggest_categorical`` from a recorded path, then with each question's first choice."""

    def __init__(self, path: list[int]) -> None:
        self.path = path
        self.questions: list[tuple[str, int, int]] = []  # (name, number of choices, chosen index)
        self.params: dict[str, Any] = {}

    def suggest_categorical(self, name: str, choices: Any) -> Any:
        choices = list(choices)
        depth = len(self.questions)
        index = self.path[depth] if depth < len(self.path) else 0
        self.questions.append((name, len(choices), index))
        self.params[name] = choices[index]
        return choices[index]


def iter_space_params(space: SearchSpace) -> Iterator[dict[str, Any]]:
    """Every point of ``space`` as its Optuna params (see [Note: enumerating the search space])."""
    small = dataclasses.replace(space, block_names=("b0", "b1"))
    stack: list[list[int]] = [[]]
    while stack:
        path = stack.pop()
        trial = _ReplayTrial(path)
        small.suggest(trial)  # type: ignore[arg-type]
        for depth in range(len(path), len(trial.questions)):
            prefix = [index for _, _, index in trial.questions[:depth]]
            stack.extend(prefix + [alt] for alt in range(trial.questions[depth][1] - 1, 0, -1))
        yield trial.params


def get_forward_key(params: dict[str, Any]) -> tuple[Any, ...]:
    """What the first forward of a step depends on: points that share it share its simulation."""
    raf = next((v for k, v in params.items() if k.startswith("reshard_after_forward")), None)
    return (*(params.get(k) for k in _FORWARD_KEYS), raf)


class KnobFactory:
    """Knobs for any point of ``space``, from per-parameter expansions of ``build_config``."""

    def __init__(self, space: SearchSpace, *, world_size: int, device: str, mixed_precision: MixedPrecisionConfig) -> None:
        self.space, self.world_size, self.device, self.mp = space, world_size, device, mixed_precision
        self.defaults = space.get_default_params()
        self._cache: dict[tuple[Any, ...], Knobs] = {}

    def build_config(self, params: dict[str, Any]) -> RuntimeConfig:
        return dataclasses.replace(self.space.build_config(params), mixed_precision=self.mp)

    def _expand(self, key: tuple[Any, ...], params: dict[str, Any]) -> Knobs:
        if key not in self._cache:
            config = self.build_config(params)
            self._cache[key] = resolve_knobs(config, self.space.block_names, world_size=self.world_size, device=self.device)
        return self._cache[key]

    def get_knobs(self, params: dict[str, Any]) -> Knobs:
        mesh = params["mesh"]
        base = {**self.defaults, "mesh": mesh}
        base = {k: v for k, v in base.items() if not k.startswith("reshard_after_forward")}
        meshed = self._expand(("mesh", mesh, *sorted((k, str(v)) for k, v in params.items() if k.startswith("reshard_after_forward"))),
                              {**base, **{k: v for k, v in params.items() if k.startswith("reshard_after_forward")}})  # fmt: skip
        fwd = self._expand(("fwd", params["forward_prefetch"]), {**base, "forward_prefetch": params["forward_prefetch"]})
        bwd = self._expand(("bwd", params["backward_prefetch"]), {**base, "backward_prefetch": params["backward_prefetch"]})
        nosync_keys = ("nosync_blocks", "nosync_level_fsdp", "nosync_level_hsdp", "keep_unsharded", "defer_concat")
        nosync_params = {k: params[k] for k in nosync_keys if k in params}
        nosync = self._expand(("nosync", mesh, *sorted((k, str(v)) for k, v in nosync_params.items())), {**base, **nosync_params})
        return dataclasses.replace(
            meshed,
            unshard_async=params.get("unshard_async", "auto") == "on" or (params.get("unshard_async", "auto") == "auto" and self.device == "cpu"),
            max_rs_buffers=params.get("reduce_scatter_buffers", 1),
            forward_prefetch=fwd.forward_prefetch,
            backward_prefetch=bwd.backward_prefetch,
            sync=nosync.sync,
            reshard_after_backward=nosync.reshard_after_backward,
            defer_concat=nosync.defer_concat,
        )
