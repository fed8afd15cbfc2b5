"""What a test needs from outside Python (a browser, a PostgreSQL server, an optional package).

On a developer's box a test whose tool is absent skips and says why. In CI (``.ci/run`` sets
``AUTOTUNE_REQUIRE_ALL=1``) it fails instead: a run that skipped them would pass without checking them.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

REQUIRE_ALL_ENV = "AUTOTUNE_REQUIRE_ALL"


def skip_unless_required(reason: str) -> NoReturn:
    """Skip with ``reason``; fail with it where ``AUTOTUNE_REQUIRE_ALL=1``."""
    if os.environ.get(REQUIRE_ALL_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ALL_ENV}=1: every test must run here)", pytrace=False)
    pytest.skip(reason)
