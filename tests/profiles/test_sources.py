"""`--model` beyond our Llama profiles: model factories and Hugging Face configs.

End to end (2 gloo ranks, a few trials each, every run under a wall-clock limit): a search
on an HF LlamaForCausalLM, an HF GPT-2 and a factory defined here emits a config named by
the model's own module paths that applies unchanged in a plain training loop, with losses
bitwise equal to hand-written ``fully_shard`` defaults when the config keeps the order of
floating-point sums, within 1e-5 (relative) otherwise. The factories are defined here (ranks
import them by name: ``test_sources:regressor``); the rank program is ``_model_programs``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _model_programs import REL_TOL, order_preserving, without_order_changes
from torch import nn

from fsdp_runtime import AutotuneError, config_to_dict, default_config, load_config, save_config
from fsdp_runtime.blocks import _rename as rename_units

# Two trials (the defaults, one sampled), no final round; never pruned or re-measured (what
# those do is tested in test_search.py): the model is what is under test here.
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


# ---------------------------------------------------------------------------
# Factories (the model factory protocol, profiles/factory.py)


class _Stage(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(self.norm(x)))


class Regressor(nn.Module):
    """Not a language model: float inputs, an MSE loss, blocks at an unusual path (``trunk.stages``)."""

    def __init__(self, dim: int = 16, num_stages: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.trunk = nn.Module()
        self.trunk.stages = nn.ModuleList(_Stage(dim) for _ in range(num_stages))
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for stage in self.trunk.stages:
            h = stage(h)
        return self.out(h)

    def make_autotune_batch(
        self, generator: torch.Generator, batch_size: int, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch_size, seq_len, 4, generator=generator)
        return x, x.sum(-1, keepdim=True).sin()

    def compute_autotune_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)


class TokenLM(nn.Module):
    """The default protocol: token ids in, logits out (a tensor), ``vocab_size`` attribute."""

    def __init__(self, vocab_size: int = 64, dim: int = 16, num_blocks: int = 4, loss_out: bool = False) -> None:
        super().__init__()
        self.vocab_size, self.loss_out = vocab_size, loss_out
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(_Stage(dim) for _ in range(num_blocks))
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, ids: torch.Tensor):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        return SimpleNamespace(loss=logits.float().logsumexp(-1).mean()) if self.loss_out else logits


def regressor() -> nn.Module:
    return Regressor()


def token_lm() -> nn.Module:
    return TokenLM()


def token_lm_with_loss() -> nn.Module:
    return TokenLM(loss_out=True)


class _DictTokenLM(TokenLM):
    """Logits in a dict: outside the default protocol, which wants a tensor or an object with ``.logits``."""

    def forward(self, ids: torch.Tensor):
        return {"logits": super().forward(ids)}


def token_lm_dict_out() -> nn.Module:
    return _DictTokenLM()


def broken() -> nn.Module:
    raise ValueError("checkpoint shard missing")


def flat() -> nn.Module:
    return nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8))


# ---------------------------------------------------------------------------
# Tiny Hugging Face configs, written as a user would have them


def _write_hf(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def hf_llama(tmp: Path, num_layers: int = 4) -> Path:
    """A model dir holding a tiny LlamaForCausalLM config.json."""
    return _write_hf(
        tmp / f"tiny-llama-{num_layers}",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": num_layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 128,
            "max_position_embeddings": 32,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "dtype": "bfloat16",
            "use_cache": True,
        },
    )


def hf_gpt2_toml(tmp: Path) -> Path:
    """A model TOML naming a tiny GPT-2 config.json (no dropout: runs compare bit for bit) and its training shape."""
    _write_hf(
        tmp / "tiny-gpt2",
        {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_embd": 32,
            "n_layer": 2,
            "n_head": 4,
            "vocab_size": 128,
            "n_positions": 64,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    )
    path = tmp / "gpt2.toml"
    path.write_text('name = "tiny-gpt2"\nhf_config = "tiny-gpt2/config.json"\nseq_len = 16\nbatch_size = 2\n')
    return path


# ---------------------------------------------------------------------------
# Loading: unit names, shapes, errors


def test_unit_names_are_the_model_s_own_module_paths(tmp_path):
    from profiles.sources import load_model_source

    llama = load_model_source(str(hf_llama(tmp_path)))
    assert llama.block_names == [f"model.layers.{i}" for i in range(4)] and llama.unit_names[-1] == "root"
    assert (llama.seq_len, llama.batch_size, llama.vocab_size) == (
        32,
        4,
        128,
    )  # seq_len capped by max_position_embeddings
    assert llama.get_config().use_cache is False  # training keeps no KV cache
    assert {p.dtype for p in llama.build(device="meta").parameters()} == {
        torch.float32
    }  # trials train in fp32 whatever the file says
    gpt2 = load_model_source(str(hf_gpt2_toml(tmp_path)))
    assert gpt2.block_names == ["transformer.h.0", "transformer.h.1"] and (
        gpt2.name,
        gpt2.seq_len,
        gpt2.batch_size,
    ) == ("tiny-gpt2", 16, 2)
    assert load_model_source("test_sources:regressor").block_names == [f"trunk.stages.{i}" for i in range(3)]
    assert load_model_source("test_sources:token_lm").vocab_size == 64


def test_default_batch_and_loss_protocol():
    from autotune.trials.training import make_microbatch
    from profiles.factory import compute_loss
    from profiles.sources import load_model_source

    source = load_model_source("test_sources:token_lm")
    model = source.build(seed=3)
    batch = make_microbatch(source, seed=0, step=0, microbatch=0, dp_rank=0, model=model)
    assert batch.shape == (4, 129) and batch.dtype == torch.int64 and int(batch.max()) < 64
    expected = nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
    assert torch.equal(compute_loss(model, batch), expected)
    with_loss = load_model_source("test_sources:token_lm_with_loss").build(seed=3)  # an output's .loss is the loss
    assert torch.equal(compute_loss(with_loss, batch), with_loss(batch[:, :-1]).loss)
    regressor = load_model_source("test_sources:regressor")  # the model's own batch and loss
    x, y = make_microbatch(regressor, seed=0, step=0, microbatch=0, dp_rank=0, model=regressor.build())
    assert x.shape == (4, 128, 4) and y.shape == (4, 128, 1)
    # Identical weights on every rank for one seed: FSDP2 shards each rank's own copy.
    assert all(torch.equal(a, b) for a, b in zip(source.build(seed=1).parameters(), source.build(seed=1).parameters()))


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            "no_such_pkg.models:build",
            r"model factory 'no_such_pkg.models:build': cannot import 'no_such_pkg.models' \(ModuleNotFoundError",
        ),
        ("test_sources:nothing_here", r"module 'test_sources' has no function 'nothing_here'"),
        (
            "test_sources:broken",
            r"model factory 'test_sources:broken' raised ValueError: checkpoint shard missing \(building on the meta device\)",
        ),
        (
            "test_sources:flat",
            r"model factory 'test_sources:flat': no repeated blocks found in Sequential .*build them as one ModuleList",
        ),
    ],
)
def test_a_factory_that_cannot_be_searched_is_one_line_naming_model(model, message):
    from autotune.search.preflight import check_model

    with pytest.raises(AutotuneError, match=message) as caught:
        check_model(model)
    assert caught.value.field == "model" and "\n" not in str(caught.value)


def test_a_factory_module_in_the_current_directory_imports(tmp_path, monkeypatch):
    from profiles.sources import load_model_source

    (tmp_path / "my_models_13.py").write_text(
        "from torch import nn\n\ndef build():\n    return nn.Sequential(nn.ModuleList(nn.Linear(2, 2) for _ in range(3)))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    with pytest.raises(
        AutotuneError, match="vocabulary size is unknown"
    ):  # found and built: the protocol is what it lacks
        _ = load_model_source("my_models_13:build").block_names
    assert str(tmp_path) in sys.path  # and the ranks inherit it (PYTHONPATH)


def test_model_toml_and_unknown_names_are_one_line(tmp_path):
    from profiles.sources import load_model_source

    bad = tmp_path / "bad.toml"
    bad.write_text('factory = "test_sources:token_lm"\nseq = 16\n')
    with pytest.raises(AutotuneError, match=r"bad.toml: seq: unknown field"):
        load_model_source(str(bad))
    good = tmp_path / "lm.toml"
    good.write_text('factory = "test_sources:token_lm"\nseq_len = 16\nbatch_size = 1\n')
    source = load_model_source(str(good))
    assert (source.name, source.seq_len, source.batch_size, source.source) == ("lm", 16, 1, str(good.resolve()))
    with pytest.raises(
        AutotuneError,
        match=r"unknown model 'llama9b': use a profile \(.*llama8b.*\), a model TOML, package.module:function",
    ) as caught:
        load_model_source("llama9b")
    assert caught.value.field == "model"


def test_hf_configs_without_transformers_say_how_to_install(tmp_path, monkeypatch):
    from profiles.hf import HFModel

    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if not installed
    source = HFModel(name="x", config_path=str(tmp_path / "config.json"), source="x")
    with pytest.raises(AutotuneError, match=r"needs transformers: pip install 'fsdp-autotune\[hf\]'"):
        source.build(device="meta")


def test_an_output_without_logits_is_one_line():
    from profiles.factory import compute_loss

    with pytest.raises(
        AutotuneError, match=r"_DictOut\(token ids\) returned dict: expected logits, or an object with .logits or .loss"
    ):
        compute_loss(_DictOut(), torch.zeros(1, 3, dtype=torch.int64))


def test_the_simulator_traces_the_trials_loss():
    """The simulator's fake-tensor trace runs the trials' loss (profiles.factory.compute_loss): a
    model outside the protocol is the same one line there, not an AttributeError."""
    from autotune.sim import get_model_work
    from profiles.sources import load_model_source

    with pytest.raises(AutotuneError, match=r"_DictTokenLM\(token ids\) returned dict: expected logits"):
        get_model_work(load_model_source("test_sources:token_lm_dict_out"), "float32")


class _DictOut(nn.Module):
    def forward(self, ids):
        return {"logits": ids}


def test_a_missing_hf_config_is_one_line(tmp_path):
    from profiles.sources import load_model_source

    with pytest.raises(AutotuneError, match=r"no Hugging Face config at .*nothing is downloaded") as caught:
        load_model_source(str(tmp_path / "gone" / "config.json"))
    assert caught.value.field == "model"


def test_scale_proxy_of_an_hf_config_keeps_depth_and_unit_names(tmp_path):
    from autotune.search.proxy import plan_model
    from profiles.sources import load_model_source

    l8b = _write_hf(
        tmp_path / "Meta-Llama-3-8B",
        {
            "model_type": "llama",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 8192,
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
        },
    )
    source = load_model_source(str(l8b))
    assert source.get_num_params() == 8_030_261_248  # Llama 3 8B, counted on the meta device
    plan = plan_model(source, world_size=2, memory_per_rank=6 * 2**30, flops_per_rank=20e9, step_budget_s=0.35)
    assert plan.is_proxy and plan.run.unit_names == source.unit_names and len(plan.run.block_names) == 32
    config = plan.run.get_config()
    assert config.hidden_size < 4096 and config.hidden_size == config.num_attention_heads * config.head_dim
    assert config.num_attention_heads // config.num_key_value_heads == 4  # GQA ratio kept
    assert plan.proxy_name.startswith("Meta-Llama-3-8B@hidden_size=") and plan.estimated_memory_per_rank <= 6 * 2**30
    # Trials rebuild the proxy from the plan's model argument alone.
    assert load_model_source(plan.trial_model).get_config().hidden_size == config.hidden_size


def test_a_factory_that_does_not_fit_is_refused_with_what_to_do():
    from autotune.search.proxy import plan_model
    from profiles.sources import load_model_source

    with pytest.raises(
        AutotuneError,
        match=r"factory 'test_sources:token_lm' .* does not fit this machine .*cannot be shrunk into a scale proxy",
    ) as caught:
        plan_model(
            load_model_source("test_sources:token_lm"),
            world_size=2,
            memory_per_rank=1024,
            flops_per_rank=1e12,
            step_budget_s=1.0,
        )
    assert caught.value.field == "model"
    # In memory but slower than the step budget: it runs as it is (there is nothing to shrink).
    plan = plan_model(
        load_model_source("test_sources:token_lm"),
        world_size=2,
        memory_per_rank=2**40,
        flops_per_rank=1.0,
        step_budget_s=1.0,
    )
    assert (
        not plan.is_proxy
        and plan.run.name == "test_sources:token_lm"
        and plan.reason.endswith("(a factory runs as it is)")
    )


# ---------------------------------------------------------------------------
# Through the CLI


def _run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    import cli

    monkeypatch.setattr(sys, "argv", ["autotune", *args])
    with pytest.raises(SystemExit) as caught:
        cli.main()
    out, err = capsys.readouterr()
    return caught.value.code or 0, out, err


def test_validate_checks_units_against_the_model(tmp_path, monkeypatch, capsys):
    model = str(hf_llama(tmp_path))
    ours = save_config(
        default_config([f"layers.{i}" for i in range(4)]), tmp_path / "ours.toml"
    )  # searched on our Llama profile
    code, out, _ = _run_cli(monkeypatch, capsys, "validate", str(ours), "--model", model)
    assert code == 0 and "ok" in out and "resolved by position onto its 4 blocks model.layers.0..model.layers.3" in out
    two = save_config(default_config(["model.layers.0", "model.layers.1"]), tmp_path / "two.toml")
    code, _, err = _run_cli(monkeypatch, capsys, "validate", str(two), "--model", model)
    assert code == 2 and err.count("\n") == 1, err
    assert (
        "two.toml: units: cover 2 of the 4 blocks of LlamaForCausalLM: model.layers.2, model.layers.3 would be sharded with the root"
        in err
    )
    unknown = save_config(
        default_config(["model.layers.0", "model.layers.1", "model.layers.2", "model.layers.9"]),
        tmp_path / "unknown.toml",
    )
    code, _, err = _run_cli(monkeypatch, capsys, "validate", str(unknown), "--model", model)
    assert code == 2 and "units[3].name: module 'model.layers.9' not found in LlamaForCausalLM" in err


def test_search_with_a_factory_that_does_not_import_exits_2_before_any_file(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    code, _, err = _run_cli(monkeypatch, capsys, "search", "--model", "no_such_pkg.models:build", "--out", str(out))
    assert (
        code == 2
        and err.startswith("error: --model: model factory 'no_such_pkg.models:build': cannot import")
        and err.count("\n") == 1
    ), err
    assert not out.exists()


# ---------------------------------------------------------------------------
# Search end to end, then the emitted config in a plain training loop


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["hf_llama", "hf_gpt2", "factory"])
def test_search_emits_a_config_that_applies_unchanged(kind, tmp_path, shared_pool):
    from autotune.search import SearchSettings, run_search
    from profiles.sources import load_model_source

    model = {
        "hf_llama": lambda: str(hf_llama(tmp_path)),
        "hf_gpt2": lambda: str(hf_gpt2_toml(tmp_path)),
        "factory": lambda: "test_sources:regressor",
    }[kind]()
    summary = run_search(SearchSettings(model=model, out_dir=tmp_path / "run", **SEARCH))
    assert summary.best is not None, [(r.number, r.status, r.reason) for r in summary.rows]
    assert "seconds" in summary.record.consolidation, (
        summary.record.consolidation
    )  # consolidation timed on this model too
    best = load_config(tmp_path / "run" / "best.toml")
    assert best.unit_names == load_model_source(model).unit_names  # the model's own module paths
    configs = {"emitted": config_to_dict(best), "emitted_in_order": config_to_dict(without_order_changes(best))}
    if kind == "hf_llama":  # the same knobs named as on our Llama profile: resolved by position
        by_position = {f"model.layers.{i}": f"layers.{i}" for i in range(4)}
        configs["profile_names"] = config_to_dict(rename_units(best, by_position))  # names, modules, prefetch lists
    run = shared_pool.run(
        "_model_programs:compare_with_fully_shard", {"model": model, "configs": configs}, timeout_s=120
    )
    assert run.ok, run.reason
    for losses in run.results:
        assert (
            losses["emitted_in_order"] == losses["fully_shard"]
        )  # bitwise: prefetch, reshard, async unshard, concat deferral
        if order_preserving(best):
            assert losses["emitted"] == losses["fully_shard"]
        else:
            assert losses["emitted"] == pytest.approx(losses["fully_shard"], rel=REL_TOL)
        if kind == "hf_llama":
            assert losses["profile_names"] == losses["emitted"]
