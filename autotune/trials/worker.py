"""One rank of a search across nodes, started by torchrun (or srun) on every node.

    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:29400 \\
        --max-restarts 3 -m autotune.trials.worker --pool HEAD:29401

torchrun's rendezvous gives each rank its ``RANK`` and ``WORLD_SIZE``; the rank then joins the
driver's store at ``--pool`` (the ``autotune search --workers HEAD:29401`` process), is admitted
to a world (a *generation*) there, forms its process group on that store, and serves the
driver's jobs as a local pool's ranks do (:func:`autotune.trials.rank.serve_jobs`): [Note: node
pool] in :mod:`autotune.trials.nodes`. A heartbeat thread per rank counts up under the
generation every second and watches for the driver's ``abort``: then the rank exits at once, so
a hang or a lost peer ends the world on every node and torchrun's elastic restart
(``--max-restarts``) starts the workers of the next one. When the driver is gone (the search
ended, or was killed), every rank exits 0 and torchrun ends: nothing is left running on the
nodes waiting for a driver that will not come back.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

EXIT_ABORTED = 75
"""A worker's exit code when the driver aborted its generation (a failed or hung trial)."""
HEARTBEAT_S = 1.0
_boards: list[Path] = []
"""This host's arrival board once the rank serves, removed by whichever thread ends the rank."""


def _end(code: int) -> None:
    """End the rank at once, without unwinding (its threads may be in a collective or a store
    wait), and with it this host's arrival board: every rank on the host tries, the first removes it."""
    for board in _boards:
        shutil.rmtree(board, ignore_errors=True)
    sys.stderr.flush()
    os._exit(code)


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port), or a one-line ``ValueError`` naming it."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--pool {address!r}: expected HOST:PORT (the driver's address, e.g. head-node:29401)")
    return host, int(port)


def get_placement(rank: int) -> dict[str, Any]:
    """Where this rank runs: its host, node (torchrun's ``GROUP_RANK``), local rank and pid."""
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        "pid": os.getpid(),
    }


def join(address: str, backend: str, join_timeout_s: float, secret: bytes) -> tuple[Any, int, int, int]:
    """Admitted to a world by the driver ([Note: node pool]): the driver's store, this rank, the
    world size and the world's generation; the process group formed on the driver's store. What
    it posts and reads there is signed with the search's ``secret`` ([Note: signed messages] in
    :mod:`autotune.trials.wire`)."""
    import torch
    import torch.distributed as dist

    from autotune.trials.wire import open_sealed, seal

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = parse_address(address)
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=join_timeout_s))
    pool = dist.PrefixStore("nodepool/", store)
    ticket = pool.add("tickets", 1)
    info = get_placement(rank) | {"world_size": world_size, "backend": backend}
    pool.set(f"ticket/{ticket}", seal(secret, f"nodepool/ticket/{ticket}", info))
    pool.wait([f"admitted/{ticket}"], timedelta(seconds=join_timeout_s))
    key = f"nodepool/admitted/{ticket}"
    generation = int(open_sealed(secret, key, pool.get(f"admitted/{ticket}"), sender=f"the driver at {address}"))
    if generation == 0:  # superseded by a newer worker of this rank
        os._exit(EXIT_ABORTED)
    threading.Thread(target=_beat, args=(address, f"gen/{generation}/", rank), daemon=True).start()
    if backend == "nccl":  # one GPU per local rank, before NCCL binds its communicators to one
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    pg_store = dist.PrefixStore(f"pg/{generation}", store)
    dist.init_process_group(
        backend, store=pg_store, rank=rank, world_size=world_size, timeout=timedelta(seconds=join_timeout_s)
    )
    return pool, rank, world_size, generation


