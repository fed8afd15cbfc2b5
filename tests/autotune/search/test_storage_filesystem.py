"""An SQLite study on a network file system is refused before anything is written; the mount
table that says so is planted ([Note: SQLite on a network file system] in autotune/search/mounts.py)."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from autotune.search import preflight
from autotune.search.mounts import get_existing_ancestor, get_mount, parse_mount_table, read_mount_table
from autotune.search.preflight import ALLOW_NETWORK_SQLITE_ENV, check_storage_filesystem, get_sqlite_path
from autotune.search.settings import SearchError, SearchSettings
from autotune.search.study import open_study

MOUNTINFO = """\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
40 22 0:45 / /shared rw,relatime shared:20 - nfs4 fs01:/export rw,vers=4.2
41 22 259:3 / /shared2 rw,relatime shared:21 - xfs /dev/nvme1n1 rw
42 40 0:46 / /shared/scratch rw,relatime - lustre 10.0.0.1@o2ib:/scratch rw,flock
43 22 0:47 / /home/a\\040b rw master:3 - cifs //nas/home rw
"""
PROC_MOUNTS = """\
/dev/sda1 / ext4 rw,relatime 0 0
fs01:/export /shared nfs rw,vers=3 0 0
"""


def test_the_mount_of_a_path_is_the_longest_mount_point_over_it():
    assert parse_mount_table(MOUNTINFO)[4] == ("/home/a b", "cifs")
    assert get_mount("/shared/runs/study.db", MOUNTINFO) == ("/shared", "nfs4")
    assert get_mount("/shared", MOUNTINFO) == ("/shared", "nfs4")
    assert get_mount("/shared2/study.db", MOUNTINFO) == ("/shared2", "xfs")  # not under /shared
    assert get_mount("/shared/scratch/x/study.db", MOUNTINFO) == ("/shared/scratch", "lustre")
    assert get_mount("/home/a b/study.db", MOUNTINFO) == ("/home/a b", "cifs")
    assert get_mount("/tmp/study.db", MOUNTINFO) == ("/", "ext4")
    assert get_mount("/shared/study.db", PROC_MOUNTS) == ("/shared", "nfs")
    # a mount over an earlier one at the same point is the one that counts
    assert get_mount("/shared/a", MOUNTINFO + "50 40 0:9 / /shared rw - tmpfs tmpfs rw\n") == ("/shared", "tmpfs")


def test_this_machines_mount_table_reads_and_a_new_file_lives_in_its_nearest_existing_dir(tmp_path):
    assert "/" in [point for point, _ in parse_mount_table(read_mount_table())]
    assert get_existing_ancestor(tmp_path / "not" / "yet" / "study.db") == str(tmp_path.resolve())


def test_only_sqlite_urls_name_a_database_file():
    assert get_sqlite_path("sqlite:////shared/runs/study.db") == "/shared/runs/study.db"
    assert get_sqlite_path("sqlite:///runs/study.db") == "runs/study.db"
    assert get_sqlite_path("sqlite:///file:/shared/s.db?mode=rwc&uri=true") == "/shared/s.db"
    assert [get_sqlite_path(u) for u in ("sqlite://", "journal:/shared/s.log", "postgresql+psycopg://u@h/db")] == [
        None
    ] * 3


@pytest.fixture
def shared(tmp_path, monkeypatch) -> Path:
    """``tmp_path/shared``, an NFS mount as far as the search can tell."""
    root = tmp_path.resolve()
    table = f"22 1 259:2 / / rw - ext4 /dev/sda1 rw\n40 22 0:45 / {root}/shared rw - nfs4 fs01:/export rw\n"
    monkeypatch.setattr(preflight, "read_mount_table", lambda: table)
    monkeypatch.delenv(ALLOW_NETWORK_SQLITE_ENV, raising=False)
    (root / "shared").mkdir()
    return root / "shared"


def _refused(result, *needles: str) -> str:
    lines = [ln for ln in result.stderr.strip().splitlines() if ln.strip()]
    assert result.returncode != 0 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


def test_a_search_refuses_the_default_sqlite_study_in_an_out_on_nfs(cli_main, shared):
    out = shared / "runs" / "llama"
    line = _refused(
        cli_main("search", "--model", "tiny", "--out", str(out)),
        f"--out: the SQLite study {out}/study.db would be on nfs4 ({shared}), a network file system",
        "--storage postgresql+psycopg://USER@HOST/DB or --storage journal:PATH, or --out on a local disk",
        f"{ALLOW_NETWORK_SQLITE_ENV}=1",
    )
    assert "error:" in line
    assert not (shared / "runs").exists()
    # the dry run says it too, before a run dir is made
    _refused(cli_main("search", "--model", "tiny", "--out", str(out), "--dry-run"), "would be on nfs4")
    assert not (shared / "runs").exists()


def test_a_search_refuses_an_sqlite_storage_on_nfs_and_takes_the_journal_there(cli_main, shared, tmp_path):
    out = tmp_path / "local"
    url = f"sqlite:///{shared}/study.db"
    _refused(
        cli_main("search", "--model", "tiny", "--out", str(out), "--storage", url),
        f"--storage: the SQLite study {shared}/study.db would be on nfs4",
    )
    assert not out.exists() and not (shared / "study.db").exists()
    check_storage_filesystem(f"journal:{shared}/study.log")
    check_storage_filesystem("postgresql+psycopg://tuner@dbhost/autotune")
    check_storage_filesystem(f"sqlite:///{tmp_path.resolve()}/local.db")  # ext4


def test_the_escape_hatch_lets_a_known_good_network_fs_through(shared, monkeypatch):
    url = f"sqlite:///{shared}/study.db"
    with pytest.raises(SearchError, match="would be on nfs4") as e:
        check_storage_filesystem(url)
    assert e.value.field == "storage"
    monkeypatch.setenv(ALLOW_NETWORK_SQLITE_ENV, "yes")  # only 1 opens it
    with pytest.raises(SearchError):
        check_storage_filesystem(url)
    monkeypatch.setenv(ALLOW_NETWORK_SQLITE_ENV, "1")
    check_storage_filesystem(url)


def test_a_journal_study_on_the_shared_dir_is_created_and_reloaded(shared, tmp_path):
    """What a second worker (another host on the same NFS path) does: open the study the first made."""
    url = f"journal:{shared}/study.log"
    first, created = open_study(SearchSettings(out_dir=tmp_path / "w0", model="tiny", storage=url), "s")
    trial = first.ask()
    first.tell(trial, 1.5)
    again, created_again = open_study(
        SearchSettings(out_dir=tmp_path / "w1", model="tiny", storage=url, resume=True), "s"
    )
    assert (created, created_again) == (True, False)
    assert [(t.state, t.value) for t in again.get_trials()] == [(optuna.trial.TrialState.COMPLETE, 1.5)]
