"""The scripts of ``benchmarks/``, ``studies/`` and ``tools/``: what each folder holds, each script's one-line
summary, and those that run here: the GPU benchmarks' dry runs (without CUDA, as they will run on a GPU box up to
the first CUDA call) and ``studies/trial_budget.py`` on recorded searches."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT_DIRS = ("benchmarks", "studies", "tools")
BENCHMARKS = {
    "_common.py",
    "analysis_throughput.py",
    "consolidation.py",
    "gpu_check.py",
    "gpu_in_job.py",
    "gpu_sim_accuracy.py",
    "gpu_suite.py",
    "gpu_torchtitan.py",
    "in_job_tuner.py",
    "knobs.py",
    "memory_knobs.py",
    "node_search.py",
    "realized_speedup.py",
    "search_time.py",
    "sharded_build.py",
    "sim_accuracy.py",
    "store_polling.py",
    "trial_overhead.py",
}
"""The product's benchmarks: a study (a one-off question behind a design decision) goes to ``studies/``, a
script that makes test fixtures to ``tools/``."""


def get_summary_problem(path: Path) -> str | None:
    """Why ``path``'s module docstring does not open with a one-line summary (one line that ends a sentence,
    then a blank line or the docstring's end), or None when it does."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
    if not doc:
        return "no module docstring"
    lines = doc.split("\n")
    if not lines[0].strip() or lines[0] != lines[0].strip():
        return "the docstring does not start on its first line"
    if not lines[0].endswith((".", "?")):
        return f"the first line does not end a sentence: {lines[0]!r}"
    if len(lines) > 1 and lines[1].strip():
        return f"the summary runs on past its first line: {lines[1]!r}"
    return None


def get_listed_scripts(readme: Path) -> set[str]:
    """The scripts a folder's README lists: the first cell of each table row, ``| `name.py` |``."""
    return set(re.findall(r"^\| `([\w.]+\.py)` \|", readme.read_text(encoding="utf-8"), flags=re.MULTILINE))


@pytest.mark.parametrize("folder", SCRIPT_DIRS)
def test_every_script_opens_with_a_one_line_summary_of_what_it_prints_or_does(folder):
    scripts = sorted((ROOT / folder).glob("*.py"))
    problems = {p.name: why for p in scripts if (why := get_summary_problem(p))}
    assert scripts and not problems, problems


@pytest.mark.parametrize("folder", SCRIPT_DIRS)
def test_each_folder_s_readme_lists_exactly_its_scripts(folder):
    scripts = {p.name for p in (ROOT / folder).glob("*.py")}
    assert get_listed_scripts(ROOT / folder / "README.md") == scripts


def test_benchmarks_holds_the_product_s_benchmarks_only():
    assert {p.name for p in (ROOT / "benchmarks").glob("*.py")} == BENCHMARKS


