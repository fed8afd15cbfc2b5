"""Pipeline trials in the traces ([Note: pipeline bubble] in ``autotune/analysis/__init__.py``):
P2P split off the FSDP collectives, the bubble, each stage's figures.

Synthetic traces whose right answers are worked out in each test's docstring, then two real
4-rank trials (``tiny``, ``mesh.pp = 2``, 4 microbatches, ``--cluster cpu-emulated-ib``)
stripped to the events the analysis reads by ``tools/strip_trace.py``:
``tests/data/cpu_pp2_1f1b`` (1F1B) and ``tests/data/cpu_pp2_interleaved`` (interleaved 1F1B, 2
virtual stages); the stripped traces give the full traces' figures (checked when made).
"""

from __future__ import annotations

import pytest
from _artifact_fixtures import load_fixture
from _fixtures import DATA, get_fixture_traces
from _trace_builders import EXACT, gloo, label, span, step, trace, write

from autotune.analysis import FsdpTraceAnalysis, PipelineLayout, TraceError, summarize_traces
from fsdp_runtime import load_config

PP2 = PipelineLayout(pp=2, schedule="1f1b")


def approx(value: float) -> object:
    return pytest.approx(value, abs=EXACT)


def p2p(name: str, start: float, end: float) -> dict:
    """gloo's send/recv span: on the training thread, from the post to the return of the wait."""
    return label(name, start, end)


def stage0_events() -> list[dict]:
    """Rank 0 (stage 0), one step [0, 1000) us:

    compute [0, 100), [400, 580), [750, 850); a receive [105, 400) waited for right away; the
    all-gather of ``layers.0`` [600, 700), exposed; a send [645, 900), outstanding while the
    rank computes and then waited for; the trial's broadcast [960, 980) outside every unit.
    Idle gaps: [100, 400) ends with the receive (a wait: [105, 400) pending, 295 us), [580, 600)
    and [700, 750) with no completion (Python, even with the send pending: not bubble),
    [850, 960) ends with the send at 900 (a wait of 50 us). Bubble 345 us; P2P 295 + 255 us.
    """
    return [
        step(1, 0, 1000),
        span("aten::mm", 0, 100),
        span("c10d::recv_", 100, 110),
        p2p("gloo:recv", 105, 400),
        span("aten::mm", 400, 580),
        label("FSDP::all_gather (layers.0)", 580, 600),
        span("c10d::_allgather_base_", 585, 590),
        gloo("gloo:all_gather", 600, 700),
        span("c10d::send", 640, 650),
        p2p("gloo:send", 645, 900),
        span("aten::mm", 750, 850),
        span("c10d::broadcast_", 950, 955),
        gloo("gloo:broadcast", 960, 980),
    ]


def stage1_events() -> list[dict]:
    """Rank 1 (stage 1): a receive [5, 420) waited for until compute [420, 800) starts; the
    all-gather of ``layers.1`` [430, 700) hidden under it; a send [805, 850) waited for. Bubble
    [5, 420) + [805, 850) = 460 us."""
    return [
        step(1, 0, 1000),
        span("c10d::recv_", 0, 10),
        p2p("gloo:recv", 5, 420),
        label("FSDP::all_gather (layers.1)", 410, 420),
        span("c10d::_allgather_base_", 412, 418),
        span("aten::mm", 420, 800),
        gloo("gloo:all_gather", 430, 700),
        span("c10d::send", 800, 810),
        p2p("gloo:send", 805, 850),
    ]


@pytest.fixture
def two_stages(tmp_path):
    return [
        write(tmp_path / "trace_rank0.json", trace(stage0_events(), rank=0)),
        write(tmp_path / "trace_rank1.json", trace(stage1_events(), rank=1)),
    ]


def test_p2p_is_pipeline_traffic_not_fsdp_communication(two_stages):
    steps = FsdpTraceAnalysis(two_stages, pipeline=PP2).get_step_metrics().set_index("rank")
    rank0 = steps.loc[0]
    assert rank0["send_recv_ms"] == 0 and rank0["num_collectives"] == 2  # the all-gather and the broadcast
    assert (rank0["comm_ms"], rank0["all_gather_ms"], rank0["other_comm_ms"]) == (
        approx(0.12),
        approx(0.1),
        approx(0.02),
    )
    assert rank0["exposed_comm_ms"] == approx(0.12) and rank0["compute_ms"] == approx(0.38)
    assert rank0["p2p_ms"] == approx(0.55)


