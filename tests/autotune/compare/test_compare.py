"""``autotune compare``: configs run alone in rotating, reversing rounds; speedups over the first with
intervals over the rounds; ``compare.json`` read back; bad input refused in one line, nothing written."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
from _artifact_fixtures import ARTIFACTS, assert_refused, load_fixture, write_json

from autotune.artifacts import ArtifactError
from autotune.compare import (
    CompareRecord,
    CompareSettings,
    SilentCompareReporter,
    build_word_config,
    get_round_order,
    get_speedup_interval,
    load_compare_configs,
)
from autotune.compare.stats import is_settled
from autotune.search import SearchSpace
from fsdp_runtime import MeshConfig, MixedPrecisionConfig, get_unsupported_knobs, save_config

FP32 = MixedPrecisionConfig(param_dtype="float32", reduce_dtype="float32")


def _write_config(path: Path, model: str = "tiny", **changes) -> Path:
    """FSDP2's defaults for ``model`` (as ``defaults`` builds them), with ``changes``; every block
    unit with ``raf`` set to its ``reshard_after_forward``."""
    raf = changes.pop("raf", None)
    settings = CompareSettings(model=model, configs=["defaults", "defaults"])
    config = build_word_config("defaults", settings, num_microbatches=1, mixed_precision=FP32)
    if raf is not None:
        units = [dataclasses.replace(u, reshard_after_forward=raf) if u.name != "root" else u for u in config.units]
        config = dataclasses.replace(config, units=units)
    return save_config(dataclasses.replace(config, **changes), path)


# --------------------------------------------------------------------------- the order of runs


def test_round_orders_rotate_and_reverse():
    assert [get_round_order(r, 3) for r in range(6)] == [
        [0, 1, 2],  # A B C
        [2, 1, 0],  # C B A
        [1, 2, 0],  # B C A
        [0, 2, 1],  # A C B
        [2, 0, 1],  # C A B
        [1, 0, 2],  # B A C
    ]
    assert [get_round_order(r, 2) for r in range(4)] == [[0, 1], [1, 0], [1, 0], [0, 1]]  # ABBA


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_round_orders_balance_positions_and_drift(n):
    orders = [get_round_order(r, n) for r in range(2 * n)]
    assert all(sorted(order) == list(range(n)) for order in orders)
    for config in range(n):  # 2n rounds: every position twice
        assert sorted(order.index(config) for order in orders) == sorted(list(range(n)) * 2)
    for r in range(0, 2 * n, 2):  # a forward round and its reversal: positions sum to n - 1
        assert all(orders[r].index(c) + orders[r + 1].index(c) == n - 1 for c in range(n))


# --------------------------------------------------------------------------- the interval


def test_the_interval_is_a_t_interval_of_the_mean_log_ratio():
    interval = get_speedup_interval([math.exp(0.1), math.exp(-0.1)])
    half = 6.314 * math.sqrt(0.02) / math.sqrt(2)  # t(0.95, 1) * sd / sqrt(n)
    assert interval.low == pytest.approx(math.exp(-half)) and interval.high == pytest.approx(math.exp(half))
    assert interval.median == pytest.approx(math.cosh(0.1)) and interval.num_rounds == 2
    assert get_speedup_interval([1.2]) is None  # one round: no interval


@pytest.mark.parametrize(
    ("ratios", "verdict"),
    [
        ([1.10, 1.12, 1.09, 1.11], "faster"),
        ([0.80, 0.82, 0.79, 0.81], "slower"),
        ([0.95, 1.08, 1.02, 0.99], "within noise"),
        ([1.30, 1.02], "within noise"),  # clearly above 1 twice, but two rounds spread this much prove nothing
        ([1.0, 1.0, 1.0], "within noise"),
    ],
)
def test_the_interval_includes_one_when_it_should(ratios, verdict):
    interval = get_speedup_interval(ratios)
    assert interval.verdict == verdict
    assert (interval.low <= 1.0 <= interval.high) == (verdict == "within noise")
    assert interval.low <= interval.median <= interval.high


def test_until_ci_stops_after_an_even_round_once_every_interval_is_narrow():
    narrow = get_speedup_interval([1.10, 1.11, 1.10, 1.11])
    wide = get_speedup_interval([0.9, 1.2, 1.0, 1.1])
    assert narrow.half_width < 0.01 < wide.half_width
    assert is_settled([narrow], 4, 1.0)
    assert not is_settled([narrow], 3, 1.0)  # odd rounds: a forward round without its reversal
    assert not is_settled([narrow, wide], 4, 1.0) and not is_settled([narrow], 4, None)
    assert not is_settled([None], 2, 50.0)


# --------------------------------------------------------------------------- the configs


def test_the_words_are_built_for_the_model_as_the_search_builds_its_baselines(tmp_path):
    settings = CompareSettings(model="tiny", configs=["defaults", "torchtitan"], out_dir=tmp_path / "c")
    defaults, recipe = load_compare_configs(settings, SilentCompareReporter())
    assert (defaults.source, recipe.source) == ("defaults", "torchtitan")
    space = SearchSpace(
        block_names=("layers.0", "layers.1", "layers.2", "layers.3"),
        world_size=2,
        num_microbatches=1,
        device_type="cpu",
        grouping=True,
        root_knobs=True,
        mixed_precision=FP32,
        unsupported_knobs=tuple(get_unsupported_knobs().items()),
    )
    assert defaults.config == space.build_config(space.get_default_params())  # the search's defaults trial
    assert recipe.config.unit_names == ["tok_embeddings", *(f"layers.{i}" for i in range(4)), "norm+output", "root"]
    assert recipe.config.unshard_async == defaults.config.unshard_async == "off"
    assert not (tmp_path / "c").exists()


def test_the_words_take_the_files_microbatches_and_precision(tmp_path):
    path = _write_config(
        tmp_path / "mb2.toml", num_microbatches=2, mixed_precision=MixedPrecisionConfig(param_dtype="float32")
    )
    settings = CompareSettings(model="tiny", configs=[str(path), "defaults", "torchtitan"])
    configs = load_compare_configs(settings, SilentCompareReporter())
    assert [c.config.num_microbatches for c in configs] == [2, 2, 2]
    assert all(c.config.mixed_precision == configs[0].config.mixed_precision for c in configs)


# --------------------------------------------------------------------------- bad input


def _refused(result, *needles: str) -> None:
    assert result.returncode == 2, (result.stdout[-1000:], result.stderr[-1000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_a_config_of_another_model_is_refused_in_one_line(tmp_path, cli_main):
    other = _write_config(tmp_path / "llama1b.toml", model="llama1b")
    out = tmp_path / "out"
    result = cli_main("compare", "defaults", str(other), "--model", "tiny", "--out", str(out))
    _refused(result, f"{other}: units[4].name", "'layers.4' not found")
    assert not out.exists() and result.stdout == ""


@pytest.mark.parametrize(
    ("configs", "flags", "needles"),
    [
        (["defaults"], [], ["at least 2 configs", "got 1"]),
        (["defaults", "missing.toml"], [], ["missing.toml: no such config file", "defaults, torchtitan"]),
        (["defaults", "hsdp3x1.toml"], [], ["hsdp3x1.toml: mesh:", "world size 2"]),
        (["mb2.toml", "defaults"], ["--microbatches", "1"], ["--microbatches:", "mb2.toml runs 2 microbatches"]),
        (["defaults", "torchtitan"], ["--rounds", "1"], ["--rounds: must be >= 2"]),
        (["defaults", "torchtitan"], ["--until-ci", "0"], ["--until-ci:"]),
        (["defaults", "torchtitan"], ["--cluster", "nowhere"], ["--cluster:", "nowhere"]),
        (["defaults", "torchtitan"], ["--steps", "0"], ["--steps:"]),
        (["defaults", "torchtitan"], ["--param-dtype", "int8"], ["--param-dtype:", "int8"]),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(tmp_path, cli_main, monkeypatch, configs, flags, needles):
    _write_config(tmp_path / "hsdp3x1.toml", mesh=MeshConfig(kind="hsdp", replicate=3, shard=1))
    _write_config(tmp_path / "mb2.toml", num_microbatches=2)
    monkeypatch.chdir(tmp_path)
    _refused(cli_main("compare", *configs, "--model", "tiny", "--out", "out", *flags), *needles)
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- compare.json


def test_compare_json_of_every_version_reads_and_round_trips(tmp_path):
    record = CompareRecord.read(ARTIFACTS / "compare_v1.json")
    assert (record.model, record.world_size, record.num_rounds, record.orders) == ("tiny", 2, 2, [[0, 1], [1, 0]])
    first, other = record.configs
    assert (first.source, first.speedup, other.verdict) == ("defaults", None, "faster")
    assert other.speedup == pytest.approx(sorted(other.round_ratios)[0] / 2 + sorted(other.round_ratios)[1] / 2)
    assert record.to_dict() == load_fixture("compare_v1.json")
    assert CompareRecord.read(record.write(tmp_path / "compare.json")) == record


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"schema_version": 2}, "schema_version 2 is newer"),
        ({"kind": "plan_summary"}, "not a compare_summary file"),
        ({"configs": [{"label": "x"}]}, "missing field 'source' in configs[0]"),
        ({"configs": "x"}, "configs must be a JSON list"),
        ({"speedup": 1.0}, "unknown field 'speedup'"),
    ],
)
def test_compare_json_that_is_not_one_is_refused(tmp_path, change, fragment):
    path = write_json(tmp_path / "compare.json", {**load_fixture("compare_v1.json"), **change})
    with pytest.raises(ArtifactError) as excinfo:
        CompareRecord.read(path)
    assert_refused(excinfo, path, fragment)


# --------------------------------------------------------------------------- a comparison


@pytest.mark.multirank
def test_compare_runs_each_config_alone_and_gives_a_ratio_with_an_interval(tmp_path, cli_main):
    """Two configs of ``tiny`` (FSDP2's defaults, and every block kept unsharded after forward), 2
    rounds of a few steps each on fresh ranks: both configs printed, a ratio and its interval, and
    ``compare.json`` read back through its reader."""
    raf = _write_config(tmp_path / "raf_false.toml", raf=False)
    out = tmp_path / "out"
    args = ["--model", "tiny", "--nproc", "2", "--rounds", "2", "--steps", "3", "--warmup", "1", "--timeout", "90"]
    result = cli_main("compare", "defaults", str(raf), *args, "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]

    record = CompareRecord.read(out / "compare.json")
    assert record.orders == [[0, 1], [1, 0]] and record.stopped == "rounds"
    assert [c.label for c in record.configs] == ["defaults", str(raf)]
    first, other = record.configs
    assert len(first.step_ms_per_round) == len(other.round_ratios) == 2
    assert other.speedup_low <= other.speedup <= other.speedup_high and other.verdict is not None
    assert all(p and p > 0 for c in record.configs for p in c.process_peak_bytes_per_round)
    for c in record.configs:  # one trial dir per run, each its own ranks and model: no reference beside it
        for run_dir in map(Path, c.dirs):
            metrics = json.loads((run_dir / "metrics.json").read_text())
            assert metrics["status"] == "ok" and metrics["paired"] in ({}, None)
    assert re.search(r"\d+\.\d{3}x", result.stdout) and re.search(r"\d+\.\d{3}-\d+\.\d{3}", result.stdout)
    assert "defaults" in result.stdout and "raf_false.toml" in result.stdout and "90% interval" in result.stdout
    assert result.stderr.count("round 1/2:") == 2 and result.stderr.count("round 2/2:") == 2


@pytest.mark.multirank
def test_a_failed_run_stops_the_comparison_naming_it(tmp_path, cli_main):
    out = tmp_path / "out"
    result = cli_main("compare", "defaults", "torchtitan", "--model", "tiny", "--timeout", "1", "--out", str(out))
    assert result.returncode == 1
    assert "defaults: its run in round 1 failed (timeout" in result.stderr and str(out / "round1") in result.stderr
    assert not (out / "compare.json").exists() and not (out / "round1" / "2-torchtitan").exists()


def test_an_earlier_comparison_s_rounds_are_removed_and_nothing_else(tmp_path):
    """A comparison of 4 rounds into the ``--out`` of an earlier one of 6 must not leave rounds 5
    and 6 beside its own; a ``round`` dir that is not a comparison's runs, and other files, stay."""
    from autotune.compare.run import clear_previous_runs

    for r in range(1, 7):
        for run in ("1-defaults", "2-best"):
            (tmp_path / f"round{r}" / run).mkdir(parents=True)
            (tmp_path / f"round{r}" / run / "config.toml").write_text("")
    (tmp_path / "round7" / "notes").mkdir(parents=True)  # not a run: no config.toml
    (tmp_path / "rounds.txt").write_text("mine")
    (tmp_path / "roundabout").mkdir()
    removed = clear_previous_runs(tmp_path)
    assert sorted(p.name for p in removed) == [f"round{r}" for r in range(1, 7)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round7", "roundabout", "rounds.txt"]
    assert clear_previous_runs(tmp_path / "missing") == []
