"""Records small CPU/gloo FSDP2 chrome traces (one per rank) under ``torch.profiler``: the analysis tests' fixtures.

Regenerates the committed fixtures of the trace-analysis golden tests, and the bigger
trace of ``benchmarks/analysis_throughput.py``::

    python tools/record_traces.py tests/data/cpu_tiny_2rank --model tiny --layers 2
    python tools/record_traces.py /tmp/small --model small --steps 3

Each rank trains ``--warmup`` unprofiled steps, then ``--steps`` profiled steps (CPU
activity, ``ProfilerStep#N`` annotations, memory events), and writes
``trace_rank{r}.json.gz``. Timings differ on every run: after re-recording a fixture,
regenerate its golden numbers (``tests/autotune/analysis/test_analysis.py`` says how).
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def record_rank(
    rank: int, world_size: int, *, model: str | dict, config: dict, out_dir: str, warmup: int, steps: int
) -> str:
    """Rank program: train under the profiler and write this rank's gzipped trace."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from autotune.trials import build_training

    training = build_training(rank, world_size, model=model, config=config)
    for s in range(warmup):
        training.step(s)
    out = Path(out_dir) / f"trace_rank{rank}.json.gz"
    raw = out.with_suffix("")  # torch writes plain JSON; gzip it afterwards
    sched = schedule(wait=0, warmup=1, active=steps, repeat=1)
    with profile(
        activities=[ProfilerActivity.CPU],
        schedule=sched,
        profile_memory=True,
        on_trace_ready=lambda p: p.export_chrome_trace(str(raw)),
    ) as prof:
        for s in range(1 + steps):
            training.step(warmup + s)
            prof.step()
    with open(raw, "rb") as src, gzip.open(out, "wb", compresslevel=9) as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    return str(out)


def main() -> int:
    from autotune.trials import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--unshard-async", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--layers", type=int, default=None, help="override the profile's number of blocks")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    config = {"schema_version": 1, "unshard_async": args.unshard_async, "num_microbatches": args.microbatches}
    model = args.model if args.layers is None else {"name": args.model, "num_layers": args.layers}
    run = run_ranks(
        "tools.record_traces:record_rank",
        world_size=args.world_size,
        kwargs={
            "model": model,
            "config": config,
            "out_dir": str(args.out_dir.resolve()),
            "warmup": args.warmup,
            "steps": args.steps,
        },
        timeout_s=300,
    )
    if not run.ok:
        print(f"recording failed: {run.status}: {run.reason}", file=sys.stderr)
        return 1
    for path in run.results:
        print(f"{path}: {Path(path).stat().st_size / 1e3:.0f} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
