"""``--model torchtitan:FAMILY/FLAVOR``: torchtitan's own models as clients ([Note: torchtitan models]).

Needs the ``torchtitan`` extra (torchtitan 0.2.2; ``./dev`` installs it): skipped without it,
failed without it under ``AUTOTUNE_REQUIRE_ALL=1`` (CI). End to end (2 gloo ranks, two trials,
every run under a wall-clock limit): a search on torchtitan's llama3 debug model emits a config
that applies to a fresh torchtitan model in a training loop of torchtitan's shape; its losses
equal ``fully_shard`` by hand bitwise where the config keeps the order of sums (1e-5 relative
where it does not) and the unsharded model's within 1e-4, and the README's example trains the same.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from _model_programs import REL_TOL, order_preserving, without_order_changes
from _required import skip_unless_required
from _torchtitan_programs import UNSHARDED_REL_TOL

from fsdp_runtime import RuntimeConfig, config_to_dict, get_torchtitan_config, get_torchtitan_units, load_config
from profiles import ModelSourceError, TorchtitanModel, load_model_source

pytestmark = pytest.mark.torch_matrix

LLAMA = "torchtitan:llama3/debugmodel"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _torchtitan():
    if importlib.util.find_spec("torchtitan") is None:
        skip_unless_required("torchtitan is not installed: pip install 'fsdp-autotune[torchtitan]' (./dev installs it)")


def test_the_source_builds_torchtitan_s_model_from_its_registry():
    source = load_model_source(LLAMA)
    assert isinstance(source, TorchtitanModel) and source.source == LLAMA
    model = source.build(device="meta")
    assert (type(model).__module__, type(model).__name__) == ("torchtitan.models.llama3.model.model", "Transformer")
    assert (model.model_args.dim, model.model_args.n_layers, model.model_args.vocab_size) == (256, 6, 2048)
    assert model.model_args.max_seq_len == source.seq_len  # what torchtitan's trainer sets
    # Units come from the model: its ModuleDict of blocks, and torchtitan's recipe for it.
    assert source.block_names == [f"layers.{i}" for i in range(6)] and source.vocab_size == 2048
    assert [(u.name, u.reshard_after_forward) for u in get_torchtitan_units(model)] == [
        ("tok_embeddings", True),
        *((f"layers.{i}", True) for i in range(6)),
        ("norm+output", False),
        ("root", None),
    ]
    assert source.get_num_params() == sum(p.numel() for p in model.parameters()) == 6_163_712


def test_a_model_toml_gives_a_registry_model_its_training_shape(tmp_path):
    """``factory = "torchtitan:..."`` in a model TOML: the registry's model at the TOML's shape
    (its RoPE caches sized to it), where the bare name trains at 128 x 4."""
    toml = tmp_path / "tt.toml"
    toml.write_text(f'factory = "{LLAMA}"\nseq_len = 512\nbatch_size = 1\n')
    source = load_model_source(str(toml))
    assert isinstance(source, TorchtitanModel) and (source.seq_len, source.batch_size) == (512, 1)
    assert source.ref == LLAMA and source.name == "tt"
    assert source.build(device="meta").model_args.max_seq_len == 512
    bare = load_model_source(LLAMA)
    assert (bare.seq_len, bare.batch_size) == (128, 4)
    toml.write_text('factory = "torchtitan:gpt5/huge"\n')
    with pytest.raises(ModelSourceError, match="torchtitan:FAMILY/FLAVOR"):
        load_model_source(str(toml))


def test_qwen3_s_tied_head_is_grouped_with_the_embeddings():
    model = load_model_source("torchtitan:qwen3/debugmodel").build(device="meta")
    assert type(model).__name__ == "Qwen3Model" and model.output.weight is model.tok_embeddings.weight
    assert [(u.name, u.reshard_after_forward) for u in get_torchtitan_units(model)][-2:] == [
        ("tok_embeddings+norm+output", False),
        ("root", None),
    ]


def test_the_models_import_no_trainer_dependencies():
    """torchtitan's package __init__s pull datasets, tensorboard, wandb (and triton): none is imported
    (beyond what torch's compiler imports: ``torch._dynamo`` imports triton where it is installed, as
    beside a CUDA build of torch 2.15)."""
    code = (
        "import sys, torch, torch._dynamo; before = set(sys.modules); from profiles import load_model_source; "
        f"load_model_source({LLAMA!r}).build(device='meta'); "
        "print(sorted(m for m in ('datasets', 'tensorboard', 'wandb', 'triton', 'torchdata') "
        "if m in sys.modules and m not in before))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


def test_a_bad_torchtitan_model_is_one_line():
    with pytest.raises(ModelSourceError, match=r"write torchtitan:FAMILY/FLAVOR with FAMILY one of llama3, qwen3"):
        load_model_source("torchtitan:gpt5/huge")
    with pytest.raises(ModelSourceError, match=r"registry has no flavor 'huge' \(debugmodel, "):
        load_model_source("torchtitan:llama3/huge").build(device="meta")
    with pytest.raises(ModelSourceError, match=r"only the dense SDPA decoders"):
        load_model_source("torchtitan:llama3/debugmodel_flex_attn").build(device="meta")


def test_a_torchtitan_whose_registry_is_not_read_is_one_line():
    from profiles.torchtitan import check_version

    assert (check_version("0.2.2"), check_version("0.3.0")) == ((0, 2), (0, 3))
    with pytest.raises(
        ModelSourceError,
        match=r"^torchtitan 0.4.0 is installed; this fsdp-autotune reads the registries of torchtitan 0.2.2 and 0.3.0 ",
    ):
        check_version("0.4.0")
    with pytest.raises(
        ModelSourceError, match=r"^torchtitan is not installed: pip install 'fsdp-autotune\[torchtitan\]'"
    ):
        check_version(None)


def test_the_loss_hook_passes_positions_and_the_model_s_attention_masks():
    """0.3.0's trainer passes ``positions`` and ``model.get_attention_masks(positions)`` to a flex or
    varlen model: so does the loss hook (a stand-in model records them; 0.3.0's own in test_torchtitan030)."""
    import torch

    from profiles.torchtitan import torchtitan_loss

    class StandIn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(16, 16)
            self.calls = []

        def get_attention_masks(self, *, positions):
            self.calls.append(("masks", positions.clone()))
            return "block mask"

        def forward(self, tokens, positions=None, attention_masks=None):
            self.calls.append(("forward", tokens.shape, positions, attention_masks))
            return self.embedding(tokens)

    model, batch = StandIn(), torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(0))
    loss = torchtitan_loss(model, batch, attention_masks=True)
    (_, positions), (_, shape, forward_positions, masks) = model.calls
    assert positions.tolist() == [list(range(5))] * 2 and forward_positions.tolist() == positions.tolist()
    assert (shape, masks) == ((2, 5), "block mask")
    expected = torch.nn.functional.cross_entropy(model.embedding(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
    torch.testing.assert_close(loss, expected)  # torchtitan's summed loss over the tokens
    model.calls.clear()
    torchtitan_loss(model, batch)  # 0.2.2's SDPA models: tokens alone
    assert [c[0] for c in model.calls] == ["forward"] and model.calls[0][2:] == (None, None)


def test_the_loss_hook_builds_the_masks_once_per_batch_shape_and_device():
    """One document per row: positions and masks depend on the batch's shape and device alone, so the
    hook's cache builds them at the first step (a warm-up step), and every later step, timed, reuses
    them; another shape builds its own (0.3.0's real masks: test_torchtitan030)."""
    import torch

    from profiles.torchtitan import ForwardKwargsCache, load_registry, torchtitan_loss

    load_registry("llama3")  # torchtitan's packages entered without their __init__ (the loss imports from them)

    class StandIn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(16, 16)
            self.built, self.passed = [], []

        def get_attention_masks(self, *, positions):
            self.built.append(object())  # a mask of its own each time it is built
            return self.built[-1]

        def forward(self, tokens, positions=None, attention_masks=None):
            self.passed.append((tuple(positions.shape), attention_masks))
            return self.embedding(tokens)

    model, cache = StandIn(), ForwardKwargsCache()
    batch = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        torchtitan_loss(model, batch, attention_masks=True, masks=cache)
    assert len(model.built) == 1 and all(masks is model.built[0] for _, masks in model.passed)
    torchtitan_loss(model, batch[:1], attention_masks=True, masks=cache)
    assert len(model.built) == 2 and model.passed[-1] == ((1, 5), model.built[1])
    torchtitan_loss(model, batch, attention_masks=True)  # no cache: built again, as before
    assert len(model.built) == 3


# Two trials (the defaults, one sampled), no final round: the model is what is under test here.
SEARCH = {
    "world_size": 2,
    "num_trials": 2,
    "num_microbatches": 2,
    "num_warmup": 0,
    "num_measured": 2,
    "num_profiled": 1,
    "num_confirm_pairs": 0,
    "trial_timeout_s": 90.0,
    "patience": None,
    "prune_ratio": 1e6,
    "max_ratio_spread": 1e6,
}


def _shorter(tmp_path) -> str:
    """torchtitan's debugmodel as its registry builds it (its widths, blocks and loss), trained on
    1 x 32 tokens per microbatch instead of its 4 x 128: what is under test is that a config searched
    on it applies and trains, not how fast; a step takes a tenth of the time."""
    path = tmp_path / "debugmodel.toml"
    path.write_text(f'name = "debugmodel-short"\nfactory = "{LLAMA}"\nseq_len = 32\nbatch_size = 1\n')
    source = load_model_source(str(path))
    assert isinstance(source, TorchtitanModel) and source.ref == LLAMA
    assert (source.name, source.seq_len, source.batch_size) == ("debugmodel-short", 32, 1)
    return str(path)


@pytest.mark.multirank
def test_search_emit_apply_and_train_a_torchtitan_model(tmp_path, shared_pool):
    from autotune.search import SearchSettings, run_search

    model = _shorter(tmp_path)
    summary = run_search(SearchSettings(model=model, out_dir=tmp_path / "run", **SEARCH))
    assert summary.best is not None, [(r.number, r.status, r.reason) for r in summary.rows]
    assert summary.record.recipe == {
        "name": "torchtitan",
        "measured": False,
        "reason": "no final round ran (--confirm-pairs 0)",
        "emitted": "search",
    }
    best = load_config(tmp_path / "run" / "best.toml")
    blocks = [m for u in best.units for m in u.get_modules() if m.startswith("layers.")]
    assert blocks == [f"layers.{i}" for i in range(6)] and best.provenance.model == "debugmodel-short"
    base = RuntimeConfig(num_microbatches=best.num_microbatches, mixed_precision=best.mixed_precision)
    recipe = get_torchtitan_config(load_model_source(LLAMA).build(device="meta"), base)
    configs = {
        "emitted": config_to_dict(best),
        "emitted_in_order": config_to_dict(without_order_changes(best)),
        "recipe": config_to_dict(recipe),
    }
    run = shared_pool.run("_torchtitan_programs:train_torchtitan", {"model": model, "configs": configs}, timeout_s=150)
    assert run.ok, run.reason
    for losses in run.results:
        # bitwise: prefetch, reshard, async unshard, grouping, split edges keep the order of sums
        assert losses["emitted_in_order"] == losses["fully_shard"] == losses["recipe"]
        if order_preserving(best):
            assert losses["emitted"] == losses["fully_shard"]
        else:
            assert losses["emitted"] == pytest.approx(losses["fully_shard"], rel=REL_TOL)
        assert losses["emitted"] == pytest.approx(losses["unsharded"], rel=UNSHARDED_REL_TOL)
    # The README's example (apply_fsdp where torchtitan calls its own) trains exactly as the emitted config.
    readme = shared_pool.run(
        "_torchtitan_programs:run_readme_example",
        {"model": model, "config_path": str(tmp_path / "run" / "best.toml")},
        timeout_s=90,
    )
    assert readme.ok, readme.reason
    assert readme.results == [losses["emitted"] for losses in run.results]


@pytest.mark.multirank
def test_the_in_job_tuner_in_torchtitan_s_trainer_tunes_and_its_losses_are_bitwise_untuned(tmp_path, shared_pool):
    """docs/in-job.md's two lines in a subclass of torchtitan's trainer, run as written on a model
    torchtitan's own ``apply_fsdp`` sharded (``adopt_fsdp``): the tuner tries at least three
    configs, settles and writes its config; every loss equals the untuned job's bitwise."""
    model, out = _shorter(tmp_path), tmp_path / "tuned.toml"
    job = {"model": model, "num_steps": 40, "out": str(out)}  # the walk, then its final window
    tuner = {"max_steps": 26, "num_pairs": 3, "warmup_steps": 2}
    tuned = shared_pool.run("_torchtitan_programs:run_tuned_trainer", job | {"tuner": tuner}, timeout_s=150)
    assert tuned.ok, f"{tuned.status}: {tuned.reason}\n{tuned.stderr_tails}"
    untuned = shared_pool.run("_torchtitan_programs:run_tuned_trainer", job | {"tuner": None}, timeout_s=150)
    assert untuned.ok, f"{untuned.status}: {untuned.reason}\n{untuned.stderr_tails}"
    for rank, plain in zip(tuned.results, untuned.results, strict=True):
        assert len(rank["decisions"]) >= 3 and rank["finished"], rank["decisions"]
        assert rank["losses"] == plain["losses"] and len(plain["losses"]) == 40
        assert "tok_embeddings" in rank["refused"] and "units" in rank["refused"]
    assert tuned.results[0]["decisions"] == tuned.results[1]["decisions"]
    written = load_config(out)  # torchtitan's units, and the precision read from its model
    recipe = get_torchtitan_units(load_model_source(LLAMA).build(device="meta"))
    assert written.provenance.produced_by == "in-job tuner"
    assert [u.name for u in written.units] == [u.name for u in recipe]
    assert (written.mixed_precision.param_dtype, written.mixed_precision.reduce_dtype) == ("float32", "float32")
