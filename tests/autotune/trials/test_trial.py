"""Trials on fresh ranks: the trial dir's contents, and failures recorded as data with nothing left running."""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
import signal
import statistics
import subprocess
import sys

import pytest
from _trial_programs import CRASH_MESSAGE, STAGE_DEATH_MESSAGE, get_survivors

from autotune.trials import TrialMetrics, TrialResult, TrialSpec, TrialSpecError, run_trial
from fsdp_runtime import MeshConfig, PipelineConfig, default_config, load_config
from profiles import load_model_profile

UNITS = load_model_profile("tiny").unit_names
pytestmark = pytest.mark.multirank


def _spec(tmp_path, **overrides) -> TrialSpec:
    base = dict(
        model="tiny",
        config=default_config(UNITS),
        world_size=2,
        out_dir=tmp_path / "trial",
        num_warmup=1,
        num_measured=3,
        num_profiled=1,
        timeout_s=90,
        backend="gloo",
    )
    return TrialSpec(**{**base, **overrides})


def test_trial_writes_traces_metrics_config_and_env(tmp_path):
    spec = _spec(tmp_path)
    result = run_trial(spec)
    assert result.status == "ok", result.reason
    out = spec.out_dir

    for rank in range(2):
        with gzip.open(out / f"trace_rank{rank}.json.gz", "rt") as f:
            trace = json.load(f)
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert trace["distributedInfo"]["rank"] == rank
        assert any(n.startswith("FSDP::") for n in names), "FSDP2 record_function labels missing"
        assert any(n.startswith("ProfilerStep#") for n in names)

    metrics = json.loads((out / "metrics.json").read_text())
    assert (
        metrics["schema_version"] == TrialMetrics.SCHEMA_VERSION
        and metrics["kind"] == "trial_metrics"
        and metrics["status"] == "ok"
    )
    assert [r["rank"] for r in metrics["ranks"]] == [0, 1]
    for r in metrics["ranks"]:
        assert len(r["step_ms"]) == 3 and all(ms > 0 for ms in r["step_ms"])
        assert len(r["profiled_step_ms"]) == 1
        assert len(r["losses"]) == 1 + 3 + 2 and all(math.isfinite(x) for x in r["losses"])
        assert r["process_peak_bytes"] > r["process_baseline_bytes"] > 0
    slowest = [max(a, b) for a, b in zip(*(r["step_ms"] for r in metrics["ranks"]))]
    assert metrics["step_ms_per_step"] == slowest
    assert result.step_ms == metrics["step_ms"] == statistics.median(slowest)
    assert result.process_peak_bytes == max(r["process_peak_bytes"] for r in metrics["ranks"])
    assert metrics["memory_source"] == "peak_rss"
    assert metrics["host_path_ms"] is None  # timed on CUDA only ([Note: host path probe])
    assert metrics["traces"] == ["trace_rank0.json.gz", "trace_rank1.json.gz"]
    assert metrics["analysis_error"] is None
    assert (
        metrics["trace_metrics"]["num_ranks"] == 2 and metrics["trace_metrics"]["aggregate"]["num_steps"] == 2
    )  # 2 ranks x 1 profiled step

    assert load_config(out / "config.toml") == spec.config
    env = json.loads((out / "env.json").read_text())
    assert env["backend"] == "gloo" and env["world_size"] == 2 and env["torch_version"].startswith("2.")
    assert env["host"] and env["python"] and env["cpu_count"] >= 1 and env["link_emulation"] is None
    assert not list(out.glob(".*")), "temporary files left behind"
    assert TrialResult.load(out).metrics == result.metrics
    assert get_survivors(result.rank_pids) == []


