"""Shared fixtures of the autotune tests."""

from __future__ import annotations

import pytest

from autotune.trials import RankPool


@pytest.fixture(scope="session")
def pool2():
    """One 2-rank gloo pool for every test that may reuse ranks (start-up paid once)."""
    with RankPool(2) as pool:
        yield pool
