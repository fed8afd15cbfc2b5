"""Trace metrics (autotune.analysis): obvious synthetic cases, parsing and errors, committed fixtures.

Correctness of the CPU figures on real traces is tested against ground truth in
``test_analysis_truth.py`` (rank programs whose overlap is known by construction). The
recorded fixture ``cpu_tiny_2rank`` (``python tools/record_traces.py tests/data/cpu_tiny_2rank
--model tiny --layers 2``) is checked here only for what does not need golden numbers: the
invariants, the collectives FSDP2 issues, agreement with the raw gloo spans, the summary.
"""

from __future__ import annotations

import gzip
import json

import pytest
from _fixtures import get_fixture_traces
from _trace_builders import EXACT, assert_metrics, gloo, label, memory, metrics_of, span, step, trace, write

from autotune.analysis import SUMMARY_SCHEMA_VERSION, FsdpTraceAnalysis, TraceError, summarize_traces
from autotune.analysis._events import get_collective_kind, get_label_unit
from fsdp_runtime.errors import AutotuneError

# --- synthetic CPU traces: the right answer is obvious ---------------------------------


# (events of one rank's trace, per step: its metrics) -- the right answer is obvious
STEP_CASES = [
    pytest.param(
        [
            step(1, 0, 1000),
            span("c10d::_allgather_base_", 10, 20),
            span("aten::mm", 100, 900),
            span("aten::addmm", 150, 250),  # nested: counted once
            gloo("gloo:all_gather", 200, 700),
        ],
        {
            1: {
                "step_ms": 1.0,
                "compute_ms": 0.8,
                "comm_ms": 0.5,
                "all_gather_ms": 0.5,
                "exposed_comm_ms": 0.0,
                "overlap_ratio": 1.0,
                "bound_ms": 0.8,
                "bound_ratio": 1.25,
            }
        },
        id="comm_hidden_under_compute_is_not_exposed",
    ),
    pytest.param(
        [
            step(1, 0, 1000),
            span("aten::mm", 0, 100),
            span("c10d::_reduce_scatter_base_", 100, 150),  # enqueue: not compute
            gloo("gloo:all_reduce", 160, 460),  # the thread waits, no op runs
            span("aten::add", 500, 600),
        ],
        {
            1: {
                "compute_ms": 0.2,
                "comm_ms": 0.3,
                "exposed_comm_ms": 0.3,
                "overlap_ratio": 0.0,
                "reduce_scatter_ms": 0.3,  # gloo ran it as an all-reduce
                "all_reduce_ms": 0.0,
            }
        },
        id="comm_while_training_thread_idle_is_fully_exposed",
    ),
    pytest.param(
        [
            step(1, 0, 1000),
            span("c10d::_allgather_base_", 0, 10),
            gloo("gloo:all_gather", 20, 120),  # real transfer, under compute
            span("aten::mm", 10, 200),
            span("linkemu::hold_all_gather", 200, 500, cat="user_annotation"),  # the emulated link's remainder
            span("aten::mm", 500, 600),
        ],
        {
            1: {
                "compute_ms": 0.29,
                "comm_ms": 0.48,  # one collective, [20, 500): the link is busy until the hold ends
                "all_gather_ms": 0.48,
                "exposed_comm_ms": 0.3,
                "num_collectives": 1,
            }
        },
        id="emulated_link_holds_count_as_exposed_communication",
    ),
    pytest.param(
        [
            step(1, 0, 1000),
            span("aten::mm", 0, 300),
            span("c10d::allreduce_", 300, 320),
            gloo("gloo:all_reduce", 200, 600),  # overlaps compute on [200, 300) only
            span("aten::wait", 400, 500),  # a wait op is not compute
        ],
        {1: {"compute_ms": 0.3, "exposed_comm_ms": 0.3, "overlap_ratio": 0.25, "bound_ms": 0.4}},  # comm-bound step
        id="partial_overlap_and_wait_ops_are_not_compute",
    ),
    pytest.param(
        [
            step(1, 0, 1000),
            span("c10d::barrier", 0, 10),
            gloo("gloo:barrier", 5, 300),  # a harness syncing the ranks
            span("c10d::_allgather_base_", 400, 410),
            gloo("gloo:all_gather", 410, 500),
        ],
        {
            1: {
                "barrier_ms": 0.295,
                "comm_ms": 0.09,
                "other_comm_ms": 0.0,
                "exposed_comm_ms": 0.09,
                "num_collectives": 1,
            }
        },
        id="barriers_are_not_communication",
    ),
    pytest.param(
        [
            step(1, 0, 1000),
            step(2, 1000, 2000),
            span("c10d::_allgather_base_", 900, 950),
            gloo("gloo:all_gather", 990, 1100),
            span("c10d::_allgather_base_", 1200, 1250),
            gloo("gloo:all_gather", 1300, 1350),
        ],
        {1: {"num_collectives": 1, "comm_ms": 0.11}, 2: {"num_collectives": 1, "comm_ms": 0.05}},
        id="collectives_split_between_steps_by_issue_time",
    ),
]


