"""The final round against torchtitan's recipe ([Note: beating the recipe]): the decision rules.
Pure functions: the measurement is replaced; no ranks."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from autotune.search import recipe as recipe_round
from autotune.search.space import SearchSpace
from autotune.trials import StoppingRule
from autotune.trials.paired import summarize_pairs
from fsdp_runtime import MixedPrecisionConfig, get_torchtitan_config
from profiles import load_model_source


def _ctx(*, memory_budget_bytes=None, num_confirm_pairs=2, rank_program=None, model="tiny") -> SimpleNamespace:
    source = load_model_source(model)
    space = SearchSpace(
        block_names=tuple(source.block_names),
        world_size=2,
        num_microbatches=2,
        device_type="cpu",
        mixed_precision=MixedPrecisionConfig(param_dtype="float32", reduce_dtype="float32"),
    )
    settings = SimpleNamespace(
        num_confirm_pairs=num_confirm_pairs, memory_budget_bytes=memory_budget_bytes, rank_program=rank_program
    )
    phases: list[str] = []
    return SimpleNamespace(
        settings=settings,
        space=space,
        plan=SimpleNamespace(run=source),
        default_config=space.build_config(space.get_default_params()),
        reporter=SimpleNamespace(on_phase=phases.append),
        phases=phases,
    )


def _measured(ratios: list[float], faster: bool):
    """A recipe round's measurement replaced: ``ratios`` pair by pair, and whether its rule called the config faster."""

    def measure(ctx, config, recipe):
        measure.calls.append((config, recipe))
        return {
            "status": "ok",
            "reason": "",
            "step_ms": 1.0,
            "recipe_step_ms": 1.0,
            **summarize_pairs(ratios, [1.0] * len(ratios)),
            "ratio_low": min(ratios),
            "ratio_high": max(ratios),
            "faster": faster,
        }

    measure.calls = []
    return measure


def test_the_recipe_carries_the_search_s_mesh_microbatches_and_precision():
    ctx = _ctx()
    recipe, why = recipe_round.get_recipe_config(ctx)
    assert why is None
    assert recipe == get_torchtitan_config(load_model_source("tiny").build(device="meta"), ctx.default_config)
    assert (recipe.num_microbatches, recipe.unshard_async, recipe.mesh) == (2, "off", ctx.default_config.mesh)
    assert recipe.unit_names == ["tok_embeddings", *(f"layers.{i}" for i in range(4)), "norm+output", "root"]


def test_a_config_faster_than_the_recipe_is_emitted_with_its_speedup_over_it(monkeypatch):
    measure = _measured([0.80, 0.82, 0.84, 0.86], faster=True)
    monkeypatch.setattr(recipe_round, "_measure", measure)
    ctx = _ctx()
    config, record = recipe_round.run_recipe_round(ctx, "searched", {"emitted": "best"})
    assert config == "searched" and record["emitted"] == "search" and record["measured"]
    assert measure.calls[0][0] == "searched" and record["emit_rule"] == "interval" and "verdict" not in record
    assert (record["speedup_low"], record["speedup_high"]) == pytest.approx((1 / 0.86, 1 / 0.80))
    assert record["interval_covers"] == "the noise of this window's pairs, not a run alone"
    assert record["speedup_median"] == pytest.approx(1 / record["ratio"]) and record["speedup_median"] > 1
    assert record["speedups"] == pytest.approx([1 / r for r in record["block_ratios"]])
    assert record["speedup_q25"] <= record["speedup_median"] <= record["speedup_q75"]


def test_a_config_not_faster_than_the_recipe_gives_way_to_the_recipe(monkeypatch):
    monkeypatch.setattr(recipe_round, "_measure", _measured([1.02, 1.01, 0.99, 1.03], faster=False))
    ctx = _ctx()
    config, record = recipe_round.run_recipe_round(ctx, "searched", {"emitted": "best"})
    assert record["emitted"] == "recipe" and config == recipe_round.get_recipe_config(ctx)[0]
    # the defaults emitted by the final round are measured against the recipe the same way
    config, record = recipe_round.run_recipe_round(ctx, "defaults", {"emitted": "defaults"})
    assert record["candidate"] == "defaults" and record["emitted"] == "recipe"
    # under a memory budget the recipe (its peak never held to the budget) is not emitted in its place
    config, record = recipe_round.run_recipe_round(_ctx(memory_budget_bytes=2**30), "searched", {"emitted": "best"})
    assert config == "searched" and record["emitted"] == "search" and "memory budget" in record["reason"]


