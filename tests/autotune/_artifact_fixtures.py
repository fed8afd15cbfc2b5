"""Shared by the artifact tests: the committed fixtures under ``tests/data/artifacts/``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _fixtures import DATA

ARTIFACTS = DATA / "artifacts"


def load_fixture(name: str) -> dict[str, Any]:
    path = ARTIFACTS / name
    if not path.exists():
        pytest.fail(f"fixture {path} is missing (see tests/data/artifacts/README.md)", pytrace=False)
    return json.loads(path.read_text(encoding="utf-8"))


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")
    return path


def assert_refused(excinfo: pytest.ExceptionInfo, path: Path, *fragments: str) -> None:
    """One line, naming the file first, holding every fragment."""
    message = str(excinfo.value)
    assert "\n" not in message, message
    assert message.startswith(f"{path}:"), message
    for fragment in fragments:
        assert fragment in message, message
