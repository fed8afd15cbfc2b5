"""Read a chrome trace's events into columns without holding the whole document as Python objects.

[Note: streaming parse]
A torch.profiler trace is one JSON object whose ``traceEvents`` array holds every event;
as Python dicts the events take 4-5x the JSON's size, so parsing the document whole
(``json.loads``) is what made a 50 MB trace peak at ~570 MB. Here the file is read in
blocks (gunzipped on the fly), and the array is cut into ~1 MB slices at candidate
boundaries between two events (``}`` ``,`` ``{``), each slice parsed by orjson as its
own array and reduced at once to columns (:class:`EventColumns`): the dicts of one slice
are all that is alive at a time. A candidate boundary that lies inside a string or a
nested object leaves the slice unbalanced, so its parse fails and the next candidate is
tried; the end of the array is found the same way, from the end of the file, by
requiring the document's remainder (its other keys) to parse too. Whatever does not fit
this shape (a key order, a NaN literal that orjson refuses, a corrupt file) goes to the
whole-document parse (orjson, then the standard library for its error messages), which
is exact but holds every event. The garbage collector is paused meanwhile: the parse
allocates millions of containers and none of them forms a cycle.
"""

from __future__ import annotations

import gc
import json
import re
import zlib
from collections import defaultdict
from collections.abc import Iterator
from itertools import count
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pandas as pd

from autotune.analysis._errors import TraceError

EVENT_COLUMNS = ["name", "cat", "pid", "tid", "ts", "dur", "end", "correlation"]
MEMORY_COLUMNS = ["ts", "total_allocated", "total_reserved", "device_type"]
"""``total_reserved`` (what the caching allocator held, ``Total Reserved``) is NaN where an event lacks it."""
CHUNK_BYTES = 1 << 20
"""Size of the JSON slice parsed at once (its events take ~10x that as Python objects)."""
_READ_BYTES = 4 << 20
_GZIP_MAGIC = b"\x1f\x8b"
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_BETWEEN_EVENTS = re.compile(rb"\}\s*,\s*\{")
_MAX_TRIES = 8
"""Failed candidate boundaries in a row before giving up on streaming (then: whole-document parse)."""
_HEADER_LIMIT = 64 << 20
_EMPTY: dict[str, Any] = {}
_CODED = ("name", "cat", "pid", "tid")
_FIELDS = itemgetter("name", "cat", "pid", "tid", "ts", "dur")
_HOST_CATS = frozenset({"cpu_op", "user_annotation", "python_function", "Trace", "cpu_instant_event", "fwdbwd"})
"""Categories of host-side events, which carry no kernel-launch ``correlation``."""


def _open(path: Path):
    try:
        return path.open("rb")
    except FileNotFoundError:
        raise TraceError(path, "no such file") from None
    except OSError as e:
        raise TraceError(path, f"cannot read ({e.strerror})") from None


def _gunzip(path: Path, data: bytes, f: Any) -> Iterator[bytes]:
    decompressor, produced = zlib.decompressobj(31), False
    try:
        while True:
            while data:
                out = decompressor.decompress(data, _READ_BYTES)
                data = decompressor.unconsumed_tail
                if out:
                    produced = True
                    yield out
                if decompressor.eof:
                    data = decompressor.unused_data + data
                    if not data.strip(b"\x00"):
                        data = b""
                        break
                    decompressor = zlib.decompressobj(31)  # a second gzip member
            more = f.read(_READ_BYTES)
            if not more:
                break
            data = more
        rest = decompressor.flush()
    except zlib.error as e:
        raise TraceError(path, f"truncated or corrupt gzip data ({e})") from None
    if rest:
        produced = True
        yield rest
    if not decompressor.eof:
        raise TraceError(path, "truncated or corrupt gzip data (the compressed stream ends early)")
    if not produced:
        raise TraceError(path, "empty trace inside the gzip file")


def iter_blocks(path: Path) -> Iterator[bytes]:
    """The file's bytes (gunzipped when it starts with the gzip magic), in blocks of ~4 MB."""
    with _open(path) as f:
        try:
            first = f.read(_READ_BYTES)
        except OSError as e:
            raise TraceError(path, f"cannot read ({e.strerror})") from None
        if not first:
            raise TraceError(path, "empty file (the profiler did not finish writing it?)")
        if first[:2] == _GZIP_MAGIC:
            yield from _gunzip(path, first, f)
            return
        while first:
            yield first
            first = f.read(_READ_BYTES)