def test_without_a_layout_p2p_stays_send_recv_communication(two_stages):
    """A trace analysed without its trial's layout counts gloo's send/recv as collectives (``send_recv``)."""
    rank0 = FsdpTraceAnalysis(two_stages).get_step_metrics().set_index("rank").loc[0]
    assert rank0["send_recv_ms"] == approx(0.55) and rank0["comm_ms"] == approx(0.615)
    assert rank0["p2p_ms"] is None and rank0["bubble_ms"] is None


def test_bubble_counts_the_waits_that_a_transfer_ends(two_stages):
    steps = FsdpTraceAnalysis(two_stages, pipeline=PP2).get_step_metrics().set_index("rank")
    assert steps.loc[0, "bubble_ms"] == approx(0.345)  # not 0.395: [700, 750) waits on nothing
    assert steps.loc[1, "bubble_ms"] == approx(0.46) and steps.loc[1, "p2p_ms"] == approx(0.46)


def test_each_stage_has_its_units_overlap_p2p_and_bubble(two_stages):
    stages = FsdpTraceAnalysis(two_stages, pipeline=PP2).get_stage_metrics().set_index("stage")
    assert list(stages["rank"]) == [0, 1]
    expected = {
        0: {"compute_ms": 0.38, "fsdp_comm_ms": 0.1, "exposed_fsdp_comm_ms": 0.1, "overlap_ratio": 0.0},
        1: {"compute_ms": 0.38, "fsdp_comm_ms": 0.27, "exposed_fsdp_comm_ms": 0.0, "overlap_ratio": 1.0},
    }
    for stage, figures in expected.items():
        assert {k: stages.loc[stage, k] for k in figures} == {k: approx(v) for k, v in figures.items()}
    assert (stages.loc[0, "p2p_ms"], stages.loc[0, "bubble_ms"]) == (approx(0.55), approx(0.345))
    assert stages.loc[0, "num_collectives"] == 1  # the broadcast is the rank's, no stage's


def test_summary_has_the_pipeline_section_and_units_by_stage(two_stages):
    summary = summarize_traces(two_stages, pipeline=PP2)
    assert [r["stages"] for r in summary["per_rank"]] == [[0], [1]]
    section = summary["pipeline"]
    assert (section["pp"], section["virtual_stages"], section["schedule"]) == (2, 1, "1f1b")
    assert [(s["stage"], s["ranks"], s["blocks"], s["num_steps"]) for s in section["stages"]] == [
        (0, [0], ["layers.0"], 1),
        (1, [1], ["layers.1"], 1),
    ]
    assert section["stages"][0]["bubble_ms"] == approx(0.345)
    assert section["stages"][1]["overlap_ratio_time_weighted"] == approx(1.0)
    assert [(u["stage"], u["unit"]) for u in summary["aggregate"]["per_unit"]] == [(0, "layers.0"), (1, "layers.1")]
    assert summary["aggregate"]["bubble_ms"] == approx((0.345 + 0.46) / 2)


def test_a_p2p_hold_extends_its_transfer_not_another_collective(tmp_path):
    """``linkemu::hold_p2p`` after a send [100, 150): the send lasts until the hold's end (500);
    the broadcast before it stays 20 us (v3 counted the hold as ``other`` and stretched it)."""
    events = [
        step(1, 0, 1000),
        span("c10d::broadcast_", 20, 25),
        gloo("gloo:broadcast", 30, 50),
        span("c10d::send", 95, 100),
        p2p("gloo:send", 100, 150),
        label("linkemu::hold_p2p", 300, 500),
    ]
    paths = [write(tmp_path / f"trace_rank{r}.json", trace(events, rank=r)) for r in range(2)]
    for pipeline, p2p_column in [(PP2, "p2p_ms"), (None, "send_recv_ms")]:
        row = FsdpTraceAnalysis(paths, pipeline=pipeline).get_step_metrics().iloc[0]
        assert row["other_comm_ms"] == approx(0.02) and row[p2p_column] == approx(0.4)


