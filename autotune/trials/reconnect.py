"""A store client that re-makes its connection: a worker's link to the driver across a network hiccup.

[Note: store hiccups]
A ``TCPStore`` client does not reconnect by itself: once its socket is closed (a switch port
flapped, a firewall dropped the flow, the driver's host refused connections for a moment) every
call on it fails, even after the server is reachable again on the same port (measured, torch
2.13.0: ``DistNetworkError: Broken pipe`` on the old client, a new one connects at once).
:class:`ReconnectingStore` is a worker's client for its heartbeat and its job loop
(:mod:`autotune.trials.worker`): a call that fails with a network error is made again on a new
client for the same address, after a pause of 0.1 s doubling to 2 s, until the driver has been
unreachable for ``gone_after_s`` (the worker's ``--driver-gone-s``,
:data:`~autotune.trials.worker.DRIVER_GONE_S`). Past that the driver is taken for gone:
``on_gone`` runs (the worker exits 0, and torchrun ends), else the call raises
:class:`StoreGone`. A timeout (a ``wait`` for a key not yet set) is not a network error: it
passes through and the connection is kept. Before a new client is made, a plain TCP connect
probes the address: a refused port costs one quiet ``connect``, not the client's own retry loop
(whose pauses grow to seconds, and which logs a stack trace for every try).

A ``TCPStore`` client's ``set`` gets no answer: over a connection whose peer is already gone it
returns as if done, and the value is lost (measured through a proxy that closed the connection:
a job's result vanished while the ``add`` after it failed, reconnected and counted). So this
client follows each ``set`` with a ``check`` of its key on the same connection, which the server
answers only after reading the ``set``, and sets it again on a new connection where that fails.
A call made again after a drop may have reached the server the first time: a ``set`` then sets
the same signed message twice, a ``check``, ``get`` or ``wait`` asks again, and an ``add`` may
count twice. The driver's doorbell count is a hint for that reason ([Note: node pool] in
:mod:`autotune.trials.nodes`), and a heartbeat counted twice is still a heartbeat.

What survives a drop, and what is re-formed. The world's process group was formed on the
client the worker joined with, and that client's connection cannot be made again: measured with
gloo (torch 2.13.0, two ranks, every store connection cut for a second), collectives on the
default group and on groups made before the drop still run, but ``new_group`` (with or without
``use_local_synchronization``) fails with ``Broken pipe``, and every trial builds groups of its
own (its meshes; NCCL also makes each communicator through the store at its first collective).
So a worker whose heartbeat or job loop had to reconnect ends its world, with
:data:`~autotune.trials.worker.EXIT_ABORTED`, at the first point where no job of its runs: at once
when it is between jobs, else once its job has ended. A job that ends during the drop keeps its
result: it is set once the connection is back, and reaches the driver. A job that fails after
the drop is reported with the drop named. Before it exits, the worker tells the driver which job
it will not run (``gen/{g}/dropped/{rank}``), and the driver runs that job again on the world
torchrun forms next, instead of failing it ([Note: node pool]).
"""

from __future__ import annotations

import copy
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed import DistError, DistNetworkError, TCPStore

__all__ = ["BACKOFF_S", "ReconnectingStore", "StoreGone"]

BACKOFF_S = (0.1, 2.0)
"""The pause before the first new connection after a drop, and the most it doubles to."""
_PROBE_S = 2.0  # how long one probe's TCP connect may take


class StoreGone(DistNetworkError):
    """The store was unreachable past the deadline: its owner is taken for gone."""