def parse_document(path: Path) -> Any:
    """The whole file as one JSON document (orjson; the standard library for NaN and its error messages)."""
    raw = b"".join(iter_blocks(path))
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise TraceError(path, "not a JSON trace (binary content)") from None
    except json.JSONDecodeError as e:
        hint = "truncated" if e.pos >= len(raw.rstrip()) - 1 else "not valid JSON"
        raise TraceError(path, f"{hint}: {e.msg} at line {e.lineno} column {e.colno}") from None


def _loads(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def _finish(rest: bytes, prefix: bytes | None, sink: EventColumns) -> dict[str, Any] | None:
    """The last events and the document's other keys: ``rest`` is everything after the last slice."""
    end = len(rest)
    for _ in range(_MAX_TRIES):
        close = rest.rfind(b"]", 0, end)
        if close < 0:
            return None
        end, tail = close, rest[close + 1 :]
        if prefix is None:
            header = {} if not tail.strip() else None
        else:
            header = _loads(prefix + b"[]" + tail)
        if isinstance(header, dict):
            events = _loads(b"[" + rest[:close] + b"]")
            if isinstance(events, list):
                sink.add(events)
                return header
    return None


def _stream(path: Path, sink: EventColumns) -> dict[str, Any] | None:
    """Feed the events to ``sink`` slice by slice; the document's other keys, or None if it does not stream."""
    blocks = iter_blocks(path)
    buf, prefix, pos = b"", None, -1
    for block in blocks:
        buf += block
        start = len(buf) - len(buf.lstrip())
        if buf[start : start + 1] == b"[":  # the bare-array form
            pos = start + 1
            break
        match = _EVENTS_KEY.search(buf)
        if match is not None:
            prefix, pos = buf[: match.end() - 1], match.end()
            break
        if len(buf) > _HEADER_LIMIT:
            return None
    if pos < 0:
        return None
    search_from, tries = pos + CHUNK_BYTES, 0
    while True:
        boundary = _BETWEEN_EVENTS.search(buf, search_from)
        if boundary is None:
            block = next(blocks, None)
            if block is None:
                return _finish(buf[pos:], prefix, sink)
            buf, search_from, pos = buf[pos:] + block, search_from - pos, 0
            continue
        events = _loads(b"[" + buf[pos : boundary.start() + 1] + b"]")
        if not isinstance(events, list):
            tries += 1
            if tries > _MAX_TRIES:
                return None
            search_from = boundary.end() - 1
            continue
        sink.add(events)
        del events  # before the next slice is parsed: one slice's objects alive at a time
        pos = boundary.end() - 1
        search_from, tries = pos + CHUNK_BYTES, 0


def read_events(path: Path) -> tuple[dict[str, Any], EventColumns]:
    """The document's keys other than ``traceEvents``, and its events as columns.

    Raises :class:`TraceError` (one line) for a missing, empty, corrupt or non-trace file.
    """
    paused = gc.isenabled()
    gc.disable()
    try:
        sink = EventColumns(path)
        header = _stream(path, sink)
        if header is not None:
            header.pop("traceEvents", None)
            return header, sink
        doc = parse_document(path)
        if isinstance(doc, list):  # the bare-array form of the chrome trace format
            doc = {"traceEvents": doc}
        if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
            raise TraceError(path, "not a torch.profiler chrome trace (no 'traceEvents' list)")
        sink = EventColumns(path)
        sink.add(doc.pop("traceEvents"))
        return doc, sink
    finally:
        if paused:
            gc.enable()


def _categorical(codes: np.ndarray, lookup: dict[Any, int], *, as_str: bool) -> pd.Categorical:
    """Codes into ``lookup``'s keys as a categorical (keys as str for names; None as missing)."""
    values = [str(k) if as_str and not isinstance(k, str) else k for k in lookup]
    unique = list(dict.fromkeys(v for v in values if v is not None))
    if len(unique) == len(values):
        return pd.Categorical.from_codes(codes, categories=pd.Index(values, dtype=object))
    position = {v: i for i, v in enumerate(unique)}
    remap = np.array([position[v] if v is not None else -1 for v in values], dtype=np.int32)
    return pd.Categorical.from_codes(remap[codes], categories=pd.Index(unique, dtype=object))


class EventColumns:
    """Complete (``ph: X``) events as columns, ``[memory]`` events and thread names, slice by slice.

    Per slice: the complete events' fields are read with one C-level ``itemgetter`` per event
    and transposed by ``zip``; names, categories, pids and tids become integer codes (a
    ``defaultdict`` numbering each distinct value on first sight) and times float arrays, so
    nothing per event outlives the slice. ``correlation`` (the kernel-launch link) is read
    only for device-side and runtime events: CPU ops carry none.
    """

    def __init__(self, path: Path):
        self.path = path
        self._lookups: dict[str, defaultdict[Any, int]] = {c: defaultdict(count().__next__) for c in _CODED}
        self._parts: dict[str, list[np.ndarray]] = {c: [] for c in (*_CODED, "ts", "dur", "correlation")}
        self._memory: list[tuple[float, float, float, int]] = []
        self.thread_names: dict[tuple[Any, Any], str] = {}

    def add(self, events: list[Any]) -> None:
        """Reduce one slice of parsed events to columns (the dicts can be freed afterwards)."""
        spans = [e for e in events if e.__class__ is dict and e.get("ph") == "X"]
        try:
            try:
                fields = list(zip(*map(_FIELDS, spans))) or [()] * 6
            except KeyError:  # a field missing somewhere: read each with its default
                spans = [e for e in spans if "ts" in e and "dur" in e]
                fields = [
                    [e.get(c, d) for e in spans] for c, d in (("name", ""), ("cat", ""), ("pid", None), ("tid", None))
                ]
                fields += [[e["ts"] for e in spans], [e["dur"] for e in spans]]
            for column, values in zip(_CODED, fields):
                lookup = self._lookups[column]
                self._parts[column].append(
                    np.fromiter(map(lookup.__getitem__, values), dtype=np.int32, count=len(values))
                )
            self._parts["ts"].append(np.array(fields[4], dtype=np.float64))
            self._parts["dur"].append(np.array(fields[5], dtype=np.float64))
            self._parts["correlation"].append(self._correlations(spans, self._parts["cat"][-1]))
        except (TypeError, ValueError, AttributeError, OverflowError) as e:
            raise TraceError(self.path, f"an event has a malformed field ({type(e).__name__}: {e})") from None
        for e in events:
            if e.__class__ is not dict or e.get("ph") not in ("i", "M"):
                continue
            args = e.get("args") or _EMPTY
            if e["ph"] == "i" and e.get("name") == "[memory]" and "Total Allocated" in args:
                reserved = float(args.get("Total Reserved", "nan"))
                self._memory.append(
                    (float(e["ts"]), float(args["Total Allocated"]), reserved, int(args.get("Device Type", 0)))
                )
            elif e["ph"] == "M" and e.get("name") == "thread_name":
                self.thread_names[(e.get("pid"), e.get("tid"))] = str(args.get("name", ""))

    def _correlations(self, spans: list[dict[str, Any]], cat_codes: np.ndarray) -> np.ndarray:
        out = np.full(len(spans), -1, dtype=np.int64)
        host_only = [code for cat, code in self._lookups["cat"].items() if cat in _HOST_CATS]
        rows = np.flatnonzero(~np.isin(cat_codes, host_only))
        if len(rows):
            out[rows] = [(spans[i].get("args") or _EMPTY).get("correlation", -1) for i in rows.tolist()]
        return out

    def to_frames(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """``(events, memory)``: columns :data:`EVENT_COLUMNS` (name, cat, pid, tid categorical) and :data:`MEMORY_COLUMNS`."""
        joined = {c: np.concatenate(p) if p else np.empty(0) for c, p in self._parts.items()}
        columns: dict[str, Any] = {
            c: _categorical(joined[c].astype(np.int32), self._lookups[c], as_str=c in ("name", "cat")) for c in _CODED
        }
        columns["ts"], columns["dur"] = joined["ts"].astype(np.float64), joined["dur"].astype(np.float64)
        columns["end"] = columns["ts"] + columns["dur"]
        columns["correlation"] = joined["correlation"].astype(np.int64)
        self._parts = {c: [] for c in self._parts}
        memory = pd.DataFrame.from_records(self._memory, columns=MEMORY_COLUMNS)
        return pd.DataFrame(columns, columns=EVENT_COLUMNS), memory
