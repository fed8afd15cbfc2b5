"""``autotune search --presearch sim`` ([Note: presearch]) end to end, the v5 search record, the
proxy's ``autotune plan`` hint, and the simulator on models beyond our Llama profiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _search_fixtures import FAST, complete_row, nosync_params
from torch import nn

from autotune.report import get_prediction_table
from autotune.search import SearchError, SearchRecord, SearchSettings, SearchSpace, plan_model, run_search
from autotune.search.predictions import get_spearman
from autotune.search.proxy import get_plan_hint
from autotune.sim import get_model_work
from profiles import load_model_profile
from profiles.sources import load_model_source

ARTIFACTS = Path(__file__).resolve().parents[2] / "data" / "artifacts"


@pytest.mark.multirank
def test_presearch_measures_the_simulators_top_k_and_records_predicted_vs_measured(tmp_path, shared_pool):
    settings = SearchSettings(
        out_dir=tmp_path, num_trials=7, num_confirm_pairs=1, presearch="sim", presearch_top_k=2, **FAST
    )
    summary = run_search(settings)
    rows = summary.rows
    assert [r.number for r in rows] == list(range(7)) and rows[0].is_default
    # trials 1-3 calibrate the simulator (as ordinary paired trials), 4 and 5 are its two fastest predictions
    assert [r.calibration for r in rows] == [None, "unshard_async", "replicated", "eager_concat", None, None, None]
    assert [r.presearch_rank for r in rows] == [None, None, None, None, 1, 2, None]
    assert all(r.ratio is not None for r in rows[1:4]) and rows[2].params["mesh"] == "hsdp:2x1"
    assert rows[4].predicted_ratio <= rows[5].predicted_ratio
    # every trial has a prediction: the enqueued ones from the presearch, the others from the study's calibration at the end
    assert all(r.predicted_step_ms > 0 and r.predicted_ratio > 0 for r in rows)
    assert rows[0].predicted_ratio == pytest.approx(
        1.0
    )  # the defaults, and the anchor: predicted at its step timed in the calibration trials' pairs
    record = json.loads((tmp_path / "search.json").read_text())
    assert record["schema_version"] == SearchRecord.SCHEMA_VERSION
    presearch = record["presearch"]
    assert presearch["num_ranked"] > 100 and presearch["num_enqueued"] == 2 and presearch["num_compared"] >= 1
    assert presearch["calibrated_on"] == rows[0].trial_dir and "profile" not in presearch
    assert presearch["calibration_trials"] == [r.trial_dir for r in rows[1:4]]
    notes = " ".join(presearch["notes"])
    assert (
        "(given)" in presearch["notes"][0]
    )  # the anchor's step: the defaults as timed in the calibration trials' pairs
    assert (
        "cpu share" in notes and "shard group of one" in notes and "eager concat" in notes and "sync wait" not in notes
    )
    results = json.loads((tmp_path / "results.json").read_text())["trials"]
    assert [t["presearch_rank"] for t in results] == [None] * 4 + [1, 2, None] and all(
        t["predicted_step_ms"] for t in results
    )
    table = get_prediction_table(rows)
    assert [row[1] for row in table.rows][:6] == [
        "defaults",
        "calibration (unshard_async)",
        "calibration (replicated)",
        "calibration (eager_concat)",
        "presearch #1",
        "presearch #2",
    ]
    assert table.rows[6][1] in ("sampled", "refined")


def test_the_calibration_trials_are_points_of_the_space_it_can_express():
    from autotune.search.calibration_trials import get_calibration_params

    space = SearchSpace(block_names=("layers.0", "layers.1"), world_size=2, num_microbatches=4, device_type="cpu")
    points = get_calibration_params(space)
    assert list(points) == ["unshard_async", "replicated", "eager_concat"]
    defaults = space.get_default_params()
    assert points["unshard_async"] == {**defaults, "unshard_async": "on", "forward_prefetch": "depth1"}
    assert points["eager_concat"] == nosync_params(defaults, keep_unsharded=False, defer_concat=False)
    assert points["replicated"] == {**defaults, "mesh": "hsdp:2x1"}
    # One microbatch has no sync to skip; one rank nothing to replicate or gather.
    assert list(
        get_calibration_params(
            SearchSpace(block_names=("layers.0",), world_size=2, num_microbatches=1, device_type="cpu")
        )
    ) == ["unshard_async", "replicated"]
    assert "replicated" not in get_calibration_params(
        SearchSpace(block_names=("layers.0",), world_size=1, num_microbatches=2, device_type="cpu")
    )


def test_presearch_is_refused_where_it_cannot_calibrate(tmp_path):
    with pytest.raises(SearchError, match="unknown presearch 'grid'"):
        SearchSettings(out_dir=tmp_path, presearch="grid")
    with pytest.raises(SearchError, match="top-k must be >= 1"):
        SearchSettings(out_dir=tmp_path, presearch="sim", presearch_top_k=0)


def test_search_record_v5_reads_v4_and_round_trips_predictions(tmp_path):
    old = SearchRecord.read(ARTIFACTS / "search_v4.json")
    assert old.presearch is None and old.best.predicted_step_ms is None and old.best.presearch_rank is None
    row = complete_row(
        1,
        10.0,
        ratio=0.9,
        predicted_step_ms=9.5,
        predicted_ratio=0.92,
        presearch_rank=1,
    )
    record = SearchRecord(model="tiny", best=row, presearch={"kind": "sim", "num_ranked": 10, "median_abs_error": 0.05})
    record.write(tmp_path / "search.json")
    again = SearchRecord.read(tmp_path / "search.json")
    assert again.best == row and again.presearch == record.presearch


def test_spearman_and_prediction_table_by_hand():
    assert get_spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert get_spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert get_spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833)  # ties share their mean rank
    rows = [
        complete_row(
            0,
            100.0,
            is_default=True,
            predicted_step_ms=100.0,
            predicted_ratio=1.0,
        ),
        complete_row(
            1,
            80.0,
            ratio=0.8,
            predicted_step_ms=88.0,
            predicted_ratio=0.88,
            presearch_rank=1,
        ),
        complete_row(2, 90.0),
    ]
    table = get_prediction_table(rows)
    assert table.rows == [
        ["0", "defaults", "100.0", "100.0", "+0.0%", "1.000", "-"],
        ["1", "presearch #1", "88.0", "80.0", "+10.0%", "0.880", "0.800"],
    ]
    assert get_prediction_table(rows[2:]) is None


def test_a_search_on_a_proxy_points_to_autotune_plan():
    llama8b = load_model_profile("llama8b")
    proxy = plan_model(llama8b, world_size=2, memory_per_rank=4 * 2**30, flops_per_rank=25e9, step_budget_s=1.0)
    assert proxy.is_proxy
    assert get_plan_hint(proxy) == (
        "hint: these trials measure a proxy; for llama8b itself on a GPU cluster, simulate it: "
        "autotune plan --model llama8b --cluster h100-node --nodes 1"
    )
    fits = plan_model(
        load_model_profile("tiny"), world_size=2, memory_per_rank=4 * 2**30, flops_per_rank=25e9, step_budget_s=1.0
    )
    assert get_plan_hint(fits) is None


# -- the simulator on a Hugging Face config and a factory -------------------------------------


def _hf_tiny_llama(tmp: Path) -> Path:
    """An HF LlamaForCausalLM config with the ``tiny`` profile's shape (dim 64, 4 blocks, ffn 192, vocab 512)."""
    directory = tmp / "hf-tiny"
    directory.mkdir()
    (directory / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 192,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 512,
                "max_position_embeddings": 32,
                "tie_word_embeddings": False,
            }
        )
    )
    return directory


