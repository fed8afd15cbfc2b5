"""Versioned JSON artifacts: every JSON file autotune writes is read and written here.

[Note: artifacts]
Each artifact (``metrics.json`` of a trial, ``search.json`` of a search, a trial spec, ``plan.json``,
``compare.json``) is a
dataclass in the stage that produces it, with a ``KIND`` and a ``SCHEMA_VERSION``; its
``to_dict()`` carries both, and its ``read(path)`` goes through :func:`read_artifact`,
which refuses, with one line naming the file:

- a file that is not UTF-8 JSON, or not an object;
- another kind (``search.json`` handed to the metrics reader);
- a newer ``schema_version`` than this code knows (written by a newer fsdp-autotune).

An older version is upgraded step by step by the artifact's ``MIGRATIONS`` (version ``v``
-> ``v + 1``), so run dirs written by earlier releases stay readable; the committed
fixtures under ``tests/data/artifacts/`` prove it for each released version.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fsdp_runtime.errors import AutotuneError
from fsdp_runtime.files import write_json_atomic

__all__ = [
    "ArtifactError",
    "Migration",
    "build_dataclass",
    "check_artifact",
    "get_added_field_migrations",
    "read_artifact",
    "write_artifact",
]

Migration = Callable[[dict[str, Any]], dict[str, Any]]


class ArtifactError(AutotuneError):
    """An artifact file is unreadable, of another kind, or from a newer schema."""


def _unchanged(data: dict[str, Any]) -> dict[str, Any]:
    return data


def get_added_field_migrations(*versions: int) -> dict[int, Migration]:
    """The migrations of ``versions`` whose next version only added fields with defaults: the data
    as it is (the dataclass fills the new fields in)."""
    return dict.fromkeys(versions, _unchanged)


def check_artifact(
    data: Any, *, kind: str, version: int, migrations: Mapping[int, Migration] | None = None, source: str
) -> dict[str, Any]:
    """``data`` upgraded to ``version``, after checking it is a ``kind`` artifact not newer than ``version``."""
    if not isinstance(data, dict):
        raise ArtifactError(f"{source}: not a {kind} file (a JSON {type(data).__name__}, expected an object)")
    found_kind, found_version = data.get("kind"), data.get("schema_version")
    if found_kind != kind:
        raise ArtifactError(f"{source}: not a {kind} file (kind is {found_kind!r})")
    if isinstance(found_version, bool) or not isinstance(found_version, int) or found_version < 1:
        raise ArtifactError(f"{source}: schema_version must be a positive integer, got {found_version!r}")
    if found_version > version:
        raise ArtifactError(
            f"{source}: {kind} schema_version {found_version} is newer than this fsdp-autotune reads ({version}); upgrade fsdp-autotune"
        )
    migrations = migrations or {}
    while data["schema_version"] < version:
        step = migrations.get(data["schema_version"])
        if step is None:
            raise ArtifactError(
                f"{source}: {kind} schema_version {data['schema_version']} is no longer readable (oldest supported: {min(migrations, default=version)})"
            )
        data = {**step(data), "schema_version": data["schema_version"] + 1}
    return data


def read_artifact(
    path: str | Path, *, kind: str, version: int, migrations: Mapping[int, Migration] | None = None
) -> dict[str, Any]:
    """The JSON object in ``path``, checked and upgraded by :func:`check_artifact`."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such file") from None
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ArtifactError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    return check_artifact(data, kind=kind, version=version, migrations=migrations, source=str(path))


def write_artifact(path: str | Path, data: dict[str, Any]) -> Path:
    """Write an artifact's ``to_dict()`` atomically (it must carry ``kind`` and ``schema_version``)."""
    if "kind" not in data or "schema_version" not in data:
        raise ValueError("an artifact needs 'kind' and 'schema_version'")
    return write_json_atomic(path, data)


def build_dataclass(cls: type, data: Any, *, source: str, what: str) -> Any:
    """``cls(**data)``, refusing a non-object, an unknown field or a missing one with one line."""
    import dataclasses

    if not isinstance(data, dict):
        raise ArtifactError(f"{source}: {what} must be a JSON object, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ArtifactError(f"{source}: unknown field {unknown[0]!r} in {what}")
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.init
    ]
    missing = [n for n in required if n not in data]
    if missing:
        raise ArtifactError(f"{source}: missing field {missing[0]!r} in {what}")
    return cls(**data)
