"""Prints the trace analysis' throughput (MB of chrome trace per second of ``summarize_traces``) and peak memory.

    python benchmarks/analysis_throughput.py                      # a generated ~50 MB CPU trace (one rank)
    python benchmarks/analysis_throughput.py --kind gpu --mb 50   # a generated ~50 MB GPU (NCCL) trace
    python benchmarks/analysis_throughput.py TRACE [TRACE ...]    # or these trace files (one per rank)
    python benchmarks/analysis_throughput.py --profile            # plus a cProfile of one run (top 25)

The generated trace tiles a real recorded trace (``tests/data/cpu_tiny_2rank`` rank 0, or
HTA's ``tests/data/hta_nccl/sampled_rank-0.json.gz`` for ``--kind gpu``) step after step,
shifted in time and renumbered, written in Kineto's indented layout, until it is ``--mb``
MB of JSON. Every measurement runs in a fresh process (so the peak RSS is this analysis'
own): the wall and CPU time of ``summarize_traces`` (best and median of ``--repeat``), the rise of the
process' peak RSS over its RSS before the analysis (VmHWM - VmRSS), and, in one more run,
tracemalloc's peak (Python and numpy allocations). Throughput counts uncompressed JSON
bytes (what the analysis parses), per core: the analysis is single-threaded, so MB per
CPU-second is the per-core rate (it holds on a loaded box, where wall time also counts
waiting for a core); the wall rate is printed beside it with the load average.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
SOURCES = {
    "cpu": REPO / "tests/data/cpu_tiny_2rank/trace_rank0.json.gz",
    "gpu": REPO / "tests/data/hta_nccl/sampled_rank-0.json.gz",
}


def _load(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)


def _shifted(
    event: dict[str, Any], *, copy: int, offset: float, num_steps: int, max_correlation: int
) -> dict[str, Any]:
    event = dict(event, ts=event["ts"] + offset)
    name = event.get("name", "")
    if isinstance(name, str) and name.startswith("ProfilerStep#"):
        event["name"] = f"ProfilerStep#{int(name.split('#')[1]) + copy * num_steps}"
    args = event.get("args")
    if isinstance(args, dict) and isinstance(args.get("correlation"), int) and args["correlation"] > 0:
        event["args"] = dict(args, correlation=args["correlation"] + copy * max_correlation)
    return event


def generate_trace(kind: str, out: Path, megabytes: float) -> Path:
    """A ``megabytes`` MB chrome trace: the source trace's steps tiled one after the other."""
    doc = _load(SOURCES[kind])
    events = [e for e in doc["traceEvents"] if isinstance(e, dict)]
    meta = [e for e in events if e.get("ph") == "M" or "ts" not in e]
    timed = [e for e in events if e.get("ph") != "M" and "ts" in e]
    steps = [e for e in timed if str(e.get("name", "")).startswith("ProfilerStep#")]
    start = min(e["ts"] for e in timed)
    span = max(e["ts"] + e.get("dur", 0) for e in timed) - start + 1000.0
    max_correlation = max(
        (e.get("args", {}).get("correlation", 0) for e in timed if isinstance(e.get("args"), dict)), default=0
    )
    one_copy = sum(len(json.dumps(e, indent=2)) + 2 for e in timed)
    copies = max(1, round(megabytes * 1e6 / one_copy))
    header = {k: v for k, v in doc.items() if k not in ("traceEvents", "traceName")}
    with out.open("w", encoding="utf-8") as f:
        f.write(json.dumps(header, indent=2)[:-2] + ',\n  "traceEvents": [\n')
        first = True
        for event in meta:
            f.write(("" if first else ",\n") + json.dumps(event, indent=2))
            first = False
        for copy in range(copies):
            for event in timed:
                shifted = _shifted(
                    event, copy=copy, offset=copy * span, num_steps=len(steps), max_correlation=max_correlation
                )
                f.write(("" if first else ",\n") + json.dumps(shifted, indent=2))
                first = False
        f.write('\n  ],\n  "traceName": "generated"\n}\n')
    return out


