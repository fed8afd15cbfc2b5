"""``benchmarks/gpu_suite.py``: each part isolated in its own process tree and time slice, so one
that raises, or outlives its slice with processes of other sessions under it, takes nothing of the
others; its dry run on the real parts, one of them made to raise (``--fail-part``)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_suite  # noqa: E402

pytestmark = pytest.mark.torch_matrix

# Fake parts: ``python -c CODE --out DIR``, as the suite runs a part's script.
OUT = "import json, pathlib, subprocess, sys, time\nout = pathlib.Path(sys.argv[sys.argv.index('--out') + 1])\n"
WRITES = OUT + "(out / 'results.json').write_text(json.dumps({'ran': True}))\nprint('wrote results.json')\n"
RAISES = OUT + "print('about to fail', flush=True)\nraise RuntimeError('this part broke')\n"
# A child in the part's process group, and one in a session of its own as the trials' ranks are
# (autotune/trials/launch.py): a kill of the part's group alone leaves that one running.
OUTLIVES = OUT + textwrap.dedent("""
    kids = [subprocess.Popen(['sleep', '300']), subprocess.Popen(['sleep', '300'], start_new_session=True)]
    (out / 'pids.json').write_text(json.dumps([p.pid for p in kids]))
    print('children started', flush=True)
    time.sleep(300)
    """)


def fake_part(code: str, expected_s: float = 1.0) -> gpu_suite.Part:
    return gpu_suite.Part(("-c", code), expected_s, "a fake part")


@pytest.fixture
def quick(monkeypatch):
    """No reserve, a short kill grace, and a probe that writes its file and nothing else."""
    monkeypatch.setattr(gpu_suite, "RESERVE_S", 0.0)
    monkeypatch.setattr(gpu_suite, "GRACE_S", 1.0)
    probe = OUT + "(out / 'environment.json').write_text(json.dumps({'python': '3.x', 'packages': {}}))\n"
    monkeypatch.setattr(gpu_suite, "probe_command", lambda args: [sys.executable, "-c", probe, "--out", str(args.out)])


def read_part(out: Path, name: str) -> dict:
    return json.loads((out / name / "part.json").read_text())


def test_a_part_that_raises_is_recorded_as_failed_and_the_parts_around_it_still_run(tmp_path, monkeypatch, quick):
    parts = {"first": fake_part(WRITES), "broken": fake_part(RAISES), "last": fake_part(WRITES)}
    monkeypatch.setattr(gpu_suite, "PARTS", parts)
    assert gpu_suite.main(["--out", str(tmp_path), "--budget-s", "120"]) == 1
    for name in ("first", "last"):
        assert json.loads((tmp_path / name / "results.json").read_text()) == {"ran": True}
        assert read_part(tmp_path, name)["status"] == "passed"
    broken = read_part(tmp_path, "broken")
    assert (broken["status"], broken["returncode"]) == ("failed", 1)
    assert broken["reason"] == "exit code 1: RuntimeError: this part broke"
    assert "about to fail" in broken["tail"] and broken["command"].startswith(sys.executable)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(p["part"], p["status"]) for p in summary["parts"]] == [
        ("environment", "passed"),
        ("first", "passed"),
        ("broken", "failed"),
        ("last", "passed"),
    ]
    assert summary["passed"] is False


def test_a_part_past_its_slice_is_killed_with_its_children_and_the_next_part_runs(tmp_path, monkeypatch, quick):
    # A 20 s budget split 1:9: the outliving part gets 2 s, the next what is left (~17 s).
    monkeypatch.setattr(gpu_suite, "PARTS", {"outlives": fake_part(OUTLIVES, 1), "next": fake_part(WRITES, 9)})
    started = time.monotonic()
    assert gpu_suite.main(["--out", str(tmp_path), "--budget-s", "20"]) == 1
    assert time.monotonic() - started < 15
    outlived = read_part(tmp_path, "outlives")
    assert outlived["status"] == "timed out" and outlived["reason"].startswith("killed with its process tree after")
    assert outlived["slice_s"] <= 2.0 and "children started" in outlived["tail"]
    pids = json.loads((tmp_path / "outlives" / "pids.json").read_text())
    deadline = time.monotonic() + 5
    while any(map(gpu_suite.is_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(gpu_suite.is_alive, pids)), "a child of the killed part is still running"
    assert read_part(tmp_path, "next")["status"] == "passed" and (tmp_path / "next" / "results.json").exists()
    assert read_part(tmp_path, "next")["slice_s"] > 10  # the rest of the budget, not a fixed share


def test_a_part_that_ends_early_leaves_its_remainder_to_the_parts_after_it(monkeypatch):
    monkeypatch.setattr(gpu_suite, "PARTS", {"a": fake_part("", 1), "b": fake_part("", 3), "c": fake_part("", 1)})
    assert gpu_suite.get_slice(100, ["a", "b", "c"], 0) == 20
    assert gpu_suite.get_slice(95, ["a", "b", "c"], 1) == 95 * 3 / 4  # a took 5 of its 20
    assert gpu_suite.get_slice(-3, ["a", "b", "c"], 2) == 0


def test_the_dry_run_runs_each_real_part_s_dry_run_and_records_the_one_made_to_raise(tmp_path, capsys):
    """The environment's probe without CUDA, ``check`` made to raise, ``sim_accuracy``'s real dry run."""
    code = gpu_suite.main(
        ["--dry-run", "--out", str(tmp_path), "--parts", "check,sim_accuracy", "--fail-part", "check"]
    )
    assert code == 1
    check = read_part(tmp_path, "check")
    assert check["status"] == "failed" and check["reason"].endswith("check: made to fail by --fail-part")
    accuracy = read_part(tmp_path, "sim_accuracy")
    assert accuracy["status"] == "passed", accuracy["tail"]
    assert accuracy["command"].endswith(f"--out {tmp_path / 'sim_accuracy'} --dry-run")
    assert (
        accuracy["tail"][-1].startswith("dry run: calibrated on")
        and (tmp_path / "sim_accuracy" / "output.log").exists()
    )
    environment = json.loads((tmp_path / "environment.json").read_text())
    assert environment["dry_run"] is True and environment["gpus"] == []  # no device queried
    assert not environment["packages"]["optuna"].startswith("error")
    printed = capsys.readouterr().out
    assert "torch " in printed and "results.json" in printed and "written: " in printed  # the summary's table


def test_a_short_budget_gives_the_parts_in_front_their_expected_time_first(monkeypatch):
    """Three parts expecting 270, 150 and 270 s in 525 s: by shares alone the first would get 205 s
    and time out; in priority order it gets its expected time and a margin, the last what is left."""
    monkeypatch.setattr(gpu_suite, "PARTS", {"a": fake_part("", 270), "b": fake_part("", 150), "c": fake_part("", 270)})
    assert gpu_suite.get_slice(525, ["a", "b", "c"], 0) == gpu_suite.GRACE * 270
    assert gpu_suite.get_slice(255, ["a", "b", "c"], 1) == gpu_suite.GRACE * 150
    assert gpu_suite.get_slice(105, ["a", "b", "c"], 2) == 105


def test_the_default_parts_expected_seconds_fit_the_default_budget():
    """What the suite runs by default fits one lease: every default part's expected seconds, the
    probe's and the reserve kept from the last slice, against ``--budget-s``'s default."""
    args = gpu_suite.parse_args([])
    expected = sum(gpu_suite.PARTS[name].expected_s for name in args.parts)
    assert args.parts == list(gpu_suite.PARTS)
    assert expected + gpu_suite.PROBE_S + gpu_suite.RESERVE_S <= args.budget_s == gpu_suite.BUDGET_S


def test_a_part_this_torch_cannot_run_is_skipped_with_the_reason_and_takes_no_share(tmp_path, monkeypatch):
    """A probe that finds a torch refusing torchtitan 0.3.0 (2.11): the part that needs it is not
    started, is recorded as skipped with the probe's reason, and its share goes to the others."""
    refused = "torchtitan 0.3.0 needs torch >= 2.12 (DataParallelMeshDims); torch 2.11.0 has none"
    monkeypatch.setattr(gpu_suite, "RESERVE_S", 0.0)
    probe = OUT + f"(out / 'environment.json').write_text(json.dumps({{'torchtitan_030_refused': {refused!r}}}))\n"
    monkeypatch.setattr(gpu_suite, "probe_command", lambda args: [sys.executable, "-c", probe, "--out", str(args.out)])
    needs = dataclasses.replace(fake_part(RAISES, 50), needs_torchtitan_030=True)
    monkeypatch.setattr(gpu_suite, "PARTS", {"needs_030": needs, "other": fake_part(WRITES, 50)})
    assert gpu_suite.main(["--out", str(tmp_path), "--budget-s", "100"]) == 0
    skipped = read_part(tmp_path, "needs_030")
    assert (skipped["status"], skipped["command"], skipped["seconds"]) == ("skipped", None, 0.0)
    assert skipped["reason"] == f"skipped, not run: {refused}"
    assert not (tmp_path / "needs_030" / "output.log").exists()  # never started
    other = read_part(tmp_path, "other")
    assert other["status"] == "passed" and other["slice_s"] > 90  # the whole budget, not half of it
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["passed"] is True and summary["skipped"] == {"needs_030": skipped["reason"]}


