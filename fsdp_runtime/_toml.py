"""A minimal TOML writer for the config schema (reading uses stdlib ``tomllib``).

``fsdp_runtime`` must import with torch alone, so it cannot depend on ``tomli_w``.
The schema only ever holds tables, arrays of tables, strings, ints, floats, bools
and lists of those scalars, so this writer covers exactly that and raises on
anything else rather than guessing.
"""

from __future__ import annotations

import json
import math
from typing import Any


def _scalar(value: Any, path: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        # A JSON string literal is a valid TOML basic string.
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_scalar(v, f"{path}[]") for v in value) + "]"
    if isinstance(value, dict) and all(not isinstance(v, (dict, list)) for v in value.values()):
        inner = ", ".join(f"{_key(k)} = {_scalar(v, path + '.' + k)}" for k, v in value.items() if v is not None)
        return "{ " + inner + " }" if inner else "{}"
    raise TypeError(f"{path}: cannot write {type(value).__name__} to TOML")


def _key(key: str) -> str:
    if key and all(c.isalnum() or c in "-_" for c in key):
        return key
    return json.dumps(key)


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _emit_table(data: dict[str, Any], prefix: str, out: list[str]) -> None:
    scalars = {k: v for k, v in data.items() if v is not None and not isinstance(v, dict) and not _is_table_array(v)}
    for k, v in scalars.items():
        out.append(f"{_key(k)} = {_scalar(v, prefix + k)}")
    for k, v in data.items():
        name = f"{prefix}{_key(k)}"
        if isinstance(v, dict):
            out.append("")
            out.append(f"[{name}]")
            _emit_table(v, name + ".", out)
        elif _is_table_array(v):
            for item in v:
                out.append("")
                out.append(f"[[{name}]]")
                _emit_table(item, name + ".", out)


def dumps(data: dict[str, Any]) -> str:
    """``data`` as TOML text: nested dicts as tables, lists of dicts as arrays of tables, ``None``
    values left out (TOML has no null); a value the schema never holds raises ``TypeError`` naming its path."""
    out: list[str] = []
    _emit_table(data, "", out)
    return "\n".join(out).lstrip("\n") + "\n"
