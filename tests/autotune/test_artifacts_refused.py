"""Artifact readers refuse what is not theirs: another kind, a newer or bad schema version, a
body that does not match its version, a broken trial spec. The contract ([Note: artifacts] in
autotune/artifacts.py) is one line naming the file, never a traceback."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _artifact_fixtures import assert_refused, load_fixture, write_json

from autotune.analysis import SUMMARY_SCHEMA_VERSION
from autotune.artifacts import ArtifactError
from autotune.compare import CompareRecord
from autotune.plan import PlanRecord
from autotune.search import SearchRecord, read_results
from autotune.trials import TrialMetrics, TrialSpec, TrialSpecError

# --------------------------------------------------------------------------- refusing what is not one


@dataclasses.dataclass(frozen=True)
class Reader:
    name: str
    kind: str
    version: int
    file_name: str
    fixture: str
    read: Callable[[Path], Any]
    other_kind: str
    """A fixture of another kind, handed to this reader."""

    def __str__(self) -> str:
        return self.name


READERS = [
    Reader(
        "CompareRecord.read",
        "compare_summary",
        CompareRecord.SCHEMA_VERSION,
        "compare.json",
        "compare_v1.json",
        CompareRecord.read,
        "plan_v2.json",
    ),
    Reader(
        "TrialMetrics.read",
        "trial_metrics",
        TrialMetrics.SCHEMA_VERSION,
        "metrics.json",
        "metrics_v9.json",
        TrialMetrics.read,
        "search_v3.json",
    ),
    Reader(
        "SearchRecord.read",
        "search_summary",
        SearchRecord.SCHEMA_VERSION,
        "search.json",
        "search_v10.json",
        SearchRecord.read,
        "metrics_v3.json",
    ),
    Reader(
        "read_results",
        "search_results",
        SearchRecord.SCHEMA_VERSION,
        "results.json",
        "results_v1.json",
        lambda p: read_results(p.parent),
        "search_v1.json",
    ),
    Reader(
        "PlanRecord.read",
        "plan_summary",
        PlanRecord.SCHEMA_VERSION,
        "plan.json",
        "plan_v2.json",
        PlanRecord.read,
        "search_v6.json",
    ),
    Reader(
        "TrialSpec.read",
        "trial_spec",
        TrialSpec.SCHEMA_VERSION,
        "trial_spec.json",
        "trial_spec_v4.json",
        TrialSpec.read,
        "metrics_v3.json",
    ),
]


@pytest.mark.parametrize("reader", READERS, ids=str)
def test_reader_refuses_another_kind(reader, tmp_path):
    other = load_fixture(reader.other_kind)
    path = write_json(tmp_path / reader.file_name, other)
    with pytest.raises(ArtifactError) as excinfo:
        reader.read(path)
    assert_refused(excinfo, path, f"not a {reader.kind} file", repr(other["kind"]))


@pytest.mark.parametrize("reader", READERS, ids=str)
def test_reader_refuses_a_newer_schema_version(reader, tmp_path):
    path = write_json(
        tmp_path / reader.file_name, {**load_fixture(reader.fixture), "schema_version": reader.version + 1}
    )
    with pytest.raises(ArtifactError) as excinfo:
        reader.read(path)
    assert_refused(excinfo, path, f"schema_version {reader.version + 1} is newer", "upgrade fsdp-autotune")


BAD_FILES = {
    "not UTF-8": (b'{"kind": "caf\xe9"}', "not UTF-8"),
    "invalid JSON": (b'{"schema_version": 2, "kind": "trial_m', "not valid JSON"),
    "empty": (b"", "not valid JSON"),
    "a JSON array": (b"[1, 2]", "a JSON list, expected an object"),
    "a JSON string": (b'"metrics"', "a JSON str, expected an object"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
@pytest.mark.parametrize("reader", READERS, ids=str)
def test_reader_refuses_a_file_that_is_not_a_json_object(reader, case, tmp_path):
    content, fragment = BAD_FILES[case]
    path = tmp_path / reader.file_name
    path.write_bytes(content)
    with pytest.raises(ArtifactError) as excinfo:
        reader.read(path)
    assert_refused(excinfo, path, fragment)


@pytest.mark.parametrize("reader", READERS, ids=str)
def test_reader_refuses_a_missing_file(reader, tmp_path):
    path = tmp_path / reader.file_name
    with pytest.raises(ArtifactError) as excinfo:
        reader.read(path)
    assert_refused(excinfo, path, "no such file")


@pytest.mark.parametrize("version", [0, -1, "2", None, 1.5])
def test_reader_refuses_a_bad_schema_version(version, tmp_path):
    path = write_json(tmp_path / "metrics.json", {**load_fixture("metrics_v9.json"), "schema_version": version})
    with pytest.raises(ArtifactError) as excinfo:
        TrialMetrics.read(path)
    assert_refused(excinfo, path, "schema_version must be a positive integer")


def test_reader_refuses_a_boolean_schema_version(tmp_path):
    path = write_json(tmp_path / "metrics.json", {**load_fixture("metrics_v1.json"), "schema_version": True})
    with pytest.raises(ArtifactError):
        TrialMetrics.read(path)


def test_metrics_refuse_an_embedded_summary_from_a_newer_release(tmp_path):
    data = load_fixture("metrics_v8.json")
    data["trace_metrics"]["schema_version"] = SUMMARY_SCHEMA_VERSION + 1
    path = write_json(tmp_path / "metrics.json", data)
    with pytest.raises(ArtifactError) as excinfo:
        TrialMetrics.read(path)
    assert_refused(excinfo, path, "trace_metrics", "upgrade fsdp-autotune")


def test_metrics_refuse_an_embedded_summary_of_another_kind(tmp_path):
    data = load_fixture("metrics_v8.json")
    data["trace_metrics"] = {"schema_version": 1, "kind": "trial_env"}
    path = write_json(tmp_path / "metrics.json", data)
    with pytest.raises(ArtifactError) as excinfo:
        TrialMetrics.read(path)
    assert_refused(excinfo, path, "trace_metrics", "not a trace_metrics file")


# An artifact of the right kind and version whose body is not what the version defines.
# The contract ([Note: artifacts]) is one line naming the file, never a traceback.


def _without(data: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k != key}


def _metrics_with_rank_field(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "ranks": [{**data["ranks"][0], "gpu_util": 0.9}, *data["ranks"][1:]]}


def _bad_body(
    case_id: str, file_name: str, read: Callable[[Path], Any], make: Callable[[], Any], field_name: str
) -> Any:
    return pytest.param(file_name, read, make, field_name, id=case_id)


BAD_BODIES = [
    _bad_body(
        "plan-missing-field",
        "plan.json",
        PlanRecord.read,
        lambda: _without(load_fixture("plan_v2.json"), "best"),
        "best",
    ),
    _bad_body(  # the v1 -> v2 migration leaves a missing row missing, for the reader to name
        "plan-v1-missing-field",
        "plan.json",
        PlanRecord.read,
        lambda: _without(load_fixture("plan_v1.json"), "best"),
        "best",
    ),
    _bad_body(
        "metrics-unknown-field",
        "metrics.json",
        TrialMetrics.read,
        lambda: {**load_fixture("metrics_v8.json"), "gpu_util": 0.9},
        "gpu_util",
    ),
    _bad_body(
        "metrics-missing-field",
        "metrics.json",
        TrialMetrics.read,
        lambda: _without(load_fixture("metrics_v8.json"), "status"),
        "status",
    ),
    _bad_body(
        "metrics-rank-unknown-field",
        "metrics.json",
        TrialMetrics.read,
        lambda: _metrics_with_rank_field(load_fixture("metrics_v8.json")),
        "gpu_util",
    ),
    _bad_body(
        "metrics-rank-not-an-object",
        "metrics.json",
        TrialMetrics.read,
        lambda: {**load_fixture("metrics_v1.json"), "ranks": ["rank0"]},
        "ranks",
    ),
    _bad_body(
        "search-missing-field",
        "search.json",
        SearchRecord.read,
        lambda: _without(load_fixture("search_v3.json"), "model"),
        "model",
    ),
    _bad_body(
        "search-incomplete-row",
        "search.json",
        SearchRecord.read,
        lambda: {**load_fixture("search_v1.json"), "best": {"state": "COMPLETE"}},
        "best",
    ),
    _bad_body(
        "results-missing-trials",
        "results.json",
        lambda p: read_results(p.parent),
        lambda: _without(load_fixture("results_v1.json"), "trials"),
        "trials",
    ),
]


@pytest.mark.parametrize(("file_name", "read", "make", "field_name"), BAD_BODIES)
def test_reader_refuses_a_body_that_does_not_match_its_version(file_name, read, make, field_name, tmp_path):
    path = write_json(tmp_path / file_name, make())
    with pytest.raises(ArtifactError) as excinfo:
        read(path)
    assert_refused(excinfo, path, field_name)


# --------------------------------------------------------------------------- the trial spec


def test_plan_json_of_before_it_was_versioned_is_refused_in_one_line(tmp_path):
    """``plan.json`` was written unversioned (``"kind": "autotune-plan"``) before ``PlanRecord``."""
    old = {k: v for k, v in load_fixture("plan_v1.json").items() if k != "schema_version"} | {"kind": "autotune-plan"}
    path = write_json(tmp_path / "plan.json", old)
    with pytest.raises(ArtifactError) as excinfo:
        PlanRecord.read(path)
    assert_refused(excinfo, path, "not a plan_summary file", "'autotune-plan'")


def test_old_trial_spec_without_kind_is_refused_clearly(tmp_path):
    """The previous release's spec (``TrialSpec.to_dict`` at HEAD~2) had no kind nor schema_version."""
    old = {k: v for k, v in load_fixture("trial_spec_v4.json").items() if k not in ("kind", "schema_version")}
    old["rank_program"] = "autotune.trial_rank:run_trial_rank"  # the old module path
    path = write_json(tmp_path / "trial_spec.json", old)
    with pytest.raises(ArtifactError) as excinfo:
        TrialSpec.read(path)
    assert_refused(excinfo, path, "not a trial_spec file", "kind is None")


