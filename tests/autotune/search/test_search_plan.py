"""The search plan ([Note: the search plan] in autotune.search.search_plan): the model as itself or a
proxy on a GPU node, the baseline that fits, every GPU at hand, real links over NCCL and the cost,
checked on CPU through ``--plan-for``."""

from __future__ import annotations

import pytest

from autotune.search import SearchError, SearchSettings
from autotune.search.gpu_pricing import Baseline
from autotune.search.search_plan import make_search_plan
from autotune.search.settings import get_default_world_size


def plan_for(model: str, cluster: str = "h100-node", **kwargs):
    return make_search_plan(SearchSettings(model=model, plan_for=cluster, dry_run=True, **kwargs))


def test_llama8b_on_an_h100_node_is_measured_as_itself_against_defaults_that_fit():
    """On 8 H100s llama8b at seq 8192 runs as itself on every GPU in bf16; FSDP2's defaults (91 GiB
    simulated) do not fit 80 GB, so the baseline is the defaults with the least checkpointing that does."""
    plan = plan_for("llama8b")
    assert plan.target.world_size == 8 and plan.target.backend == "nccl"
    assert not plan.model.is_proxy and plan.model.run.seq_len == 8192
    assert (plan.precision.param_dtype, plan.precision.reduce_dtype) == ("bfloat16", "float32")
    assert plan.baseline.checkpointing == "selective"
    assert "91.0 GiB, over the 77.6 usable" in plan.baseline.reason
    assert plan.baseline.name == "FSDP2's defaults with selective activation checkpointing on every block"
    text = "\n".join(plan.describe())
    assert "llama8b as itself" in text and "ranks: 8 (nccl, bfloat16 parameters" in text
    assert f"baseline: {plan.baseline.name}" in text and "GPU-minutes on 8 GPUs" in text


def test_llama8b_on_an_h200_node_keeps_fsdp2s_defaults():
    plan = plan_for("llama8b", "h200-node")
    assert not plan.model.is_proxy and plan.target.world_size == 8
    assert plan.baseline == Baseline(reason=plan.baseline.reason, predicted_peak_gib=plan.baseline.predicted_peak_gib)
    assert plan.baseline.checkpointing == "none" and "they fit" in plan.baseline.reason


def test_llama70b_is_proxied_on_one_node_and_itself_where_its_leanest_config_fits():
    """70B's leanest config is ~197 GiB a GPU on 8 H100s: a proxy, with the figures; on 32 ranks (4 nodes)
    the simulator's leanest config fits, and it plans as itself."""
    one_node = plan_for("llama70b")
    assert one_node.model.is_proxy and len(one_node.model.run.block_names) == 80
    assert "leanest config" in one_node.model.reason and "over the 77.6 GiB usable" in one_node.model.reason
    assert "\n" not in one_node.model.reason
    assert plan_for("llama70b", world_size=16).model.is_proxy
    four_nodes = plan_for("llama70b", world_size=32)
    assert not four_nodes.model.is_proxy and four_nodes.target.num_nodes == 4
    assert four_nodes.baseline.checkpointing == "full"


def test_a_model_too_big_for_any_config_is_proxied_in_one_line(tmp_path):
    huge = tmp_path / "huge.toml"
    huge.write_text(
        'name = "huge"\ndescription = "planted"\nseq_len = 8192\nbatch_size = 1\n[shape]\ndim = 16384\nnum_layers = 4\nnum_heads = 128\n'
        "num_kv_heads = 8\nffn_hidden_dim = 53248\nvocab_size = 128256\n"
    )
    plan = plan_for(str(huge), world_size=1)
    assert plan.model.is_proxy and "\n" not in plan.model.reason
    assert "peaks at" in plan.model.reason and "GiB per GPU on 1 ranks" in plan.model.reason


def test_the_users_shape_is_what_is_planned_and_what_trials_run():
    plan = plan_for("llama8b", seq_len=4096, batch_size=2)
    assert (plan.model.run.seq_len, plan.model.run.batch_size) == (4096, 2)
    assert plan.model.trial_model == {"name": plan.source.source, "seq_len": 4096, "batch_size": 2}
    assert "seq 4096, batch 2" in "\n".join(plan.describe())


def test_proxy_flags_force_either():
    assert plan_for("llama8b", proxy=True).model.is_proxy
    forced = plan_for("llama70b", proxy=False)
    assert not forced.model.is_proxy and forced.model.reason.startswith("--no-proxy")
    cpu = make_search_plan(SearchSettings(model="small", proxy=True))
    assert cpu.model.is_proxy and cpu.model.reason == "--proxy"


