"""The simulator's inputs and outputs: traced work vs torch's FlopCounterMode, collective prices by hand,
monotonicity in link and device speed, and one-line errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autotune.search import SearchSpace
from autotune.sim import Hardware, SimError, Simulator, get_model_work, simulate
from autotune.sim.hardware import get_group
from fsdp_runtime import ConfigError, MixedPrecisionConfig, UnitConfig, default_config, validate_for_world
from profiles import build_model, load_cluster_profile, load_model_profile

BF16 = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")


def test_traced_flops_match_flop_counter_mode_on_the_meta_model():
    # FlopCounterMode on the meta device runs SDPA's math path: attention backward as 4 bmm (2x forward); the
    # traced flash kernel's formula counts 5 (2.5x forward: the backward recomputes the scores). Matmuls: equal.
    from torch.utils.flop_counter import FlopCounterMode

    profile = load_model_profile("small")
    work = get_model_work(profile, "float32")
    model = build_model(profile, device="meta")
    tokens = torch.randint(0, profile.shape.vocab_size, (profile.batch_size, profile.seq_len + 1), device="meta")
    with FlopCounterMode(display=False) as counter:
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    attention_forward = profile.shape.num_layers * work.work["block", "forward"].attention_flops
    assert counter.get_total_flops() == work.get_flops_per_microbatch() - 0.5 * attention_forward
    assert work.work["block", "backward"].attention_flops == 2.5 * work.work["block", "forward"].attention_flops


def test_llama8b_work_and_activations_have_the_published_shape():
    work = get_model_work(load_model_profile("llama8b"), "bfloat16")
    tokens = 8192
    block_params = 218_103_808  # 4096 x (2 x 4096 + 2 x 1024) + 3 x 4096 x 14336 matmul weights
    assert work.work["block", "forward"].gemm_flops == 2 * tokens * block_params
    assert work.work["block", "backward"].gemm_flops == 2 * work.work["block", "forward"].gemm_flops
    assert work.tokens == tokens and len(work.block_names) == 32
    # flash attention: a block keeps ~2 GiB at 8k tokens in this model (float32 norm/RoPE intermediates), not the 8 GiB score matrix
    assert 1.5 * 2**30 < work.activations.block_saved < 2.5 * 2**30
    assert work.activations.block_input == tokens * 4096 * 2
    assert work.root_head_fraction == pytest.approx(0.5, abs=1e-3)  # untied: embeddings are half the root


def test_ring_collective_prices_by_hand():
    cluster = load_cluster_profile("h100-node")
    hw = Hardware(cluster, 2)
    intra, inter = get_group(8, 1, 8), get_group(16, 1, 8)
    assert (intra.num_nodes, inter.num_nodes, inter.members_per_node) == (1, 2, 8)
    gb = 1e9
    # latency + bytes (n-1)/n / (bandwidth x efficiency): NVLink 450 x 0.8; IB 8 NICs x 50 x 0.9 = 360, under NVLink's 360
    assert hw.get_collective_seconds("all_gather", gb, intra) == pytest.approx(10e-6 + gb * 7 / 8 / 360e9)
    assert hw.get_collective_seconds("reduce_scatter", gb, inter) == pytest.approx(20e-6 + gb * 15 / 16 / 360e9)
    assert hw.get_collective_seconds("all_reduce", gb, get_group(2, 8, 8)) == pytest.approx(2 * (20e-6 + gb / 2 / 45e9))
    shard, replicate = hw.get_mesh_groups(2, 8)  # HSDP 2x8 on 2 nodes: shard groups in a node, replicas across
    assert (shard.link_name, replicate.link_name, replicate.members_per_node) == ("intra_node", "inter_node", 1)
    assert hw.get_collective_seconds("all_gather", gb, get_group(1, 1, 8)) == 0.0


def test_flat_profiles_price_like_link_emulation():
    cluster = load_cluster_profile("cpu-emulated-ib")
    hw = Hardware(cluster, 2)
    link = cluster.links["inter_node"]
    assert hw.get_collective_seconds("reduce_scatter", 1e6, get_group(4, 1, 2)) == pytest.approx(
        link.get_seconds(1_000_000)
    )


def _sample_configs(work, world_size: int, count: int) -> list:
    space = SearchSpace(block_names=work.block_names, world_size=world_size, num_microbatches=2, device_type="cuda")
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    configs = []
    for _ in range(count):
        config = space.suggest(study.ask())
        configs.append(dataclasses.replace(config, mixed_precision=BF16))
    return configs


@pytest.mark.parametrize("what", ["intra_node", "inter_node", "device"])
def test_a_faster_link_or_device_never_predicts_a_slower_step(what):
    work = get_model_work(load_model_profile("llama1b"), "bfloat16")
    base = load_cluster_profile("h100-node")
    if what == "device":
        acc = base.accelerator
        faster = dataclasses.replace(
            base,
            accelerator=dataclasses.replace(
                acc, peak_tflops={k: 2 * v for k, v in acc.peak_tflops.items()}, hbm_gbps=2 * acc.hbm_gbps
            ),
        )
    else:
        link = base.links[what]
        faster = dataclasses.replace(
            base,
            links={
                **base.links,
                what: dataclasses.replace(link, bandwidth_gbps=4 * link.bandwidth_gbps, latency_us=link.latency_us / 2),
            },
        )
    slow, fast = (
        Simulator(work, Hardware(base, 2), activation_checkpointing=True),
        Simulator(work, Hardware(faster, 2), activation_checkpointing=True),
    )
    for config in _sample_configs(work, 16, 25):
        assert fast.simulate(config).step_s <= slow.simulate(config).step_s * (1 + 1e-9), config


def test_prediction_outputs_for_llama8b_on_a_node():
    work = get_model_work(load_model_profile("llama8b"), "bfloat16")
    config = default_config(list(work.block_names), num_microbatches=2, mixed_precision=BF16)
    hw = Hardware(load_cluster_profile("h100-node"), 1)
    plain, checkpointed = simulate(config, work, hw), simulate(config, work, hw, activation_checkpointing=True)
    assert not plain.fits and checkpointed.fits  # 32 x ~2 GiB of activations do not fit in 80 GB without checkpointing
    assert checkpointed.step_s > plain.step_s  # the recomputed forward
    assert [u.name for u in checkpointed.units] == [*work.block_names, "root"]
    assert 0.3 < checkpointed.mfu < 0.6
    assert checkpointed.tokens_per_s_per_device == pytest.approx(2 * 8192 / checkpointed.step_s)
    root = checkpointed.units[-1]
    assert root.exposed_s == pytest.approx(
        root.comm_s
    )  # its all-gather opens each microbatch, its reduce-scatter closes it
    assert checkpointed.exposed_comm_s <= checkpointed.comm_s and checkpointed.compute_s <= checkpointed.step_s


def test_bad_input_is_one_line():
    work = get_model_work(load_model_profile("tiny"), "float32")
    with pytest.raises(SimError, match=r"cpu-gloo.*no accelerator table"):
        simulate(default_config(list(work.block_names)), work, Hardware(load_cluster_profile("cpu-gloo"), 1))
    hw = Hardware(load_cluster_profile("h100-node"), 1)
    with pytest.raises(ConfigError, match=r"units\[0\]\.name: unit 'layers\.9' is not a unit of this model"):
        simulate(dataclasses.replace(default_config([]), units=[UnitConfig(name="layers.9")]), work, hw)
    with pytest.raises(SimError, match="param_dtype is bfloat16 but the workload was traced in float32"):
        simulate(default_config(list(work.block_names), mixed_precision=BF16), work, hw)


def test_random_configs_keep_the_optimizer_state_by_hand_and_gain_from_a_faster_link():
    """40 random configs of ``tiny`` on 2 A100 nodes (16 ranks), and again with 4x the inter-node bandwidth."""
    work = get_model_work(load_model_profile("tiny"), "bfloat16")
    base = load_cluster_profile("a100-node")
    link = base.links["inter_node"]
    faster = dataclasses.replace(
        base, links={**base.links, "inter_node": dataclasses.replace(link, bandwidth_gbps=4 * link.bandwidth_gbps)}
    )
    simulator, fast = Simulator(work, Hardware(base, 2)), Simulator(work, Hardware(faster, 2))
    # tiny: a block holds q, o 64x64, k, v 64x32 (2 of 4 heads), 3 x 64x192 MLP and 2 norms: 49,280 parameters;
    # the root embeddings and head 512x64 each and a norm: 65,600. Every dim-0 divides 16: no padding.
    num_params = 4 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 192 + 2 * 64) + 2 * 512 * 64 + 64
    assert num_params == 262_720
    meshes = set()
    for config in _sample_configs(work, 16, 40):
        prediction, quicker = simulator.simulate(config), fast.simulate(config)
        shard = validate_for_world(config, 16)[1]
        meshes.add(shard)
        # AdamW keeps a float32 master shard and two float32 moments: 12 bytes per sharded parameter, all step long.
        assert prediction.memory_breakdown["sharded_params_and_optimizer"] == 12 * num_params // shard, config
        # The compute stream is the step's critical path: it computes or waits for a collective.
        assert prediction.step_s == pytest.approx(prediction.compute_s + prediction.exposed_comm_s, rel=1e-9)
        assert prediction.exposed_comm_s <= prediction.comm_s
        # At 16 ranks on 2 nodes every mesh crosses nodes (shard groups, or the replicas' all-reduce): a faster
        # link makes every step's collectives shorter, and none of them more exposed.
        assert quicker.comm_s < prediction.comm_s, config
        assert quicker.exposed_comm_s <= prediction.exposed_comm_s * (1 + 1e-9), config
        assert quicker.step_s <= prediction.step_s * (1 + 1e-9), config
        assert quicker.compute_s == pytest.approx(prediction.compute_s, rel=1e-9)
    assert len(meshes) >= 3, meshes  # FSDP and HSDP shard groups of several sizes were sampled


def _grouped(work, *, checkpointing: str = "none", modules=("layers.0", "layers.1")):
    from fsdp_runtime import RuntimeConfig

    units = [
        UnitConfig(
            name="layers.0-1",
            modules=list(modules),
            activation_checkpointing=checkpointing,
            forward_prefetch=["layers.2"],
        ),
        UnitConfig(name="layers.2", activation_checkpointing=checkpointing),
        UnitConfig(name="layers.3"),
        UnitConfig(name="root"),
    ]
    return RuntimeConfig(units=units, mixed_precision=BF16)


def test_units_of_several_blocks_and_per_unit_checkpointing_schema_2():
    from autotune.sim import resolve_knobs
    from autotune.sim.costs import get_mesh_costs

    work = get_model_work(load_model_profile("tiny"), "bfloat16")
    knobs = resolve_knobs(_grouped(work, checkpointing="full"), work.block_names, world_size=8, device="cuda")
    assert knobs.unit_blocks == ((0, 1), (2,), (3,)) and knobs.forward_prefetch[0] == (1,)
    assert knobs.checkpointing == ("full", "full", "none", "none")
    hw = Hardware(load_cluster_profile("h100-node"), 1)
    plain = get_mesh_costs(
        work, hw, replicate=1, shard=8, param_dtype="bfloat16", reduce_dtype="float32", activation_checkpointing=False
    )
    kinds = {
        k: get_mesh_costs(
            work,
            hw,
            replicate=1,
            shard=8,
            param_dtype="bfloat16",
            reduce_dtype="float32",
            activation_checkpointing=False,
            unit_blocks=knobs.unit_blocks,
            checkpointing=(k, k, "none", "none"),
        )
        for k in ("none", "selective", "full")
    }
    grouped = kinds["none"]
    # one all-gather of both blocks' parameters: their bytes, one latency
    assert grouped.padded[0] == 2 * plain.padded[0] and grouped.sharded[0] == 2 * plain.sharded[0]
    link = hw.cluster.links["intra_node"]
    assert grouped.all_gather_s[0] == pytest.approx(
        link.latency_us * 1e-6 + 2 * plain.padded[0] * 2 * 7 / 8 / (link.bandwidth_gbps * link.efficiency * 1e9)
    )
    assert grouped.all_gather_s[0] < 2 * plain.all_gather_s[0] and grouped.forward_s[0] == pytest.approx(
        2 * plain.forward_s[0]
    )
    # checkpointing recomputes the forward in backward: all of it (full), its non-matmul work (selective)
    memory_part = hw.get_memory_seconds(work.work["block", "forward"].memory_bytes) + hw.get_host_floor_s(
        "block_forward"
    )
    assert kinds["full"].backward_s[0] == pytest.approx(2 * (plain.backward_s[0] + plain.forward_s[0]))
    assert kinds["selective"].backward_s[0] == pytest.approx(2 * (plain.backward_s[0] + memory_part))
    assert kinds["full"].backward_s[2] == plain.backward_s[2]  # layers.3 unchecked
    assert work.activations.block_input < work.activations.block_selective < work.activations.block_saved


def test_schema_2_configs_simulate_with_fewer_collectives_and_less_memory():
    work = get_model_work(load_model_profile("tiny"), "bfloat16")
    hw = Hardware(load_cluster_profile("h100-node"), 1)
    default = simulate(default_config(list(work.block_names), mixed_precision=BF16), work, hw)
    same = simulate(_grouped(work, modules=("layers.0",)), work, hw)  # a one-module list is a plain unit...
    assert [u.name for u in same.units][:1] == ["layers.0"]
    grouped, checkpointed = simulate(_grouped(work), work, hw), simulate(_grouped(work, checkpointing="full"), work, hw)
    assert [u.name for u in grouped.units] == ["layers.0-1", "layers.2", "layers.3", "root"]
    assert (
        grouped.units[0].comm_s < default.units[0].comm_s + default.units[1].comm_s
    )  # one latency per collective instead of two
    # the recomputed forwards cost compute (hidden here: the tiny model waits for its collectives) and save memory
    assert (
        checkpointed.compute_s > grouped.compute_s
        and checkpointed.step_s >= grouped.step_s
        and checkpointed.peak_memory_bytes < grouped.peak_memory_bytes
    )


def test_selective_checkpointing_saves_the_ops_fsdp_runtime_saves():
    from autotune.sim import model_work
    from fsdp_runtime import checkpointing

    assert model_work._SELECTIVE_SAVED == set(checkpointing.SAVED_OP_NAMES)