def test_the_summary_check_refuses_a_script_without_one(tmp_path):
    cases = {
        "none.py": "import sys\n",
        "empty.py": '""""""\n',
        "runs_on.py": '"""Prints the step time of each knob\nalone, against the defaults."""\n',
        "no_sentence.py": '"""Prints the step time of each knob\n\nalone."""\n',
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        assert get_summary_problem(tmp_path / name), name
    (tmp_path / "good.py").write_text('"""Prints the step time of each knob alone.\n\nMore here."""\n')
    assert get_summary_problem(tmp_path / "good.py") is None


@pytest.mark.torch_matrix
def test_gpu_check_dry_run_plans_the_run_and_tabulates_a_recorded_trial(tmp_path):
    recorded = tmp_path / "recorded"
    recorded.mkdir()
    shutil.copy(ROOT / "tests" / "data" / "artifacts" / "metrics_v8.json", recorded / "metrics.json")
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/gpu_check.py",
            "--dry-run",
            "--out",
            str(tmp_path / "out"),
            "--recorded",
            str(recorded),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    model = next(line for line in lines if line.startswith("model: "))
    assert "'name': 'llama8b'" in model and "of 80 GiB" in model
    assert any(
        line.startswith("search: 6 trials of llama8b-") and line.endswith("blocks on 1 GPU(s), bfloat16/float32")
        for line in lines
    )
    assert sum(line.startswith("numerics ") for line in lines) == 3
    # one GPU: the communication-buffer knobs are not run, and it says why (one rank issues no collectives)
    assert (
        "numerics comm_buffers: not run on 1 GPU (FSDP2 issues no collectives on one rank, so their buffers are never used: it needs 2 ranks or more)"
        in lines
    )
    row = lines[lines.index(next(line for line in lines if line.strip().startswith("trial"))) + 1].split()
    assert row[:2] == ["recorded", "ok"] and lines[-1] == "dry run: no trial ran"
    assert not list((tmp_path / "out").rglob("metrics.json"))  # nothing ran
    (toml,) = (tmp_path / "out").glob("llama8b-*blocks.toml")  # the sized model, as the search will get it
    assert "dim = 4096" in toml.read_text(encoding="utf-8")


@pytest.mark.torch_matrix
def test_gpu_torchtitan_dry_run_builds_0_3_0_s_model_its_recipe_and_the_trial_specs(tmp_path):
    """benchmarks/gpu_torchtitan.py up to its first CUDA call, with torchtitan 0.3.0 (tests/_torchtitan030.py)."""
    from _torchtitan030 import require_torchtitan_030, run_with_030

    args = ["benchmarks/gpu_torchtitan.py", "--dry-run", "--torchtitan", str(require_torchtitan_030())]
    done = run_with_030([*args, "--out", str(tmp_path / "out")], timeout_s=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[:3] == [
        "torchtitan 0.3.0",
        # one model per GPU (3B's 50.1 GiB would not fit 48 GiB); at a GPU job's shape, not the bare name's 128 x 4
        "flavor: llama3/1B (one model 19.9 GiB of 80 GiB, fill 60%), seq_len 4096 x batch 1 per rank",
        "search: 4 trials of torchtitan-llama3-1B on 1 GPU(s), bfloat16/float32",
    ]
    assert "model: Llama3Model, 1.236B params, blocks layers.0..layers.15" in lines
    from torch.distributed.fsdp import FSDPModule

    # 9 asked everywhere, and the CUDA-only process-group buffers (2.8 on); its own reduce-scatter
    # group (2.13 on) and symmetric memory (2.12 on) where this torch has them
    has = [hasattr(FSDPModule, m) for m in ("set_separate_reduce_scatter_group", "set_symm_mem_for_comm")]
    knobs = 10 + sum(has)
    space = f"space: {knobs} knobs; defaults: 17 units"
    assert space in lines  # 16 blocks and the root
    assert lines[lines.index(space) + 1].startswith(
        "recipe: 18 units; beside the blocks: tok_embeddings+norm+lm_head (reshard after forward: False), root"
    )  # 1B ties its head to its embeddings
    assert "trial vs_recipe: model.toml, 17 units vs 18 units, nccl" in lines
    assert (tmp_path / "out" / "model.toml").read_text().splitlines()[1:] == [
        'factory = "torchtitan:llama3/1B"',
        "seq_len = 4096",
        "batch_size = 1",
    ]
    assert lines[-4:] == [
        "speedup over FSDP2's defaults: not measured (no final round)",
        "speedup over torchtitan's recipe: not measured (no final round)",
        "emitted: the search's config",
        "dry run: no trial ran",
    ]
    assert not list((tmp_path / "out").rglob("metrics.json"))  # nothing ran


@pytest.mark.torch_matrix
def test_gpu_in_job_dry_run_shards_0_3_0_s_model_as_torchtitan_does_and_adopts_it(tmp_path):
    """benchmarks/gpu_in_job.py up to its first CUDA call: torchtitan 0.3.0's own sharding of its
    llama3 1B (on meta, one gloo rank) adopted with its recipe, the tuner's moves on CUDA."""
    from _torchtitan030 import require_torchtitan_030, run_with_030

    args = ["benchmarks/gpu_in_job.py", "--dry-run", "--torchtitan", str(require_torchtitan_030())]
    done = run_with_030([*args, "--out", str(tmp_path / "out")], timeout_s=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "torchtitan 0.3.0, llama3/1B"
    assert lines[1].startswith("job: torchtitan (torchtitan 0.3.0 imports with torch ")
    assert "model: torchtitan-llama3-1B, 1.236B params, seq_len 4096 x batch 1" in lines
    # 16 blocks, the tied embeddings + norm + head, the root: torchtitan's sharding, read back
    assert "adopted: 18 units of torchtitan's sharding, bfloat16/float32" in lines
    moves = next(line for line in lines if line.startswith("moves on cuda: "))
    # on CUDA async unshard is a move; one microbatch per step in torchtitan's loop: no sync move
    assert "forward_prefetch=depth1" in moves and "unshard_async=on" in moves and "sync=last" not in moves
    assert lines[-4:-1] == [
        "window: 80 steps of 120; first plan: the seed",
        "tuned / untuned: not measured (no run)",
        "dry run: no step ran",
    ]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert (results["job"], results["dry_run"], results["units"]) == ("torchtitan", True, 18)


# A torch that cannot import torchtitan 0.3.0, as 2.11 (the GPU machines') is: its attribute removed
# before the script runs (a no-op on a torch that lacks it already).
AS_TORCH_2_11 = """
import os, runpy, sys
import torch.distributed.fsdp as fsdp
if hasattr(fsdp, "DataParallelMeshDims"):
    del fsdp.DataParallelMeshDims
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as python SCRIPT puts its folder first
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.torch_matrix
def test_gpu_in_job_dry_run_runs_the_project_s_llama_where_torchtitan_0_3_0_cannot_import(tmp_path):
    """benchmarks/gpu_in_job.py up to its first CUDA call on a torch that refuses torchtitan 0.3.0
    (with 0.3.0 there): the tuner over the project's llama1b sharded with the config its ranks get,
    and results.json says which job ran and why; ``--job torchtitan`` refuses in one line."""
    from _torchtitan030 import get_env_030

    env = get_env_030(torch_can=False)
    base = [sys.executable, "-c", AS_TORCH_2_11, "benchmarks/gpu_in_job.py", "--dry-run", "--out", str(tmp_path)]
    done = subprocess.run(base, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "the project's llama1b"
    assert lines[1].startswith(
        "job: llama (torchtitan 0.3.0 cannot be imported here (torchtitan 0.3.0 needs torch >= 2.12"
    )
    assert "ranks run: gpu_in_job:run_llama_job on llama1b" in lines
    assert "model: llama1b, 1.236B params, seq_len 8192 x batch 1" in lines
    assert "adopted: 17 units of a trial's build, FSDP2's defaults, bfloat16/float32" in lines  # 16 blocks, the root
    assert not any(line.startswith("missing ") for line in lines)  # no torchtitan-only wheel asked for
    results = json.loads((tmp_path / "results.json").read_text())
    assert (results["job"], results["model"], results["units"]) == ("llama", {"name": "llama1b"}, 17)
    assert "needs torch >= 2.12" in results["job_reason"] and "unshard_async=on" in results["moves"]
    forced = subprocess.run(
        [*base, "--job", "torchtitan"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert forced.returncode == 1 and forced.stderr.strip().startswith("gpu_in_job.py: torchtitan 0.3.0 needs torch")


def _write_search(run_dir: Path, ratios: list[tuple[dict, float, str]], winner: int, model: str = "small") -> None:
    """A finished search's ``results.json`` and ``search.json`` as a search writes them (the fields the script reads)."""
    import json

    run_dir.mkdir(parents=True)
    rows = [
        {
            "number": i,
            "status": "ok",
            "params": params,
            "ratio": ratio,
            "state": "COMPLETE",
            "stopped": stopped,
            "is_default": i == 0,
        }
        for i, (params, ratio, stopped) in enumerate(ratios)
    ]
    (run_dir / "results.json").write_text(json.dumps({"schema_version": 1, "kind": "results", "trials": rows}))
    finalists = [{"trial": winner, "ratio": ratios[winner][1], "status": "ok"}]
    (run_dir / "search.json").write_text(
        json.dumps({"model": model, "confirmation": {"winner": winner, "finalists": finalists}})
    )


def test_trial_budget_reads_recorded_searches_and_prices_a_budget_that_misses_the_good_knob(tmp_path):
    """``trial_budget.py`` on searches where one knob value (``a = 1``) is 20% faster and comes at
    trial 3: cut at 2 trials a search never emits it, cut at 4 it does; and searches of two models
    are refused."""
    slow, fast = {"a": 0, "b": 0}, {"a": 1, "b": 0}
    dirs = []
    for k, noise in enumerate((1.00, 1.02, 0.98)):
        trials = [
            ({"a": 0, "b": 0}, 1.0 * noise, "max_blocks"),
            ({"a": 0, "b": 1}, 0.99 * noise, "max_blocks"),
            (slow | {"b": 1}, 1.01 * noise, "unlikely"),
            (fast, 0.80 * noise, "faster"),
        ]
        dirs.append(tmp_path / f"s{k}")
        _write_search(dirs[-1], trials, winner=3)
    script = [sys.executable, str(ROOT / "studies" / "trial_budget.py")]
    out = subprocess.run(
        [*script, *map(str, dirs), "--budgets", "2,4", "--finalists", "1", "--draws", "5"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "mmuF" in out.stdout and "emitted trial 3" in out.stdout
    modelled = {
        int(line.split()[0]): float(line.split()[-1]) for line in out.stdout.splitlines() if " trials: " in line
    }
    assert modelled[4] < 0.9 < modelled[2]
    _write_search(tmp_path / "other", [({"a": 0, "b": 0}, 1.0, "max_blocks")], winner=0, model="wide")
    mixed = subprocess.run(
        [*script, str(dirs[0]), str(tmp_path / "other")], capture_output=True, text=True, timeout=120
    )
    assert mixed.returncode != 0 and "different models" in mixed.stderr


def test_sim_accuracy_noise_floor_grows_with_the_pairs_spread_and_nets_it_out_of_the_error():
    """``sim_accuracy.get_noise_floor``: pairs that agree leave no floor, so the simulator's net error is the
    observed one; pairs spread +-10% give a floor of a few percent, which the net error takes out in quadrature."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from sim_accuracy import get_noise_floor

    def rows(spread: float, error: float) -> list[dict]:
        pairs = [1 - spread, 1.0, 1 + spread, 1.0]  # median of blocks (0.95, 1.05) -> 1.0
        return [
            {"pair_ratios": [0.6 * p for p in pairs], "measured_ratio": 0.6, "predicted_ratio": 0.6 * (1 + error)}
            for _ in range(5)
        ]

    exact = get_noise_floor(rows(0.0, 0.04))
    assert exact["noise_floor"] == 0.0 and abs(exact["net_ratio_error"] - 0.04) < 1e-9
    noisy = get_noise_floor(rows(0.10, 0.04))
    assert 0.01 < noisy["noise_floor"] < 0.04
    assert abs(noisy["net_ratio_error"] - (0.04**2 - noisy["noise_floor"] ** 2) ** 0.5) < 1e-9
    wide = get_noise_floor(rows(0.20, 0.04))
    assert wide["noise_floor"] > noisy["noise_floor"] and wide["net_ratio_error"] < noisy["net_ratio_error"]
    assert get_noise_floor([{"pair_ratios": [0.5], "measured_ratio": 0.5, "predicted_ratio": 0.5}]) == {}


def test_injob_walk_study_counts_its_walks_and_a_planted_move_twice_as_fast_is_adopted():
    """``studies/injob_walk.py``: the counting on hand-made walks (a false adoption is any move not
    planted, power the planted one, biases over the walks whose final window measured); a move truly
    0.5x is measured and adopted in nearly every walk and the final window reads about 2x; the command
    line prints a row per case and burst model."""
    sys.path.insert(0, str(ROOT / "studies"))
    from injob_walk import CASES, WalkResult, run_case, summarize

    def walk(adopted: list[str], speedup: float, interval: tuple[float, float] | None) -> WalkResult:
        decisions = [
            (m, "adopted" if m in adopted else "too slow" if m == "r" else "max_blocks", m == "q") for m in "pqr"
        ]
        true, measured = (2.0 if "p" in adopted else 1.0), interval is not None
        return WalkResult(decisions, true, 2.2 if measured else 1.0, speedup, measured, interval, 200)

    s = summarize([walk(["p"], 1.9, (1.8, 2.1)), walk(["p", "q"], 2.1, (2.05, 2.2)), walk([], 1.0, None)], {"p": 0.5})
    assert (s.false_adoption.k, s.power.k, s.reached.k, s.power.n) == (1, 2, 3, 3)
    assert (s.false_at_last.k, s.false_at_last.n, s.too_slow.k, s.too_slow.n) == (1, 1, 3, 9)
    assert (s.coverage.k, s.coverage.n, s.mean_adopted, s.mean_measured) == (1, 2, 1.0, 3.0)
    assert s.final_bias == pytest.approx((0.95 * 1.05) ** 0.5) and s.product_bias == pytest.approx(1.1)
    assert summarize([walk(["q"], 1.0, None)], {}).power.n == 0

    planted = run_case({"forward_prefetch=depth1": 0.5}, walks=8, seed=0, noise=(0.09, -0.04), burst=False)
    assert planted.reached.k == 8 and planted.power.k >= 7
    assert planted.final_bias == pytest.approx(1.0, abs=0.08)
    out = subprocess.run(
        [sys.executable, str(ROOT / "studies" / "injob_walk.py"), "--walks", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert sum(line.startswith(tuple(CASES)) for line in out.stdout.splitlines()) == 2 * len(CASES)


@pytest.mark.torch_matrix
def test_gpu_sim_accuracy_writes_each_case_judged_as_it_is_measured(tmp_path, monkeypatch):
    """On a GPU the profile is calibrated right after the calibration case, and each later case's
    row (measured, predicted, error) is written as it is measured: a run stopped part way (a GPU
    suite's time slice) keeps the cases it measured, judged. The trials are stood in for by the
    recorded calibration trial and the recorded H200 steps."""
    import types

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_sim_accuracy as gsa

    measured_ms = list(gsa.get_gsa_measured_ms().values())

    def fake_measure(i, cases, labels, args, out):
        if i == 4:
            raise KeyboardInterrupt  # the suite's time slice ends here
        if i == 0:
            shutil.copytree(gsa.RECORDED, out / "case_00")
        return types.SimpleNamespace(ok=True, step_ms=measured_ms[i], status="ok", reason="", metrics=None)

    monkeypatch.setattr(gsa, "_measure_case", fake_measure)
    monkeypatch.setattr(sys, "argv", ["gpu_sim_accuracy.py", "--out", str(tmp_path)])
    with pytest.raises(KeyboardInterrupt):
        gsa.main()
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [row["measured_ms"] for row in rows[:4]] == measured_ms[:4]
    assert all(row["predicted_ms"] for row in rows[:4])
    assert [row["measured_ms"] for row in rows[4:]] == [None] * (len(rows) - 4)
    assert (tmp_path / "device.toml").exists()


def test_realized_speedup_summary_counts_only_claims_over_the_defaults_and_judges_the_aim(capsys):
    """``realized_speedup.get_summary`` on hand-made searches: realized / claimed per workload and over all
    (median, worst, spread); a search that emitted the defaults (whose record may still carry a figure) or the
    recipe is counted apart, never in the ratio; the aim is a median within 3% of 1 and none below 0.95."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import realized_speedup as rs

    def row(workload: str, claimed: float | None, realized: float | None, emitted: str = "best", **extra) -> dict:
        low = {"claimed_low": claimed * 0.9, "claimed_high": claimed * 1.1} if claimed else {}
        return {"workload": workload, "emitted": emitted, "claimed": claimed, "realized": realized, **low, **extra}

    rows = [
        row("small", 1.25, 1.225),  # 0.98
        row("small", 1.20, 1.20),  # 1.00
        row("small", 1.10, 1.122),  # 1.02
        row("small", 1.20, 0.60, emitted="defaults"),  # 0.5 if it were counted
        row("small", None, 1.30, emitted="recipe"),
        row("wide1024", 1.50, 1.41),  # 0.94: below the worst allowed
        row("wide1024", 1.50, 1.515),  # 1.01
        row("other", 1.00, 1.05),  # 1.05, 1.04, 1.06: none below 0.95, median 5% off
        row("other", 1.00, 1.04),
        row("other", 1.00, 1.06),
        row("other", 1.40, None, error="its run in round 1 failed"),
    ]
    summary = rs.get_summary(rows)
    small, wide, other, every = summary["small"], summary["wide1024"], summary["other"], summary["all"]
    assert (small["searches"], small["counted"], small["defaults"], small["recipe"]) == (5, 3, 1, 1)
    assert abs(small["median"] - 1.00) < 1e-9 and abs(small["worst"] - 0.98) < 1e-9
    assert abs(small["best"] - 1.02) < 1e-9 and small["aim"] is True
    assert abs(wide["median"] - 0.975) < 1e-9 and abs(wide["worst"] - 0.94) < 1e-9 and wide["aim"] is False
    assert abs(other["median"] - 1.05) < 1e-9 and other["worst"] > 0.95 and other["aim"] is False
    assert (other["counted"], other["failed"]) == (3, 1)
    assert every["counted"] == 8 and abs(every["median"] - 1.015) < 1e-9 and abs(every["worst"] - 0.94) < 1e-9
    assert rs.get_summary([row("small", 1.2, 0.6, emitted="defaults")])["small"]["aim"] is None
    # inside the claim's interval (claimed +-10% here): every counted one, wide1024's 1.41 of 1.50 too
    assert (small["covered"], small["with_interval"], wide["covered"], every["covered"]) == (3, 3, 2, 8)
    bare = rs.get_summary([row("small", 1.2, 1.5)])["small"]  # 1.5 beyond 1.32: realized outside it
    assert (bare["covered"], bare["with_interval"], bare["coverage"]) == (0, 1, 0.0) and bare["coverage_high"] < 0.8
    # Wilson's 90% interval: for none of n its upper end is z^2 / (n + z^2) in closed form
    assert rs.wilson(0, 10) == (0.0, pytest.approx(1.645**2 / (10 + 1.645**2)))
    low, high = rs.wilson(16, 20)  # worked by hand: centre 0.7642, half-width 0.1426
    assert low == pytest.approx(0.6216, abs=2e-4) and high == pytest.approx(0.9068, abs=2e-4)
    rs.print_summary(rows)
    out = capsys.readouterr().out
    assert "small            5       3   1.000  0.980  0.980-1.020  defaults 1, recipe 1, failed 0; aim holds" in out
    assert "aim MISSED" in next(line for line in out.splitlines() if line.startswith("all "))
    assert "all       8 of 8: 100% (90% interval 75-100%)" in out  # what the claims' intervals held
    # an emitted recipe claims nothing over the defaults, but what it did alone against them is said
    assert (small["recipe_realized"], small["recipe_slower"]) == ([1.30], 0)
    slower = rs.get_summary([row("small", None, 0.9, emitted="recipe", realized_high=0.95)])["small"]
    assert (slower["recipe_realized"], slower["recipe_slower"]) == ([0.9], 1)
    assert (
        "small     emitted torchtitan's recipe 1 times; alone against the defaults: 1.300x (0 wholly slower at 90%)"
        in out
    )
    rs.print_row(row("small", 1.25, None, run=0, search_wall_s=10.0) | {"claimed_low": None, "claimed_high": None})
    assert "claimed 1.250x (interval unknown)" in capsys.readouterr().out
    conf = {"emitted": "best", "speedup_median": 1.3}  # a search that records no interval for its claim
    assert rs.get_claim({"confirmation": conf}) == {
        "emitted": "best",
        "claimed": 1.3,
        "claimed_low": None,
        "claimed_high": None,
    }
    assert rs.get_claim({"confirmation": conf, "recipe": {"emitted": "recipe"}})["claimed"] is None
    assert rs.get_claim({"confirmation": conf | {"emitted": "defaults"}})["claimed"] is None


@pytest.mark.multirank
def test_realized_speedup_quick_run_searches_compares_and_summarizes_from_its_results(tmp_path):
    """``realized_speedup.py --quick``: one 2-trial search of tiny, its emitted config compared alone against the
    defaults; ``results.json`` holds the claimed and the realized figure (where the search emitted a config of its
    own), and ``--summarize`` reprints them."""
    script = [sys.executable, str(ROOT / "benchmarks" / "realized_speedup.py")]
    done = subprocess.run(
        [*script, "--quick", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert row["workload"] == "tiny" and row["search_wall_s"] > 0 and "error" not in row
    # which one a 2-trial search of tiny emits is the box's noise; each is checked as far as it goes
    if row["emitted"] == "defaults":  # nothing claimed over the defaults: not compared, not counted
        assert row["claimed"] is None and "realized" not in row and "ratio" not in row
    elif row["emitted"] == "recipe":  # nothing claimed over the defaults, but compared
        assert row["claimed"] is None and row["realized"] > 0 and "ratio" not in row
    else:
        assert row["emitted"] == "best" and row["claimed"] > 0 and row["realized"] > 0
        assert abs(row["ratio"] - row["realized"] / row["claimed"]) < 1e-9
    assert row.get("compare_rounds", 2) == 2  # --quick: 2 rounds
    again = subprocess.run(
        [*script, "--summarize", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0, again.stderr
    ratio_table, _, coverage = again.stdout.partition("realized alone inside the claim's printed 90% interval")
    assert "realized / claimed" in ratio_table and any(line.startswith("all ") for line in ratio_table.splitlines())
    # the coverage table counts the searches whose claim has an interval: here the one emitted best, or none
    covered = [line for line in coverage.splitlines() if line.startswith("all ")]
    assert len(covered) == (row["emitted"] == "best"), coverage
    assert done.stdout.endswith(again.stdout)


def test_realized_speedup_resumes_after_its_last_finished_row_and_pools_runs(tmp_path):
    """``--resume`` keeps the rows of an earlier run up to the first whose compare was cut short
    (searched again), refuses rows of another workload turn, and ``--summarize`` pools results files."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import realized_speedup as rs

    def row(run: int, workload: str = "small", **fields) -> dict:
        return {"run": run, "workload": workload, "emitted": "best", "claimed": 1.2, **fields}

    done = [row(0, realized=1.25), row(1, emitted="defaults", claimed=None), row(2, error="its run failed")]
    (tmp_path / "results.json").write_text(json.dumps({"rows": [*done, row(3), row(4, realized=1.1)]}))
    assert rs.get_resumed(tmp_path, ["small"]) == done  # row 3 was not compared: it and what follows run again
    assert rs.get_resumed(tmp_path / "nothing-yet", ["small"]) == []
    with pytest.raises(SystemExit, match="row 1 is not run 1 of small,wide1024"):
        rs.get_resumed(tmp_path, ["small", "wide1024"])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": [row(0, realized=1.3, search_wall_s=1.0)]}))
    assert len(rs.read_rows(tmp_path)) == 5 and rs.read_rows(other)[0]["realized"] == 1.3
    with pytest.raises(SystemExit, match="cannot read the rows of"):
        rs.read_rows(tmp_path / "missing.json")


@pytest.mark.multirank
def test_in_job_tuner_quick_run_prints_each_run_and_the_ratios():
    """``in_job_tuner.py --quick``: tiny, 30 steps, the untuned and the tuned run on one pool; each
    run's line, the tuner's decisions, and the two ratios (tuned over untuned in total and per step)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "in_job_tuner.py"), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("round 1 untuned") for line in lines), done.stdout
    tuned = next(line for line in lines if line.startswith("round 1 tuned"))
    assert "settled at step" in tuned and "None" not in tuned, tuned  # 30 steps hold its 20-step window
    assert any(line.strip().startswith("step ") for line in lines)  # a decision line
    for label in ("tuned total / untuned total", "tuned settled step / untuned step"):
        ratio = next(line for line in lines if line.startswith(label))
        assert 0.2 < float(ratio.split("median ")[1].split()[0]) < 5, ratio


def test_the_decisions_study_quick_run_bounds_a_tie_emitted_or_adopted_with_bursts():
    """``studies/decisions.py --quick``: each decision driven through its real rule (600 trials,
    a burst anywhere, a quiet box's pair spread of 3%, where one block settles: the case the call
    on one block's interval emitted a tie in 10% of windows; a fixed seed); a tie is not shown emitted or adopted in more
    than 5% of windows, the interval's nominal rate (the Wilson 95% interval of its share reaches
    5% or below: the Monte Carlo error counted), and a true 10% speedup is emitted more often
    than a tie."""
    sys.path.insert(0, str(ROOT / "studies"))
    import decisions

    table = decisions.main(["--quick", "--sigma", "0.03"])
    for (decision, order, _), counts in table.items():
        tie, ten = counts[0], counts[-1]
        if decision in ("emit", "adopt"):
            assert decisions.wilson(tie, 600)[0] <= 0.05, (decision, order, counts)
            assert ten > tie, (decision, order, counts)
