"""Shared fixtures of the autotune tests; puts ``tests/autotune`` (the ``_*`` helpers) on ``sys.path``,
which the launchers pass on to the ranks, for the tests in its stage folders."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autotune.trials import RankPool

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(scope="session")
def pool2():
    """One 2-rank gloo pool for every test that may reuse ranks (start-up paid once)."""
    with RankPool(2) as pool:
        yield pool
