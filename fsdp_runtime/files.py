"""Atomic file writes: the one helper every writer in the project uses.

A reader never sees a half-written file: data goes to a temp file in the same directory
and is renamed over the target. Temp names are unique per call (``mkstemp``), so two
processes writing into one directory (two search workers sharing ``--out``, ranks of one
trial) never collide on a temp file; the last rename wins whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A unique temp path beside ``path`` with the same suffixes (``.json.gz`` stays ``.json.gz``,
    for writers that pick a format by name); renamed onto ``path`` when the block succeeds,
    removed when it raises."""
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.stem.split('.')[0]}.", suffix="".join(path.suffixes) + ".tmp"
    )
    os.close(fd)
    tmp = Path(tmp_name)
    # Writers that pick the format from the name need the real suffix last.
    named = tmp.with_name(tmp.name.removesuffix(".tmp"))
    try:
        yield named
        os.replace(named, path)
    finally:
        tmp.unlink(missing_ok=True)
        named.unlink(missing_ok=True)


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically; returns ``path``."""
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def write_json_atomic(path: str | Path, data: Any) -> Path:
    """``json.dumps(data, indent=2)`` to ``path`` atomically; returns ``path``."""
    return write_atomic(path, json.dumps(data, indent=2) + "\n")