def test_the_dry_run_of_every_default_part_passes_in_job_says_which_job_it_ran(tmp_path):
    """The whole suite's dry run as a GPU box's run would go, under this torch: every part passes
    its dry run; torchtitan 0.3.0's part is skipped, saying why, only on a torch that cannot import
    0.3.0 (2.11, the GPU machines'), and ``in_job`` then runs the project's llama instead."""
    from _torchtitan030 import require_torchtitan_030

    from profiles.factory import ModelSourceError
    from profiles.torchtitan import check_torch_for_030

    try:
        check_torch_for_030()
        refused = None
    except ModelSourceError as e:
        refused = str(e)
    command = [sys.executable, "benchmarks/gpu_suite.py", "--dry-run", "--out", str(tmp_path)]
    command += ["--torchtitan", str(require_torchtitan_030(torch_can=False))]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    summary = json.loads((tmp_path / "summary.json").read_text())
    statuses = {p["part"]: (p["status"], p["reason"]) for p in summary["parts"]}
    assert list(statuses) == ["environment", *gpu_suite.PARTS], done.stdout[-3000:]
    for name in gpu_suite.PARTS:
        if name == "torchtitan" and refused:
            assert statuses[name] == ("skipped", f"skipped, not run: {refused}")
            assert f"torchtitan: skipped, not run: {refused}" in done.stdout  # said after the table
        else:
            assert statuses[name] == ("passed", None), read_part(tmp_path, name)["tail"]
    assert done.returncode == 0 and summary["passed"] is True
    in_job = json.loads((tmp_path / "in_job" / "results.json").read_text())
    assert in_job["dry_run"] is True and in_job["job"] == ("llama" if refused else "torchtitan")
    if refused:
        assert refused in in_job["job_reason"] and in_job["model"] == {"name": "llama1b"}