@pytest.mark.parametrize(("events", "expected"), STEP_CASES)
def test_step_metrics_of_synthetic_traces(tmp_path, events, expected):
    rows = metrics_of(tmp_path / "t.json", events)
    for number, metrics in expected.items():
        assert_metrics(rows[number], **metrics)


def test_holds_pair_with_the_collectives_they_hold(tmp_path):
    path = write(
        tmp_path / "t.json",
        trace(
            [
                step(1, 0, 1000),
                step(2, 1000, 4000),
                span("linkemu::hold_all_reduce", 5, 30, cat="user_annotation"),  # issued before the window: on its own
                # Two async all-gathers in flight, both done when the first wait finds them: the hold in
                # layers.1's hooks is layers.1's (by unit), not the transfer that ended last.
                label("FSDP::all_gather (layers.1)", 40, 60),
                span("c10d::_allgather_base_", 45, 50),
                label("FSDP::forward_prefetch for layers.2", 60, 80),
                span("c10d::_allgather_base_", 65, 70),
                gloo("gloo:all_gather", 50, 100),
                gloo("gloo:all_gather", 100, 150),
                label("FSDP::pre_forward (layers.1)", 300, 400),
                span("linkemu::hold_all_gather", 310, 350, cat="user_annotation"),
                label("FSDP::pre_forward (layers.2)", 500, 600),
                span("linkemu::hold_all_gather", 510, 520, cat="user_annotation"),
                # Reduce-scatters, no labels: the first outlived its model (no hold); the hold right
                # after the second's transfer is the second's, and retires the first (waited before,
                # without a hold), so the third's hold, long after its transfer, is the third's.
                span("c10d::_reduce_scatter_base_", 700, 710),
                gloo("gloo:all_reduce", 710, 760),
                span("c10d::_reduce_scatter_base_", 800, 810),
                gloo("gloo:all_reduce", 810, 850),
                span("linkemu::hold_reduce_scatter", 850, 1100, cat="user_annotation"),
                span("c10d::_reduce_scatter_base_", 1200, 1210),
                gloo("gloo:all_reduce", 1210, 1250),
                span("linkemu::hold_reduce_scatter", 2500, 2600, cat="user_annotation"),
            ]
        ),
    )
    comm = FsdpTraceAnalysis([path]).events[0].comm
    t0 = comm["start"].min()
    got = [(r.start - t0, r.end - t0, r.kind, r.unit) for r in comm.itertuples()]
    assert got == [
        (0.0, 25.0, "all_reduce", None),
        (45.0, 345.0, "all_gather", "layers.1"),
        (95.0, 515.0, "all_gather", "layers.2"),
        (705.0, 755.0, "reduce_scatter", None),
        (805.0, 1095.0, "reduce_scatter", None),  # crosses into step 2, counts whole for step 1
        (1205.0, 2595.0, "reduce_scatter", None),
    ]
    rows = {r["step"]: r for r in FsdpTraceAnalysis([path]).get_step_metrics().to_dict("records")}
    assert rows[1]["num_collectives"] == 5 and rows[2]["num_collectives"] == 1


