"""Two structurally different configs paired on one device's memory: their models built in turn.

[Note: models built in turn]
Where the candidate and the reference differ in structure (mesh, grouping, checkpointing,
precision, an int reshard: [Note: knobs switched in place] in :mod:`fsdp_runtime.switch`), no
switch in place exists. Two models at once need two models' memory, which a job sized to its
GPU does not have. So on CUDA (and on CPU with ``AUTOTUNE_PAIRED_MODELS=turn``) the ranks hold
one of the two at a time: whenever the pairs move to the other side, the model held is freed
(references dropped, the caching allocator emptied) and the other side's is built from the same
seed, warmed up with the trial's warm-up steps (unrecorded), then measured; the ABBA order, the
settle step after each switch, the block ratios and their spread are unchanged ([Note: paired
measurement]). In ABBA order the ranks switch once per pair and once before the first, so a
trial of ``n`` pairs builds ``n + 2`` models (the candidate's first), one more if the candidate
is profiled after the reference stepped last: each side's runs are separate builds, so the spread
across blocks holds build-to-build variation too, which is what it should hold here. Every build
starts from the same initial weights; losses are each build's own. The cost is a build and its
warm-up per pair, seconds each on a GPU (``benchmarks/gpu_check.py`` shows each trial's fixed
cost), against no search at all where two models do not fit; a rank draws its rows of the initial
weights once and restores them at every later build ([Note: shard cache] in
:mod:`profiles.chunked_init`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

from autotune.trials.paired import Side

__all__ = ["ModelsInTurn"]


class ModelsInTurn:
    """Holds the model of one side at a time; :meth:`activate` makes a side's the one held."""

    def __init__(
        self, build: Callable[[dict[str, Any]], Any], warm_up: Callable[[Side], None], release: Callable[[], None]
    ) -> None:
        self._build, self._warm_up, self._release = build, warm_up, release
        self.configs: dict[int, dict[str, Any]] = {}
        self.held: Side | None = None
        self.num_builds = 0

    def add(self, side: Side, config: dict[str, Any], *, built: bool = False) -> None:
        """Let ``side`` take turns with ``config`` (``built``: its model is the one held now)."""
        self.configs[id(side)] = config
        side.in_turn = self
        if built:
            self.held = side
            self.num_builds += 1

    def activate(self, side: Side) -> Any:
        """``side``'s training, built (and the other side's freed) unless it is the one held."""
        if self.held is not side:
            if self.held is not None:
                self.held.training = None
                self.held = None
                gc.collect()
                self._release()
            side.training = self._build(self.configs[id(side)])
            self.num_builds += 1
            self.held = side
            self._warm_up(side)
        return side.training
