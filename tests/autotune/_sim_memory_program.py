"""Peak memory of one rank under FSDPMemTracker (fake tensors, a fake world-8 process group) vs the simulator.

Run as a program (``python _sim_memory_program.py MODEL``): the fake process group is global
state, kept out of the test process. Prints one JSON line per config: tracked and predicted
peak bytes. Two steps are tracked; FSDPMemTracker's peak covers both (the first step has no
AdamW state yet, so the second's is the peak).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
import torch.distributed as dist


def _configs(blocks: list[str]):
    from fsdp_runtime import MeshConfig, MixedPrecisionConfig, UnitConfig, default_config

    bf16 = MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32")
    depth2 = [
        UnitConfig(
            name=b, forward_prefetch=blocks[i + 1 : i + 3], backward_prefetch=list(reversed(blocks[max(0, i - 2) : i]))
        )
        for i, b in enumerate(blocks)
    ]

    def with_units(units, **changes):
        return dataclasses.replace(
            default_config(blocks, num_microbatches=2, **changes), units=[*units, UnitConfig(name="root")]
        )

    return {
        "defaults": default_config(blocks, num_microbatches=2),
        "reshard_after_forward_false": with_units([UnitConfig(name=b, reshard_after_forward=False) for b in blocks]),
        "no_sync_keep_unsharded": with_units(
            [UnitConfig(name=b, sync="last", reshard_after_backward=False) for b in blocks]
        ),
        "prefetch_depth2_async_off": with_units(depth2, unshard_async="off"),
        "hsdp_2x4_replica_last": with_units(
            [UnitConfig(name=b, sync="replica_last") for b in blocks], mesh=MeshConfig(kind="hsdp", replicate=2)
        ),
        "bf16_no_sync_3_microbatches": dataclasses.replace(
            default_config(blocks, num_microbatches=3, mixed_precision=bf16),
            units=[*(UnitConfig(name=b, sync="last") for b in blocks), UnitConfig(name="root")],
        ),
    }


def _track(profile, config) -> float:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from fsdp_runtime import GradAccumulator, apply_fsdp
    from fsdp_runtime.apply import build_mesh
    from profiles import build_model
    from profiles.factory import compute_loss

    mesh = build_mesh(config, "cpu")  # outside fake mode: DeviceMesh needs real rank tensors
    with FakeTensorMode():
        model = build_model(profile, device="cpu")
        applied = apply_fsdp(model, config, device_type="cpu", mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        accumulator = GradAccumulator(applied)
        tokens = torch.randint(0, profile.shape.vocab_size, (profile.batch_size, profile.seq_len + 1))
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((tokens,))
        with tracker:
            for _ in range(2):
                for m in range(config.num_microbatches):
                    tracker.reset_mod_stats()  # FSDPMemTracker tracks one iteration of module stats at a time
                    with accumulator.microbatch(m):
                        (compute_loss(model, tokens) / config.num_microbatches).backward()
                optimizer.step()
                optimizer.zero_grad()
        return float(next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"])


def main(model: str) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autotune.sim import Hardware, Simulator, get_model_work
    from profiles import AcceleratorSpec, ClusterProfile, LinkClass, load_model_profile

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    profile = load_model_profile(model)
    accelerator = AcceleratorSpec(
        name="fake",
        peak_tflops={"float32": 1.0, "bfloat16": 1.0},
        gemm_efficiency=1.0,
        attention_efficiency=1.0,
        hbm_gbps=1.0,
    )
    link = LinkClass(latency_us=1.0, bandwidth_gbps=1.0)
    cluster = ClusterProfile(
        name="fake",
        description="",
        backend="gloo",
        device="cpu",
        ranks_per_node=8,
        memory_per_rank_gib=1e3,
        links={"intra_node": link, "inter_node": link},
        accelerator=accelerator,
    )
    for name, config in _configs(profile.block_names).items():
        simulator = Simulator(
            get_model_work(profile, config.mixed_precision.param_dtype or "float32"), Hardware(cluster, 1)
        )
        predicted = simulator.simulate(config).peak_memory_bytes
        print(json.dumps({"config": name, "tracked": _track(profile, config), "predicted": predicted}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