def test_trial_records_cpu_time_and_page_faults_of_unprofiled_and_profiled_steps(tmp_path, monkeypatch):
    """Per rank and step: own wall, training-thread CPU and page faults, for the measured steps (here
    the defaults paired with themselves, split by pair order) and the traced ones; and what they cost.
    With ``AUTOTUNE_HOST_PROBE=1`` the candidate's last warm-up step times the host's path per block
    pass on CPU too (metrics v9), the slowest rank's at the top."""
    config = default_config(UNITS)
    monkeypatch.setenv("AUTOTUNE_HOST_PROBE", "1")
    result = run_trial(_spec(tmp_path, reference=config, num_measured=4, num_profiled=2))
    assert result.status == "ok", result.reason
    metrics = result.metrics
    # The defaults paired with themselves: one model; the trial's peak is at least the candidate's (metrics v8).
    assert metrics.num_models == 1 and metrics.trial_peak_bytes >= metrics.process_peak_bytes > 0
    assert metrics.reserved_peak_bytes is None  # CPU
    timed = [r.host_path_ms for r in metrics.ranks]
    assert all(t is not None and t["block_forward"] > 0 and t["block_backward"] > 0 for t in timed)
    assert metrics.host_path_ms == {k: max(t[k] for t in timed) for k in ("block_forward", "block_backward")}
    for r in metrics.ranks:
        assert len(r.step_ms) == len(r.own_step_ms) == len(r.step_cpu_ms) == len(r.step_page_faults) == 4
        assert len(r.profiled_step_ms) == len(r.profiled_cpu_ms) == len(r.profiled_page_faults) == 2
        assert all(ms > 0 for ms in r.step_cpu_ms + r.profiled_cpu_ms)
        assert all(isinstance(n, int) and n >= 0 for n in r.step_page_faults + r.profiled_page_faults)
    # step_ms holds each step's slowest rank: the largest of the ranks' own times, step by step.
    assert (
        [max(own) for own in zip(*(r.own_step_ms for r in metrics.ranks))]
        == metrics.ranks[0].step_ms
        == metrics.step_ms_per_step
    )

    figures = metrics.profiler
    assert [f["rank"] for f in figures["per_rank"]] == [0, 1]
    for r, f in zip(metrics.ranks, figures["per_rank"]):
        assert (
            f["wall"]
            == statistics.median(r.profiled_step_ms) / statistics.median(r.own_step_ms)
            == pytest.approx(1 / f["trace_scale"], rel=1e-12)
        )
        assert f["cpu"] == statistics.median(r.profiled_cpu_ms) / statistics.median(r.step_cpu_ms)
        assert f["page_faults"] == statistics.median(r.step_page_faults)
    summed = [a + b for a, b in zip(*(r.step_cpu_ms for r in metrics.ranks))]
    assert figures["cpu_ms"] == statistics.median(summed)
    assert metrics.profiler_cpu_overhead == figures["profiled_cpu_ms"] / figures["cpu_ms"] > 0
    assert metrics.profiler_overhead == metrics.profiled_step_ms / metrics.step_ms
    assert TrialResult.load(result.out_dir).metrics == metrics


_HEAP_PROBE = """
import json, ctypes, os, torch
from autotune.trials.rank_memory import PREFAULT_BYTES, prefault_heap, tune_heap
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
libc = tune_heap(torch.device("cpu"))
if libc is None:
    print(json.dumps(None)); raise SystemExit
ctypes.CDLL("libc.so.6").malloc_trim(0)
before = rss()
prefault_heap(libc, 2)
kept = rss()
ctypes.CDLL("libc.so.6").malloc_trim(0)
print(json.dumps({"kept": kept - before, "after_trim": rss() - before, "prefault": PREFAULT_BYTES}))
"""


