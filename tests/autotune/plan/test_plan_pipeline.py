"""``autotune plan``'s pipeline axis ([Note: the plan's pipeline axis] in autotune/plan/pipeline.py)."""

from __future__ import annotations

import pytest

from autotune.plan import PlanError, PlanRecord, PlanSettings, get_pipeline_table, run_plan
from autotune.plan.pipeline import get_pp_degrees, get_schedule_choices
from autotune.sim import PipelinePrediction
from fsdp_runtime import load_config, validate_config, validate_for_world


def test_pp_degrees_default_to_the_divisors_of_world_and_blocks_up_to_8():
    assert get_pp_degrees(None, 128, 80) == [1, 2, 4, 8]  # llama70b on 16 nodes of 8
    assert get_pp_degrees(None, 16, 4) == [1, 2, 4]
    assert get_pp_degrees(None, 8, 6) == [1, 2]
    assert get_pp_degrees((8, 1, 2, 2), 128, 80) == [1, 2, 8]
    with pytest.raises(
        PlanError, match="PP degree 3 does not divide the world size 8 and the model's 32 blocks"
    ) as info:
        get_pp_degrees((1, 3), 8, 32)
    assert info.value.field == "pp_degrees"


def test_pp_degrees_parse_from_one_option():
    assert PlanSettings(pp_degrees="1,2,4,8").pp_degrees == (1, 2, 4, 8)
    for bad in ("1,x", "0,2"):
        with pytest.raises(PlanError) as info:
            PlanSettings(pp_degrees=bad)
        assert info.value.field == "pp_degrees"


def test_schedules_are_the_runtime_s_and_interleave_where_the_stages_divide_the_blocks():
    assert get_schedule_choices(2, 80) == [
        ("gpipe", 1),
        ("1f1b", 1),
        ("interleaved_1f1b", 2),
        ("interleaved_1f1b", 4),
    ]
    assert get_schedule_choices(8, 80) == [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)]  # 32 stages: no


def test_plan_ranks_pp_degrees_beside_fsdp_alone_and_records_each(tmp_path):
    result = run_plan(
        PlanSettings(model="tiny", cluster="h100-node", num_nodes=2, out_dir=tmp_path, num_workers=1, pp_degrees="1,2")
    )
    assert result.pp_degrees == [1, 2]
    by_pp = {row.params.get("pp", 1): row for row in result.best_per_pp}
    assert set(by_pp) == {1, 2}
    piped = by_pp[2].prediction
    assert isinstance(piped, PipelinePrediction) and not isinstance(by_pp[1].prediction, PipelinePrediction)
    # the same tokens per step: 2 microbatches per data-parallel rank without PP, 4 per pipeline of 2 ranks
    assert piped.pipeline.num_microbatches == 4 and piped.pipeline.schedule in ("gpipe", "1f1b", "interleaved_1f1b")
    assert piped.tokens_per_s_per_device * piped.step_s == pytest.approx(
        by_pp[1].prediction.tokens_per_s_per_device * by_pp[1].prediction.step_s
    )
    assert any(r.params.get("pp") == 2 for r in result.ranked) and any("pp" not in r.params for r in result.ranked)
    table = get_pipeline_table(result)
    assert table is not None and [row[0] for row in table.rows] == ["1", "2"]
    record = PlanRecord.read(tmp_path / "plan.json")
    assert record.SCHEMA_VERSION == 3 and record.pp_degrees == [1, 2]
    assert [row["pipeline"]["pp"] for row in record.best_per_pp] == [1, 2]
    assert record.best_per_pp[1]["predicted_bubble_fraction"] == pytest.approx(piped.bubble_fraction)
    assert all("pipeline" in row for row in [record.default, record.best, *record.top])
    assert record.default["pipeline"] == {"pp": 1, "schedule": None, "virtual_stages": 1, "num_microbatches": 2}


def test_a_plan_of_pipelines_only_emits_a_schema_3_config_the_runtime_accepts(tmp_path):
    result = run_plan(
        PlanSettings(
            model="tiny",
            cluster="h100-node",
            num_nodes=2,
            out_dir=tmp_path,
            num_workers=1,
            pp_degrees="4",
            memory_knobs=False,
        )
    )
    assert result.pp_degrees == [4] and all(r.params["pp"] == 4 for r in result.ranked)
    assert "pp" not in result.default.params  # FSDP2's defaults without PP stay the reference
    config = load_config(tmp_path / "best.toml")
    assert config.mesh.pp == 4 and config.pipeline.schedule == result.best.params["pp_schedule"]
    assert config.num_microbatches == 8 and result.pipeline_in_config
    validate_config(config)
    replicate, shard = validate_for_world(config, 16)
    assert replicate * shard == 4
    notes = config.provenance.notes
    assert any(n.startswith("pipeline: 4 stages deep x 4 data-parallel ranks") for n in notes)
    assert isinstance(result.best_detail, PipelinePrediction) and len(result.best_detail.stages) == 4 * (
        config.pipeline.virtual_stages
    )


def test_a_fixed_mesh_leaves_out_the_degrees_whose_data_parallel_world_it_does_not_cover(tmp_path):
    lines: list[str] = []

    class Reporter:
        def on_phase(self, message: str) -> None:
            lines.append(message)

        def on_start(self, total: int) -> None: ...

        def on_advance(self, count: int) -> None: ...

    settings = dict(model="tiny", cluster="h100-node", num_nodes=2, num_workers=1, memory_knobs=False)
    result = run_plan(
        PlanSettings(**settings, out_dir=tmp_path / "a", fixed_mesh="hsdp:2x4", pp_degrees="2,4"), reporter=Reporter()
    )
    assert (
        result.pp_degrees == [2] and "PP 4 left out: --mesh hsdp:2x4 does not cover its 4 data-parallel ranks" in lines
    )
    with pytest.raises(PlanError, match="no PP degree of 4 leaves --mesh hsdp:2x4 its ranks") as info:
        run_plan(PlanSettings(**settings, out_dir=tmp_path / "b", fixed_mesh="hsdp:2x4", pp_degrees="4"))
    assert info.value.field == "pp_degrees"
