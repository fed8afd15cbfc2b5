"""The search across nodes on hosts that share no directory with the driver ([Note: node-local
files] in autotune/trials/gather.py): each rank writes into its own node's directory and sends the
driver what it needs, so ``--out`` lives on the driver's disk alone.

Two torchrun agents stand in for two hosts, each in a network namespace of its own with its own
address on a bridge, its own hostname and a tmpfs over the test's directory, where the driver's
``--out`` is (tests/autotune/trials/_netns.py): the workers reach the driver's store by a real
address, not loopback, and cannot see the driver's ``--out``. Where this process may not make namespaces (not root), the test is skipped with the
reason; ``AUTOTUNE_REQUIRE_ALL`` does not require it (CI here runs as root, so it runs there).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _netns import probe, two_hosts
from typer.testing import CliRunner

from autotune.trials.loopback import get_agent_command, get_free_port, kill_tree
from autotune.trials.stores import listen_store
from autotune.trials.wire import SECRET_ENV, new_secret

pytestmark = pytest.mark.multirank

REPO = Path(__file__).resolve().parents[3]
LIMIT_S = 300


def _start(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def test_a_search_across_two_hosts_that_share_no_directory_emits_and_its_report_reads_the_gathered_traces(tmp_path):
    why = probe()
    if why is not None:
        pytest.skip(f"two hosts in network namespaces: {why}")
    out = tmp_path / "search"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}
    env[SECRET_ENV] = new_secret().hex()
    with two_hosts() as (driver_ip, hosts):
        pool = f"{driver_ip}:{get_free_port()}"
        rdzv_port = get_free_port()
        rendezvous = listen_store(
            driver_ip, rdzv_port, timeout_s=LIMIT_S
        )  # no agent hosts it: no address of theirs is its
        search = [sys.executable, "-c", "import cli; cli.main()", "search", "--model", "tiny", "--trials", "1"]
        search += ["--workers", pool, "--cluster", "cpu-emulated-2node", "--patience", "0", "--confirm-pairs", "0"]
        search += ["--trial-timeout", "90", "--json", "--out", str(out)]
        processes = [_start(search, tmp_path / "driver.log", env)]
        for i, host in enumerate(hosts):
            agent = get_agent_command(
                pool, rdzv=f"{driver_ip}:{rdzv_port}", run_id="apart", more=("--monitor-interval", "0.2")
            )
            host_env = env | {"GLOO_SOCKET_IFNAME": host.interface}
            processes.append(
                _start(
                    host.wrap([*agent, "--join-timeout-s", "60"], hide=str(tmp_path)),
                    tmp_path / f"agent{i}.log",
                    host_env,
                )
            )
        deadline = time.monotonic() + LIMIT_S
        try:
            while processes[0].poll() is None and time.monotonic() < deadline:
                if all(p.poll() is not None for p in processes[1:]):  # the driver ends soon after, or never will
                    deadline = min(deadline, time.monotonic() + 60)
                time.sleep(0.2)
        finally:
            for process in processes:
                kill_tree(process.pid)
                process.wait()
            del rendezvous
    logs = {p.name: p.read_text()[-2500:] for p in sorted(tmp_path.glob("*.log"))}
    assert processes[0].returncode == 0, logs
    defaults = out / "trials" / "trial_0000"
    traces = sorted(defaults.glob("trace_rank*.json.gz"))
    assert [t.name for t in traces] == ["trace_rank0.json.gz", "trace_rank1.json.gz"], logs
    assert all(json.loads(gzip.decompress(t.read_bytes()))["traceEvents"] for t in traces)
    ranks = json.loads((defaults / "env.json").read_text())["ranks"]
    assert sorted(r["host"] for r in ranks) == ["node0", "node1"]  # each rank on its own "host"
    assert (out / "best.toml").exists()
    from cli import app

    report = CliRunner().invoke(app, ["report", str(defaults), "--json"])
    assert report.exit_code == 0, report.output
    assert json.loads(report.stdout)["trace_metrics"]["num_ranks"] == 2
