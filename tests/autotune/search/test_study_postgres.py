"""Several workers on one study ([Note: study storages] in autotune/search/study.py): a real
PostgreSQL server (one study across workers, a killed worker's trial failed by heartbeat) and
Optuna's journal file; the one-host PID rule of SQLite and journal.

The server is a throwaway one (:mod:`_postgres`; the tests skip, saying why, where no server
binary exists, and fail there under ``AUTOTUNE_REQUIRE_ALL=1``, as in CI). Every subprocess has a hard wall-clock limit and is killed with its whole
process group, its ranks (sessions of their own) included; nothing here can hang CI.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from _postgres import postgres_server  # noqa: F401 (a fixture)

from autotune.search import SearchError, SearchSettings
from autotune.search.study import close_interrupted, get_worker_id, open_study

REPO = Path(__file__).resolve().parents[3]
FAST = ["--model", "tiny", "--confirm-pairs", "0", "--patience", "0", "--trial-timeout", "90", "--json"]
States = optuna.trial.TrialState
WORKER_TIMEOUT_S = 420


def _start(out: Path, *args: str) -> subprocess.Popen:
    """``autotune search`` as a worker process, its output in files (a full pipe would stall it)."""
    out.mkdir(parents=True)
    cmd = [sys.executable, "-c", "import cli; cli.main()", "search", *FAST, "--out", str(out), *args]
    with open(out.parent / f"{out.name}.stdout", "w") as stdout, open(out.parent / f"{out.name}.stderr", "w") as stderr:
        return subprocess.Popen(cmd, cwd=REPO, stdout=stdout, stderr=stderr, start_new_session=True)


def _rank_pids(parent: int) -> list[int]:
    """Live rank processes started by ``parent`` (each in a session of its own)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"autotune.trials.rank" in cmdline:
            pids.append(int(entry.name))
    return pids


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL to the worker's process group and to each of its ranks' (as if its host died)."""
    for pid in [*_rank_pids(proc.pid), proc.pid]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait(timeout=30)


def _wait_all(workers: list[subprocess.Popen], deadline: float) -> None:
    for w in workers:
        try:
            w.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def _wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception:  # the study may not exist yet
            value = None
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _stderr(out: Path) -> str:
    return (out.parent / f"{out.name}.stderr").read_text(errors="replace")[-2000:]


def _check_one_study(trials: list[optuna.trial.FrozenTrial], num_trials: int) -> None:
    """No trial duplicated or lost: contiguous numbers, one defaults trial, every trial
    finished, and each config measured once (a repeat is told the first one's result)."""
    numbers = sorted(t.number for t in trials)
    # Each worker checks the count before asking, so the study may overshoot by one per extra worker.
    assert num_trials <= len(trials) <= num_trials + 1 and numbers == list(range(len(trials))), numbers
    assert all(t.state.is_finished() for t in trials), [(t.number, t.state.name) for t in trials]
    assert sum(t.user_attrs.get("is_default", False) for t in trials) == 1
    ran = [t for t in trials if "duplicate_of" not in t.user_attrs and t.user_attrs.get("status") != "interrupted"]
    hashes = [t.user_attrs["config_hash"] for t in ran]
    assert len(set(hashes)) == len(hashes), [(t.number, t.params) for t in ran]
    assert all(
        t.user_attrs["duplicate_of"] in {r.number for r in ran} for t in trials if "duplicate_of" in t.user_attrs
    )
    assert len({t.user_attrs["worker"] for t in trials}) == 2


@pytest.mark.multirank
def test_two_workers_on_postgres_and_a_killed_workers_trial_failed_by_heartbeat(postgres_server, tmp_path):  # noqa: F811
    url = postgres_server.create_database("two_workers")
    num_trials = 4
    common = ["--trials", str(num_trials), "--storage", url, "--study-name", "shared", "--resume", "--heartbeat", "2"]
    workers = [_start(tmp_path / f"w{i}", *common) for i in range(2)]
    victim, survivor = workers
    reader: list[optuna.Study] = []

    def study() -> optuna.Study:
        if not reader:  # created once the workers made the schema: a reader must not race them for it
            storage = optuna.storages.RDBStorage(url, skip_table_creation=True, skip_compatibility_check=True)
            reader.append(optuna.load_study(study_name="shared", storage=storage))
        return reader[0]

    def victims_trial() -> optuna.trial.FrozenTrial | None:
        running = study().get_trials(deepcopy=False, states=(States.RUNNING,))
        mine = f"{socket.gethostname()}:{victim.pid}"
        return next(
            (
                t
                for t in running
                if t.user_attrs.get("worker") == mine
                and "trial_dir" in t.user_attrs
                and not t.user_attrs.get("is_default")
            ),
            None,
        )

    deadline = time.monotonic() + WORKER_TIMEOUT_S
    try:
        trial = _wait_until(victims_trial, 240, "a running trial of worker 0")
        # Killed at once: the trial's first heartbeat is recorded right after ask() (loop.run_one),
        # so even a worker killed before its heartbeat thread's first beat leaves no RUNNING trial.
        _kill_tree(victim)  # mid-trial: its ranks are at work
        try:
            failed = _wait_until(
                lambda: next(
                    t for t in study().get_trials(deepcopy=False) if t.number == trial.number and t.state == States.FAIL
                ),
                60,
                "the killed worker's trial to fail",
            )
        except AssertionError:
            states = [(t.number, t.state.name, t.user_attrs.get("worker")) for t in study().get_trials()]
            raise AssertionError(
                f"trial {trial.number} not failed: {states}; survivor rc {survivor.poll()}: {_stderr(tmp_path / 'w1')}"
            ) from None
        assert survivor.poll() is None, "the other worker ended before it failed the trial"
        _wait_all([survivor], deadline)
    finally:
        for w in workers:
            if w.poll() is None:
                _kill_tree(w)
    assert survivor.returncode == 0, _stderr(tmp_path / "w1")
    assert failed.user_attrs["status"] == "interrupted", failed.user_attrs
    assert f":{victim.pid} sent no heartbeat for 8 s" in failed.user_attrs["reason"], failed.user_attrs["reason"]
    trials = study().get_trials()
    _check_one_study(trials, num_trials)
    assert [t.number for t in trials if t.state == States.FAIL] == [trial.number]
    assert json.loads((tmp_path / "w1.stdout").read_text())["num_trials"] == len(trials)


def _journal_worker(url: str, out_dir: str, num: int, queue) -> None:
    """A worker process on a journal storage: opens the study as a search does, runs ``num`` trials."""
    settings = SearchSettings(model="tiny", out_dir=Path(out_dir), storage=url, study_name="shared", resume=True)
    study, created = open_study(settings, "shared")
    for _ in range(num):
        trial = study.ask()
        study.tell(trial, trial.suggest_float("x", 0.0, 1.0))
    queue.put((os.getpid(), created))


def test_two_worker_processes_share_a_journal_file(tmp_path):
    """The journal storage as ``open_study`` opens it, written by two processes at once: one
    creates the study, the other joins it, and every trial of both is kept with its own number.
    (The CLI path of two workers is tested on SQLite in test_search and on PostgreSQL above; this
    one tests the storage without ranks, so it costs seconds, not minutes.)"""
    import multiprocessing

    url = f"journal:{tmp_path / 'study.log'}"
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    workers = [ctx.Process(target=_journal_worker, args=(url, str(tmp_path / f"w{i}"), 5, queue)) for i in range(2)]
    for w in workers:
        w.start()
    try:
        for w in workers:
            w.join(timeout=120)
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
    assert [w.exitcode for w in workers] == [0, 0]
    created = [queue.get(timeout=5)[1] for _ in workers]
    assert sorted(created) == [False, True]
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(tmp_path / "study.log")))
    trials = optuna.load_study(study_name="shared", storage=storage).get_trials()
    assert sorted(t.number for t in trials) == list(range(10))
    assert all(t.state == States.COMPLETE for t in trials)


