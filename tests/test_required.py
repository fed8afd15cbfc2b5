"""``_required``: a test whose tool is absent skips on a developer's box and fails in CI."""

from __future__ import annotations

import pytest
from _required import REQUIRE_ALL_ENV, skip_unless_required


def test_an_absent_tool_skips_with_its_reason(monkeypatch):
    monkeypatch.delenv(REQUIRE_ALL_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no chromium on PATH"):
        skip_unless_required("no chromium on PATH")


def test_an_absent_tool_fails_where_every_test_must_run(monkeypatch):
    monkeypatch.setenv(REQUIRE_ALL_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=r"no chromium on PATH \(AUTOTUNE_REQUIRE_ALL=1: every test"):
        skip_unless_required("no chromium on PATH")
