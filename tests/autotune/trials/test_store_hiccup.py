"""A driver's store that hiccups ([Note: store hiccups] in autotune/trials/reconnect.py): a TCP
proxy between the workers and the driver's store cuts every connection and refuses new ones for
a while, as a flapping link would.

The reconnecting client alone: a call outlives a cut on a new connection, a blocking wait too, a
timeout is not a drop, and a store gone past the deadline raises (or runs ``on_gone``). Then two
torchrun agents on loopback (as in test_nodes.py) whose workers reach the driver only through
the proxy: a job during which the store drops keeps its result, the workers end that world
between jobs, the next job runs on the world torchrun forms again, and a driver gone past
``--driver-gone-s`` ends torchrun with exit 0. Every process has a hard limit and is killed with
its whole tree.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from test_nodes import start_agents
from torch.distributed import DistStoreError, PrefixStore

from autotune.trials.loopback import get_free_port, kill_tree
from autotune.trials.nodes import NodePool
from autotune.trials.reconnect import ReconnectingStore, StoreGone
from autotune.trials.stores import listen_store
from autotune.trials.wire import SECRET_ENV, new_secret

pytestmark = pytest.mark.multirank

REPO = Path(__file__).resolve().parents[3]
SECRET = new_secret()
CUT_S = 3.0
GONE_S = 6.0
"""The workers' ``--driver-gone-s``: twice the cut, so a cut is a hiccup and a longer one the driver gone."""


@pytest.fixture(autouse=True)
def _secret(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET.hex())


class StoreProxy:
    """Forwards every connection made to its loopback ``port`` to ``target_port``; :meth:`cut` closes
    all of them and refuses new ones for a while (or for good)."""

    def __init__(self, target_port: int) -> None:
        self.target_port, self.port = target_port, 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self._open()

    def _open(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        self.port, self._listener = listener.getsockname()[1], listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                return
            with self._lock:
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for s in (source, sink):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self, seconds: float | None) -> None:
        """Close every connection and the listener now; listen again after ``seconds`` (None: never)."""
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
            except OSError:
                pass
            listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        if seconds is not None:
            threading.Timer(seconds, self._open).start()


@pytest.fixture
def proxied_store():
    """A store server and a proxy in front of it."""
    server = listen_store("127.0.0.1", 0)
    proxy = StoreProxy(server.port)
    yield server, proxy
    proxy.cut(None)


def test_a_call_outlives_a_cut_on_a_new_connection_and_a_timeout_is_not_a_drop(proxied_store):
    server, proxy = proxied_store
    downs: list[float] = []
    root = ReconnectingStore("127.0.0.1", proxy.port, timeout_s=10, gone_after_s=10, on_reconnect=downs.append)
    client = root.under("nodepool/").under("gen/1/")
    client.set("job/0", b"x")
    assert PrefixStore("gen/1/", PrefixStore("nodepool/", server)).get("job/0") == b"x"  # PrefixStore's keys

    proxy.cut(1.0)
    start = time.monotonic()
    assert client.get("job/0") == b"x" and client.add("done/0", 1) == 1
    took = time.monotonic() - start  # at least the cut: the call waited for the port to open again
    assert root.reconnects == 1 and len(downs) == 1 and 0 < downs[0] <= took and took > 0.9

    with pytest.raises(DistStoreError, match="timeout"):
        client.wait(["job/1"], timedelta(seconds=0.2))
    assert root.reconnects == 1  # the connection kept

    # a blocking wait (the job loop between jobs) cut under it: it waits on, on a new connection
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (client.wait(["job/1"]), done.set()), daemon=True)
    waiter.start()
    time.sleep(0.3)
    proxy.cut(1.0)
    time.sleep(1.5)
    assert not done.is_set()
    PrefixStore("gen/1/", PrefixStore("nodepool/", server)).set("job/1", b"y")
    assert done.wait(10) and root.reconnects == 2


def test_a_store_gone_past_the_deadline_raises_or_runs_on_gone(proxied_store):
    _, proxy = proxied_store
    gone: list[bool] = []
    client = ReconnectingStore("127.0.0.1", proxy.port, timeout_s=10, gone_after_s=1.5, on_gone=lambda: gone.append(1))
    client.set("a", b"1")
    proxy.cut(None)
    start = time.monotonic()
    with pytest.raises(StoreGone, match=rf"the store at 127.0.0.1:{proxy.port} unreachable for [\d.]+ s"):
        client.get("a")
    assert gone == [1] and 1.0 < time.monotonic() - start < 5


def sleep_by_rank(rank: int, world_size: int, *, seconds: list[float]) -> int:
    """A rank program: sleep this rank's ``seconds``, return the pid."""
    time.sleep(seconds[rank])
    return os.getpid()


def test_jobs_go_on_across_a_store_hiccup_on_a_re_formed_world_and_a_driver_gone_ends_torchrun(tmp_path):
    address, lines = f"127.0.0.1:{get_free_port()}", []
    pool = NodePool(2, address=address, secret=SECRET, join_timeout_s=60, lost_after_s=30, say=lines.append)
    proxy = StoreProxy(int(address.split(":")[1]))
    worker_args = ("--driver-gone-s", str(GONE_S))
    agents = start_agents(f"127.0.0.1:{proxy.port}", tmp_path, max_restarts=3, worker_args=worker_args)
    logs = lambda: [(tmp_path / f"agent{n}.log").read_text()[-3000:] for n in range(2)]  # noqa: E731
    try:
        first = pool.run("_trial_programs:get_rank_pid", timeout_s=60)
        assert first.ok and pool.generation == 1, (first.reason, logs())

        # The store cut for 3 s while rank 0 is done with the job (between jobs) and rank 1 still
        # runs it: rank 1's job ends during the cut, its result is set once the connection is
        # back, and the job's results reach the driver.
        threading.Timer(1.0, proxy.cut, (CUT_S,)).start()
        during = pool.run("test_store_hiccup:sleep_by_rank", {"seconds": [0.2, 2.5]}, timeout_s=60)
        assert during.ok and during.results == first.results and pool.generation == 1, (during.reason, logs())

        # Both workers had to reconnect: each ends world 1 between jobs (rank 0 from its heartbeat,
        # rank 1 after its result), telling the driver, which runs the next job on world 2.
        after = pool.run("_trial_programs:get_rank_pid", timeout_s=60)
        assert after.ok and pool.generation == 2, (after.reason, lines, logs())
        assert not set(after.results) & set(first.results)  # new workers
        said = [line for line in lines if "dropped and was made again" in line]
        assert len(said) == 1 and said[0].startswith("world 1: the connection of rank ")
        assert said[0].endswith("; the job runs again on the next world")

        # The driver gone for good: every worker exits 0 once --driver-gone-s passed, torchrun ends.
        proxy.cut(None)
        cut_at = time.monotonic()
        codes = [agent.wait(timeout=GONE_S + 20) for agent in agents]
        assert codes == [0, 0] and time.monotonic() - cut_at > GONE_S - 1, logs()
    finally:
        pool.close()
        proxy.cut(None)
        for agent in agents:
            kill_tree(agent.pid)
            agent.wait()