def interleaved_events() -> list[dict]:
    """Rank 0 of pp 2 x 2 virtual stages (stages 0 and 2), one step [0, 1000) us, torch's action labels.

    ``PP:0F0`` [0, 300): the root's all-gather [20, 60) and that of ``layers.0`` [60, 120),
    compute [100, 250); ``PP:0SEND_F0``: a send [304, 960) (waited for at the end of the step);
    ``PP:2RECV_F0``: a receive [324, 500); ``PP:2F0`` [340, 900): the root's hooks again, the
    all-gather of ``layers.2`` [500, 560), compute [520, 800); the optimizer's compute [900, 950)
    in no label. Stage 0: compute 150 us, FSDP comm [20, 120) with [20, 100) exposed; stage 2:
    compute 280 us, comm [500, 560) with [500, 520) exposed. Waits: [250, 500) ends with stage 2's
    receive (pending from 304: 196 us), [950, 960) with stage 0's send (10 us); [800, 900) ends
    with no completion.
    """
    return [
        step(1, 0, 1000),
        label("PP:0F0", 0, 300),
        label("FSDP::root_pre_forward", 0, 5),
        label("FSDP::all_gather", 5, 20),
        span("c10d::_allgather_base_", 10, 15),
        gloo("gloo:all_gather", 20, 60),
        label("FSDP::all_gather (layers.0)", 20, 40),
        span("c10d::_allgather_base_", 25, 30),
        gloo("gloo:all_gather", 60, 120),
        span("aten::mm", 100, 250),
        label("PP:0SEND_F0", 300, 320),
        span("c10d::send", 302, 306),
        p2p("gloo:send", 304, 960),
        label("PP:2RECV_F0", 320, 340),
        span("c10d::recv_", 322, 326),
        p2p("gloo:recv", 324, 500),
        label("PP:2F0", 340, 900),
        label("FSDP::root_pre_forward", 340, 345),
        label("FSDP::all_gather (layers.2)", 345, 360),
        span("c10d::_allgather_base_", 350, 355),
        gloo("gloo:all_gather", 500, 560),
        span("aten::mm", 520, 800),
        span("aten::mm", 900, 950),
    ]


def test_a_rank_holding_two_stages_splits_by_the_action_labels(tmp_path):
    paths = [
        write(tmp_path / "trace_rank0.json", trace(interleaved_events(), rank=0)),
        write(tmp_path / "trace_rank1.json", trace([step(1, 0, 1000), span("aten::mm", 0, 100)], rank=1)),
    ]
    analysis = FsdpTraceAnalysis(paths, pipeline=PipelineLayout(pp=2, virtual_stages=2))
    assert analysis.events[0].stages == [0, 2] and analysis.events[1].stages == [1, 3]
    assert analysis.events[0].unit_stages == {"root": 0, "layers.0": 0, "layers.2": 2}
    stages = analysis.get_stage_metrics().set_index("stage")
    expected = {
        0: {"compute_ms": 0.15, "fsdp_comm_ms": 0.1, "exposed_fsdp_comm_ms": 0.08, "p2p_ms": 0.656, "bubble_ms": 0.01},
        2: {
            "compute_ms": 0.28,
            "fsdp_comm_ms": 0.06,
            "exposed_fsdp_comm_ms": 0.02,
            "p2p_ms": 0.176,
            "bubble_ms": 0.196,
        },
    }
    for stage, figures in expected.items():
        assert {k: stages.loc[stage, k] for k in figures} == {k: approx(v) for k, v in figures.items()}
    assert stages.loc[2, "overlap_ratio"] == approx(1 - 20 / 60)
    rank0 = analysis.get_step_metrics().set_index("rank").loc[0]
    assert rank0["compute_ms"] == approx(0.48)  # the optimizer's 50 us belong to no stage
    assert (rank0["bubble_ms"], rank0["p2p_ms"]) == (approx(0.206), approx(0.656))


def test_ranks_must_split_into_the_pipeline_ranks(two_stages):
    with pytest.raises(TraceError, match="2 rank traces do not split into mesh.pp = 3"):
        FsdpTraceAnalysis(two_stages, pipeline=PipelineLayout(pp=3))


