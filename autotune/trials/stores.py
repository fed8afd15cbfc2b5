"""The pools' ``TCPStore`` servers, listening on the one interface they are meant for.

[Note: store binding]
torch's ``TCPStore`` server listens on every interface whatever host it is given (measured,
torch 2.13.0: ``TCPStore("127.0.0.1", 0, is_master=True)`` listens on ``0.0.0.0``), so a store meant
for the ranks of one host is reachable from the network too. :func:`listen_store` binds a socket
to the named address first and hands it to the server (``master_listen_fd``): the one-host pools
listen on loopback only, the search across nodes on the address ``--workers`` names (a cluster
network's, or ``0.0.0.0`` where the user asks for every interface). What reaches the store is
still checked: [Note: signed messages] in :mod:`autotune.trials.wire`.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

__all__ = ["LOOPBACK", "listen_store"]

LOOPBACK = "127.0.0.1"
_BACKLOG = 1024


def listen_store(host: str, port: int, *, timeout_s: float = 30.0, world_size: int | None = None) -> Any:
    """A ``TCPStore`` server listening on ``host:port`` only (``port`` 0: one the OS picks; the
    store's ``port`` says which); ``host`` a name or an address of this machine."""
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(_BACKLOG)
        bound = listener.getsockname()[1]
        store = TCPStore(
            host,
            bound,
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the server owns the descriptor now
    return store
