"""The GPU step attribution of ``autotune report``: where a GPU trial's step goes on the device.

Real GPU trial dirs (one H200, world 1, torch 2.11) from ``tests/data/gpu_traces`` (``tests/_gpu_traces.py``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from _fixtures import get_fixture_traces
from typer.testing import CliRunner

from autotune.analysis import KERNEL_CLASSES, summarize_traces
from autotune.report import get_gpu_tables, load_report
from autotune.report.attribution import CLASS_TITLES, PARTS, get_part
from autotune.report.gpu_step import GPU_SECTION_TITLE
from autotune.report.html import FIGURES_META
from autotune.trials import TrialMetrics
from tests._gpu_traces import get_gpu_trial


def _gpu_trial(name: str) -> Path:
    return get_gpu_trial(name)


@pytest.fixture(scope="module")
def l8b4() -> Path:
    return _gpu_trial("h200-l8b4-defaults")


@pytest.fixture(scope="module")
def l8b4_report(l8b4):
    return load_report(l8b4)


@pytest.fixture(scope="module")
def cpu_trial(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cpu_trial")
    traces = get_fixture_traces("cpu_tiny_2rank")
    for trace in traces:
        shutil.copy(trace, folder / trace.name)
    TrialMetrics(
        status="ok",
        model="tiny",
        world_size=2,
        backend="gloo",
        step_ms=150.0,
        trace_metrics=summarize_traces(traces),
    ).write(folder / "metrics.json")
    return folder


def test_parts_of_the_step():
    assert [get_part(k) for k in ("head.forward", "block.forward", "tail.forward")] == ["forward"] * 3
    assert [get_part(k) for k in ("head.backward", "block.backward", "tail.backward")] == ["backward"] * 3
    assert {get_part(k) for k in ("unshard.block", "unshard_local.root", "pre_hook.block")} == {"unshard"}
    assert {get_part(k) for k in ("reduce.root", "reduce_local.block", "post_hook.block", "concat.block")} == {"reduce"}
    assert (get_part("optimizer"), get_part("microbatch")) == ("optimizer", "other")


@pytest.mark.parametrize("name", ["h200-l8b4-defaults", "h200-llama1b-defaults"])
def test_classes_and_parts_add_up_to_the_busy_device_time(name):
    attribution = load_report(_gpu_trial(name)).attribution
    assert attribution is not None and attribution.error is None and attribution.local
    classes, parts = attribution.by_class(), attribution.by_part()
    assert list(classes) == list(KERNEL_CLASSES) and list(parts) == list(PARTS)
    assert sum(classes.values()) == pytest.approx(attribution.span_ms - attribution.idle_ms, rel=0.01)
    assert sum(parts.values()) == pytest.approx(sum(classes.values()), rel=1e-9)
    assert classes["communication"] == 0.0  # world 1: no NCCL kernel
    assert attribution.num_microbatches == 2 and attribution.num_steps == 2
    assert sum(r.ms for r in attribution.get_unit_costs()) == pytest.approx(sum(classes.values()), rel=1e-9)


def test_l8b4_step_where_the_time_goes(l8b4_report):
    attribution = l8b4_report.attribution
    classes = attribution.by_class()
    assert max(classes, key=classes.get) == "gemm"
    assert classes["gemm"] == pytest.approx(174, abs=3)
    assert classes["optimizer"] == pytest.approx(41, abs=2)
    assert attribution.idle_ms == pytest.approx(8, abs=1.5)
    assert attribution.span_ms == pytest.approx(378, abs=5)
    assert classes["copy"] == pytest.approx(60, abs=3) and classes["loss"] == pytest.approx(16.5, abs=1.5)
    parts = attribution.by_part()
    assert parts["backward"] > parts["forward"] > parts["optimizer"] > parts["reduce"] > parts["unshard"] > 0
    assert attribution.blocks == [f"layers.{i}" for i in range(4)]
    units = {r.key: r for r in attribution.get_unit_costs()}
    block_fwd, block_bwd = units["block.forward"], units["block.backward"]
    assert (block_fwd.calls, block_fwd.per) == (8, "block x microbatch")  # 4 blocks x 2 microbatches
    assert block_fwd.ms_per_call == pytest.approx(8.05, abs=0.4)
    assert block_bwd.ms_per_call == pytest.approx(2 * block_fwd.ms_per_call, rel=0.15)
    assert units["optimizer"].calls == 1 and units["tail.forward"].classes["loss"] > 0


def test_attribution_tables(l8b4_report):
    by_class, by_part, per_call = get_gpu_tables(l8b4_report)
    assert by_class.title.startswith("GPU step by kernel class") and "2 microbatches" in by_class.title
    titles = [row[0] for row in by_class.rows]
    assert titles == [*CLASS_TITLES.values(), "idle (no kernel running)", "device span of the step"]
    gemm = by_class.rows[0]
    assert float(gemm[1]) == pytest.approx(174, abs=3) and gemm[2].endswith("%") and by_class.rows[-1][2] == "100.0%"
    assert [row[0] for row in by_part.rows][:6] == list(PARTS.values())
    assert by_part.rows[1][3].startswith("GEMM")  # the backward's largest class
    assert per_call.rows[0][:4] == ["block forward", "model forward", "block x microbatch", "8"]


def test_cli_prints_the_attribution_and_the_page_shows_it(l8b4, tmp_path):
    from cli import app

    out = tmp_path / "r"
    result = CliRunner().invoke(app, ["report", str(l8b4), "--out", str(out)])
    assert result.exit_code == 0, result.output
    for text in ("GPU step by kernel class", "GPU step by part", "GPU time per call", "GEMM", "FSDP2 unshard"):
        assert text in result.stdout, text
    page = (out / "report.html").read_text()
    assert f"<h2>{GPU_SECTION_TITLE.replace(chr(39), '&#x27;')}</h2>" in page
    assert "data-figure='gpu_attribution'" in page and "<caption>GPU step by part" in page
    assert "gpu_attribution" in page.split(f"name='{FIGURES_META}' content='")[1].split("'")[0].split(",")
    assert (out / "gpu_step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_cpu_trial_has_no_gpu_attribution(cpu_trial, tmp_path):
    from cli import app

    report = load_report(cpu_trial)
    assert report.attribution is None and get_gpu_tables(report) == []
    result = CliRunner().invoke(app, ["report", str(cpu_trial), "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert "GPU step" not in result.stdout and "GPU time" not in result.stdout
    page = (tmp_path / "r" / "report.html").read_text()
    assert "gpu_attribution" not in page and "GPU step" not in page and "GPU time" not in page
    assert not (tmp_path / "r" / "gpu_step.png").exists()