class _Connection:
    """The client a store and its views share, and how it has fared."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.worked = store is not None  # a client that answered once: a new one is a reconnect
        self.reconnects = 0


class ReconnectingStore:
    """A client of the ``TCPStore`` at ``host:port`` whose calls outlive a dropped connection
    ([Note: store hiccups]): ``get``, ``set``, ``check``, ``wait``, ``add`` and ``multi_get`` as a
    ``TCPStore``'s, under the prefixes of :meth:`under` (as ``PrefixStore`` makes its keys).

    ``store``: a client already connected (else one is made at the first call); ``timeout_s``:
    each call's own time limit, as a ``TCPStore``'s; ``on_reconnect(down_s)``: told after a new
    client replaced one that had worked, with how long the store was unreachable; ``on_gone()``:
    run when the store stayed unreachable for ``gone_after_s`` (else :class:`StoreGone`)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout_s: float,
        gone_after_s: float,
        store: Any = None,
        on_reconnect: Callable[[float], None] | None = None,
        on_gone: Callable[[], None] | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.timeout_s, self.gone_after_s = timeout_s, gone_after_s
        self.on_reconnect, self.on_gone = on_reconnect, on_gone
        self._connection = _Connection(store)
        self._prefix = ""

    @property
    def reconnects(self) -> int:
        """How many times a new client replaced one that had worked."""
        return self._connection.reconnects

    def under(self, prefix: str) -> ReconnectingStore:
        """A view of this store whose keys are under ``prefix`` (``PrefixStore(prefix, self)``), on the same client."""
        view = copy.copy(self)
        view._prefix = f"{self._prefix}{prefix}/"
        return view

    def get(self, key: str) -> bytes:
        return self._call(lambda store: store.get(self._prefix + key))

    def set(self, key: str, value: bytes | str) -> None:
        """``value`` set under ``key``, and seen there: a ``TCPStore`` client's ``set`` has no answer, so
        over a connection already gone it returns as if done and the value is lost ([Note: store
        hiccups]); a ``check`` on the same connection, answered only after the ``set`` was read, says it was."""
        full = self._prefix + key

        def set_and_check(store: Any) -> None:
            store.set(full, value)
            if not store.check([full]):
                raise DistNetworkError(f"the value set under {full!r} did not reach the store")

        self._call(set_and_check)

    def add(self, key: str, amount: int) -> int:
        return self._call(lambda store: store.add(self._prefix + key, amount))

    def check(self, keys: list[str]) -> bool:
        return self._call(lambda store: store.check([self._prefix + k for k in keys]))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call(lambda store: store.multi_get([self._prefix + k for k in keys]))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        full = [self._prefix + k for k in keys]
        self._call(lambda store: store.wait(full) if timeout is None else store.wait(full, timeout))

    def _call(self, op: Callable[[Any], Any]) -> Any:
        """``op(client)``, made again on a new client after a network error until the store has
        been unreachable for ``gone_after_s``."""
        connection, down_since, pause = self._connection, None, BACKOFF_S[0]
        while True:
            try:
                if connection.store is None:
                    connection.store = self._connect()
                    if connection.worked:
                        connection.reconnects += 1
                        if self.on_reconnect is not None:
                            self.on_reconnect(time.monotonic() - down_since if down_since else 0.0)
                result = op(connection.store)
                connection.worked = True
                return result
            except (DistNetworkError, OSError) as e:  # the connection lost, or no new one yet
                error = e
            except DistError as e:  # a timeout, or an answer: not the connection's
                if connection.store is not None:
                    raise
                error = e  # the new client's handshake failed: try again
            now = time.monotonic()
            down_since = down_since if down_since is not None else now
            connection.store = None
            left = self.gone_after_s - (now - down_since)
            if left <= 0:
                if self.on_gone is not None:
                    self.on_gone()
                raise StoreGone(
                    f"the store at {self.host}:{self.port} unreachable for {now - down_since:.1f} s: {error}"
                ) from error
            time.sleep(min(pause, left))  # the last try at the deadline
            pause = min(2 * pause, BACKOFF_S[1])

    def _connect(self) -> Any:
        """A new client, once a plain TCP connect says the port is open."""
        with socket.create_connection((self.host, self.port), timeout=_PROBE_S):
            pass
        return TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=self.timeout_s))
