"""Makes ``tests/`` importable (``_harness``) in the test process and, through ``sys.path``, in the
ranks; the rank pool shared by every test that may reuse ranks."""

import contextlib
import os
import sys
from pathlib import Path

import pytest

from autotune.trials import RankPool
from autotune.trials.wire import ALLOW_TARGETS_ENV

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

TEST_TARGETS = (
    "_guard_programs,_harness,_model_programs,_numerics_programs,_search_programs,_torchtitan_programs,"
    "_trial_programs,_truth_programs,_tuner_programs,test_consolidate,test_linkemu,test_presearch,test_store_hiccup,"
    "in_job_tuner"
)
"""The tests' own rank programs, which every rank they start (the pools', torchrun's workers') may run."""
os.environ[ALLOW_TARGETS_ENV] = TEST_TARGETS


@pytest.fixture(scope="session")
def pool2():
    """One 2-rank gloo pool for every test that may reuse ranks (start-up paid once)."""
    with RankPool(2) as pool:
        yield pool


@pytest.fixture(scope="session")
def pool4():
    """One 4-rank gloo pool for the world-4 tests that may reuse ranks (start-up paid once).

    Idle ranks block on the store (no CPU); a job that fails or outlives its limit kills every
    rank's tree and the next job starts fresh ranks, as with ``pool2``."""
    with RankPool(4) as pool:
        yield pool


def _search_on(pool: RankPool, monkeypatch: pytest.MonkeyPatch) -> RankPool:
    """``pool`` as the rank pool of every search the test runs (``run_search`` opens none of its
    own), with no warm reference left in its ranks by an earlier test's search."""
    from autotune.search import run

    dropped = pool.run("_harness:drop_kept_model", timeout_s=120)
    assert dropped.ok, f"{dropped.status}: {dropped.reason}"
    monkeypatch.setattr(run, "open_pool", lambda settings: contextlib.nullcontext(pool))
    return pool


@pytest.fixture
def shared_pool(pool2, monkeypatch):
    """The test's searches run on the session's 2-rank pool (its ranks start once, not per search).

    Not for a test whose trial time limits follow what the search measured ([Note: trial
    timeouts]): warm ranks make its first run, which sets them, shorter than a cold start."""
    return _search_on(pool2, monkeypatch)


@pytest.fixture
def shared_pool4(pool4, monkeypatch):
    """The test's searches run on the session's 4-rank pool (see ``shared_pool``)."""
    return _search_on(pool4, monkeypatch)


@pytest.fixture
def one_rank_group():
    """A one-rank gloo default group for the test (in-process; destroyed after it)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def cli_main(capsys, monkeypatch):
    """``autotune ARGS`` in this process (``cli.main()``: the console script's entry point, its
    error mapping included) -> a ``CompletedProcess`` with its exit code, stdout and stderr.
    A subprocess per call would spend seconds importing the CLI before doing anything."""
    import subprocess

    def run(*args: str) -> subprocess.CompletedProcess:
        import cli

        monkeypatch.setattr(sys, "argv", ["autotune", *args])
        code = 0
        try:
            cli.main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, captured.out, captured.err)

    return run
