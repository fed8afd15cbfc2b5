"""Faults injected into the real CLI (``autotune search`` as a subprocess) and bad input.

Each test asserts the exit code, the one-line message, and that the study still holds every
trial finished before the fault with its measurement. Every subprocess has a hard time limit
and is killed with its whole process group; nothing here can hang CI.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest

REPO = Path(__file__).resolve().parents[2]
FAST = ["--model", "tiny", "--confirm-pairs", "0", "--patience", "0", "--trial-timeout", "90"]
States = optuna.trial.TrialState


# Ctrl-C as Python's default, whatever the launching shell set: a shell runs a background job with
# SIGINT ignored, which Python then keeps, and the SIGINT test measured an uninterruptible search.
_MAIN = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); import cli; cli.main()"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", _MAIN, *args]


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        _cli(*args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _finish(proc: subprocess.Popen, timeout_s: float = 300) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _run(*args: str, timeout_s: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(_cli(*args), cwd=REPO, capture_output=True, text=True, timeout=timeout_s, **kw)


def _study(db: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{db}")


def _wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception:  # the study may be half-created by the worker right now
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _is_running(trial: optuna.trial.FrozenTrial, min_number: int = 0) -> bool:
    """RUNNING with its trial dir set (its ranks are at work)."""
    return trial.state == States.RUNNING and trial.number >= min_number and "trial_dir" in trial.user_attrs


def _running_trial(db: Path, name: str, *, min_number: int = 0) -> optuna.trial.FrozenTrial | None:
    """A running trial (:func:`_is_running`)."""
    return next((t for t in _study(db, name).get_trials(deepcopy=False) if _is_running(t, min_number)), None)


def _running_and_finished(db: Path, name: str) -> tuple[optuna.trial.FrozenTrial, dict[int, float]] | None:
    """From one read of the study: a running trial after the first and the finished trials'
    values; None while no such trial runs."""
    trials = _study(db, name).get_trials(deepcopy=False)
    running = next((t for t in trials if _is_running(t, min_number=1)), None)
    finished = {t.number: t.value for t in trials if t.state == States.COMPLETE}
    return (running, finished) if running is not None else None


def _rank_pids(parent: int) -> list[int]:
    """Live rank processes started by ``parent`` (``python -m autotune.trials.rank``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"autotune.trials.rank" in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def _one_line_error(stderr: str, *needles: str) -> None:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert lines and "Traceback" not in stderr, stderr
    assert all(n in lines[-1] for n in needles), lines[-1]


def _pool_temp_dirs(pid: int) -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"autotune-*-{pid}-*"))


# -- faults during a search -----------------------------------------------------------


@pytest.mark.multirank
def test_sigkill_of_a_rank_is_a_failed_trial_with_its_real_cause(tmp_path):
    proc = _start("search", *FAST, "--trials", "4", "--out", str(tmp_path), "--study-name", "k")
    db = tmp_path / "study.db"
    trial = _wait_until(lambda: _running_trial(db, "k", min_number=1), 150, "a running trial")
    victim = _wait_until(lambda: _rank_pids(proc.pid)[1:], 30, "the ranks")[0]
    os.kill(victim, signal.SIGKILL)
    out, err = _finish(proc)
    assert proc.returncode == 0, err[-2000:]
    trials = _study(db, "k").get_trials()
    failed = [t for t in trials if t.state == States.FAIL]
    assert len(failed) == 1 and failed[0].number >= trial.number, [
        (t.number, t.state, t.user_attrs.get("reason")) for t in trials
    ]
    reason = failed[0].user_attrs["reason"]
    assert "was killed by SIGKILL from outside the trial" in reason and "out of memory" not in reason, reason
    assert failed[0].user_attrs["status"] == "crash"
    assert sum(t.state == States.COMPLETE for t in trials) >= 2  # the search went on
    assert not _pool_temp_dirs(proc.pid)


@pytest.mark.multirank
def test_sigint_closes_the_running_trial_and_says_how_to_resume(tmp_path):
    proc = _start("search", *FAST, "--trials", "6", "--out", str(tmp_path), "--study-name", "i")
    db = tmp_path / "study.db"
    _wait_until(lambda: _study(db, "i").get_trials(states=(States.COMPLETE,)), 150, "a finished trial")
    ranks = _rank_pids(proc.pid)  # the pool's ranks, the same for every trial
    # The signal right after the running trial is seen: a trial on ``tiny`` that stops after one
    # block ([Note: futility]) lasts about a second, less than reading the process table took.
    running, finished = _wait_until(lambda: _running_and_finished(db, "i"), 60, "a running trial")
    proc.send_signal(signal.SIGINT)
    out, err = _finish(proc, timeout_s=60)
    assert proc.returncode == 130
    _one_line_error(err, "interrupted:", "kept in study 'i'", "--resume")
    trials = {t.number: t for t in _study(db, "i").get_trials()}
    assert trials[running.number].state == States.FAIL and trials[running.number].user_attrs["status"] == "interrupted"
    for number, value in finished.items():
        assert trials[number].value == value
    assert ranks and not [p for p in ranks if Path(f"/proc/{p}").exists()], "ranks outlived the search"
    assert not _pool_temp_dirs(proc.pid)
    assert (tmp_path / running.user_attrs["trial_dir"] / "INCOMPLETE").exists() or (
        tmp_path / running.user_attrs["trial_dir"] / "metrics.json"
    ).exists()