def test_gloo_spans_pair_with_their_enqueue_ops_in_order(tmp_path):
    path = write(
        tmp_path / "t.json",
        trace(
            [
                step(1, 0, 1000),
                gloo("gloo:all_reduce", 0, 50),  # enqueued before the window: keeps its gloo kind
                span("c10d::_reduce_scatter_base_", 100, 110),
                span("c10d::allreduce_", 120, 130),
                span("c10d::broadcast_", 140, 150),
                gloo("gloo:all_reduce", 200, 300),  # first queued: the reduce-scatter
                gloo("gloo:all_reduce", 300, 350),  # then the all-reduce
                gloo("gloo:broadcast", 400, 420),
            ]
        ),
    )
    comm = FsdpTraceAnalysis([path]).events[0].comm
    assert list(comm["kind"]) == ["all_reduce", "reduce_scatter", "all_reduce", "other"]
    assert list(comm["issue_ts"] - comm["issue_ts"].iloc[0]) == [0.0, 100.0, 120.0, 140.0]


def test_units_from_fsdp_labels(tmp_path):
    path = write(
        tmp_path / "t.json",
        trace(
            [
                step(1, 0, 1000),
                label("FSDP::pre_forward", 0, 100),
                label("FSDP::all_gather", 10, 50),
                span("c10d::_allgather_base_", 20, 30),
                label("FSDP::pre_backward (layers.1)", 200, 400),
                label("FSDP::backward_prefetch for layers.0", 210, 260),
                span("c10d::_allgather_base_", 220, 230),
                label("FSDP::post_backward_reduce (layers.1)", 500, 600),
                span("c10d::_reduce_scatter_base_", 510, 520),
                span("c10d::allreduce_", 700, 710),  # outside any label: no unit
                gloo("gloo:all_gather", 30, 90),
                gloo("gloo:all_gather", 230, 330),
                gloo("gloo:all_reduce", 520, 620),
                gloo("gloo:all_reduce", 710, 800),
            ]
        ),
    )
    analysis = FsdpTraceAnalysis([path])
    assert analysis.events[0].units == ["root", "layers.1", "layers.0"]
    units = analysis.get_unit_metrics().set_index("unit")
    assert units.loc["root", "all_gather_ms"] == pytest.approx(0.06, abs=EXACT)
    assert units.loc["layers.0", "all_gather_ms"] == pytest.approx(0.1, abs=EXACT)
    assert units.loc["layers.1", "reduce_scatter_ms"] == pytest.approx(0.1, abs=EXACT)
    assert units.loc["layers.1", "hook_ms"] == pytest.approx(0.3, abs=EXACT)  # [200,400) + [500,600)
    assert units["num_collectives"].sum() == 3  # the unlabelled all-reduce counts for the step only
    assert analysis.get_step_metrics().loc[0, "num_collectives"] == 4


def test_a_grouped_units_prefetch_is_its_own(tmp_path):
    """``fully_shard([layers.2, layers.3])`` labels the unit ``layers.2, layers.3``; a collective
    issued inside ``forward_prefetch for`` it is that unit's, not the unit whose hook prefetched."""
    path = write(
        tmp_path / "t.json",
        trace(
            [
                step(1, 0, 1000),
                label("FSDP::pre_forward (layers.0, layers.1)", 0, 300),
                label("FSDP::forward_prefetch for layers.2, layers.3", 100, 200),
                span("c10d::_allgather_base_", 110, 120),
                gloo("gloo:all_gather", 120, 400),
            ]
        ),
    )
    units = FsdpTraceAnalysis([path]).get_unit_metrics().set_index("unit")
    assert units.loc["layers.2, layers.3", "all_gather_ms"] == pytest.approx(0.28, abs=EXACT)
    assert units.loc["layers.0, layers.1", "num_collectives"] == 0


