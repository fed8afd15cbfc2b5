"""A throwaway PostgreSQL server for tests (``postgres_server``, a module-scoped fixture).

The server binaries come from Debian's ``postgresql`` package (``/usr/lib/postgresql/*/bin``);
where there are none the tests that use the fixture skip, saying so (fail under
``AUTOTUNE_REQUIRE_ALL=1``, as in CI: :mod:`_required`). Data and unix-socket
dirs live in one temp dir, the server listens on a free port of 127.0.0.1 with trust auth
(nothing outside this host can reach it), as the ``postgres`` system user when we are root
(the server refuses to run as root). Every step has a hard time limit; the server is stopped
(``pg_ctl stop -m immediate``, then SIGKILL of its whole process group) and its dir removed at
the end, whatever happened.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from _required import skip_unless_required

START_TIMEOUT_S = 60.0
"""initdb plus start-up until the server accepts connections (a few seconds when idle)."""


def find_server_bin() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` holding initdb, postgres and pg_ctl."""
    found = [Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/postgres")]
    found = [d for d in found if all((d / name).exists() for name in ("initdb", "pg_ctl"))]
    return max(found, key=lambda d: int(d.parent.name) if d.parent.name.isdigit() else 0, default=None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PostgresServer:
    port: int
    root: Path
    bin_dir: Path
    run_as: list[str]
    """The command prefix that runs a server binary as the server's user (empty when we are not root)."""
    log: Path
    process: subprocess.Popen | None = None

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """A new empty database; returns its SQLAlchemy URL."""
        import psycopg

        with psycopg.connect(
            host="127.0.0.1", port=self.port, user="postgres", dbname="postgres", autocommit=True, connect_timeout=10
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def log_tail(self, num_lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return ""


def run_limited(cmd: list[str], *, timeout_s: float, what: str) -> subprocess.CompletedProcess:
    """``subprocess.run`` whose time limit kills the command's whole process group."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{what} took over {timeout_s} s: {out[-1000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def _wait_ready(server: PostgresServer, deadline: float) -> None:
    import psycopg

    while True:
        if server.process is not None and server.process.poll() is not None:
            raise AssertionError(f"postgres exited with {server.process.returncode} on start-up:\n{server.log_tail()}")
        try:
            psycopg.connect(
                host="127.0.0.1", port=server.port, user="postgres", dbname="postgres", connect_timeout=2
            ).close()
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"postgres did not accept connections within {START_TIMEOUT_S} s:\n{server.log_tail()}"
                ) from None
            time.sleep(0.2)


def _start(server: PostgresServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    data, sockets = server.root / "data", server.root / "sockets"
    init = run_limited(
        [
            *server.run_as,
            str(server.bin_dir / "initdb"),
            "-D",
            str(data),
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
        ],
        timeout_s=START_TIMEOUT_S,
        what="initdb",
    )
    assert init.returncode == 0, f"initdb failed: {init.stdout[-1500:]}"
    settings = {
        "listen_addresses": "127.0.0.1",
        "port": str(server.port),
        "unix_socket_directories": str(sockets),
        "fsync": "off",
        "synchronous_commit": "off",
        "full_page_writes": "off",
        "max_connections": "40",
        "shared_buffers": "16MB",
    }
    args = [arg for key, value in settings.items() for arg in ("-c", f"{key}={value}")]
    log = open(server.log, "ab")
    # Started directly (not with pg_ctl start) so the server is a child in a process group of ours.
    server.process = subprocess.Popen(
        [*server.run_as, str(server.bin_dir / "postgres"), "-D", str(data), *args],
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    log.close()
    _wait_ready(server, deadline)


def _stop(server: PostgresServer) -> None:
    if server.process is None:
        return
    if server.process.poll() is None:
        try:
            run_limited(
                [
                    *server.run_as,
                    str(server.bin_dir / "pg_ctl"),
                    "stop",
                    "-D",
                    str(server.root / "data"),
                    "-m",
                    "immediate",
                    "-w",
                    "-t",
                    "10",
                ],
                timeout_s=20,
                what="pg_ctl stop",
            )
        except AssertionError:
            pass  # the group kill below ends it
    try:
        os.killpg(server.process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.process.wait(timeout=30)


@pytest.fixture(scope="module")
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server for this test module, stopped and removed at its end."""
    bin_dir = find_server_bin()
    if bin_dir is None:
        skip_unless_required(
            "no PostgreSQL server binaries (initdb, postgres, pg_ctl) under /usr/lib/postgresql/*/bin: apt-get install postgresql"
        )
    try:
        import psycopg  # noqa: F401
    except ImportError:
        skip_unless_required("psycopg is not installed: pip install 'fsdp-autotune[postgres]'")
    run_as: list[str] = []
    owner = None
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            skip_unless_required(
                "running as root and there is no 'postgres' system user to run the server as (it refuses root)"
            )
        run_as = ["runuser", "-u", "postgres", "--"]
    root = Path(tempfile.mkdtemp(prefix="autotune-pg-"))  # short: a unix socket path has ~100 characters
    server = PostgresServer(port=_free_port(), root=root, bin_dir=bin_dir, run_as=run_as, log=root / "server.log")
    try:
        (root / "sockets").mkdir()
        if owner is not None:
            for path in (root, root / "sockets"):
                os.chown(path, owner.pw_uid, owner.pw_gid)
        _start(server)
        yield server
    finally:
        try:
            _stop(server)
        finally:
            shutil.rmtree(root, ignore_errors=True)