@pytest.mark.multirank
def test_sigkill_of_the_search_then_resume_keeps_every_finished_trial(tmp_path):
    args = ["search", *FAST, "--trials", "3", "--out", str(tmp_path), "--study-name", "r"]
    proc = _start(*args)
    db = tmp_path / "study.db"
    try:
        _wait_until(
            lambda: _study(db, "r").get_trials(states=(States.COMPLETE,)) and _running_trial(db, "r"),
            150,
            "one finished and one running trial",
        )
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    killed = _study(db, "r").get_trials()
    before = {t.number: t.value for t in killed if t.state == States.COMPLETE}
    running = {t.number for t in killed if t.state == States.RUNNING}
    assert before and running
    incomplete = [tmp_path / t.user_attrs["trial_dir"] for t in killed if t.number in running]
    assert all((d / "INCOMPLETE").exists() and not (d / "metrics.json").exists() for d in incomplete)
    done = _run(*args, "--resume", "--json", timeout_s=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["num_trials"] >= 3
    after = {t.number: t for t in _study(db, "r").get_trials()}
    for number, value in before.items():
        assert after[number].value == value, "a finished trial changed on resume"
    for number in running:  # the dead worker's trial is closed, with the reason
        assert after[number].state == States.FAIL and after[number].user_attrs["status"] == "interrupted"
        assert "died before the trial finished" in after[number].user_attrs["reason"]
    assert not _pool_temp_dirs(proc.pid), "the next run removes a killed run's rank temp dirs"


def _lock_when_told(db: Path) -> str:
    """``autotune search`` that locks its study DB just before the first result of trial 1 or
    later (COMPLETE or PRUNED: a measurement) is written, and holds the lock until it exits.

    The lock is taken by another SQLite connection (as another writer would hold it) at the
    one moment that matters, so every write of that result meets it."""
    return f"""
import sqlite3
import cli
from autotune.search import outcome
write, held = outcome._write, []
def write_under_lock(study, told):
    if not held and told.number >= 1 and told.state in ("COMPLETE", "PRUNED"):
        held.append(sqlite3.connect({str(db)!r}, timeout=60, isolation_level=None))
        held[0].execute("BEGIN EXCLUSIVE")
    write(study, told)
outcome._write = write_under_lock
cli.main()
"""


@pytest.mark.multirank
def test_a_study_locked_past_the_timeout_loses_no_measurement(tmp_path):
    args = ["search", *FAST, "--trials", "3", "--out", str(tmp_path), "--study-name", "l", "--storage-timeout", "1"]
    db = tmp_path / "study.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", _lock_when_told(db), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    out, err = _finish(proc, timeout_s=300)
    assert proc.returncode == 2, err[-2000:]
    _one_line_error(err, "--storage:", "unavailable", "is recorded by --resume")
    pending = list((tmp_path / "pending").glob("trial_*.json"))
    assert len(pending) == 1, pending
    kept = json.loads(pending[0].read_text())
    assert kept["number"] >= 1 and f"trial {kept['number']}'s result is kept in" in err
    assert kept["state"] in ("COMPLETE", "PRUNED") and kept["user_attrs"]["step_ms"] > 0
    told = {t.number: t for t in _study(db, "l").get_trials()}
    assert told[kept["number"]].state == States.RUNNING, "the locked write reached the study"
    assert all(told[n].state.is_finished() for n in range(kept["number"])), "an earlier trial was not recorded"
    done = _run(*args, "--resume", "--json", timeout_s=300)
    assert done.returncode == 0, done.stderr[-2000:]
    trial = next(t for t in _study(db, "l").get_trials() if t.number == kept["number"])
    assert trial.state.name == kept["state"] and trial.user_attrs["step_ms"] == kept["user_attrs"]["step_ms"]
    assert trial.value == kept["value"]
    assert not list((tmp_path / "pending").glob("trial_*.json"))
    assert all(t.state.is_finished() for t in _study(db, "l").get_trials())


# -- bad input: one line, non-zero exit, nothing created -------------------------------
# ``cli.main()`` in-process (``cli_main`` in tests/conftest.py: the same entry point as the
# console script, error mapping included): a subprocess per case would spend most of its time
# importing torch.


def _refused(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode != 0, result.stdout[-1000:]
    _one_line_error(result.stderr, *needles)


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--mesh", "hsdp:3x3"], ["--mesh:", "hsdp:3x3", "world size is 2"]),
        (["--mesh", "hsdp:axb"], ["--mesh:", "hsdp:axb"]),
        (["--sampler", "nope"], ["--sampler:", "nope"]),
        (["--storage", "nope://"], ["--storage:", "nope://"]),
        (["--nproc", "0"], ["--nproc:", "world size must be >= 1"]),
        (["--cluster", "nowhere"], ["nowhere"]),
        (["--pp", "1,3"], ["--pp:", "pipeline degree 3 does not divide the world size 2"]),
        (["--nproc", "3", "--pp", "3"], ["--pp:", "pipeline degree 3 does not divide the model's 4 blocks"]),
        (["--pp", "1,x"], ["--pp:", "must be integers"]),
        (["--pp", "2", "--mesh", "fsdp"], ["--mesh:", "drop it to search pipeline degrees"]),
    ],
)
def test_bad_flags_are_refused_before_anything_is_created(tmp_path, cli_main, args, needles):
    out = tmp_path / "run"
    _refused(cli_main("search", "--model", "tiny", "--out", str(out), *args), *needles)
    assert not out.exists()


