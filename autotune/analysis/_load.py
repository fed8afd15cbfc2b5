"""Read one torch.profiler chrome trace (``.json`` or gzipped) into DataFrames.

The file itself is never modified: traces stay openable in Perfetto/chrome://tracing.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pandas as pd

from autotune.analysis._errors import TraceError

EVENT_COLUMNS = ["name", "cat", "pid", "tid", "ts", "dur", "end", "correlation"]
MEMORY_COLUMNS = ["ts", "total_allocated", "device_type"]
_GZIP_MAGIC = b"\x1f\x8b"
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)")
_STEP_NAME = re.compile(r"^ProfilerStep#(\d+)$")


@dataclass(kw_only=True)
class RankTrace:
    """One rank's trace: its complete (``ph == "X"``) events and memory events, times in us."""

    path: Path
    rank: int
    device: Literal["cpu", "gpu"]
    """``gpu`` when the trace has device kernels (``cat == "kernel"``), else ``cpu``."""
    events: pd.DataFrame
    """Columns :data:`EVENT_COLUMNS`; ``correlation`` is -1 where the event has none."""
    memory: pd.DataFrame
    """``[memory]`` instant events, columns :data:`MEMORY_COLUMNS`."""
    thread_names: dict[tuple[Any, Any], str] = field(default_factory=dict)
    num_bytes: int = 0
    """Size of the file as stored (compressed when gzipped)."""


def _read_json(path: Path) -> Any:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise TraceError(path, "no such file") from None
    except OSError as e:
        raise TraceError(path, f"cannot read ({e.strerror})") from None
    if not raw:
        raise TraceError(path, "empty file (the profiler did not finish writing it?)")
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as e:
            raise TraceError(path, f"truncated or corrupt gzip data ({e})") from None
        if not raw:
            raise TraceError(path, "empty trace inside the gzip file")
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise TraceError(path, "not a JSON trace (binary content)") from None
    except json.JSONDecodeError as e:
        hint = "truncated" if e.pos >= len(raw.rstrip()) - 1 else "not valid JSON"
        raise TraceError(path, f"{hint}: {e.msg} at line {e.lineno} column {e.colno}") from None


def _get_rank(path: Path, doc: dict[str, Any], default: int) -> int:
    info = doc.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return info["rank"]
    match = _RANK_IN_NAME.search(path.name)
    return int(match.group(1)) if match else default


def _to_frames(events: list[Any]) -> tuple[pd.DataFrame, pd.DataFrame, dict[tuple[Any, Any], str]]:
    rows: list[tuple[Any, ...]] = []
    memory: list[tuple[float, float, int]] = []
    threads: dict[tuple[Any, Any], str] = {}
    for e in events:
        if not isinstance(e, dict):
            continue
        ph = e.get("ph")
        if ph == "X" and "ts" in e and "dur" in e:
            args = e.get("args") or {}
            ts, dur = float(e["ts"]), float(e["dur"])
            rows.append((e.get("name", ""), e.get("cat", ""), e.get("pid"), e.get("tid"), ts, dur, ts + dur, int(args.get("correlation", -1))))
        elif ph == "i" and e.get("name") == "[memory]":
            args = e.get("args") or {}
            if "Total Allocated" in args:
                memory.append((float(e["ts"]), float(args["Total Allocated"]), int(args.get("Device Type", 0))))
        elif ph == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str((e.get("args") or {}).get("name", ""))
    frame = pd.DataFrame.from_records(rows, columns=EVENT_COLUMNS)
    # Few distinct names: categoricals make the classifiers' string matching per name, not per event.
    frame["name"] = frame["name"].astype(str).astype("category")
    frame["cat"] = frame["cat"].astype(str).astype("category")
    return frame, pd.DataFrame.from_records(memory, columns=MEMORY_COLUMNS), threads


def load_trace(path: str | Path, *, default_rank: int = 0) -> RankTrace:
    """Load a chrome trace; raise :class:`TraceError` (one line) if it is not a usable one."""
    path = Path(path)
    doc = _read_json(path)
    if isinstance(doc, list):  # the bare-array form of the chrome trace format
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceError(path, "not a torch.profiler chrome trace (no 'traceEvents' list)")
    events, memory, threads = _to_frames(doc["traceEvents"])
    if not events["name"].str.match(_STEP_NAME.pattern).any():
        raise TraceError(path, "no ProfilerStep#N spans (profile with a torch.profiler schedule and call prof.step() every step)")
    device = "gpu" if (events["cat"] == "kernel").any() else "cpu"
    return RankTrace(
        path=path,
        rank=_get_rank(path, doc, default_rank),
        device=device,
        events=events,
        memory=memory,
        thread_names=threads,
        num_bytes=path.stat().st_size,
    )
