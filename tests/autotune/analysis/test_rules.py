"""Trace metrics where they differ from a naive reading, settled as HTA settles them
([Note: trace metrics] in ``autotune/analysis/__init__.py``): kernels without a launch,
overlap across a step boundary, send/recv, the time-weighted overlap. Synthetic traces whose
right answer is obvious; the same rules on HTA's own traces: ``test_hta_agreement.py``.
"""

from __future__ import annotations

import pytest
from _trace_builders import (
    EXACT,
    STREAM_COMPUTE,
    STREAM_NCCL,
    assert_metrics,
    gloo,
    launch,
    metrics_of,
    span,
    step,
    trace,
    write,
)

from autotune.analysis import SUMMARY_SCHEMA_VERSION, FsdpTraceAnalysis, summarize_traces
from autotune.analysis._events import get_collective_kind


def gpu_trace(events: list[dict], *, rank: int = 0) -> dict:
    """A GPU-format trace: the kernels' category is ``kernel`` (``launch`` marks them so)."""
    return trace(events, rank=rank, backend="nccl")


def test_gpu_kernel_without_a_launch_is_dropped(tmp_path):
    orphan = span("ncclDevKernel_AllGather_RING_LL", 100, 900, cat="kernel", pid=0, tid=STREAM_NCCL, correlation=99)
    path = write(
        tmp_path / "t.json",
        gpu_trace(
            [
                step(1, 0, 1000),
                step(2, 1000, 2000),
                *launch("sm90_gemm", (10, 20), (100, 300), stream=STREAM_COMPUTE, correlation=1),
                *launch(
                    "ncclDevKernel_AllReduce_Sum_f32", (1010, 1020), (1100, 1200), stream=STREAM_NCCL, correlation=2
                ),
                orphan,  # its launch (correlation 99) is not in the trace: it has no step
            ]
        ),
    )
    analysis = FsdpTraceAnalysis([path])
    assert analysis.events[0].num_unlaunched_kernels == 1
    rows = {r["step"]: r for r in analysis.get_step_metrics().to_dict("records")}
    assert rows[1]["num_collectives"] == 0 and rows[1]["comm_ms"] == 0.0
    assert rows[2]["num_collectives"] == 1 and rows[2]["all_gather_ms"] == 0.0


def test_overlap_across_a_step_boundary_is_hidden(tmp_path):
    rows = metrics_of(
        tmp_path / "t.json",
        [
            step(1, 0, 1000),
            step(2, 1000, 2000),
            span("aten::mm", 0, 800),
            span("c10d::_reduce_scatter_base_", 900, 950),
            gloo("gloo:all_reduce", 950, 1200),  # issued in step 1
            span("aten::mm", 1000, 1300),  # step 2's compute
        ],
    )
    assert_metrics(
        rows[1],
        comm_ms=0.25,
        exposed_comm_ms=0.05,  # only [950, 1000) waits
        overlap_ratio=0.8,
        compute_ms=0.8,  # the step's own compute
    )
    assert rows[2]["comm_ms"] == 0.0


def test_send_recv_is_a_kind_of_its_own():
    for name in (
        "ncclDevKernel_SendRecv",
        "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t",
        "c10d::send",
        "c10d::recv_",
        "gloo:send",
        "gloo:recv",
    ):
        assert get_collective_kind(name) == "send_recv", name
    assert get_collective_kind("ncclDevKernel_Broadcast_RING_LL") == "other"


def test_send_recv_kernels_count_as_communication(tmp_path):
    path = write(
        tmp_path / "t.json",
        gpu_trace(
            [
                step(1, 0, 1000),
                *launch("sm90_gemm", (10, 20), (100, 300), stream=STREAM_COMPUTE, correlation=1),
                *launch("ncclDevKernel_SendRecv", (30, 40), (200, 500), stream=STREAM_NCCL, correlation=2),
            ]
        ),
    )
    row = FsdpTraceAnalysis([path]).get_step_metrics().iloc[0]
    assert_metrics(row, send_recv_ms=0.3, comm_ms=0.3, exposed_comm_ms=0.2)
    assert row["other_comm_ms"] == 0.0


def test_time_weighted_overlap_beside_the_median(tmp_path):
    path = write(
        tmp_path / "t.json",
        trace(
            [
                step(1, 0, 1000),
                step(2, 1000, 2000),
                step(3, 2000, 3000),
                span("aten::mm", 0, 500),
                span("c10d::allreduce_", 10, 20),
                gloo("gloo:all_reduce", 100, 200),  # 0.1 ms hidden
                span("aten::mm", 1000, 1500),
                span("c10d::allreduce_", 1010, 1020),
                gloo("gloo:all_reduce", 1100, 1200),
                span("c10d::allreduce_", 2010, 2020),
                gloo("gloo:all_reduce", 2100, 2700),  # 0.6 ms exposed
            ]
        ),
    )
    summary = summarize_traces([path])
    assert summary["schema_version"] == SUMMARY_SCHEMA_VERSION
    assert summary["aggregate"]["overlap_ratio"] == pytest.approx(1.0, abs=EXACT)  # median of 1, 1, 0
    assert summary["aggregate"]["overlap_ratio_time_weighted"] == pytest.approx(0.2 / 0.8, abs=EXACT)
    assert summary["per_rank"][0]["overlap_ratio_time_weighted"] == pytest.approx(0.25, abs=EXACT)
    assert all("send_recv_ms" in s for s in summary["per_rank"][0]["steps"])
