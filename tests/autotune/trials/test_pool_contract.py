"""What every rank pool does, the same tests on both kinds ([Note: node pool] in
autotune/trials/nodes.py; :class:`autotune.trials.Pool`): this host's ``RankPool`` (the session's
``pool2``) and a ``NodePool`` whose ranks two torchrun agents on loopback start (one rank each,
gloo). A job's results come back in rank order; a job that raises on one rank, or outlives its
limit, fails alone, with its status and reason, and the next job runs on ranks started again;
``close()`` ends the ranks.

The agents start once for the module; every process has a hard wall-clock limit (a watchdog kills
the agents' trees) and is killed with its whole tree on teardown. Two failures only: each makes
torchrun start its workers again, seconds apiece on a small box.
"""

from __future__ import annotations

import threading
import time

import pytest
from _trial_programs import CRASH_MESSAGE, get_survivors
from test_nodes import start_agents

from autotune.trials import NodePool, Pool, RankPool, kill_tree
from autotune.trials.loopback import get_free_port
from autotune.trials.wire import SECRET_ENV, new_secret

pytestmark = pytest.mark.multirank

AGENTS_LIMIT_S = 240
"""The most the agents (and their workers) may live, whatever the tests do."""
START_S = 90  # a job's limit where ranks may have to start (a world to form) first


@pytest.fixture(scope="module")
def node_pool(tmp_path_factory):
    """A 2-rank NodePool and the two torchrun agents whose workers join it."""
    secret, address = new_secret(), f"127.0.0.1:{get_free_port()}"
    pool = NodePool(2, address=address, secret=secret, join_timeout_s=START_S, lost_after_s=60, say=lambda line: None)
    with pytest.MonkeyPatch.context() as env:  # the agents' workers sign with it ([Note: signed messages])
        env.setenv(SECRET_ENV, secret.hex())
        agents = start_agents(address, tmp_path_factory.mktemp("agents"))
    watchdog = threading.Timer(AGENTS_LIMIT_S, lambda: [kill_tree(agent) for agent in agents])
    watchdog.daemon = True
    watchdog.start()
    try:
        yield pool
    finally:
        watchdog.cancel()
        pool.close()
        for agent in agents:
            kill_tree(agent)


@pytest.fixture(scope="module", params=["local", "nodes"])
def pool(request) -> Pool:
    """Each kind of pool in turn, its ranks running (the local one's started by its first job)."""
    return request.getfixturevalue("pool2" if request.param == "local" else "node_pool")


def test_both_pools_are_pools_and_say_whether_their_ranks_are_remote():
    local = RankPool(2)  # no rank starts before the first job
    nodes = NodePool(2, address=f"127.0.0.1:{get_free_port()}", secret=new_secret(), say=lambda line: None)
    assert isinstance(local, Pool) and isinstance(nodes, Pool)
    assert (local.remote, nodes.remote) == (False, True)
    assert local.pids == nodes.pids == [] and local.num_starts == nodes.num_starts == 0
    assert not isinstance(object(), Pool)


def test_a_job_s_results_come_back_in_rank_order(pool):
    run = pool.run("_trial_programs:get_rank_pid", timeout_s=START_S)
    assert run.ok, run.reason
    assert run.results == run.pids == pool.pids and len(set(run.results)) == pool.world_size == 2


def test_a_job_that_raises_on_one_rank_fails_alone_and_the_next_runs_on_new_ranks(pool):
    before = pool.run("_trial_programs:get_rank_pid", timeout_s=START_S)
    assert before.ok, before.reason
    starts = pool.num_starts
    crashed = pool.run("_trial_programs:crash_on_rank1", timeout_s=60)
    assert crashed.status == "crash" and CRASH_MESSAGE in crashed.reason, crashed.reason
    after = pool.run("_trial_programs:get_rank_pid", timeout_s=START_S)
    assert after.ok, after.reason
    assert pool.num_starts == starts + 1 and set(after.results).isdisjoint(before.results)


def test_a_job_past_its_limit_times_out_and_the_next_runs_on_new_ranks(pool):
    before = pool.run("_trial_programs:get_rank_pid", timeout_s=START_S)
    assert before.ok, before.reason
    starts, started = pool.num_starts, time.monotonic()
    hung = pool.run("_trial_programs:sleep_then_pid", {"seconds": 60}, timeout_s=3)
    assert hung.status == "timeout" and hung.reason.startswith("no result after 3s"), hung.reason
    assert time.monotonic() - started < 30
    after = pool.run("_trial_programs:get_rank_pid", timeout_s=START_S)
    assert after.ok, after.reason
    assert pool.num_starts == starts + 1 and set(after.results).isdisjoint(before.results)


def test_close_ends_the_ranks(pool):
    run = pool.run("_trial_programs:get_rank_pid", timeout_s=START_S)
    assert run.ok, run.reason
    pool.close()
    deadline = time.monotonic() + 30  # the node pool's ranks exit once they read the exit job
    while get_survivors(run.results) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert get_survivors(run.results) == []
