"""The ranks' files sent to the driver, for ranks that share no filesystem with it.

[Note: node-local files]
A trial's rank writes one file the driver needs: its profiled window's chrome trace
(``trace_rank{r}.json.gz``, which the analysis, the report and the calibration read); everything
else it measured travels in its result. Ranks of this host's pool write the trace straight into
the trial dir. Ranks of a pool whose ranks may run on other hosts (``pool.remote``: the search
across nodes) share no filesystem with the driver, so the driver sets ``send_files`` in the
trial's spec and each rank:

1. writes its trace into a directory of its own node, :func:`get_node_dir` (``$TMPDIR/
   autotune-node-<user>/<trial dir's name>``, created by the rank), never into the driver's ``--out``;
2. reads it back and sends it, gzipped as written, inside its signed result ([Note: signed
   messages] in :mod:`autotune.trials.wire`), then removes it from the node;
3. where it is larger than :data:`TRACE_CAP_BYTES` (a store value that large would hold up every
   other request to the driver's store), leaves it on the node and sends where it lies instead:
   the trial dir then has no trace for that rank, and the trial's ``metrics.json`` names the host
   and the path (``kept_traces``) for the user to fetch; the analysis reads the ranks whose traces
   arrived.

On the driver, :func:`receive_files` writes each trace that arrived into the trial dir
(atomically) before the trial dir's record is written, so a search across nodes works with
``--out`` on the driver's disk alone. What stays on the nodes: traces over the cap (named in
``metrics.json``), torchrun's own logs (``--log-dir``), and the link emulation's arrival board
(``$TMPDIR/autotune-nodepool-*``, removed with its world).
"""

from __future__ import annotations

import getpass
import socket
import tempfile
from pathlib import Path
from typing import Any

from fsdp_runtime.files import write_atomic

__all__ = ["TRACE_CAP_BYTES", "get_node_dir", "pack_trace", "receive_files"]

TRACE_CAP_BYTES = 32 * 2**20
"""The largest gzipped trace a rank sends to the driver (32 MiB); a larger one stays on its node."""


def get_node_dir(spec: dict[str, Any]) -> Path:
    """This node's directory for the trial ``spec`` (created): where its ranks write their files."""
    base = Path(tempfile.gettempdir()) / f"autotune-node-{getpass.getuser()}"
    directory = base / Path(spec["out_dir"]).name
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def pack_trace(path: Path, *, cap_bytes: int = TRACE_CAP_BYTES) -> dict[str, Any]:
    """What a rank sends for its trace at ``path`` on its node ([Note: node-local files]): its bytes
    (and the file removed), or, above ``cap_bytes``, where it stays."""
    size = path.stat().st_size
    if size > cap_bytes:
        return {"name": path.name, "kept": {"host": socket.gethostname(), "path": str(path), "bytes": size}}
    data = path.read_bytes()
    path.unlink()
    return {"name": path.name, "data": data}


def receive_files(results: list[dict[str, Any]], out_dir: Path, cap_bytes: int = TRACE_CAP_BYTES) -> list[dict]:
    """Write into ``out_dir`` each trace the ranks sent (``result["sent_trace"]``, popped), and name it in
    ``result["trace"]``; a trace left on its node (or one larger than ``cap_bytes``: the cap is the
    driver's too) leaves ``trace`` None. Returns the traces left on the nodes: rank, host, path, bytes."""
    kept = []
    for result in results:
        sent = result.pop("sent_trace", None)
        if sent is None:
            continue
        name = Path(sent["name"]).name  # a bare name: nothing is written outside the trial dir
        data = sent.get("data")
        if isinstance(data, bytes) and len(data) <= cap_bytes and name.startswith("trace_rank"):
            write_atomic(out_dir / name, data)
            result["trace"] = name
        else:
            result["trace"] = None
            kept.append({"rank": result.get("rank"), **(sent.get("kept") or {"bytes": len(data or b"")})})
    return kept
