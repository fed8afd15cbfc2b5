"""The search across nodes ([Note: node pool] in autotune/trials/nodes.py): two torchrun agents on
loopback stand in for two nodes of one rank each (gloo, ``--rdzv-backend c10d``).

The pool's faults on a real world: a rank killed mid-job, a node lost (a job that raises on one
rank and a hang past the limit: test_pool_contract.py, on both pools); each fails that job with
its reason, and the next job runs on the world torchrun forms again (``--max-restarts``). A world that never forms is one line naming the address. End to
end: ``autotune search --workers`` drives the agents' ranks through a whole search that emits,
and every trial dir names both nodes. Every process has a hard wall-clock limit and is killed
with its whole tree.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _harness import reference_losses

from autotune.trials.loopback import get_agent_command, get_free_port, kill_tree
from autotune.trials.nodes import NodePool, NodePoolError
from autotune.trials.wire import SECRET_ENV, new_secret, seal
from autotune.trials.worker import get_board
from fsdp_runtime import config_to_dict, load_config

pytestmark = pytest.mark.multirank

REPO = Path(__file__).resolve().parents[3]
AGENT_LIMIT_S = 300
SECRET = new_secret()
"""The tests' search secret, in every driver's and agent's environment ([Note: signed messages])."""
UNSHARDED_REL_TOL = 1e-4
"""Sharded training against one process without FSDP ([the runtime config](docs/config.md), "Math")."""


@pytest.fixture(autouse=True)
def _secret(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET.hex())