def test_hf_config_traces_like_the_llama_profile_of_its_shape(tmp_path):
    tiny = load_model_profile("tiny")
    source = load_model_source(str(_hf_tiny_llama(tmp_path))).with_overrides(
        seq_len=tiny.seq_len, batch_size=tiny.batch_size
    )
    hf, ours = get_model_work(source, "bfloat16"), get_model_work(tiny, "bfloat16")
    assert hf.block_names == tuple(f"model.layers.{i}" for i in range(4))
    assert hf.work["block", "forward"].gemm_flops == ours.work["block", "forward"].gemm_flops
    assert hf.work["block", "backward"].gemm_flops == ours.work["block", "backward"].gemm_flops
    assert hf.param_shapes["model.layers.0"] and sum(map(len, hf.param_shapes.values())) > 0
    assert hf.activations.block_input == ours.activations.block_input == tiny.batch_size * tiny.seq_len * 64 * 2


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vocab_size = 32
        self.embed, self.blocks, self.head = (
            nn.Embedding(32, 16),
            nn.ModuleList(_Block(16) for _ in range(3)),
            nn.Linear(16, 32),
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def tiny_lm() -> nn.Module:
    return TinyLM()


def test_a_factory_is_traced_whole_and_its_blocks_averaged():
    source = load_model_source("test_presearch:tiny_lm")
    work = get_model_work(source, "float32")
    tokens = source.batch_size * source.seq_len
    assert work.block_names == ("blocks.0", "blocks.1", "blocks.2")
    # one block: two linears of 16 x 32 weights, 2 FLOPs per weight and token forward, twice that backward
    assert work.work["block", "forward"].gemm_flops == 2 * tokens * 2 * 16 * 32
    assert work.work["block", "backward"].gemm_flops == 2 * work.work["block", "forward"].gemm_flops
    assert work.work["tail", "forward"].gemm_flops == 2 * tokens * 16 * 32  # the output head


def test_plan_takes_a_hugging_face_config_and_emits_its_unit_names(tmp_path):
    from autotune.plan import PlanSettings, run_plan
    from fsdp_runtime import load_config

    model = str(_hf_tiny_llama(tmp_path))
    result = run_plan(
        PlanSettings(
            model=model,
            cluster="h100-node",
            num_microbatches=1,
            fixed_mesh="fsdp",
            num_workers=1,
            out_dir=tmp_path / "plan",
        )
    )
    assert result.ranked and result.num_evaluated > 100
    config = load_config(tmp_path / "plan" / "best.toml")
    # The plan may group blocks (ranked with the memory knobs): every HF block is in a unit, in order.
    assert [m for u in config.units for m in u.get_modules()] == [
        *(f"model.layers.{i}" for i in range(4)),
        "root",
    ] and config.provenance.model == "hf-tiny"


@pytest.mark.parametrize("model", ["test_presearch:tiny_lm", "torchtitan:llama3/debugmodel"])
def test_the_presearch_simulates_any_model_the_trials_train(model):
    """A factory and torchtitan's own model, not only our Llama profiles: the predictor is built
    (it was refused, and only after the defaults and calibration trials had run) and predicts the
    defaults at ratio 1."""
    from types import SimpleNamespace

    from _measured_profiles import get_measured_profile

    from autotune.search.presearch import make_predictor

    source = load_model_source(model)
    work = get_model_work(source, "float32")
    space = SearchSpace(block_names=work.block_names, world_size=2, num_microbatches=2, device_type="cpu")
    ctx = SimpleNamespace(
        plan=SimpleNamespace(run=source), settings=SimpleNamespace(cluster=None, world_size=2), space=space
    )
    predictor = make_predictor(ctx, get_measured_profile(world_size=2))
    assert predictor.predict(space.get_default_params())["predicted_ratio"] == pytest.approx(1.0)
    replicated = predictor.predict({**space.get_default_params(), "mesh": "hsdp:2x1"})
    assert replicated["predicted_step_ms"] > 0
