"""Entry point of one rank started by :func:`autotune.launch.run_ranks` (``python -m autotune._rank DIR RANK``)."""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any


def init_rank(tmpdir: str, rank: int) -> tuple[dict, Any]:
    """Read the launcher's spec, set this rank's threads, join the parent's store and the default group."""
    spec = pickle.loads((Path(tmpdir) / "spec.pkl").read_bytes())
    os.environ.setdefault("OMP_NUM_THREADS", str(spec["num_threads"]))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec["num_threads"])
    world_size = spec["world_size"]
    timeout = timedelta(seconds=spec["pg_timeout_s"])
    store = dist.TCPStore("127.0.0.1", spec["store_port"], world_size + 1, is_master=False, timeout=timeout)
    dist.init_process_group(spec["backend"], store=store, rank=rank, world_size=world_size, timeout=timeout)
    return spec, store


def call_target(target: str, rank: int, world_size: int, kwargs: dict) -> Any:
    """``module:function(rank, world_size, **kwargs)``; on failure print the reason and exit at once.

    A user error (:class:`AutotuneError`) prints one line and exits with ``EXIT_USER_ERROR``;
    anything else prints the traceback and exits 1. Interpreter teardown is skipped: a peer
    may be blocked in a collective with us.
    """
    from autotune.launch import EXIT_USER_ERROR
    from fsdp_runtime.errors import AutotuneError

    module_name, fn_name = target.split(":")
    try:
        return getattr(importlib.import_module(module_name), fn_name)(rank, world_size, **kwargs)
    except AutotuneError as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(EXIT_USER_ERROR)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def main(tmpdir: str, rank_str: str) -> int:
    rank = int(rank_str)
    spec, _ = init_rank(tmpdir, rank)
    import torch.distributed as dist

    result = call_target(spec["target"], rank, spec["world_size"], spec["kwargs"])
    tmp = Path(tmpdir) / f".result_{rank}.pkl"
    tmp.write_bytes(pickle.dumps(result))
    tmp.replace(Path(tmpdir) / f"result_{rank}.pkl")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main(*sys.argv[1:3])
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: the result is written, and C++ static destructors racing
    # gloo's threads at exit occasionally aborted a finished rank.
    os._exit(code)
