"""Committed fixture traces under ``tests/data/<case>/``; a missing one fails the test loudly."""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data"


def get_fixture_traces(case: str) -> list[Path]:
    """The ``trace_rank*.json[.gz]`` files of a fixture case, in rank order."""
    folder = DATA / case
    traces = sorted(folder.glob("trace_rank*.json*"))
    if not traces:
        pytest.fail(
            f"fixture {folder} is missing or has no trace_rank*.json[.gz]: regenerate it "
            "(tools/record_traces.py for recorded CPU traces, tests/autotune/_trace_builders.py for the GPU one)",
            pytrace=False,
        )
    return traces
