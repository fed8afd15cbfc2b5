"""Which file system a path is on, from the kernel's mount table (for the SQLite study's refusal).

[Note: SQLite on a network file system]
SQLite locks its file with ``fcntl()``. sqlite.org's FAQ (question 5) says this "might not work
correctly if the database file is kept on an NFS filesystem"; its page "How To Corrupt An SQLite
Database File" (2.1, filesystems with broken or missing lock implementations) says the same of
network file systems in general, and "SQLite Over a Network, Caveats and Considerations" advises a
client/server database over one file shared by several machines. Whether a cluster file system's
locks are coherent across hosts depends on how it is mounted (Lustre's ``flock`` against
``localflock``, BeeGFS's ``tuneUseGlobalFileLocks``), which a search cannot check. So a search
refuses an SQLite study on any of :data:`NETWORK_FS_TYPES` before it writes anything, and names
the storages that work there: PostgreSQL, or Optuna's journal file, whose default lock
(``JournalFileSymlinkLock``) Optuna documents for NFSv2 or later.
``AUTOTUNE_ALLOW_SQLITE_ON_NETWORK_FS=1`` lets it through, for a file system whose locks are known to work.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

NETWORK_FS_TYPES = frozenset(
    {
        # Network file systems: the kernel's type names (/proc/filesystems, mount(8)'s -t).
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "9p",
        "afs",
        "ncpfs",
        # Cluster and parallel file systems of HPC sites (their kernel module's type name).
        "lustre",
        "gpfs",
        "beegfs",
        "ceph",
        "glusterfs",
        "ocfs2",
        "gfs2",
        "orangefs",
        "pvfs2",
        # FUSE clients of the same (mount(8) shows them as fuse.SUBTYPE), and of remote stores.
        "fuse.sshfs",
        "fuse.glusterfs",
        "fuse.ceph-fuse",
        "fuse.s3fs",
        "fuse.gcsfuse",
        "fuse.rclone",
        "fuse.juicefs",
    }
)
"""File system types whose files processes on other hosts may lock ([Note: SQLite on a network file system])."""
_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """The kernel writes a space in a mount point as ``\\040`` (tab, newline, backslash alike)."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mount_table(text: str) -> list[tuple[str, str]]:
    """``(mount point, file system type)`` per mount, in the table's order, from the text of
    ``/proc/self/mountinfo`` (the type follows the ``-`` separator) or of ``/proc/mounts``."""
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        if "-" in fields[6:]:
            mounts.append((_unescape(fields[4]), fields[fields.index("-", 6) + 1]))
        elif len(fields) >= 3:
            mounts.append((_unescape(fields[1]), fields[2]))
    return mounts


def get_mount(path: str, mount_table: str) -> tuple[str, str] | None:
    """The mount ``(mount point, type)`` that holds the absolute, resolved ``path``: the longest mount
    point that is a prefix of it, by whole components; of equal ones the last (mounted on top)."""
    best = None
    for point, fs_type in parse_mount_table(mount_table):
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, fs_type)
    return best


def read_mount_table() -> str:
    """This process's mount table (``/proc/self/mountinfo``, else ``/proc/mounts``); empty where neither exists."""
    for name in ("/proc/self/mountinfo", "/proc/mounts"):
        try:
            return Path(name).read_text()
        except OSError:
            continue
    return ""


def get_existing_ancestor(path: Path) -> str:
    """``path``, else its nearest existing parent, resolved (symlinks followed): where a file not yet
    created will live."""
    path = Path(os.path.abspath(path))
    for candidate in [path, *path.parents]:
        if candidate.exists():
            return os.path.realpath(candidate)
    return str(path)