def test_label_and_kind_parsing():
    assert get_label_unit("FSDP::pre_forward (layers.0)") == ("pre_forward", "layers.0")
    assert get_label_unit("FSDP::backward_prefetch for layers.3") == ("backward_prefetch", "layers.3")
    # a grouped unit (fully_shard on a list of modules): FSDP2 joins the FQNs with ", "
    assert get_label_unit("FSDP::forward_prefetch for layers.0, layers.1") == ("forward_prefetch", "layers.0, layers.1")
    assert get_label_unit("FSDP::pre_backward (layers.2, layers.3)") == ("pre_backward", "layers.2, layers.3")
    assert get_label_unit("FSDP::post_backward_rs_wait ()") == ("post_backward_rs_wait", "root")
    assert get_label_unit("FSDP::root_pre_forward") == ("root_pre_forward", "root")
    assert get_label_unit("aten::mm") is None
    assert get_collective_kind("c10d::_reduce_scatter_base_") == "reduce_scatter"
    assert get_collective_kind("ncclDevKernel_AllGather_RING_LL") == "all_gather"
    assert get_collective_kind("gloo:all_reduce") == "all_reduce"
    assert get_collective_kind("c10d::broadcast_") == "other"
    assert get_collective_kind("gloo:barrier") == "barrier"


def test_peak_memory_per_step(tmp_path):
    rows = metrics_of(
        tmp_path / "t.json",
        [
            step(1, 0, 1000),
            step(2, 1000, 2000),
            memory(10, 500),
            memory(20, 900),
            memory(1500, 700),
        ],
    )
    assert rows[1]["profiler_peak_allocated_bytes"] == 900
    assert rows[2]["profiler_peak_allocated_bytes"] == 700
    assert rows[1]["overlap_ratio"] is None  # no comm: undefined, not 0


# --- errors: one line, naming the file and the problem ----------------------------------


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"", "empty file"),
        (gzip.compress(json.dumps(trace([step(1, 0, 10)])).encode())[:-20], "truncated or corrupt gzip"),
        (json.dumps(trace([step(1, 0, 10)])).encode()[:-30], "truncated"),
        (b"hello world", "not valid JSON"),
        (b'{"foo": 1}', "no 'traceEvents' list"),
        (json.dumps(trace([span("aten::mm", 0, 10)])).encode(), "no ProfilerStep#N spans"),
        (b"\x89PNG\r\n\x1a\n\x00\xff", "binary content"),
    ],
)
def test_unusable_files_raise_one_line_errors(tmp_path, content, problem):
    path = tmp_path / "trace_rank0.json.gz"
    path.write_bytes(content)
    with pytest.raises(TraceError) as info:
        summarize_traces([path])
    message = str(info.value)
    assert isinstance(info.value, AutotuneError)
    assert message.startswith(str(path)) and problem in message and "\n" not in message