def test_a_median_below_1_the_window_did_not_call_faster_gives_way_to_the_recipe(monkeypatch):
    """[Note: emitted on an interval]: a config whose pairs lean faster but whose interval reaches 1
    is a tie: the recipe the user already has is emitted, and the record and notes say so in one line."""
    from autotune.search.emit import get_recipe_notes

    monkeypatch.setattr(recipe_round, "_measure", _measured([0.96, 1.01, 0.97, 1.00], faster=False))
    config, record = recipe_round.run_recipe_round(_ctx(), "searched", {"emitted": "best"})
    assert record["ratio"] < 1.0 and record["emitted"] == "recipe"
    assert config == recipe_round.get_recipe_config(_ctx())[0]
    assert record["verdict"].startswith(
        "torchtitan's recipe is emitted: the emitted config was not shown faster than it at 90%"
    )
    assert "90% interval 0.990-1.042x" in record["verdict"]
    assert get_recipe_notes(record)[0].startswith(record["verdict"])


def test_a_failed_measurement_keeps_the_search_s_config_and_says_why(monkeypatch):
    monkeypatch.setattr(
        recipe_round, "_measure", lambda ctx, c, r: {"status": "timeout", "reason": "rank 1 hung", "ratio": None}
    )
    config, record = recipe_round.run_recipe_round(_ctx(), "searched", {"emitted": "best"})
    assert config == "searched" and record["emitted"] == "search" and "rank 1 hung" in record["reason"]


def test_not_measured_where_there_is_no_final_round_or_no_model_to_read(monkeypatch):
    monkeypatch.setattr(recipe_round, "_measure", lambda *a: pytest.fail("measured"))
    for ctx, confirmation, why in [
        (_ctx(num_confirm_pairs=0), None, "no final round ran (--confirm-pairs 0)"),
        (_ctx(rank_program="x:y"), {"emitted": "best"}, "a custom rank program builds its own model"),
    ]:
        config, record = recipe_round.run_recipe_round(ctx, "searched", confirmation)
        assert config == "searched" and record == {
            "name": "torchtitan",
            "measured": False,
            "reason": why,
            "emitted": "search",
        }
        assert ctx.phases == [f"not measured against torchtitan's recipe: {why}"]


def test_the_recipe_round_runs_its_pairs_unless_clearly_slower_or_settled():
    """[Note: emitted on an interval]: the speedup over the recipe is reported from this round, so it
    is never stopped as clearly faster (a figure taken where it looked fastest); clearly slower than
    the recipe (above 1, not only above --prune-ratio's 1.2) stops it, and so does a settled ratio."""
    from autotune.search.context import SearchContext
    from autotune.search.verdict import get_verdict_rule
    from fsdp_runtime.tuning.sequential import PairNoise, decide

    noise = PairNoise()
    for _ in range(4):
        noise.observe([1.0, 1.0, 1.1, 1.1])  # 3 df each, a pair spread of about 5.5%
    ctx = SimpleNamespace(settings=SimpleNamespace(num_measured=4, precision=0.05, prune_ratio=1.2), noise=noise)
    ctx.get_stopping_rule = lambda **kw: SearchContext.get_stopping_rule(ctx, **kw)
    rule = get_verdict_rule(ctx, 6)
    assert (rule.max_blocks, rule.faster_below, rule.prune_above, rule.futile_above) == (3, None, 1.0, None)
    assert decide(rule, [0.78, 0.80]) is None and decide(rule, [0.78, 0.80] * 3) in ("settled", "max_blocks")
    assert decide(rule, [1.0, 1.02]) is None and decide(rule, [1.0, 1.02] * 3) in ("settled", "max_blocks")
    assert decide(rule, [1.25, 1.3, 1.28, 1.27]) == "slower"


def test_the_config_to_emit_is_profiled_in_the_recipe_round():
    """[Note: the emitted config's trace]: the search's config is profiled after its pairs against the
    recipe (the defaults are not: trial 0 was); the search profiles at the end only where this round runs."""
    from autotune.trials.metrics import TrialMetrics

    ctx = _ctx()
    specs = []
    ctx.get_stopping_rule = lambda **kw: StoppingRule(max_blocks=2)
    ctx.write_dir = Path("/nonexistent")
    ctx.trial_spec = lambda config, out_dir, **kw: specs.append(kw) or SimpleNamespace(**kw)
    ctx.run = lambda spec: SimpleNamespace(
        status="ok",
        reason="",
        step_ms=1.0,
        metrics=TrialMetrics(status="ok", model="tiny", world_size=2, backend="gloo", traces=["trace_rank0.json.gz"]),
    )
    recipe, _ = recipe_round.get_recipe_config(ctx)
    figures = recipe_round._measure(ctx, "searched", recipe)
    assert specs[-1]["profile"] and figures["profiled"] and specs[-1]["num_pairs"] == 4  # 2 x --confirm-pairs
    recipe_round._measure(ctx, ctx.default_config, recipe)
    assert not specs[-1]["profile"]
    assert recipe_round.profiles_at_end(ctx) and not recipe_round.profiles_at_end(_ctx(num_confirm_pairs=0))
    assert not recipe_round.profiles_at_end(_ctx(rank_program="mine:program"))
