"""A search over pipeline degrees on 4 gloo ranks (2 stages x 2 data-parallel ranks), end to end."""

from __future__ import annotations

import json

import pytest
from _search_fixtures import FAST

from autotune.search import SearchSettings, run_search
from autotune.search.consolidation import time_consolidation
from fsdp_runtime import MeshConfig, PipelineConfig, default_config, load_config


@pytest.mark.multirank
def test_a_search_with_pipeline_degrees_measures_and_emits_a_staged_config(tmp_path, shared_pool4):
    settings = SearchSettings(
        out_dir=tmp_path,
        **{**FAST, "world_size": 4, "num_microbatches": 4},
        num_trials=2,
        num_confirm_pairs=0,
        num_refine=0,
        pipeline_degrees="2",
        cluster="cpu-emulated-ib",
        prune_ratio=1e9,
        sampler="random",
    )
    summary = run_search(settings)
    assert [r.state for r in summary.rows] == ["COMPLETE"] * 2, [(r.state, r.reason) for r in summary.rows]
    default = summary.rows[0]  # one degree offered: "pp" is not asked, its mesh and schedule are
    assert default.params["mesh_pp2"] == "fsdp" and default.params["pp2_schedule"] == "1f1b"
    emitted = load_config(summary.best_config_path)
    assert emitted.mesh.pp == 2 and emitted.num_microbatches == 4
    record = json.loads((tmp_path / "search.json").read_text())
    assert "pipeline stages" in json.dumps(record)  # the consolidation timing says why it was skipped


def test_consolidation_of_pipeline_stages_is_skipped_with_its_reason():
    config = default_config([f"layers.{i}" for i in range(4)], num_microbatches=2)
    staged = config.__class__(mesh=MeshConfig(pp=2), pipeline=PipelineConfig(), units=config.units, num_microbatches=2)
    result = time_consolidation(None, staged)  # type: ignore[arg-type]: returns before touching the search
    assert result["skipped"].startswith("pipeline stages")