def _beat(address: str, prefix: str, rank: int) -> None:
    """Count up every second; exit at once when the driver aborts the generation or is gone. On
    a connection of its own: the job loop's blocking wait holds its own one."""
    import torch.distributed as dist

    host, port = parse_address(address)
    pool = dist.PrefixStore("nodepool/", dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60)))
    while True:
        try:
            pool.add(f"{prefix}beat/{rank}", 1)
            if pool.check([f"{prefix}abort"]):
                _end(EXIT_ABORTED)
        except Exception:  # the driver is gone: the search ended or died, and no world will form again
            _end(0)  # not a failure: torchrun restarts no worker to wait for it
        time.sleep(HEARTBEAT_S)


def get_board(address: str, generation: int | str) -> Path:
    """This host's arrival board for the world ``generation`` of the pool at ``address``."""
    return Path(tempfile.gettempdir()) / f"autotune-nodepool-{address.replace(':', '-')}-{generation}"


def serve(address: str, backend: str, join_timeout_s: float, secret: bytes) -> None:
    import torch.distributed as dist

    from autotune.trials.linkemu import BOARD_ENV
    from autotune.trials.rank import serve_jobs
    from autotune.trials.wire import seal

    pool, rank, world_size, generation = join(address, backend, join_timeout_s, secret)
    prefix = f"gen/{generation}/"
    # One arrival board per host and generation ([Note: link emulation]): the ranks that share a host share it.
    board = get_board(address, generation)
    for stale in board.parent.glob(get_board(address, "*").name):  # an earlier world's: its ranks are gone
        if stale != board:
            shutil.rmtree(stale, ignore_errors=True)
    board.mkdir(exist_ok=True)
    _boards.append(board)
    os.environ[BOARD_ENV] = str(board)
    pool.set(f"{prefix}rank/{rank}", seal(secret, f"nodepool/{prefix}rank/{rank}", get_placement(rank)))

    def report(code: int, text: str) -> None:
        report = {"code": code, "tail": text[-4000:]}
        pool.set(f"{prefix}failed/{rank}", seal(secret, f"nodepool/{prefix}failed/{rank}", report))

    jobs, sender = dist.PrefixStore(prefix, pool), f"the driver at {address}"
    serve_jobs(
        jobs, rank, world_size, secret=secret, scope=prefix, sender=sender, on_fail=report, on_exit=lambda: _end(0)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autotune.trials.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--pool", required=True, help="HOST:PORT of the driver (autotune search --workers HOST:PORT)")
    parser.add_argument("--backend", default=None, help="gloo or nccl (default: nccl where CUDA is, else gloo)")
    parser.add_argument("--join-timeout-s", type=float, default=900.0, help="how long to wait for the driver and peers")
    parser.add_argument(
        "--secret-file",
        default=None,
        help="the search's secret, hex (the driver's OUT/pool-secret); default: $AUTOTUNE_POOL_SECRET",
    )
    args = parser.parse_args(argv)
    from autotune.trials.wire import WireError, load_secret

    try:
        parse_address(args.pool)
        secret = load_secret(args.secret_file)
    except (ValueError, WireError) as e:
        print(f"autotune.trials.worker: {e}", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        print(
            "autotune.trials.worker: no RANK in the environment: start it with torchrun (or srun + torchrun)",
            file=sys.stderr,
        )
        return 2
    if args.backend is None:
        import torch

        args.backend = "nccl" if torch.cuda.is_available() else "gloo"
    serve(args.pool, args.backend, args.join_timeout_s, secret)
    return 0


if __name__ == "__main__":
    sys.exit(main())


CHECK_BYTES = 8 * 2**20


def check_rank(rank: int, world_size: int) -> dict[str, Any]:
    """A dry run's job on every rank: where it runs, its device, and one timed all-reduce of
    :data:`CHECK_BYTES` over the whole world (the median of three, after one to warm up)."""
    import statistics

    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    buffer = torch.ones(CHECK_BYTES // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(4):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return get_placement(rank) | {"device": name, "all_reduce_ms": statistics.median(times[1:])}