def test_a_memory_budget_on_a_proxy_is_refused_before_anything_is_created(tmp_path, cli_main):
    """A proxy's peak memory is not the model's: the budget could only be checked against the wrong model."""
    out = tmp_path / "run"
    _refused(
        cli_main("search", "--model", "llama8b", "--memory-budget-gib", "4", "--out", str(out)),
        "--memory-budget-gib: llama8b runs as a scale proxy on this machine",
        "autotune plan --model llama8b --cluster h100-node",
    )
    assert not out.exists()


def test_out_that_is_a_file_or_under_one_is_refused(tmp_path, cli_main):
    (tmp_path / "file").write_text("x")
    _refused(cli_main("search", "--model", "tiny", "--out", str(tmp_path / "file")), "--out:", "is a file")
    _refused(
        cli_main("search", "--model", "tiny", "--out", str(tmp_path / "file" / "run")), "--out:", "which is a file"
    )


def test_read_only_out_is_refused(cli_main):
    parent = Path(tempfile.mkdtemp(prefix="autotune-ro-test-"))  # a place another user can reach
    try:
        os.chmod(parent, 0o755)
        out = parent / "ro"
        out.mkdir(mode=0o555)
        os.chmod(out, 0o555)
        model = parent / "tiny.toml"  # readable by the unprivileged user, wherever the repo lies
        shutil.copy(REPO / "profiles" / "models" / "tiny.toml", model)
        os.chmod(model, 0o644)
        # root writes anywhere: drop to nobody's effective uid so the permission bits count.
        as_root = os.geteuid() == 0
        if as_root:
            os.seteuid(65534)
        try:
            result = cli_main("search", "--model", str(model), "--out", str(out))
        finally:
            if as_root:
                os.seteuid(0)
        _refused(result, "--out:", "cannot write into", str(out))
        assert not list(out.iterdir())
    finally:
        os.chmod(parent / "ro", 0o755)
        shutil.rmtree(parent, ignore_errors=True)


def _bad_model(tmp_path: Path, **shape) -> Path:
    base = {
        "dim": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "ffn_hidden_dim": 128,
        "vocab_size": 256,
    } | shape
    body = 'name = "bad"\nseq_len = 16\nbatch_size = 1\n[shape]\n' + "".join(f"{k} = {v}\n" for k, v in base.items())
    path = tmp_path / "bad.toml"
    path.write_text(body)
    return path


@pytest.mark.parametrize(("field", "value"), [("dim", -64), ("num_layers", 0)])
def test_a_model_toml_with_a_bad_width_or_depth_is_refused(tmp_path, cli_main, field, value):
    path = _bad_model(tmp_path, **{field: value})
    _refused(
        cli_main("search", "--model", str(path), "--out", str(tmp_path / "run")),
        str(path),
        f"{field} must be a positive integer, got {value}",
    )
    assert not (tmp_path / "run").exists()