def test_trial_spec_refuses_an_unknown_field_by_name(tmp_path):
    data = {**load_fixture("trial_spec_v4.json"), "torch_version": "2.5.1"}
    with pytest.raises(TrialSpecError) as excinfo:
        TrialSpec.from_dict(data, source="spec.json")
    assert_refused(excinfo, Path("spec.json"), "unknown field 'torch_version'")

    path = write_json(tmp_path / "trial_spec.json", data)
    with pytest.raises(TrialSpecError) as excinfo:
        TrialSpec.read(path)
    assert_refused(excinfo, path, "unknown field 'torch_version'")


@pytest.mark.parametrize("missing", ["world_size", "config", "out_dir", "model"])
def test_trial_spec_refuses_a_missing_field_naming_the_file(missing, tmp_path):
    path = write_json(tmp_path / "trial_spec.json", _without(load_fixture("trial_spec_v3.json"), missing))
    with pytest.raises(TrialSpecError) as excinfo:
        TrialSpec.read(path)
    assert_refused(excinfo, path, "incomplete trial spec", missing)


def test_trial_spec_with_an_invalid_value_names_the_file(tmp_path):
    path = write_json(tmp_path / "trial_spec.json", {**load_fixture("trial_spec_v3.json"), "world_size": 0})
    with pytest.raises(TrialSpecError) as excinfo:
        TrialSpec.read(path)
    assert_refused(excinfo, path, "world size must be >= 1")