def start_agents(
    pool_address: str, out: Path, *, max_restarts: int = 6, per_node: int = 1, worker_args: tuple[str, ...] = ()
) -> list[subprocess.Popen]:
    """Two torchrun agents (``--nnodes 2 --nproc-per-node per_node``) whose workers join ``pool_address``
    (``worker_args``: more of the worker's options)."""
    rdzv = f"127.0.0.1:{get_free_port()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}
    agents = []
    for node in range(2):
        command = get_agent_command(
            pool_address,
            rdzv=rdzv,
            run_id="autotune-test",
            per_node=per_node,
            max_restarts=max_restarts,
            log_dir=out / f"agent{node}",
            more=("--monitor-interval", "0.2"),
        )
        with open(out / f"agent{node}.log", "w") as log:
            agents.append(
                subprocess.Popen(
                    [*command, "--join-timeout-s", "60", *worker_args],
                    cwd=REPO,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    return agents


def stop(processes: list[subprocess.Popen]) -> None:
    """SIGKILL every process and everything under it."""
    for proc in processes:
        kill_tree(proc.pid)
        proc.wait()


def kill_node(worker_pid: int) -> None:
    """SIGKILL a worker and its torchrun agent (its parent), as if their node were lost."""
    stat = Path(f"/proc/{worker_pid}/stat").read_text()
    agent_pid = int(stat.rsplit(")", 1)[1].split()[1])
    for pid in (agent_pid, worker_pid):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture
def two_nodes(tmp_path):
    """A NodePool (the driver) and two torchrun agents joined to it."""
    address = f"127.0.0.1:{get_free_port()}"
    lines: list[str] = []
    # A silence long enough that a worker torchrun restarts on a loaded box posts its ticket first
    pool = NodePool(2, address=address, secret=SECRET, join_timeout_s=90, lost_after_s=60, say=lines.append)
    agents = start_agents(address, tmp_path)
    try:
        yield pool, lines
    finally:
        pool.close()
        time.sleep(0.5)
        stop(agents)


@pytest.mark.torch_matrix  # torchrun's elastic restarts, under every torch the package supports
def test_faults_fail_one_job_each_and_the_next_runs_on_a_new_world(two_nodes):
    pool, lines = two_nodes
    first = pool.run("_trial_programs:get_rank_pid", timeout_s=90)
    assert first.ok, first.reason
    assert [p["node"] for p in pool.placement] == [0, 1] and pool.generation == 1
    assert lines[-1].startswith("world 1: 2 ranks on 2 node(s): ")

    # A job that raises on a rank, and one past its limit, each fail alone and the next runs on a
    # new world: tests/autotune/trials/test_pool_contract.py, on this pool and the local one.

    # rank 1 killed mid-job, outside a collective: no peer notices; torchrun starts new workers
    threading.Timer(1.5, os.kill, (pool.placement[1]["pid"], signal.SIGKILL)).start()
    killed = pool.run("_trial_programs:sleep_then_pid", {"seconds": 60}, timeout_s=60)
    assert killed.status == "crash" and "died without a word and torchrun restarted" in killed.reason, killed.reason
    last = pool.run("_trial_programs:get_rank_pid", timeout_s=90)
    assert last.ok and pool.num_starts == 2 and last.results != first.results, lines  # a world formed again
    boards = get_board(pool.address, "*")
    assert list(boards.parent.glob(boards.name)) == [
        get_board(pool.address, 2)
    ]  # the last world's board, not one per restart

    # a node lost, its agent with it: no new worker, the heartbeat falls silent (no restart to wait for)
    pool.lost_after_s = 8
    threading.Timer(1.5, kill_node, (pool.placement[1]["pid"],)).start()
    lost = pool.run("_trial_programs:sleep_then_pid", {"seconds": 60}, timeout_s=60)
    assert lost.status == "crash" and "rank 1 on" in lost.reason and "stopped answering for 8 s" in lost.reason


DRIVER = """
import sys
from autotune.trials.nodes import NodePool
from autotune.trials.wire import load_secret
pool = NodePool(2, address=sys.argv[1], secret=load_secret(), join_timeout_s=90, say=lambda line: None)
assert pool.run("_trial_programs:get_rank_pid", timeout_s=90).ok
print("formed", flush=True)
pool.run("_trial_programs:sleep_then_pid", {"seconds": 120}, timeout_s=150)
"""


def test_a_driver_killed_mid_job_ends_torchrun_on_every_node(tmp_path):
    """The search killed while its ranks run a job: every worker exits 0 once it loses the
    driver, and torchrun ends instead of restarting workers that would wait for a driver that is
    gone (on a cluster: the allocation is released)."""
    address = f"127.0.0.1:{get_free_port()}"
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, address], cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    agents = start_agents(address, tmp_path)
    try:
        assert driver.stdout.readline() == "formed\n"  # the world formed and ran a job
        time.sleep(1)  # the next job running on both ranks
        driver.kill()
        codes = [agent.wait(timeout=30) for agent in agents]
    finally:
        stop([driver, *agents])
    assert codes == [0, 0], [(tmp_path / f"agent{n}.log").read_text()[-2000:] for n in range(2)]
    assert "restart" not in (tmp_path / "agent0.log").read_text().lower()


def test_a_world_that_never_forms_is_one_line_naming_the_address():
    address = f"127.0.0.1:{get_free_port()}"
    pool = NodePool(2, address=address, secret=SECRET, join_timeout_s=1, say=lambda line: None)
    with pytest.raises(NodePoolError, match=rf"no world of 2 ranks formed at {address} within 1 s"):
        pool.run("_trial_programs:get_rank_pid", timeout_s=5)


def run_driver(tmp_path: Path, out: Path, trials: int, *more: str, during: Any = None) -> str:
    """``autotune search --workers`` over two fresh agents until it ends; ``during(out, address)`` is called
    and its ``--workers`` address every 0.05 s while it runs. Its output; a non-zero exit fails the test."""
    address = f"127.0.0.1:{get_free_port()}"
    search = [sys.executable, "-c", "import cli; cli.main()", "search", "--model", "tiny", "--trials", str(trials)]
    search += ["--workers", address, "--cluster", "cpu-emulated-2node", "--patience", "0"]
    search += ["--trial-timeout", "90", "--json", "--out", str(out), *more]
    log_path = tmp_path / f"driver-{trials}.log"
    with open(log_path, "w") as log:
        driver = subprocess.Popen(search, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    agents = start_agents(address, tmp_path)
    deadline = time.monotonic() + AGENT_LIMIT_S
    try:
        while driver.poll() is None and time.monotonic() < deadline:
            if during is not None:
                during(out, address)
            time.sleep(0.05)
    finally:
        stop([driver, *agents])
    log = log_path.read_text()
    assert driver.returncode == 0, log[-3000:]
    return log


def find_worker(address: str, rank: int) -> int | None:
    """The pid of the live torchrun worker of ``rank`` joined to ``address`` (``RANK`` in its environment)."""
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            if b"autotune.trials.worker" in command and address.encode() in command:
                if f"RANK={rank}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    return int(entry.name)
        except (OSError, ValueError):
            continue
    return None


def test_workers_on_another_backend_are_refused_in_one_line():
    """GPU workers (NCCL) joining a driver that would run gloo trials (a driver on a CPU-only host)."""
    from torch.distributed import PrefixStore, TCPStore

    address = f"127.0.0.1:{get_free_port()}"
    pool = NodePool(2, address=address, secret=SECRET, join_timeout_s=30, say=lambda line: None)
    worker = PrefixStore("nodepool/", TCPStore("127.0.0.1", int(address.split(":")[1]), is_master=False))
    ticket = worker.add("tickets", 1)
    info = {"rank": 0, "host": "gpu-node-0", "world_size": 2, "backend": "nccl"}
    worker.set(f"ticket/{ticket}", seal(SECRET, f"nodepool/ticket/{ticket}", info))
    with pytest.raises(
        NodePoolError, match="the worker on gpu-node-0 runs nccl, this search's trials gloo: run the search on one"
    ):
        pool.run("_trial_programs:get_rank_pid", timeout_s=5)


def test_workers_in_nodes_of_another_size_than_the_cluster_profile_s_are_refused_in_one_line():
    """Two ranks to a node joining a search whose ``--cluster`` has one: its meshes' names and its
    emulated links would describe nodes the world does not have."""
    from torch.distributed import PrefixStore, TCPStore

    address = f"127.0.0.1:{get_free_port()}"
    pool = NodePool(2, address=address, secret=SECRET, join_timeout_s=30, ranks_per_node=1, say=lambda line: None)
    worker = PrefixStore("nodepool/", TCPStore("127.0.0.1", int(address.split(":")[1]), is_master=False))
    for rank in range(2):
        placement = {"rank": rank, "host": "node-0", "node": 0, "local_rank": rank, "local_world_size": 2}
        ticket = worker.add("tickets", 1)
        worker.set(f"ticket/{ticket}", seal(SECRET, f"nodepool/ticket/{ticket}", {**placement, "world_size": 2}))
    with pytest.raises(NodePoolError, match="the workers on node-0 run 2 ranks to a node .* ranks_per_node is 2$"):
        pool.run("_trial_programs:get_rank_pid", timeout_s=5)


def test_a_search_across_two_agents_emits_resumes_and_outlives_a_killed_rank(tmp_path):
    """A search across two agents names both nodes everywhere; resumed after every agent stopped, it
    keeps its trial, a rank killed in its second trial fails that trial only, the next trial runs
    on the world torchrun forms again, and the search emits. The emitted config then trains on two
    nodes as the unsharded model does."""
    out = tmp_path / "search"
    log = run_driver(tmp_path, out, 1, "--confirm-pairs", "0")  # the defaults trial only
    assert "world 1: 2 ranks on 2 node(s)" in log
    first = {t.name: (t / "metrics.json").read_bytes() for t in sorted((out / "trials").glob("trial_*"))}
    assert list(first) == ["trial_0000"]

    killed: list[int] = []

    def kill_rank1_in_trial_1(out: Path, address: str) -> None:  # in its collectives: rank 0 loses its connection
        if not killed and (out / "trials" / "trial_0001").is_dir():
            pid = find_worker(address, 1)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

    log = run_driver(tmp_path, out, 3, "--resume", "--confirm-pairs", "1", during=kill_rank1_in_trial_1)
    assert killed and "world 2: 2 ranks on 2 node(s)" in log
    trials = sorted((out / "trials").glob("trial_*"))
    assert [t.name for t in trials] == ["trial_0000", "trial_0001", "trial_0002"]
    assert {t.name: (t / "metrics.json").read_bytes() for t in trials[:1]} == first  # kept as it was
    failed = json.loads((trials[1] / "metrics.json").read_text())
    assert failed["status"] == "crash" and "rank 1 on" in failed["reason"] and "died without a word" in failed["reason"]
    assert json.loads((trials[2] / "metrics.json").read_text())["status"] in ("ok", "pruned")
    for trial in trials:
        env = json.loads((trial / "env.json").read_text())
        assert [r["node"] for r in env["ranks"]] == [0, 1], trial
    best = load_config(out / "best.toml")
    assert any(
        note.startswith("trials ran on 2 node(s) of 1 rank(s), started by torchrun") for note in best.provenance.notes
    )
    record = json.loads((out / "search.json").read_text())
    meshes = "2 ranks on 2 node(s) of 1: fsdp: shard over 2 nodes; hsdp:2x1: shard in each node, replicate over 2 nodes"
    assert meshes in record["notes"] and any(n.startswith("trials ran on 2 node(s)") for n in record["notes"])

    # The emitted config in a training loop on a fresh two-node world: the unsharded model's losses.
    address = f"127.0.0.1:{get_free_port()}"
    pool = NodePool(2, address=address, secret=SECRET, join_timeout_s=90, say=lambda line: None)
    agents = start_agents(address, tmp_path)
    try:
        job = {"model": "tiny", "config": config_to_dict(best), "num_steps": 3}
        run = pool.run("_harness:train_losses", job, timeout_s=120)
    finally:
        pool.close()
        time.sleep(0.5)
        stop(agents)
    assert run.ok, run.reason
    expected = reference_losses(model="tiny", world_size=2, num_microbatches=best.num_microbatches, num_steps=3)
    for losses, reference in zip(run.results, expected, strict=True):
        assert losses == pytest.approx(reference, rel=UNSHARDED_REL_TOL)


def test_a_dry_run_forms_the_world_across_the_nodes_and_runs_no_trial(tmp_path):
    """``autotune search --dry-run --workers``: what a cluster user runs first; two nodes of two
    ranks each, the shape in which a shard group can stay inside a node."""
    address, out = f"127.0.0.1:{get_free_port()}", tmp_path / "search"
    command = [sys.executable, "-c", "import cli; cli.main()", "search", "--model", "tiny", "--dry-run", "--nproc", "4"]
    command += ["--workers", address, "--cluster", "cpu-emulated-ib", "--out", str(out)]
    with open(tmp_path / "driver.log", "w") as log:
        driver = subprocess.Popen(
            command, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True
        )
    agents = start_agents(address, tmp_path, per_node=2)
    try:
        stdout, _ = driver.communicate(timeout=AGENT_LIMIT_S)
        codes = [agent.wait(timeout=60) for agent in agents]  # the world told to exit: torchrun ends
    finally:
        stop([driver, *agents])
    assert driver.returncode == 0, (tmp_path / "driver.log").read_text()[-3000:]
    lines = stdout.splitlines()
    assert lines[0].startswith("target: this machine: ") and lines[0].endswith("CPU cores, gloo")
    assert lines[1].startswith("model: tiny as itself") and "world: 4 ranks on 2 node(s)" in lines
    assert any(line.startswith("  node 0 (") and line.endswith("ranks 0, 1 on cpu") for line in lines)
    assert any(line.startswith("  node 1 (") and line.endswith("ranks 2, 3 on cpu") for line in lines)
    meshes = next(line for line in lines if line.startswith("4 ranks on 2 node(s) of 2: "))
    assert "fsdp: shard over 2 nodes" in meshes and "hsdp:2x2: shard in each node, replicate over 2 nodes" in meshes
    assert any(line.startswith("all-reduce of 8 MiB over every rank: ") for line in lines)
    assert lines[-1] == "dry run: no trial ran" and codes == [0, 0]
    assert not get_board(address, 1).exists()  # the host's arrival board goes with its ranks
    assert not list(out.iterdir())  # --out checked writable; no study, no trial dir
