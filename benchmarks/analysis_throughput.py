"""Trace-analysis throughput: MB of chrome trace analysed per second by ``summarize_traces``.

    python benchmarks/analysis_throughput.py              # records model 'small', 2 ranks, 3 steps first
    python benchmarks/analysis_throughput.py TRACE_DIR    # or analyses trace_rank*.json[.gz] in TRACE_DIR

Reports MB/s of uncompressed JSON (what the analysis parses) and of the files as stored
(gzip), for the full summary (load + classify + step/unit metrics), best of ``--repeat``.
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _record(out_dir: Path) -> None:
    script = Path(__file__).with_name("record_traces.py")
    subprocess.run([sys.executable, str(script), str(out_dir), "--model", "small", "--steps", "3"], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace_dir", nargs="?", type=Path)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from autotune.analysis import FsdpTraceAnalysis

    with tempfile.TemporaryDirectory(prefix="analysis-bench-") as tmp:
        trace_dir = args.trace_dir or Path(tmp)
        if args.trace_dir is None:
            _record(trace_dir)
        traces = sorted(trace_dir.glob("trace_rank*.json*"))
        stored = sum(p.stat().st_size for p in traces)
        raw = sum(len(gzip.decompress(p.read_bytes())) if p.suffix == ".gz" else p.stat().st_size for p in traces)
        load_s, total_s = [], []
        for _ in range(args.repeat):
            start = time.perf_counter()
            analysis = FsdpTraceAnalysis(traces)
            loaded = time.perf_counter()
            analysis.summarize()
            load_s.append(loaded - start)
            total_s.append(time.perf_counter() - start)
        best = min(total_s)
        num_events = sum(len(t.events) for t in analysis.traces.values())
        print(f"traces: {len(traces)} files, {raw / 1e6:.1f} MB JSON ({stored / 1e6:.1f} MB gzipped), {num_events} complete events")
        print(f"summarize_traces: best {best:.2f} s, median {statistics.median(total_s):.2f} s of {args.repeat} (load+classify best {min(load_s):.2f} s)")
        print(f"throughput: {raw / 1e6 / best:.1f} MB/s of JSON ({stored / 1e6 / best:.2f} MB/s gzipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
