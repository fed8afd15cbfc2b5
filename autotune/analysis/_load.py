"""Read one torch.profiler chrome trace (``.json`` or gzipped) into DataFrames.

The file itself is never modified: traces stay openable in Perfetto/chrome://tracing.
Parsing streams the file ([Note: streaming parse] in ``_parse``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pandas as pd

from autotune.analysis._errors import TraceError
from autotune.analysis._parse import EVENT_COLUMNS, MEMORY_COLUMNS, read_events

__all__ = ["EVENT_COLUMNS", "MEMORY_COLUMNS", "RankTrace", "get_rank", "load_trace"]

_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
_STEP_NAME = re.compile(r"^ProfilerStep#(\d+)$")


@dataclass(kw_only=True)
class RankTrace:
    """One rank's trace: its complete (``ph == "X"``) events and memory events, times in us."""

    path: Path
    rank: int
    device: Literal["cpu", "gpu"]
    """``gpu`` when the trace has device kernels (``cat == "kernel"``), else ``cpu``."""
    events: pd.DataFrame
    """Columns :data:`EVENT_COLUMNS` (``name``, ``cat``, ``pid``, ``tid`` categorical);
    ``correlation`` is -1 where the event has none."""
    memory: pd.DataFrame
    """``[memory]`` instant events, columns :data:`MEMORY_COLUMNS`."""
    thread_names: dict[tuple[Any, Any], str] = field(default_factory=dict)
    num_bytes: int = 0
    """Size of the file as stored (compressed when gzipped)."""
    rank_source: Literal["distributedInfo", "file name", "position"] = "position"
    """Where :attr:`rank` came from."""


def get_rank(path: Path, header: dict[str, Any]) -> tuple[int, str] | None:
    """``(rank, source)`` from the trace's ``distributedInfo``, else ``rank<N>`` in its file name; None if neither says."""
    info = header.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int) and not isinstance(info["rank"], bool):
        return info["rank"], "distributedInfo"
    match = _RANK_IN_NAME.search(path.name)
    return (int(match.group(1)), "file name") if match else None


def load_trace(path: str | Path, *, default_rank: int = 0) -> RankTrace:
    """Load a chrome trace; raise :class:`TraceError` (one line) if it is not a usable one.

    The rank is :func:`get_rank`'s, else ``default_rank``.
    """
    path = Path(path)
    header, columns = read_events(path)
    events, memory = columns.to_frames()
    if not events["name"].cat.categories.str.match(_STEP_NAME.pattern).any():
        raise TraceError(
            path, "no ProfilerStep#N spans (profile with a torch.profiler schedule and call prof.step() every step)"
        )
    device = "gpu" if (events["cat"] == "kernel").any() else "cpu"
    rank, source = get_rank(path, header) or (default_rank, "position")
    return RankTrace(
        path=path,
        rank=rank,
        device=device,
        events=events,
        memory=memory,
        thread_names=columns.thread_names,
        num_bytes=path.stat().st_size,
        rank_source=source,
    )
