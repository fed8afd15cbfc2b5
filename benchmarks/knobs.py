"""Prints the step-time ratio of each FSDP2 knob alone to FSDP2's defaults, measured in one run.

    .venv/bin/python benchmarks/knobs.py [--model small] [--world 2] [--microbatches 4] [--pairs 3]

One launch of ranks; for each knob, A (baseline) and B (knob) are built and timed in
alternation, ``--pairs`` times, each over ``--steps`` unprofiled steps after one warm-up
step. Prints per knob the median step time of A and B and the median of the per-pair B/A
ratios (< 1 means the knob is faster). The concat-deferral row compares eager concat
against FSDP2's deferred concat, both with ``sync = "last"``; the embeddings' row compares the
embeddings split off as a unit of their own with and without their backward all-gather, and the
separate reduce-scatter group's row runs where this torch has it (2.13 on). ``--cluster`` enables link
emulation so overlap knobs can be judged as
on a cluster whose links wait rather than compute.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import run_rank0  # noqa: E402

from autotune.search import SearchSpace  # noqa: E402
from autotune.trials import build_training  # noqa: E402
from fsdp_runtime import MeshConfig, RuntimeConfig, config_to_dict, default_config, get_unsupported_knobs  # noqa: E402
from profiles import load_model_profile  # noqa: E402


def _units(config: RuntimeConfig, **changes) -> RuntimeConfig:
    return dataclasses.replace(
        config, units=[dataclasses.replace(u, **changes) if u.name != "root" else u for u in config.units]
    )


def _prefetch(config: RuntimeConfig, depth: int) -> RuntimeConfig:
    blocks = [u.name for u in config.units if u.name != "root"]
    units = []
    for u in config.units:
        if u.name != "root":
            i = blocks.index(u.name)
            u = dataclasses.replace(
                u,
                forward_prefetch=blocks[i + 1 : i + 1 + depth],
                backward_prefetch=list(reversed(blocks[max(0, i - depth) : i])),
            )
        units.append(u)
    return dataclasses.replace(config, units=units)


def get_cases(
    blocks: list[str], num_microbatches: int, world_size: int = 2
) -> dict[str, tuple[RuntimeConfig, RuntimeConfig]]:
    """Knob name -> (A baseline, B with the knob)."""
    base = default_config(blocks, num_microbatches=num_microbatches)
    last = _units(base, sync="last")
    # Plain replication (HSDP Nx1): the search space leaves replica_last out there as dominated by last.
    replicated = dataclasses.replace(base, mesh=MeshConfig(kind="hsdp", replicate=world_size, shard=1))
    return {
        "unshard_async off": (base, dataclasses.replace(base, unshard_async="off")),
        "prefetch depth 1": (base, _prefetch(base, 1)),
        "prefetch depth 2": (base, _prefetch(base, 2)),
        "reshard_after_forward false": (base, _units(base, reshard_after_forward=False)),
        "reshard_after_backward false": (base, _units(base, reshard_after_backward=False)),
        "sync last": (base, last),
        "sync last + no reshard_after_backward": (base, _units(last, reshard_after_backward=False)),
        "eager concat (vs deferred, sync last)": (last, _units(last, defer_concat=False)),
        "reduce_scatter buffers 2": (base, dataclasses.replace(base, reduce_scatter_max_input_buffers=2)),
        "replica_last (vs last, HSDP Nx1)": (_units(replicated, sync="last"), _units(replicated, sync="replica_last")),
        **_method_cases(blocks, num_microbatches, world_size),
    }


def _method_cases(blocks: list[str], num_microbatches: int, world_size: int) -> dict[str, tuple[RuntimeConfig, ...]]:
    """The registry's newer FSDP2 methods this torch has: a separate reduce-scatter group against FSDP2's
    defaults, and the embeddings' backward all-gather skipped against the same split-off embeddings."""
    base = default_config(blocks, num_microbatches=num_microbatches)
    space = SearchSpace(
        block_names=tuple(blocks),
        world_size=world_size,
        num_microbatches=num_microbatches,
        root_knobs=True,
        embedding_names=("tok_embeddings",),
        head_names=("norm", "output"),
    )
    split = space.build_config({**space.get_default_params(), "root_split": "split"})
    cases = {
        "separate reduce-scatter group": (base, dataclasses.replace(base, separate_reduce_scatter_group=True)),
        "unshard_in_backward false (embeddings split off)": (
            split,
            dataclasses.replace(split, unshard_in_backward=False),
        ),
    }
    if "separate_reduce_scatter_group" in get_unsupported_knobs():  # before torch 2.13
        del cases["separate reduce-scatter group"]
    return cases


def time_config(rank: int, world_size: int, *, model: str, config: dict, num_steps: int, cluster: str | None) -> float:
    """Median step seconds of ``config`` over ``num_steps`` steps after one warm-up step."""
    from autotune.trials import LinkEmulator
    from autotune.trials.program import timed_step
    from profiles import load_cluster_profile

    emulator = LinkEmulator.from_cluster(load_cluster_profile(cluster)) if cluster else None
    training = build_training(rank, world_size, model=model, config=config)
    device = training.device
    timed_step(training, 0, device, emulator)
    return statistics.median(timed_step(training, s, device, emulator)[0] / 1e3 for s in range(1, num_steps + 1))


def rank_main(
    rank: int,
    world_size: int,
    *,
    model: str,
    cases: dict[str, tuple[dict, dict]],
    num_pairs: int,
    num_steps: int,
    cluster: str | None = None,
) -> dict:
    results = {}
    for name, (a, b) in cases.items():
        times_a, times_b = [], []
        for _ in range(num_pairs):
            times_a.append(time_config(rank, world_size, model=model, config=a, num_steps=num_steps, cluster=cluster))
            times_b.append(time_config(rank, world_size, model=model, config=b, num_steps=num_steps, cluster=cluster))
        results[name] = (times_a, times_b)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", default=None, help="substring filter on knob names")
    parser.add_argument(
        "--cluster", default=None, help="cluster profile whose links are emulated (e.g. cpu-emulated-ib)"
    )
    args = parser.parse_args()
    profile = load_model_profile(args.model)
    blocks = profile.unit_names[:-1]
    cases = {
        k: (config_to_dict(a), config_to_dict(b))
        for k, (a, b) in get_cases(blocks, args.microbatches, args.world).items()
        if not args.only or args.only in k
    }
    results = run_rank0(
        "knobs:rank_main",
        world_size=args.world,
        kwargs={
            "model": args.model,
            "cases": cases,
            "num_pairs": args.pairs,
            "num_steps": args.steps,
            "cluster": args.cluster,
        },
    )
    print(
        f"model={args.model} world={args.world} microbatches={args.microbatches} pairs={args.pairs} steps/measurement={args.steps} cluster={args.cluster}"
    )
    print(f"{'knob':40s} {'A ms':>9s} {'B ms':>9s} {'B/A':>7s}  per-pair B/A")
    for name, (times_a, times_b) in results.items():
        ratios = [b / a for a, b in zip(times_a, times_b)]
        print(
            f"{name:40s} {statistics.median(times_a) * 1e3:9.1f} {statistics.median(times_b) * 1e3:9.1f} {statistics.median(ratios):7.3f}  {' '.join(f'{r:.3f}' for r in ratios)}"
        )


if __name__ == "__main__":
    main()