def _memory_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def measure(paths: list[Path], mode: str) -> dict[str, float]:
    """One analysis in this (fresh) process: seconds, RSS rise, or tracemalloc's peak."""
    import tracemalloc

    from autotune.analysis import summarize_traces

    result: dict[str, float] = {}
    if mode == "tracemalloc":
        tracemalloc.start()
        summarize_traces(paths)
        result["tracemalloc_peak_mb"] = tracemalloc.get_traced_memory()[1] / 1e6
        tracemalloc.stop()
        return result
    rss_before = _memory_kb("VmRSS")
    start, cpu_start = time.perf_counter(), time.process_time()
    summarize_traces(paths)
    result["seconds"], result["cpu_seconds"] = time.perf_counter() - start, time.process_time() - cpu_start
    result["rss_rise_mb"] = (_memory_kb("VmHWM") - rss_before) * 1024 / 1e6
    return result


def _run_measure(paths: list[Path], mode: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--measure", mode, *map(str, paths)], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _profile(paths: list[Path]) -> None:
    import cProfile
    import pstats

    from autotune.analysis import summarize_traces

    profiler = cProfile.Profile()
    profiler.runcall(summarize_traces, paths)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="*", type=Path, help="trace files to analyse (default: generate one)")
    parser.add_argument("--kind", choices=sorted(SOURCES), default="cpu", help="what to generate")
    parser.add_argument("--mb", type=float, default=50.0, help="size of the generated trace, MB of JSON")
    parser.add_argument("--gzip", action="store_true", help="gzip the generated trace (as autotune trial writes them)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one analysis")
    parser.add_argument("--measure", choices=["time", "tracemalloc"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.traces, args.measure)))
        return 0

    with tempfile.TemporaryDirectory(prefix="analysis-bench-") as tmp:
        paths = args.traces
        if not paths:
            generated = generate_trace(args.kind, Path(tmp) / "trace_rank0.json", args.mb)
            if args.gzip:
                gz = generated.with_suffix(".json.gz")
                gz.write_bytes(gzip.compress(generated.read_bytes(), compresslevel=6))
                generated.unlink()
                generated = gz
            paths = [generated]
        stored = sum(p.stat().st_size for p in paths)
        raw = sum(len(gzip.decompress(p.read_bytes())) if p.name.endswith(".gz") else p.stat().st_size for p in paths)
        runs = [_run_measure(paths, "time") for _ in range(args.repeat)]
        traced = _run_measure(paths, "tracemalloc")
        seconds, cpu = [r["seconds"] for r in runs], [r["cpu_seconds"] for r in runs]
        best = min(seconds)
        print(f"traces: {len(paths)} file(s), {raw / 1e6:.1f} MB JSON ({stored / 1e6:.1f} MB as stored)")
        print(
            f"summarize_traces: wall best {best:.2f} s, median {statistics.median(seconds):.2f} s; CPU best {min(cpu):.2f} s, "
            f"median {statistics.median(cpu):.2f} s, of {args.repeat} runs (each in a fresh process)"
        )
        print(
            f"throughput: {raw / 1e6 / min(cpu):.1f} MB/s of JSON per core-second of CPU (median {raw / 1e6 / statistics.median(cpu):.1f}); "
            f"{raw / 1e6 / best:.1f} MB/s wall (median {raw / 1e6 / statistics.median(seconds):.1f})"
        )
        rss = max(r["rss_rise_mb"] for r in runs)
        print(
            f"peak memory: RSS rise {rss:.0f} MB ({rss / (raw / 1e6):.2f}x the JSON), tracemalloc peak {traced['tracemalloc_peak_mb']:.0f} MB "
            f"({traced['tracemalloc_peak_mb'] / (raw / 1e6):.2f}x)"
        )
        print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        if args.profile:
            _profile(paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
