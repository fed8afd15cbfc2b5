"""Pipeline stages in the traces: which stages each rank holds, its P2P split off the collectives,
and the stage of each unit, transfer and compute interval ([Note: pipeline bubble]).

Stage ``s`` of ``pp * virtual_stages`` lives on pipeline rank ``s % pp``, and global rank ``r``
is pipeline rank ``r // dp`` (``dp = ranks / pp``): [Note: pipeline stages] in
``fsdp_runtime/pipeline.py``. On a rank holding one stage everything it does is that stage's;
on a rank holding several, torch's schedules label each action ``PP:<stage>...`` and the label
around an event names its stage.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pandas as pd

from autotune.analysis import _intervals as iv
from autotune.analysis._errors import TraceError
from autotune.analysis._events import RankEvents
from fsdp_runtime import ROOT_UNIT, RuntimeConfig

_NUMBERS = re.compile(r"(\d+)")


@dataclass(frozen=True, kw_only=True)
class PipelineLayout:
    """How a pipeline trial placed its stages: the part of the runtime config the traces do not say."""

    pp: int
    """Pipeline ranks (``mesh.pp``)."""
    virtual_stages: int = 1
    """Stages per pipeline rank (``pipeline.virtual_stages``)."""
    schedule: str | None = None
    """``pipeline.schedule`` (reported only)."""
    blocks_per_stage: tuple[int, ...] | None = None
    """``pipeline.blocks_per_stage``; None: an even split."""

    @classmethod
    def from_config(cls, config: RuntimeConfig) -> PipelineLayout | None:
        """The layout of a config with ``mesh.pp`` > 1, else None (no pipeline)."""
        if config.mesh.pp <= 1:
            return None
        pipeline = config.pipeline
        counts = tuple(pipeline.blocks_per_stage) if pipeline.blocks_per_stage is not None else None
        return cls(
            pp=config.mesh.pp,
            virtual_stages=pipeline.virtual_stages,
            schedule=pipeline.schedule,
            blocks_per_stage=counts,
        )

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def get_stages(self, rank: int, num_ranks: int) -> list[int]:
        """The stages global rank ``rank`` holds, in order."""
        pipeline_rank = rank // (num_ranks // self.pp)
        return [pipeline_rank + k * self.pp for k in range(self.virtual_stages)]


def get_unit_modules(unit: str) -> list[str]:
    """The module FQNs an FSDP unit's labels name (``layers.0, layers.1`` for a grouped unit); none for root."""
    return [] if unit == ROOT_UNIT else [m.strip() for m in unit.split(",") if m.strip()]


def model_order(name: str) -> list[object]:
    """Sort key of module FQNs in model order (``layers.2`` before ``layers.10``)."""
    return [int(p) if p.isdigit() else p for p in _NUMBERS.split(name)]


def get_stage_at(events: RankEvents, times: np.ndarray) -> np.ndarray:
    """The stage of the action label around each time (None outside every label); on a rank
    holding one stage, that stage everywhere."""
    times = np.asarray(times, dtype=float)
    if len(events.stages) == 1:
        return np.full(len(times), events.stages[0], dtype=object)
    labels = events.stage_labels
    out = np.full(len(times), None, dtype=object)
    if len(labels) == 0 or len(times) == 0:
        return out
    starts, ends = labels["start"].to_numpy(dtype=float), labels["end"].to_numpy(dtype=float)
    at = np.searchsorted(starts, times, side="right") - 1
    inside = (at >= 0) & (times < ends[np.maximum(at, 0)])
    out[inside] = labels["stage"].to_numpy()[at[inside]]
    return out


def get_stage_spans(events: RankEvents, stage: int) -> np.ndarray:
    """The merged action labels of ``stage`` on the rank (cached per stage)."""
    key = ("stage_spans", stage)
    if key not in events.cache:
        labels = events.stage_labels[events.stage_labels["stage"] == stage]
        events.cache[key] = iv.union(labels[["start", "end"]].to_numpy(dtype=float))
    return events.cache[key]


def _split_blocks(all_units: list[str], layout: PipelineLayout) -> dict[str, int]:
    """Each block's stage from the config's split of the blocks the ranks' labels name (model order),
    for ranks holding several stages whose traces have no action labels; empty where it does not split."""
    blocks = sorted({m for u in all_units for m in get_unit_modules(u)}, key=model_order)
    counts = layout.blocks_per_stage
    if counts is None:
        per, extra = divmod(len(blocks), layout.num_stages)
        counts = (per,) * layout.num_stages if per and not extra else None
    if counts is None or sum(counts) != len(blocks) or len(counts) != layout.num_stages:
        return {}
    stage_of = np.repeat(np.arange(len(counts)), counts)
    return {block: int(stage) for block, stage in zip(blocks, stage_of)}


def _vote(stages: np.ndarray) -> int | None:
    """The most common stage (ties: the lowest), None without any."""
    counts = Counter(int(s) for s in stages if s is not None)
    return min(counts, key=lambda s: (-counts[s], s)) if counts else None


def _get_unit_stages(events: RankEvents, block_stages: dict[str, int]) -> dict[str, int | None]:
    """A unit's stage: the action labels around its collectives' issue points, else around its
    FSDP labels (the root's hooks run in every stage of the rank; its collectives only in the stage
    holding parameters), else the config's split of the blocks."""
    if len(events.stages) == 1:
        return dict.fromkeys(events.units, events.stages[0])
    out: dict[str, int | None] = {}
    for unit in events.units:
        issued = events.comm.loc[events.comm["unit"] == unit, "issue_ts"].to_numpy()
        stage = _vote(get_stage_at(events, issued))
        if stage is None:
            stage = _vote(get_stage_at(events, events.labels.loc[events.labels["unit"] == unit, "start"].to_numpy()))
        if stage is None:
            modules = get_unit_modules(unit)
            stage = block_stages.get(modules[0]) if modules else None
        out[unit] = stage if stage in events.stages else None
    return out


def assign_stages(events_by_rank: dict[int, RankEvents], layout: PipelineLayout) -> None:
    """Set each rank's stages, split its P2P off its collectives and give each unit and transfer its stage."""
    num_ranks = len(events_by_rank)
    if num_ranks % layout.pp:
        raise TraceError(
            "<trace list>", f"{num_ranks} rank traces do not split into mesh.pp = {layout.pp} pipeline ranks"
        )
    block_stages = _split_blocks([u for e in events_by_rank.values() for u in e.units], layout)
    for rank, events in events_by_rank.items():
        events.stages = layout.get_stages(rank, num_ranks)
        is_p2p = (events.comm["kind"] == "send_recv").to_numpy()
        p2p = events.comm[is_p2p]
        events.p2p = pd.DataFrame(
            {
                "start": p2p["start"].to_numpy(),
                "end": p2p["end"].to_numpy(),
                "issue_ts": p2p["issue_ts"].to_numpy(),
                "stage": pd.Series(get_stage_at(events, p2p["issue_ts"].to_numpy()), dtype=object),
            }
        )
        events.comm = events.comm[~is_p2p].reset_index(drop=True)
        events.unit_stages = _get_unit_stages(events, block_stages)
        events.cache.clear()
