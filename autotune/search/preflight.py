"""Checks a search makes before it creates or runs anything: a bad flag costs one line, not a run dir."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from autotune.search.mounts import NETWORK_FS_TYPES, get_existing_ancestor, get_mount, read_mount_table
from autotune.search.settings import SearchError, SearchSettings

_HSDP = re.compile(r"^hsdp:(\d+)x(\d+)$")
ALLOW_NETWORK_SQLITE_ENV = "AUTOTUNE_ALLOW_SQLITE_ON_NETWORK_FS"
"""Set to 1: an SQLite study on a network file system whose locks are known to work is let through."""


def check_mesh(mesh: str | None, world_size: int) -> None:
    """``fsdp`` or ``hsdp:RxS`` with R >= 2 replicas and R * S equal to the world size."""
    if mesh is None or mesh == "fsdp":
        return
    match = _HSDP.match(mesh)
    if match is None:
        raise SearchError(
            f"mesh {mesh!r} is neither 'fsdp' nor 'hsdp:RxS' (R replicas x S shards, e.g. hsdp:2x4)", field="fixed_mesh"
        )
    replicate, shard = int(match.group(1)), int(match.group(2))
    if replicate < 2 or shard < 1:
        raise SearchError(f"mesh {mesh!r} needs at least 2 replicas and 1 shard", field="fixed_mesh")
    if replicate * shard != world_size:
        raise SearchError(
            f"mesh {mesh!r} spans {replicate * shard} ranks but the world size is {world_size}", field="fixed_mesh"
        )


def check_out_dir(out_dir: Path) -> None:
    """The run dir exists or can be created, is a directory, and this process can write into it."""
    for parent in [out_dir, *out_dir.parents]:
        if parent.exists():
            if not parent.is_dir():
                where = "is a file" if parent == out_dir else f"is under {parent}, which is a file"
                raise SearchError(f"{out_dir} {where}", field="out_dir")
            break
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write-check-"):
            pass
    except OSError as e:
        raise SearchError(f"cannot write into {out_dir}: {e.strerror or e}", field="out_dir") from None


def check_storage_url(url: str) -> None:
    """A storage URL SQLAlchemy can parse, with a driver that imports (``journal:PATH`` is a file, not a URL)."""
    if url.startswith("journal:"):
        return
    import sqlalchemy.engine
    import sqlalchemy.exc

    try:
        sqlalchemy.engine.make_url(url).get_dialect()
    except (sqlalchemy.exc.ArgumentError, sqlalchemy.exc.NoSuchModuleError, ValueError, ImportError) as e:
        raise SearchError(
            f"not a usable storage URL {url!r} ({type(e).__name__}: {str(e).splitlines()[0]})", field="storage"
        ) from None


def get_sqlite_path(url: str) -> str | None:
    """The database file of an ``sqlite:`` URL (None: another storage, or an in-memory database)."""
    if not url.startswith("sqlite:"):
        return None
    import sqlalchemy.engine

    database = sqlalchemy.engine.make_url(url).database or ""
    database = database.removeprefix("file:").split("?")[0]
    return None if database in ("", ":memory:") else database


def check_storage_filesystem(url: str, *, field: str = "storage") -> None:
    """Refuse an SQLite study on a network file system ([Note: SQLite on a network file system] in
    :mod:`autotune.search.mounts`), unless :data:`ALLOW_NETWORK_SQLITE_ENV` is 1."""
    database = get_sqlite_path(url)
    if database is None or os.environ.get(ALLOW_NETWORK_SQLITE_ENV) == "1":
        return
    mount = get_mount(get_existing_ancestor(Path(database).expanduser()), read_mount_table())
    if mount is None or mount[1] not in NETWORK_FS_TYPES:
        return
    raise SearchError(
        f"the SQLite study {database} would be on {mount[1]} ({mount[0]}), a network file system where "
        "SQLite's locking is not safe: use --storage postgresql+psycopg://USER@HOST/DB or --storage journal:PATH, "
        f"or --out on a local disk ({ALLOW_NETWORK_SQLITE_ENV}=1 if its locks are known to work)",
        field=field,
    )


def check_model(model: str) -> int:
    """The model loads and builds on the meta device with repeated blocks (else one line naming
    ``model``); returns its number of blocks."""
    from profiles.sources import load_model_source

    return len(load_model_source(model).block_names)


def check_pipeline_degrees(degrees: tuple[int, ...], world_size: int, num_blocks: int) -> None:
    """Each degree asked for splits the world size and the blocks (else one line naming ``--pp``)."""
    for pp in degrees:
        if world_size % pp or num_blocks % pp:
            what = f"the world size {world_size}" if world_size % pp else f"the model's {num_blocks} blocks"
            raise SearchError(f"pipeline degree {pp} does not divide {what}", field="pipeline_degrees")


def preflight(settings: SearchSettings, *, num_blocks: int | None = None) -> None:
    """Everything that can be checked before the run dir and the study exist (``num_blocks``: the
    model's, where the caller loaded it already)."""
    if num_blocks is None:
        num_blocks = check_model(settings.model)
    check_mesh(settings.fixed_mesh, settings.world_size)
    check_pipeline_degrees(settings.pipeline_degrees, settings.world_size, num_blocks)
    if settings.fixed_mesh is not None and settings.pipeline_degrees != (1,):
        raise SearchError(
            "--mesh fixes the data-parallel mesh of the whole world; drop it to search pipeline degrees (--pp)",
            field="fixed_mesh",
        )
    if settings.storage is not None:
        check_storage_url(settings.storage)
    if settings.cluster is not None:
        from profiles import load_cluster_profile

        load_cluster_profile(settings.cluster)
    if settings.dry_run and settings.plan_for is not None:
        return  # the run dir is the GPU node's, not this box's
    check_storage_filesystem(settings.get_storage(), field="out_dir" if settings.storage is None else "storage")
    check_out_dir(settings.out_dir)
    if not os.access(settings.out_dir, os.W_OK):
        raise SearchError(f"cannot write into {settings.out_dir}", field="out_dir")