def test_plan_for_is_a_dry_run_of_a_gpu_node():
    with pytest.raises(SearchError, match="add --dry-run") as e:
        make_search_plan(SearchSettings(model="llama8b", plan_for="h100-node"))
    assert e.value.field == "plan_for"
    with pytest.raises(SearchError, match="not a GPU node") as e:
        plan_for("llama8b", "cpu-gloo")
    assert e.value.field == "plan_for"


def test_every_gpu_at_hand_by_default(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert get_default_world_size(plan_for=None, workers=None) == 8
    assert get_default_world_size(plan_for=None, workers="head:29401") == 2  # across nodes: --nproc says it
    assert get_default_world_size(plan_for="h200-node", workers=None) == 8
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert SearchSettings().world_size == 2 and SearchSettings(world_size=3).world_size == 3


def test_a_cpu_search_plans_the_cpu_rule_and_the_defaults():
    plan = make_search_plan(SearchSettings())
    assert plan.target.device_type == "cpu" and plan.baseline.checkpointing == "none"
    assert not plan.model.is_proxy and plan.emulated_cluster is None
    assert plan.estimated_wall_s is None  # on CPU: from the defaults trial, once it ran
    emulated = make_search_plan(SearchSettings(cluster="cpu-emulated-ib"))
    assert emulated.emulated_cluster == "cpu-emulated-ib" and "emulated" in emulated.links_note


def test_cluster_over_nccl_is_topology_never_emulation():
    from autotune.trials import TrialSpec, TrialSpecError
    from autotune.trials.linkemu import get_emulated_cluster

    assert get_emulated_cluster("h100-node", "nccl") is None
    assert get_emulated_cluster("cpu-emulated-ib", "gloo") == "cpu-emulated-ib"
    assert get_emulated_cluster(None, "gloo") is None
    plan = plan_for("llama8b", cluster="h100-node")
    assert plan.emulated_cluster is None and plan.links_note == "real (nccl)"
    gpu = make_search_plan(SearchSettings(model="llama8b", plan_for="h100-node", dry_run=True, cluster="h100-node"))
    assert gpu.emulated_cluster is None and "never emulated" in gpu.links_note
    with pytest.raises(TrialSpecError, match="link emulation .* is a CPU tool") as e:
        TrialSpec(model="tiny", config=None, world_size=2, out_dir="x", cluster="h100-node", backend="nccl")
    assert e.value.field == "cluster" and "\n" not in str(e.value)


def test_the_search_passes_no_emulation_to_nccl_trials(monkeypatch, tmp_path):
    """``SearchContext.trial_spec`` hands trials the cluster to emulate over gloo only."""
    import autotune.search.context as context
    from autotune.search.proxy import ModelPlan
    from autotune.search.run import make_space
    from profiles.sources import load_model_source

    settings = SearchSettings(model="tiny", cluster="cpu-emulated-ib", out_dir=tmp_path)
    plan = make_search_plan(settings)
    space = make_space(settings, plan)
    source = load_model_source("tiny")
    model = ModelPlan(
        requested=source, run=source, is_proxy=False, reason="", estimated_memory_per_rank=0, estimated_step_s=0.0
    )
    ctx = context.SearchContext(study=None, space=space, settings=settings, plan=model, reporter=None)
    assert ctx.trial_spec(ctx.default_config, tmp_path / "t", profile=False).cluster == "cpu-emulated-ib"
    monkeypatch.setattr(context, "get_default_backend", lambda: "nccl")
    spec = ctx.trial_spec(ctx.default_config, tmp_path / "t", profile=False, paired=False)
    assert spec.cluster is None


def test_the_baseline_is_the_defaults_trial_and_the_recipes_checkpointing():
    """A baseline with checkpointing is the space's defaults (trial 0, every pair's reference) and
    torchtitan's recipe carries it."""
    from autotune.search import SearchSpace
    from fsdp_runtime import ROOT_UNIT, get_torchtitan_config
    from profiles.sources import load_model_source

    source = load_model_source("small")
    names = tuple(source.block_names)
    space = SearchSpace(block_names=names, world_size=2, checkpointing=True, baseline_checkpointing="full")
    params = space.get_default_params()
    assert (params["ac_units"], params["ac_kind"]) == ("all", "full")
    config = space.build_config(params)
    kinds = {u.name: u.activation_checkpointing for u in config.units}
    assert all(kinds[b] == "full" for b in names) and kinds[ROOT_UNIT] == "none"
    recipe = get_torchtitan_config(source.build(device="meta"), config)
    assert all(u.activation_checkpointing == "full" for u in recipe.units if u.name in names)
    plain = SearchSpace(block_names=names, world_size=2, checkpointing=True)
    assert plain.get_default_params()["ac_units"] == "none" and "ac_kind" not in plain.get_default_params()
    with pytest.raises(ValueError, match="needs the space to search checkpointing"):
        SearchSpace(block_names=names, world_size=2, baseline_checkpointing="full")


def test_the_study_keeps_its_baseline_and_shape(tmp_path):
    """A resumed search measures against the baseline it stored, and refuses another shape."""
    from autotune.search.study import open_study, resolve_plan
    from profiles.sources import load_model_source

    settings = SearchSettings(model="tiny", out_dir=tmp_path)
    plan = make_search_plan(settings)
    study, _ = open_study(settings, "s")
    stored = Baseline(checkpointing="full", reason="planted")
    _, baseline = resolve_plan(study, settings, plan.source, plan.model, baseline=stored)
    again, baseline = resolve_plan(study, settings, plan.source, plan.model, baseline=Baseline())
    assert baseline == stored and again.run.seq_len == plan.source.seq_len
    other = load_model_source("tiny").with_overrides(seq_len=plan.source.seq_len * 2)
    with pytest.raises(SearchError, match="shape"):
        resolve_plan(study, settings, other, plan.model)


def test_a_trial_out_of_memory_is_infeasible_with_its_peak_and_never_the_baseline(tmp_path):
    """An OOM trial is FAIL and infeasible with what it held; a baseline that runs out of memory in the
    warm-up stops the search in one line naming the next checkpointing to try."""
    from types import SimpleNamespace

    from autotune.search.loop import get_baseline_oom_message, get_outcome, warm_up

    reason = "rank 1 ran out of memory at 83886080000 B in use, 2147483648 B more asked: torch.OutOfMemoryError"
    result = SimpleNamespace(status="oom", reason=reason, step_ms=None, process_peak_bytes=None, metrics=None)
    ctx = SimpleNamespace(settings=SearchSettings())
    outcome = get_outcome(ctx, 3, result)
    assert outcome.state == "FAIL" and outcome.user_attrs["process_peak_bytes"] == 83886080000
    assert outcome.constraints["memory_over_budget"] == 2147483648.0
    message = get_baseline_oom_message("selective", reason)
    assert "--baseline-ac full" in message and "78.1 GiB in use" in message and "\n" not in message
    assert "--nproc" in get_baseline_oom_message("full", reason)

    ran = []
    warm = SimpleNamespace(
        reporter=SimpleNamespace(on_phase=ran.append),
        run=lambda spec: result,
        trial_spec=lambda *a, **k: None,
        default_config=None,
        write_dir=tmp_path,
        space=SimpleNamespace(baseline_checkpointing="none"),
    )
    with pytest.raises(SearchError, match="the baseline \\(FSDP2's defaults\\) ran out of memory") as e:
        warm_up(warm)
    assert e.value.field == "baseline_checkpointing"


def test_a_dry_run_on_a_gpu_node_takes_every_gpu_and_prices_this_gpu(fake_cuda, tmp_path):
    """``autotune search --dry-run`` on a (faked) 4-GPU node: 4 ranks without --nproc, priced as the
    profile named like this GPU, with this GPU's memory; --nproc still overrides it."""
    from typer.testing import CliRunner

    import cli

    fake_cuda.num_devices = 4
    result = CliRunner().invoke(cli.app, ["search", "--model", "tiny", "--dry-run", "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert "ranks: 4 (nccl, bfloat16 parameters" in result.output
    assert "4x NVIDIA H100 80GB HBM3 (80.0 GiB each), priced as h100-node" in result.output
    assert "search: 10 trials on 4 ranks" in result.output
    two = CliRunner().invoke(
        cli.app, ["search", "--model", "tiny", "--dry-run", "--nproc", "2", "--out", str(tmp_path)]
    )
    assert two.exit_code == 0 and "ranks: 2 (nccl" in two.output


def test_a_gpu_plan_over_a_30_minute_allocation_names_flags_that_fit_it():
    """The default llama8b search on 8 H100s is estimated over 30 min: the plan names the trials and
    confirmation pairs that fit, and a plan with those flags is within it."""
    import re

    from autotune.search.search_plan import ALLOCATION_S

    plan = plan_for("llama8b")
    assert plan.estimated_wall_s > ALLOCATION_S and plan.allocation_hint in plan.describe()
    found = re.match(r"to finish within 30 min: --trials (\d+)(?: --confirm-pairs (\d+))?", plan.allocation_hint)
    assert found, plan.allocation_hint
    trials, pairs = int(found[1]), int(found[2] or 3)
    fitted = plan_for("llama8b", num_trials=trials, num_confirm_pairs=pairs)
    assert fitted.estimated_wall_s <= ALLOCATION_S and fitted.allocation_hint is None
    assert make_search_plan(SearchSettings()).allocation_hint is None  # CPU: no GPU allocation