def test_a_trace_without_a_pipeline_keeps_its_figures():
    """The recorded non-pipeline fixture: every figure as the stored v3 summary has it (4 decimals),
    the pipeline figures null."""
    summary = summarize_traces(get_fixture_traces("cpu_tiny_2rank"))
    stored = load_fixture("metrics_v6.json")["trace_metrics"]  # the v3 summary upgraded, numbers as stored

    def measured(new: dict, old: dict) -> None:
        for key, value in old.items():
            if isinstance(value, float) and "time_weighted" not in key:
                assert round(new[key], 4) == value, key
            elif not isinstance(value, (dict, list)) and key not in ("send_recv_ms", "overlap_ratio_time_weighted"):
                assert new[key] == value, key

    assert summary["pipeline"] is None
    for rank, old_rank in zip(summary["per_rank"], stored["per_rank"], strict=True):
        assert rank["stages"] is None
        for new_step, old_step in zip(rank["steps"], old_rank["steps"], strict=True):
            measured(new_step, old_step)
            assert new_step["p2p_ms"] is None and new_step["bubble_ms"] is None
        for new_unit, old_unit in zip(rank["per_unit"], old_rank["per_unit"], strict=True):
            measured(new_unit, old_unit)
            assert new_unit["stage"] is None
    measured(summary["aggregate"], stored["aggregate"])
    assert [u["unit"] for u in summary["aggregate"]["per_unit"]] == ["root", "layers.0", "layers.1"]


# --- the real trials (stripped)


def _analyze(name: str) -> FsdpTraceAnalysis:
    return FsdpTraceAnalysis(
        get_fixture_traces(name), pipeline=PipelineLayout.from_config(load_config(DATA / name / "config.toml"))
    )


def test_real_1f1b_trial_per_stage():
    analysis = _analyze("cpu_pp2_1f1b")
    steps, stages = analysis.get_step_metrics(), analysis.get_stage_metrics()
    assert (steps["send_recv_ms"] == 0).all() and (steps["p2p_ms"] > 0).all()
    assert (steps["bubble_ms"] <= steps["p2p_ms"] + EXACT).all()
    assert list(stages["bubble_ms"]) == list(steps["bubble_ms"])  # one stage per rank
    assert (stages["fsdp_comm_ms"] <= steps["comm_ms"] + EXACT).all()
    summary = analysis.summarize()["pipeline"]["stages"]
    assert [(s["ranks"], s["blocks"]) for s in summary] == [
        ([0, 1], ["layers.0", "layers.1"]),
        ([2, 3], ["layers.2", "layers.3"]),
    ]
    golden = {  # medians over the stage's 2 ranks x 2 steps, ms
        0: {
            "step_ms": 419.23,
            "compute_ms": 184.92,
            "fsdp_comm_ms": 100.02,
            "exposed_fsdp_comm_ms": 45.98,
            "p2p_ms": 120.63,
            "bubble_ms": 99.31,
        },
        1: {
            "step_ms": 419.19,
            "compute_ms": 200.48,
            "fsdp_comm_ms": 137.12,
            "exposed_fsdp_comm_ms": 56.10,
            "p2p_ms": 34.61,
            "bubble_ms": 34.61,
        },
    }
    for stage in summary:
        assert {k: round(stage[k], 2) for k in golden[stage["stage"]]} == golden[stage["stage"]]


def test_real_interleaved_trial_per_stage():
    analysis = _analyze("cpu_pp2_interleaved")
    assert [e.stages for e in analysis.events.values()] == [[0, 2], [0, 2], [1, 3], [1, 3]]
    assert analysis.events[0].unit_stages == {"root": 0, "layers.0": 0, "layers.2": 2}
    assert analysis.events[2].unit_stages == {"layers.1": 1, "root": 3, "layers.3": 3}  # the head is stage 3's
    steps = analysis.get_step_metrics().set_index(["rank", "step"])
    by_rank_step = analysis.get_stage_metrics().groupby(["rank", "step"])
    assert (by_rank_step["bubble_ms"].sum() - steps["bubble_ms"]).abs().max() < 1e-6  # the stages' waits add up
    assert (by_rank_step["compute_ms"].sum() <= steps["compute_ms"] + EXACT).all()  # the optimizer is no stage's
    summary = analysis.summarize()["pipeline"]["stages"]
    assert [(s["ranks"], s["blocks"]) for s in summary] == [
        ([0, 1], ["layers.0"]),
        ([2, 3], ["layers.1"]),
        ([0, 1], ["layers.2"]),
        ([2, 3], ["layers.3"]),
    ]
    golden = [  # medians over the stage's 2 ranks x 2 steps: (compute, FSDP comm, exposed, bubble) ms
        (131.6, 101.94, 41.77, 38.12),
        (96.74, 67.36, 14.75, 97.66),
        (82.31, 86.12, 27.37, 105.58),
        (127.86, 103.21, 39.97, 20.24),
    ]
    keys = ("compute_ms", "fsdp_comm_ms", "exposed_fsdp_comm_ms", "bubble_ms")
    assert [tuple(round(s[k], 2) for k in keys) for s in summary] == golden
