"""Model and cluster profiles: published parameter counts, meta builds, clear errors."""

from __future__ import annotations

import pytest

from fsdp_runtime import ConfigError
from profiles import build_model, list_cluster_profiles, list_model_profiles, load_cluster_profile, load_model_profile

# Published sizes (Meta's model cards / params.json): 3.2-1B 1.24B (tied), 3.1-8B 8.03B, 3.1-70B 70.6B.
PUBLISHED = {"llama1b": 1_235_814_400, "llama8b": 8_030_261_248, "llama70b": 70_553_706_496}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_published(name):
    profile = load_model_profile(name)
    assert profile.shape.get_num_params() == PUBLISHED[name]


@pytest.mark.parametrize("name", ["llama1b", "llama8b"])
def test_meta_build_allocates_nothing_and_counts_match(name):
    profile = load_model_profile(name)
    model = build_model(profile, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]
    assert profile.unit_names[:2] == ["layers.0", "layers.1"] and profile.unit_names[-1] == "root"
    assert len(profile.unit_names) == profile.shape.num_layers + 1


def test_tiny_model_runs_forward_deterministically():
    import torch

    profile = load_model_profile("tiny")
    a, b = build_model(profile, seed=1), build_model(profile, seed=1)
    tokens = torch.randint(0, profile.shape.vocab_size, (2, 8))
    out = a(tokens)
    assert out.shape == (2, 8, profile.shape.vocab_size)
    assert torch.equal(out, b(tokens))
    assert not torch.equal(out, build_model(profile, seed=2)(tokens))


def test_builtin_lists_and_overrides():
    assert {"tiny", "small", "llama1b", "llama8b", "llama70b"} <= set(list_model_profiles())
    assert {"cpu-gloo", "h100-node", "h200-node", "a100-node"} <= set(list_cluster_profiles())
    proxy = load_model_profile("llama8b").with_overrides(dim=256, ffn_hidden_dim=768, seq_len=64)
    assert proxy.shape.num_layers == 32 and proxy.shape.dim == 256 and proxy.seq_len == 64


def test_cluster_link_model():
    cluster = load_cluster_profile("h100-node")
    inter = cluster.links["inter_node"]
    assert inter.emulated
    assert inter.get_seconds(50_000_000_000) == pytest.approx(1.0 + 20e-6)
    assert not load_cluster_profile("cpu-gloo").links["intra_node"].emulated


def test_bad_profiles_give_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown model profile 'llama9b' \(use one of: .*llama8b.*\)"):
        load_model_profile("llama9b")
    bad = tmp_path / "m.toml"
    bad.write_text(
        'name = "m"\nseq_len = 8\nbatch_size = 1\n[shape]\ndim = 10\nnum_layers = 1\nnum_heads = 3\nnum_kv_heads = 1\nffn_hidden_dim = 8\nvocab_size = 8\n'
    )
    with pytest.raises(ConfigError, match=r"m\.toml: shape: dim 10 is not divisible by num_heads 3"):
        load_model_profile(str(bad))
    bad.write_text(
        'name = "m"\nseq_len = 8\nbatch_size = 1\nbatch = 3\n[shape]\ndim = 8\nnum_layers = 1\nnum_heads = 2\nnum_kv_heads = 1\nffn_hidden_dim = 8\nvocab_size = 8\n'
    )
    with pytest.raises(ConfigError, match=r"m\.toml: batch: unknown field"):
        load_model_profile(str(bad))


@pytest.mark.parametrize(
    ("name", "peak_bf16", "memory_gib"),
    [("h100-node", 989.4, 79.6), ("h200-node", 989.4, 140.4), ("a100-node", 312.0, 80.0)],
)
def test_gpu_cluster_profiles_carry_what_the_simulator_needs(name, peak_bf16, memory_gib):
    cluster = load_cluster_profile(name)
    assert (
        cluster.collective_model == "ring" and cluster.ranks_per_node == 8 and cluster.memory_per_rank_gib == memory_gib
    )
    assert cluster.accelerator is not None and cluster.accelerator.peak_tflops["bfloat16"] == peak_bf16
    assert all(0 < link.efficiency <= 1 for link in cluster.links.values())
    assert (
        load_cluster_profile("cpu-gloo").collective_model == "flat"
        and load_cluster_profile("cpu-gloo").accelerator is None
    )


def test_bad_cluster_profiles_give_one_line_errors(tmp_path):
    bad = tmp_path / "c.toml"
    head = 'name = "c"\nbackend = "nccl"\ndevice = "cuda"\nranks_per_node = 8\nmemory_per_rank_gib = 80.0\n'
    bad.write_text(head + 'collective_model = "tree"\n')
    with pytest.raises(ConfigError, match=r"c\.toml: <top>: collective_model must be one of flat, ring, got 'tree'"):
        load_cluster_profile(str(bad))
    bad.write_text(
        head
        + '[accelerator]\nname = "x"\npeak_tflops = { bfloat16 = 1.0 }\ngemm_efficiency = 1.5\nattention_efficiency = 0.5\nhbm_gbps = 1.0\n'
    )
    with pytest.raises(ConfigError, match=r"c\.toml: accelerator: gemm_efficiency must be in \(0, 1\], got 1\.5"):
        load_cluster_profile(str(bad))
    bad.write_text(head + '[accelerator]\nname = "x"\npeak_flops = 1.0\n')
    with pytest.raises(ConfigError, match=r"c\.toml: accelerator\.peak_flops: unknown field"):
        load_cluster_profile(str(bad))
