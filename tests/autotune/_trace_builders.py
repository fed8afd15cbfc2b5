"""Hand-built minimal chrome traces whose metrics are obvious, for the analysis tests.

``python tests/autotune/_trace_builders.py`` rewrites the GPU-format fixture
``tests/data/gpu_nccl_2rank/`` (the golden numbers in test_analysis.py follow from the
spans below: read them there).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

MAIN, WORKER = 100, 200  # training thread, gloo worker thread (pid 1)
HOST, STREAM_COMPUTE, STREAM_NCCL = 1, 7, 20
# Arbitrary epoch offset: real traces have large absolute timestamps.
T0 = 5_000_000.0


def span(
    name: str, start: float, end: float, *, tid: int = MAIN, cat: str = "cpu_op", pid: int = HOST, **args: Any
) -> dict[str, Any]:
    """A complete (``ph: X``) event from ``T0 + start`` to ``T0 + end`` (microseconds)."""
    event = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": T0 + start, "dur": end - start}
    if args:
        event["args"] = args
    return event


def step(n: int, start: float, end: float) -> dict[str, Any]:
    return span(f"ProfilerStep#{n}", start, end, cat="user_annotation")


def label(name: str, start: float, end: float) -> dict[str, Any]:
    return span(name, start, end, cat="user_annotation")


def gloo(name: str, start: float, end: float) -> dict[str, Any]:
    return span(name, start, end, tid=WORKER)


def memory(
    at: float, total_allocated: int, *, device_type: int = 0, total_reserved: int | None = None
) -> dict[str, Any]:
    args = {"Total Allocated": total_allocated, "Bytes": 0, "Device Type": device_type, "Device Id": -1}
    if total_reserved is not None:  # torch.profiler writes it with profile_memory=True
        args["Total Reserved"] = total_reserved
    return {
        "ph": "i",
        "cat": "cpu_instant_event",
        "s": "t",
        "name": "[memory]",
        "pid": HOST,
        "tid": MAIN,
        "ts": T0 + at,
        "args": args,
    }


def trace(events: list[dict[str, Any]], *, rank: int = 0, world_size: int = 2, backend: str = "gloo") -> dict[str, Any]:
    meta = [
        {"ph": "M", "name": "thread_name", "pid": HOST, "tid": MAIN, "args": {"name": "thread 100 (python)"}},
        {
            "ph": "M",
            "name": "thread_name",
            "pid": HOST,
            "tid": WORKER,
            "args": {"name": "thread 200 (pt_gloo_runloop)"},
        },
    ]
    info = {"backend": backend, "rank": rank, "world_size": world_size}
    return {"schemaVersion": 1, "distributedInfo": info, "traceEvents": meta + events}


def write(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(json.dumps(doc))
    return path


EXACT = 1e-9
"""Tolerance of the metrics of these traces: their right answers are exact."""


def metrics_of(path: Path, events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The step-metrics rows of a one-rank synthetic trace, keyed by step number."""
    from autotune.analysis import FsdpTraceAnalysis

    write(path, trace(events))
    return {row["step"]: row for row in FsdpTraceAnalysis([path]).get_step_metrics().to_dict("records")}


def assert_metrics(row: Any, **expected: float) -> None:
    """Each named metric of ``row`` (a step-metrics row) is the expected value: a zero exactly
    (nothing of it counted), any other value to :data:`EXACT`."""
    import pytest

    assert {k: row[k] for k in expected} == {
        k: v if v == 0 else pytest.approx(v, abs=EXACT) for k, v in expected.items()
    }


def launch(
    kernel: str,
    host: tuple[float, float],
    device: tuple[float, float],
    *,
    stream: int,
    correlation: int,
    api: str = "cudaLaunchKernel",
) -> list[dict[str, Any]]:
    """A host-side launch (``api`` over ``host``) and the device kernel it launched (over ``device``),
    linked by ``correlation``."""
    return [
        span(api, *host, cat="cuda_runtime", correlation=correlation),
        span(kernel, *device, cat="kernel", pid=0, tid=stream, stream=stream, correlation=correlation, device=0),
    ]


def gpu_rank_trace(rank: int) -> dict[str, Any]:
    """Two steps of 1000 us. Per rank (kernel times):

    step 1: compute [100, 400) and [500, 700); AllGather [300, 600) on rank 0,
            [100, 600) on rank 1; a Memcpy [700, 800) (neither compute nor comm).
    step 2: compute [1100, 1300); AllReduce [1150, 1250) (hidden);
            ReduceScatter [1300, 1500) (exposed).
    """
    ag_start = 300.0 if rank == 0 else 100.0
    events = [
        step(1, 0, 1000),
        step(2, 1000, 2000),
        span("aten::mm", 10, 60),
        *launch("sm90_xmma_gemm_f32", (20, 30), (100, 400), stream=STREAM_COMPUTE, correlation=1),
        label("FSDP::all_gather (layers.0)", 65, 90),
        span("c10d::_allgather_base_", 70, 85),
        *launch("ncclDevKernel_AllGather_RING_LL", (75, 80), (ag_start, 600), stream=STREAM_NCCL, correlation=2),
        span("aten::mm", 95, 120),
        *launch("sm90_xmma_gemm_f32", (100, 110), (500, 700), stream=STREAM_COMPUTE, correlation=3),
        span("aten::copy_", 130, 150),
        *launch(
            "Memcpy HtoD (Pageable -> Device)",
            (135, 145),
            (700, 800),
            stream=STREAM_COMPUTE,
            correlation=4,
            api="cudaMemcpyAsync",
        ),
        span("aten::mm", 1010, 1060),
        *launch("sm90_xmma_gemm_f32", (1020, 1030), (1100, 1300), stream=STREAM_COMPUTE, correlation=5),
        span("c10d::allreduce_", 1070, 1090),
        *launch(
            "ncclDevKernel_AllReduce_Sum_f32_RING_LL", (1075, 1080), (1150, 1250), stream=STREAM_NCCL, correlation=6
        ),
        label("FSDP::post_backward_reduce (layers.0)", 1095, 1130),
        span("c10d::_reduce_scatter_base_", 1100, 1120),
        *launch(
            "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", (1105, 1110), (1300, 1500), stream=STREAM_NCCL, correlation=7
        ),
    ]
    doc = trace(events, rank=rank, backend="nccl")
    doc["deviceProperties"] = [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85031714816}]
    for e in doc["traceEvents"]:
        if e.get("cat") == "kernel" or e["name"].startswith("Memcpy"):
            e["cat"] = "gpu_memcpy" if e["name"].startswith("Memcpy") else "kernel"
    return doc


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "data" / "gpu_nccl_2rank")
    out.mkdir(parents=True, exist_ok=True)
    for r in range(2):
        print(write(out / f"trace_rank{r}.json", gpu_rank_trace(r)))