def test_a_silent_workers_trial_is_failed_and_a_beating_ones_kept(postgres_server, tmp_path):  # noqa: F811
    url = postgres_server.create_database("heartbeat")
    study, created = open_study(SearchSettings(out_dir=tmp_path, model="tiny", storage=url, heartbeat_s=1), "hb")
    assert created
    ours, theirs = study.ask(), study.ask()
    ours.set_user_attr("worker", get_worker_id())
    theirs.set_user_attr("worker", "elsewhere:1")
    other_host = optuna.storages.RDBStorage(url)
    for trial in (ours, theirs):  # one beat each; then only this worker's thread beats, for its own trial
        other_host.record_heartbeat(trial._trial_id)
    state = {}
    _wait_until(
        lambda: state.update({t.number: t for t in study.get_trials()}) or state[theirs.number].state == States.FAIL,
        20,
        "the silent trial to fail",
    )
    attrs = state[theirs.number].user_attrs
    assert attrs["status"] == "interrupted" and attrs["reason"].startswith(
        "worker elsewhere:1 sent no heartbeat for 4 s"
    ), attrs
    assert state[ours.number].state == States.RUNNING
    time.sleep(2)  # well past the grace period since its seeded beat
    close_interrupted(study)  # what a worker does when it opens the study: the same rule
    assert study.get_trials()[ours.number].state == States.RUNNING


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_one_host_storages_close_this_hosts_dead_workers_trials_by_pid(tmp_path, kind):
    storage = f"sqlite:///{tmp_path / 'study.db'}" if kind == "sqlite" else f"journal:{tmp_path / 'study.log'}"
    study, _ = open_study(SearchSettings(out_dir=tmp_path, model="tiny", storage=storage), "pid")
    gone = subprocess.Popen(["true"])
    gone.wait()
    here, elsewhere, alive = study.ask(), study.ask(), study.ask()
    here.set_user_attr("worker", f"{socket.gethostname()}:{gone.pid}")
    elsewhere.set_user_attr("worker", f"elsewhere:{gone.pid}")  # a PID says nothing about another host
    alive.set_user_attr("worker", get_worker_id())
    close_interrupted(study)
    trials = study.get_trials()
    assert [t.state for t in trials] == [States.FAIL, States.RUNNING, States.RUNNING]
    assert trials[0].user_attrs["status"] == "interrupted" and f":{gone.pid} died" in trials[0].user_attrs["reason"]


