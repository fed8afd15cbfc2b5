"""Runtime configs to and from dicts, TOML and JSON: strict, typed, with field paths in every error.

    from fsdp_runtime import load_config, save_config
    config = load_config("best.toml")      # or .json; validated
    save_config(config, "copy.json")       # atomic

Reading checks every value against the dataclass types of :mod:`fsdp_runtime.config`
(unknown fields, wrong types and newer schema versions are errors naming the field path)
and then runs :func:`~fsdp_runtime.validation.validate_config`. TOML has no null: unset
optional fields are omitted when writing and read back as ``None``, so both formats
round-trip losslessly.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from fsdp_runtime._toml import dumps as dumps_toml
from fsdp_runtime.config import SCHEMA_VERSION, PipelineConfig, RuntimeConfig
from fsdp_runtime.errors import ConfigError
from fsdp_runtime.files import write_atomic
from fsdp_runtime.knobs import get_added_knobs, get_knob
from fsdp_runtime.validation import validate_config

Format = Literal["toml", "json"]


_SCHEMA_2_UNIT_FIELDS = {"modules": None, "activation_checkpointing": "none"}


def config_to_dict(config: RuntimeConfig) -> dict[str, Any]:
    """The config as plain data, in the oldest schema version that holds it: a config that
    uses no schema-2 field (``units[].modules``, ``units[].activation_checkpointing``) is
    written as version 1, and one without pipeline stages (``mesh.pp`` 1) as at most version
    2, and one without the method knobs schema 4 added (all at FSDP2's defaults) as at most
    version 3, so configs (and the artifacts embedding them) that do not use the new knobs stay
    byte-identical and readable by older releases; one that does carries the version that
    holds it, which an older reader refuses with its "newer than this fsdp-autotune" error."""
    data = dataclasses.asdict(config)
    # Added to schema 1 with a default: written only when set, for the same reason.
    if data["unlisted_blocks"] == "error":
        del data["unlisted_blocks"]
    added = [knob.name for knob in get_added_knobs(4)]  # the method knobs schema 4 added, all config-scope
    if any(data[name] != get_knob(name).default for name in added):
        return data
    for name in added:
        del data[name]
    data["schema_version"] = 3
    if config.mesh.pp != 1 or config.pipeline != PipelineConfig():
        return data
    del data["pipeline"], data["mesh"]["pp"]
    data["schema_version"] = 2
    if all(unit.get(k) == default for unit in data["units"] for k, default in _SCHEMA_2_UNIT_FIELDS.items()):
        data["schema_version"] = 1
        for unit in data["units"]:
            for key in _SCHEMA_2_UNIT_FIELDS:
                del unit[key]
    return data


def config_from_dict(data: Any, *, source: str | None = None) -> RuntimeConfig:
    """The config that plain data (a parsed TOML or JSON file) describes, strictly checked: an older
    ``schema_version`` is migrated to the current one, a newer one, an unknown field or a wrong type
    raises :class:`~fsdp_runtime.ConfigError` naming the field path (prefixed with ``source``, a file
    name, where given), then :func:`~fsdp_runtime.validate_config` runs."""
    if not isinstance(data, dict):
        raise ConfigError("", f"expected a table at the top level, got {type(data).__name__}", source=source)
    if "schema_version" not in data:
        raise ConfigError("schema_version", "is missing", fix=f"add schema_version = {SCHEMA_VERSION}", source=source)
    version = data["schema_version"]
    if not isinstance(version, int) or isinstance(version, bool):
        raise ConfigError("schema_version", f"must be an integer, got {version!r}", source=source)
    if version > SCHEMA_VERSION:
        raise ConfigError(
            "schema_version",
            f"{version} is newer than this fsdp-autotune understands ({SCHEMA_VERSION})",
            fix="upgrade fsdp-autotune",
            source=source,
        )
    if version < 1:
        raise ConfigError(
            "schema_version",
            f"{version} was never a schema version",
            fix=f"use schema_version = {SCHEMA_VERSION}",
            source=source,
        )
    while version < SCHEMA_VERSION:
        data, version = {**_MIGRATIONS[version](data), "schema_version": version + 1}, version + 1
    config = _parse(RuntimeConfig, data, "", source)
    return validate_config(config, source=source)


def _migrate_v1(data: dict[str, Any]) -> dict[str, Any]:
    """v1 -> v2: v2 only added unit fields with defaults (``modules``, ``activation_checkpointing``)."""
    return data


def _migrate_v2(data: dict[str, Any]) -> dict[str, Any]:
    """v2 -> v3: v3 only added ``mesh.pp`` and the ``pipeline`` table, with defaults (no pipeline)."""
    return data


def _migrate_v3(data: dict[str, Any]) -> dict[str, Any]:
    """v3 -> v4: v4 only added method knobs (``fsdp_runtime.knobs``, ``schema`` 4), each with FSDP2's default."""
    return data


_MIGRATIONS = {1: _migrate_v1, 2: _migrate_v2, 3: _migrate_v3}
"""``{version: upgrade of a dict of that version to the next}``: every released version stays readable."""


def dumps_config(config: RuntimeConfig, fmt: Format) -> str:
    """``config`` validated and written as ``"toml"`` or ``"json"`` text (:func:`~fsdp_runtime.config_to_dict`'s
    data; TOML leaves unset optional fields out)."""
    validate_config(config)
    data = config_to_dict(config)
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    # TOML has no null: unset optional fields are omitted and read back as None.
    return dumps_toml(_drop_none(data))


def loads_config(text: str, fmt: Format, *, source: str | None = None) -> RuntimeConfig:
    """The config in ``text``, ``"toml"`` or ``"json"``, read by :func:`~fsdp_runtime.config_from_dict`;
    text that does not parse raises :class:`~fsdp_runtime.ConfigError` too."""
    try:
        data = json.loads(text) if fmt == "json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError("", f"not valid {fmt.upper()}: {e}", source=source) from None
    return config_from_dict(data, source=source)


def load_config(path: str | Path) -> RuntimeConfig:
    """Read a ``.toml`` or ``.json`` runtime config, strictly validated."""
    path = Path(path)
    fmt = _format_of(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError("", f"cannot read config: {e.strerror}", source=str(path)) from None
    except UnicodeDecodeError as e:
        raise ConfigError("", f"not UTF-8 text (byte {e.start}: {e.reason})", source=str(path)) from None
    return loads_config(text, fmt, source=str(path))


def save_config(config: RuntimeConfig, path: str | Path) -> Path:
    """Write atomically (temp file + rename): a failure never leaves a half-written config."""
    path = Path(path)
    text = dumps_config(config, _format_of(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, text)


def _format_of(path: Path) -> Format:
    suffix = path.suffix.lower()
    if suffix == ".toml":
        return "toml"
    if suffix == ".json":
        return "json"
    raise ConfigError("", f"unknown config format {suffix!r}", fix="use a .toml or .json file", source=str(path))


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


# ---------------------------------------------------------------------------
# Parsing a value against a schema type


def _parse(tp: Any, value: Any, path: str, source: str | None) -> Any:
    if dataclasses.is_dataclass(tp):
        return _parse_dataclass(tp, value, path, source)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _parse_union(args, value, path, source)
    if origin is Literal:
        if value not in args:
            raise ConfigError(path, f"{value!r} is not one of {', '.join(repr(a) for a in args)}", source=source)
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(path, f"expected a list, got {type(value).__name__}", source=source)
        return [_parse(args[0], v, f"{path}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a table, got {type(value).__name__}", source=source)
        return {str(k): _parse(args[1], v, _join(path, str(k)), source) for k, v in value.items()}
    return _parse_scalar(tp, value, path, source)


def _parse_dataclass(tp: Any, value: Any, path: str, source: str | None) -> Any:
    if not isinstance(value, dict):
        raise ConfigError(path or "<top>", f"expected a table, got {type(value).__name__}", source=source)
    hints = typing.get_type_hints(tp)
    fields = {f.name: f for f in dataclasses.fields(tp)}
    for key in value:
        if key not in fields:
            raise ConfigError(
                _join(path, key), "unknown field", fix=f"known fields: {', '.join(fields)}", source=source
            )
    kwargs = {}
    for name, f in fields.items():
        if name in value:
            kwargs[name] = _parse(hints[name], value[name], _join(path, name), source)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(_join(path, name), "is required", source=source)
    return tp(**kwargs)


def _parse_union(args: tuple[Any, ...], value: Any, path: str, source: str | None) -> Any:
    if value is None and type(None) in args:
        return None
    # bool is tried before int so that `true` stays a bool in `bool | int`.
    ordered = sorted((a for a in args if a is not type(None)), key=lambda a: a is not bool)
    for arg in ordered:
        try:
            return _parse(arg, value, path, source)
        except ConfigError:
            continue
    names = " or ".join(_type_name(a) for a in args)
    raise ConfigError(path, f"expected {names}, got {value!r}", source=source)


def _parse_scalar(tp: Any, value: Any, path: str, source: str | None) -> Any:
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true/false, got {value!r}", source=source)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {value!r}", source=source)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {value!r}", source=source)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}", source=source)
        return value
    raise TypeError(f"unsupported schema type {tp!r} at {path}")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "nothing"
    if typing.get_origin(tp) is list:
        return "a list"
    return getattr(tp, "__name__", str(tp))
