"""Loading traces fast without changing a figure: the streamed parse against the whole-document
parse ([Note: streaming parse] in ``autotune/analysis/_parse.py``), the vectorized interval
set operations and unit assignment against brute force, ranks of traces named anyhow.
"""

from __future__ import annotations

import gzip
import json

import numpy as np
import pandas as pd
import pytest
from _fixtures import get_fixture_traces
from _trace_builders import memory, span, step, trace, write

from autotune.analysis import FsdpTraceAnalysis, _parse
from autotune.analysis import _intervals as iv
from autotune.analysis._events import _assign_units
from autotune.analysis._load import load_trace


def test_traces_without_a_rank_take_the_free_ranks(tmp_path):
    named = write(
        tmp_path / "rank_0.json", {k: v for k, v in trace([step(1, 0, 10)]).items() if k != "distributedInfo"}
    )
    info = write(tmp_path / "b.json", trace([step(1, 0, 10)], rank=2))
    anonymous = write(
        tmp_path / "worker.pt.trace.json", {k: v for k, v in trace([step(1, 0, 10)]).items() if k != "distributedInfo"}
    )
    analysis = FsdpTraceAnalysis([anonymous, info, named])
    assert {r: t.path.name for r, t in analysis.traces.items()} == {
        0: "rank_0.json",
        1: "worker.pt.trace.json",
        2: "b.json",
    }
    assert [t.rank_source for t in analysis.traces.values()] == ["file name", "position", "distributedInfo"]


# --- parsing: streamed slices give what a whole-document parse gives --------------------


def _awkward_trace() -> dict:
    """Names holding what the slicer looks for; keys on both sides of traceEvents."""
    events = [
        step(1, 0, 1000),
        span('odd}, {"name": "x', 10, 20),
        span("aten::mm", 30, 40, **{"Input Dims": [[1, 2]], "note": "], }"}),
        memory(50, 123),
        *[span(f"aten::op{i}", 100 + i, 101 + i) for i in range(60)],
    ]
    doc = trace(events)
    return {
        "schemaVersion": 1,
        "traceEvents": doc["traceEvents"],
        "distributedInfo": doc["distributedInfo"],
        "traceName": "a ] b",
    }


@pytest.mark.parametrize("form", ["object", "bare array", "gzip, two members"])
def test_streamed_parse_equals_the_whole_document(tmp_path, monkeypatch, form):
    doc = _awkward_trace()
    raw = json.dumps(doc if form != "bare array" else doc["traceEvents"], indent=1).encode()
    path = tmp_path / ("t.json.gz" if form.startswith("gzip") else "t.json")
    path.write_bytes(gzip.compress(raw[:5000]) + gzip.compress(raw[5000:]) if form.startswith("gzip") else raw)
    monkeypatch.setattr(_parse, "CHUNK_BYTES", 300)  # many slices, most candidate cuts tried
    slices = []
    monkeypatch.setattr(
        _parse.EventColumns,
        "add",
        lambda self, events, add=_parse.EventColumns.add: (slices.append(len(events)), add(self, events)),
    )
    header, streamed = _parse.read_events(path)
    assert len(slices) > 5 and sum(slices) == len(doc["traceEvents"])
    whole = _parse.EventColumns(path)
    whole.add(doc["traceEvents"])
    got, expected = streamed.to_frames(), whole.to_frames()
    for a, b in zip(got, expected):
        assert a.astype(str).equals(b.astype(str))
    assert header.get("distributedInfo", {}).get("rank", 0) == 0 and "traceEvents" not in header
    if form == "object":
        assert header["traceName"] == "a ] b"


def test_a_document_that_does_not_stream_still_parses(tmp_path):
    text = json.dumps(trace([step(1, 0, 1000), span("aten::mm", 0, 10, flops=float("nan"))]))  # NaN: orjson refuses it
    assert "NaN" in text
    path = tmp_path / "t.json"
    path.write_text(text)
    assert len(load_trace(path).events) == 2


def test_kineto_layout_streams(monkeypatch):
    """The recorded fixture never needs the whole-document parse (the memory bound relies on it)."""

    def refuse(path):
        raise AssertionError(f"{path} fell back to the whole-document parse")

    monkeypatch.setattr(_parse, "parse_document", refuse)
    monkeypatch.setattr(_parse, "CHUNK_BYTES", 64 << 10)
    for path in get_fixture_traces("cpu_tiny_2rank"):
        assert _parse.read_events(path)[0]["distributedInfo"]["world_size"] == 2


# --- intervals and unit assignment against brute force ----------------------------------


def _random_set(rng, n: int) -> np.ndarray:
    starts = rng.integers(0, 200, n).astype(float)
    return iv.union(np.column_stack([starts, starts + rng.integers(0, 15, n)]))


def test_interval_set_operations_match_a_brute_force():
    rng = np.random.default_rng(0)
    grid = np.arange(0, 220, 0.5) + 0.25  # the sets' endpoints are integers: midpoints decide coverage
    for _ in range(200):
        a, b = _random_set(rng, rng.integers(0, 12)), _random_set(rng, rng.integers(0, 12))

        def covered(s):
            return np.array([((s[:, 0] <= x) & (x < s[:, 1])).any() for x in grid], dtype=bool)

        ca, cb = covered(a), covered(b)
        for op, expected in ((iv.subtract, ca & ~cb), (iv.intersect, ca & cb)):
            got = op(a, b)
            assert (covered(got) == expected).all()
            assert (got[:, 1] > got[:, 0]).all() and (got[1:, 0] > got[:-1, 1]).all()  # merged


def test_units_go_to_the_innermost_label_like_a_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(100):
        spans = []  # properly nested labels, some starting together, as record_function scopes are

        def scope(start, end, depth, spans=spans):
            spans.append((start, end, f"u{len(spans)}"))
            cursor = start + rng.integers(0, 2)
            while depth < 3 and cursor < end - 2 and rng.random() < 0.7:
                child_end = min(end, cursor + rng.integers(1, 10))
                scope(cursor, child_end, depth + 1)
                cursor = child_end + rng.integers(0, 3)

        for s in range(0, 100, 25):
            scope(float(s), float(s + rng.integers(5, 24)), 0)
        labels = pd.DataFrame(spans, columns=["start", "end", "unit"])
        times = rng.uniform(-5, 105, 50)
        expected = []
        for t in times:
            inside = [(s, -(e - s), i) for i, (s, e, _) in enumerate(spans) if s <= t < e]
            expected.append(spans[max(inside)[2]][2] if inside else None)  # latest start, then shortest, then inner
        assert _assign_units(times, labels) == expected