def test_storage_and_heartbeat_settings_are_checked_and_derived():
    with pytest.raises(SearchError, match="a journal storage needs a file: journal:PATH") as e:
        SearchSettings(storage="journal:")
    assert e.value.field == "storage"
    with pytest.raises(SearchError, match="heartbeat interval must be >= 1 s, got 0") as e:
        SearchSettings(heartbeat_s=0)
    assert e.value.field == "heartbeat_s"
    # A twentieth of the trial time limit, 5 to 60 s; a trial silent for 4 intervals is dead.
    assert [
        (SearchSettings(trial_timeout_s=t).get_heartbeat_s(), SearchSettings(trial_timeout_s=t).get_heartbeat_grace_s())
        for t in (30, 180, 3600)
    ] == [(5, 20), (9, 36), (60, 240)]
    assert SearchSettings(heartbeat_s=2).get_heartbeat_grace_s() == 8


def test_an_unusable_journal_file_is_one_line_naming_the_storage(tmp_path):
    with pytest.raises(
        SearchError,
        match=r"cannot open storage journal:/proc/nope/study.log: (FileNotFoundError|PermissionError|OSError)",
    ) as e:
        open_study(SearchSettings(out_dir=tmp_path, model="tiny", storage="journal:/proc/nope/study.log"), "s")
    assert e.value.field == "storage"
