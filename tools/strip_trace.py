"""Strips a trial's rank traces to the events the trace analysis reads: small test fixtures.

    python tools/strip_trace.py runs/pp2-1f1b-tiny/trial_0000 tests/data/cpu_pp2_1f1b   # TRIAL_DIR OUT_DIR

Keeps the training thread's top-level CPU ops (their union is that of every op: the compute)
and its communication ops at any depth (``c10d::``, ``gloo:``, waits), every ``ProfilerStep#``,
``FSDP::``, ``PP:``, ``gloo:`` and ``linkemu::`` span of any thread from a second before the
first profiled step on, and the thread names; drops every other event, every ``args`` and the
``[memory]`` events (so no profiler peak). The analysis of the stripped traces gives the full
traces' figures (checked when the fixtures were made; the memory peaks aside). Copies the
trial's ``config.toml`` beside them.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
from pathlib import Path
from typing import Any

_SPANS = re.compile(r"^(ProfilerStep#|FSDP::|PP:|gloo:|c10d::|linkemu::)")
_NOT_COMPUTE = re.compile(r"^(?:c10d::|_?c10d_functional::|gloo:|nccl:|record_param_comms)|wait", re.IGNORECASE)
_FIELDS = ("ph", "cat", "name", "pid", "tid", "ts", "dur")
_BEFORE_US = 1e6


def _main_ops(events: list[dict[str, Any]], main: tuple[Any, Any]) -> list[dict[str, Any]]:
    ops = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op" and (e["pid"], e["tid"]) == main),
        key=lambda e: (e["ts"], -e["dur"]),
    )
    kept, end = [], float("-inf")
    for e in ops:
        top = e["ts"] >= end
        if top:
            end = e["ts"] + e["dur"]
        if top or _NOT_COMPUTE.search(e["name"]):
            kept.append(e)
    return kept


def strip_trace(src: Path, dst: Path) -> None:
    doc = json.loads(gzip.decompress(src.read_bytes()))
    events = doc["traceEvents"]
    steps = [e for e in events if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")]
    since = min(e["ts"] for e in steps) - _BEFORE_US
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") != "cpu_op" and _SPANS.match(e["name"])]
    kept = [
        {k: e[k] for k in _FIELDS if k in e}
        for e in _main_ops(events, (steps[0]["pid"], steps[0]["tid"])) + spans
        if e["ts"] + e["dur"] >= since
    ]
    kept += [e for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"]
    info = {k: doc["distributedInfo"][k] for k in ("backend", "rank", "world_size")}
    out = {"schemaVersion": doc.get("schemaVersion"), "distributedInfo": info, "traceEvents": kept}
    dst.write_bytes(gzip.compress(json.dumps(out, separators=(",", ":")).encode(), mtime=0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trial_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for trace in sorted(args.trial_dir.glob("trace_rank*.json.gz")):
        strip_trace(trace, args.out_dir / trace.name)
        print(args.out_dir / trace.name)
    if (args.trial_dir / "config.toml").exists():
        shutil.copy(args.trial_dir / "config.toml", args.out_dir / "config.toml")


if __name__ == "__main__":
    main()