def test_files_that_are_not_utf8_name_the_file(tmp_path, cli_main):
    config = tmp_path / "cfg.toml"
    config.write_bytes(b"schema_version = 1\n# caf\xe9\n")
    _refused(cli_main("validate", str(config)), str(config), "not UTF-8")
    model = tmp_path / "model.toml"
    model.write_bytes(b'name = "m\xff"\n')
    _refused(cli_main("search", "--model", str(model), "--out", str(tmp_path / "run")), str(model), "not UTF-8")


def test_out_holding_another_models_study_is_refused(tmp_path, cli_main):
    optuna.create_study(study_name="small-w2-mb2", storage=f"sqlite:///{tmp_path / 'study.db'}")
    before = (tmp_path / "study.db").read_bytes()
    for extra in ([], ["--resume"]):
        _refused(
            cli_main("search", "--model", "tiny", "--out", str(tmp_path), *extra),
            "--out:",
            "already holds study 'small-w2-mb2'",
        )
    assert (tmp_path / "study.db").read_bytes() == before
    assert sqlite3.connect(tmp_path / "study.db").execute("select study_name from studies").fetchall() == [
        ("small-w2-mb2",)
    ]


def test_resume_of_a_study_run_with_other_settings_is_refused(tmp_path, cli_main):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="s", storage=storage)
    study.set_user_attr(
        "plan",
        {
            "model": "tiny",
            "world_size": 4,
            "num_microbatches": 2,
            "is_proxy": False,
            "reason": "fits",
            "overrides": {},
            "estimated_memory_per_rank": 1,
            "estimated_step_s": 0.1,
        },
    )
    _refused(
        cli_main("search", "--model", "tiny", "--out", str(tmp_path), "--study-name", "s", "--resume"),
        "study 's' was run with world_size=4",
    )


def test_a_search_where_no_trial_succeeded_exits_1(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import cli
    from autotune import pipeline
    from autotune.search import SearchRecord, SearchSummary, TrialRow

    def failed_search(settings, *, reporter=None):
        rows = [TrialRow(number=0, state="FAIL", status="crash", reason="rank 1 exited with 1: boom", is_default=True)]
        plan = SimpleNamespace(is_proxy=False, proxy_name=None, requested=SimpleNamespace(name="tiny"))
        record = SearchRecord(model="tiny", num_trials=1, stopped_because="reached 1 trials")
        return SearchSummary(out_dir=settings.out_dir, study_dir=settings.out_dir, plan=plan, rows=rows, record=record)

    monkeypatch.setattr(pipeline, "search_and_report", failed_search)
    result = CliRunner().invoke(cli.app, ["search", "--model", "tiny", "--out", str(tmp_path), "--trials", "1"])
    assert result.exit_code == 1
    assert "no trial succeeded (1 trials)" in result.output


def test_a_journal_write_failure_keeps_the_result_for_resume(tmp_path, monkeypatch):
    """A journal storage fails with OSError (disk full, NFS gone), not a database error: the
    outcome is kept in pending/ with a one-line error, and recorded when the storage is back."""
    from optuna.storages.journal import JournalFileBackend

    from autotune.search import SearchError
    from autotune.search.outcome import Outcome, apply_pending, record

    storage = optuna.storages.JournalStorage(JournalFileBackend(str(tmp_path / "journal.log")))
    study = optuna.create_study(storage=storage, study_name="j")
    trial = study.ask()
    real_append = JournalFileBackend.append_logs

    def full_disk(self, logs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(JournalFileBackend, "append_logs", full_disk)
    outcome = Outcome(number=trial.number, state="COMPLETE", value=0.8, user_attrs={"status": "ok"})
    with pytest.raises(SearchError, match=r"storage is unavailable \(\[Errno 28\] No space left on device\).*pending"):
        record(study, outcome, pending_dir=tmp_path / "pending", retry_wait_s=0.0)
    assert json.loads((tmp_path / "pending" / f"trial_{trial.number:04d}.json").read_text())["value"] == 0.8
    monkeypatch.setattr(JournalFileBackend, "append_logs", real_append)
    assert apply_pending(study, tmp_path / "pending") == [trial.number]
    assert study.trials[0].state == optuna.trial.TrialState.COMPLETE and study.trials[0].value == 0.8


def test_an_interrupted_journal_search_counts_what_it_kept(tmp_path):
    from autotune.search import SearchSettings, describe_interrupted

    path = tmp_path / "journal.log"
    study = optuna.create_study(
        storage=optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path))), study_name="j"
    )
    for value in (1.0, 0.9):
        study.tell(study.ask(), value)
    study.ask()  # the running trial the interrupt closed
    line = describe_interrupted(
        SearchSettings(model="tiny", storage=f"journal:{path}", study_name="j", out_dir=tmp_path)
    )
    assert line.startswith("interrupted: 2 finished trial(s) kept in study 'j'"), line