def _heap_probe(**env: str) -> dict | None:
    out = subprocess.run(
        [sys.executable, "-c", _HEAP_PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **env},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_rank_heap_keeps_the_prefaulted_pages_for_the_profiled_window():
    """A trial's ranks turn glibc's trimming off and touch heap pages before the profiled window:
    freed, they stay resident (the window's allocations reuse them instead of faulting fresh
    pages) until the trial's malloc_trim returns them; AUTOTUNE_GLIBC_MALLOC=default opts out."""
    heap = _heap_probe()
    expected = min(heap["prefault"], os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 8)
    assert heap["kept"] >= 0.9 * expected, heap
    assert heap["after_trim"] < 0.1 * expected, heap
    assert _heap_probe(AUTOTUNE_GLIBC_MALLOC="default") is None


def test_invalid_mesh_is_recorded_without_launching(tmp_path):
    config = dataclasses.replace(default_config(UNITS), mesh=MeshConfig(kind="hsdp", replicate=3))
    result = run_trial(_spec(tmp_path, config=config))
    assert result.status == "invalid_config"
    assert "mesh" in result.reason and "world size 2" in result.reason
    assert result.rank_pids == []
    metrics = json.loads((tmp_path / "trial" / "metrics.json").read_text())
    assert metrics["status"] == "invalid_config" and metrics["reason"] == result.reason
    assert metrics["step_ms"] is None and metrics["ranks"] == []


def test_crashing_trial_is_recorded_with_the_last_stderr_line(tmp_path):
    result = run_trial(_spec(tmp_path, rank_program="_trial_programs:crash_on_rank1", timeout_s=60))
    assert result.status == "crash"
    assert result.reason.startswith("rank 1 exited with 1:") and CRASH_MESSAGE in result.reason
    assert json.loads((tmp_path / "trial" / "metrics.json").read_text())["status"] == "crash"
    assert get_survivors(result.rank_pids) == []


def test_a_pipeline_stage_that_dies_mid_step_fails_the_trial_with_its_reason(tmp_path):
    """World 4 = 2 stages x 2 data-parallel ranks: stage 1's ranks raise in a forward; stage 0's
    ranks, blocked on a receive that never comes, are killed with them, within the time limit."""
    config = dataclasses.replace(
        default_config(UNITS, num_microbatches=4), mesh=MeshConfig(pp=2), pipeline=PipelineConfig(schedule="1f1b")
    )
    spec = _spec(
        tmp_path, config=config, world_size=4, rank_program="_trial_programs:stage_dies_mid_step", timeout_s=60
    )
    result = run_trial(spec)
    assert result.status == "crash", result.reason
    assert result.reason.startswith(("rank 2 exited with 1:", "rank 3 exited with 1:")), result.reason
    assert STAGE_DEATH_MESSAGE in result.reason
    assert get_survivors(result.rank_pids) == []
    assert json.loads((tmp_path / "trial" / "metrics.json").read_text())["status"] == "crash"


def test_a_pipeline_config_whose_stages_do_not_divide_the_blocks_is_refused_in_one_line(tmp_path):
    config = dataclasses.replace(
        default_config(UNITS), mesh=MeshConfig(pp=2), pipeline=PipelineConfig(blocks_per_stage=[1, 2])
    )
    result = run_trial(_spec(tmp_path, config=config, world_size=4))
    assert result.status == "invalid_config" and result.rank_pids == []
    assert result.reason == (
        "pipeline.blocks_per_stage: sums to 3 blocks but the model has 4 (list 2 block counts summing to 4)"
    ), result.reason


def test_deadlocking_trial_times_out_and_kills_the_process_tree(tmp_path):
    result = run_trial(_spec(tmp_path, rank_program="_trial_programs:deadlock", timeout_s=10))
    assert result.status == "timeout", result.reason
    assert "10s" in result.reason
    assert get_survivors(result.rank_pids) == []  # includes rank 1's sleeping child
    metrics = json.loads((tmp_path / "trial" / "metrics.json").read_text())
    assert metrics["status"] == "timeout" and metrics["wall_s"] >= 10


def test_spec_rejects_counts_that_cannot_describe_a_trial(tmp_path):
    with pytest.raises(TrialSpecError, match="measured steps must be >= 1"):
        _spec(tmp_path, num_measured=0)
    with pytest.raises(TrialSpecError, match="backend"):
        _spec(tmp_path, backend="mpi")


def test_spec_round_trips_through_json(tmp_path):
    spec = _spec(tmp_path, model={"name": "tiny", "dim": 32}, cluster="cpu-emulated-ib", prune_if_slower_than_ms=5.0)
    again = TrialSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec


def test_torchrun_entry_writes_the_same_trial_dir(tmp_path):
    spec = _spec(tmp_path, num_profiled=1)
    spec_path = tmp_path / "spec.json"
    spec.write(spec_path)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--log-dir",  # not torchrun's default, a new temporary dir per run
        str(tmp_path / "torchrun"),
        "-m",
        "autotune.trials.torchrun",
        "--spec",
        str(spec_path),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail("torchrun trial did not finish within 120 s")
    assert proc.returncode == 0, output.decode(errors="replace")[-2000:]
    result = TrialResult.load(spec.out_dir)
    assert result.status == "ok" and len(result.metrics.ranks) == 2 and result.step_ms > 0
    assert load_config(spec.out_dir / "config.toml") == spec.config
    assert sorted(p.name for p in spec.out_dir.glob("trace_rank*.json.gz")) == [
        "trace_rank0.json.gz",
        "trace_rank1.json.gz",
    ]


def test_cli_trial_reports_a_failed_trial_as_json_and_exit_1(tmp_path):
    from typer.testing import CliRunner

    from cli import app

    config = tmp_path / "bad.toml"
    config.write_text('schema_version = 1\n[mesh]\nkind = "hsdp"\nreplicate = 3\n')
    result = CliRunner().invoke(
        app,
        ["trial", "--model", "tiny", "--config", str(config), "--nproc", "2", "--out", str(tmp_path / "t"), "--json"],
    )
    assert result.exit_code == 1
    metrics = json.loads(result.stdout)
    assert metrics["status"] == "invalid_config" and "world size 2" in metrics["reason"]