def test_missing_file_and_duplicate_rank(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        summarize_traces([tmp_path / "nope.json"])
    a = write(tmp_path / "a.json", trace([step(1, 0, 10)], rank=0))
    b = write(tmp_path / "b.json", trace([step(1, 0, 10)], rank=0))
    with pytest.raises(TraceError, match="rank 0 already loaded"):
        summarize_traces([a, b])
    with pytest.raises(TraceError, match="no trace files"):
        summarize_traces([])


# --- GPU-format fixture: our kernel-based numbers against HTA's -------------------------


def test_gpu_fixture_golden_and_matches_hta():
    analysis = FsdpTraceAnalysis(get_fixture_traces("gpu_nccl_2rank"))
    assert analysis.device == "gpu"
    steps = analysis.get_step_metrics().set_index(["rank", "step"])
    # See _trace_builders.gpu_rank_trace: rank 0 AllGather [300, 600) vs compute [100,400)+[500,700).
    assert steps.loc[(0, 1), "compute_ms"] == pytest.approx(0.5, abs=EXACT)  # the Memcpy is not compute
    assert steps.loc[(0, 1), "exposed_comm_ms"] == pytest.approx(0.1, abs=EXACT)
    assert steps.loc[(1, 1), "comm_ms"] == pytest.approx(0.5, abs=EXACT)
    assert steps.loc[(1, 1), "exposed_comm_ms"] == pytest.approx(0.1, abs=EXACT)
    assert steps.loc[(0, 2), "reduce_scatter_ms"] == pytest.approx(0.2, abs=EXACT)
    assert steps.loc[(0, 2), "all_reduce_ms"] == pytest.approx(0.1, abs=EXACT)
    assert steps.loc[(0, 2), "exposed_comm_ms"] == pytest.approx(0.2, abs=EXACT)

    hta = analysis.get_hta_comm_comp_overlap().set_index("rank")["comp_comm_overlap_pctg"]
    for rank, group in steps.groupby(level="rank"):
        ours = 1.0 - group["exposed_comm_ms"].sum() / group["comm_ms"].sum()
        assert round(100 * ours, 2) == pytest.approx(hta[rank], abs=EXACT)
    assert list(hta) == [50.0, 62.5]


# --- recorded CPU/gloo fixture: invariants and raw spans (ground truth: test_analysis_truth.py)


@pytest.fixture(scope="module")
def cpu_analysis() -> FsdpTraceAnalysis:
    return FsdpTraceAnalysis(get_fixture_traces("cpu_tiny_2rank"))


def test_cpu_fixture_invariants(cpu_analysis):
    steps = cpu_analysis.get_step_metrics()
    kinds = steps[["all_gather_ms", "reduce_scatter_ms", "all_reduce_ms", "other_comm_ms"]].sum(axis=1)
    assert (steps["comm_ms"] <= kinds + EXACT).all()
    assert (steps["exposed_comm_ms"] <= steps["comm_ms"] + EXACT).all()
    assert (steps["compute_ms"] < steps["step_ms"]).all() and (steps["bound_ratio"] >= 1).all()
    # FSDP2, 2 blocks + root, no accumulation: 5 all-gathers (root once, blocks in forward and
    # backward) and 3 reduce-scatters per step, all issued inside the units' FSDP labels.
    comm = cpu_analysis.events[0].comm
    assert comm["unit"].notna().all()
    assert comm.groupby("kind").size().to_dict() == {"all_gather": 10, "reduce_scatter": 6}


def _raw_union_ms(spans: list[tuple[float, float]]) -> float:
    total, cursor = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > cursor:
            total += end - max(start, cursor)
            cursor = end
    return total / 1000.0


def test_cpu_fixture_comm_matches_raw_gloo_spans(cpu_analysis):
    """Independent of the analyzer: union of the raw gloo spans that start inside each step."""
    analysed = cpu_analysis.get_step_metrics().set_index(["rank", "step"])
    for rank, path in enumerate(get_fixture_traces("cpu_tiny_2rank")):
        events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
        steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")]
        gloo_spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name", "").startswith("gloo:")]
        expected = {}
        for s in steps:
            inside = [(a, b) for a, b in gloo_spans if s["ts"] <= a < s["ts"] + s["dur"]]
            expected[int(s["name"].split("#")[1])] = _raw_union_ms(inside)
        assert sorted(expected) == [1, 2]
        for key, value in expected.items():
            assert analysed.loc[(rank, key), "comm_ms"] == pytest.approx(value, abs=1e-6)


def test_summary_schema_and_aggregate(cpu_analysis):
    summary = cpu_analysis.summarize()
    assert json.loads(json.dumps(summary)) == summary  # JSON-able, no NaN
    assert (summary["schema_version"], summary["kind"], summary["device"], summary["num_ranks"]) == (
        SUMMARY_SCHEMA_VERSION,
        "trace_metrics",
        "cpu",
        2,
    )
    rank0 = summary["per_rank"][0]
    assert rank0["trace"] == "trace_rank0.json.gz" and [s["step"] for s in rank0["steps"]] == [1, 2]
    assert rank0["profiler_peak_allocated_bytes"] == 2532124
    assert [u["unit"] for u in rank0["per_unit"]] == ["root", "layers.0", "layers.1"]
    root = cpu_analysis.get_unit_metrics().query("rank == 0 and unit == 'root'")
    assert rank0["per_unit"][0]["all_gather_ms"] == pytest.approx(root["all_gather_ms"].median(), abs=EXACT)
    aggregate = summary["aggregate"]
    step_ms = sorted(cpu_analysis.get_step_metrics()["step_ms"])
    assert aggregate["num_steps"] == 4
    assert aggregate["step_ms"] == pytest.approx((step_ms[1] + step_ms[2]) / 2, abs=EXACT)
    assert aggregate["profiler_peak_allocated_bytes"] == 2532124
    assert [u["unit"] for u in aggregate["per_unit"]] == ["root", "layers.0", "layers.1"]
