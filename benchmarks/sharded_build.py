"""Prints the seconds per sharded build of a Llama at 8B width: the full-draw init, the chunked init, and the chunked init restored from the shard cache.

    .venv/bin/python benchmarks/sharded_build.py [--blocks 1 2] [--worlds 1 2] [--repeats 3] [--mode init|cache]

The model: llama8b's block shape (dim 4096, FFN 14336, 32 heads, 8 KV heads) with its 128256-token
embedding and output, and ``--blocks`` blocks (1: 1.27B parameters, 5.1 GB in fp32; 2: 1.49B;
4: 1.92B, more than a shared 24 GiB box holds comfortably with the baseline's full copies). Per
block count and world size, one launch of fresh gloo ranks builds it sharded ([Note: sharded
build]: meta device, ``fully_shard`` as FSDP2's defaults, ``to_empty``, init) through
``build_training(sharded=True)``, ``--repeats`` times with each of two inits, alternating (A B, B
A, A B ...); a build's time is the slowest rank's, each build freed before the next.

``--mode init`` (the default):

- A (before): the init this repository had before [Note: chunked init], kept here as the
  baseline: every full parameter drawn on the host from one generator in the build's order,
  each rank keeping its shard (``distribute_tensor(..., src_data_rank=None)``);
- B (after): ``Llama.init_weights``, each parameter drawn in row chunks with a generator each, a
  rank drawing only the chunks that overlap its shard.

``--mode cache`` ([Note: shard cache]; the rank holds its shard twice, model and cache):

- A (draw): the chunked init with no cache (a cache that keeps nothing): every build draws;
- B (restore): the chunked init through a shard cache one unmeasured build filled first: every
  parameter's rows restored with a copy (on CPU from plain host memory; on CUDA pinned).

Prints per case the median seconds of each (min-max), the numbers each rank drew, and the
median of the per-repeat ratios B/A with their min-max.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import run_rank0  # noqa: E402

LLAMA8B_WIDTH = {"name": "llama8b", "seq_len": 16, "batch_size": 1}
"""llama8b's shape (its blocks set by ``num_layers``); the training shape does not change a build."""


def full_draw_init_weights(model: Any, seed: int) -> int:
    """The baseline (A): the previous ``Llama.init_weights``, every full parameter drawn on every rank."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    std, drawn = 0.02, 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            scale = std / math.sqrt(2 * model.shape.num_layers) if name.endswith(("wo.weight", "w2.weight")) else std
            full = torch.randn(param.shape, generator=gen) * scale
            drawn += full.numel()
            if isinstance(param, DTensor):
                full = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
            param.copy_(full)
    return drawn


def rank_main(
    rank: int, world_size: int, *, model: dict[str, Any], config: dict[str, Any], repeats: int, mode: str = "init"
) -> dict:
    """Rank program: per init (``before``/``after``, or ``draw``/``restore``) the slowest rank's
    seconds of each build, the numbers this rank drew and each sharded build's ``[drawn, restored]``
    parameters."""
    import torch
    import torch.distributed as dist

    from autotune.trials import training as training_module
    from autotune.trials.training import build_training
    from profiles.chunked_init import ShardCache
    from profiles.llama import Llama

    original, default_cache = Llama.init_weights, training_module.SHARD_CACHE
    inits = {"before": full_draw_init_weights, "after": original}
    caches = {"draw": ShardCache(max_bytes=0), "restore": ShardCache()}  # keeps nothing; keeps all
    names = list(caches if mode == "cache" else inits)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    drawn: dict[str, int] = {}
    restores: dict[str, list[list[int]]] = {name: [] for name in names}

    def build(name: str) -> Any:
        init = original if mode == "cache" else inits[name]

        def init_weights(self: Any, seed: int, **kwargs: Any) -> None:
            drawn[name] = init(self, seed, **kwargs) if init is original else init(self, seed)

        Llama.init_weights = init_weights
        training_module.SHARD_CACHE = caches.get(name, default_cache)  # what _build_sharded uses
        training = build_training(rank, world_size, model=model, config=config, seed=0, sharded=True)
        restores[name] += training_module.take_shard_inits()
        return training

    try:
        if mode == "cache":  # fills the restoring cache; not measured
            build("restore")
            restores["restore"].clear()
        for repeat in range(repeats):
            for name in names[:: 1 if repeat % 2 == 0 else -1]:  # A B, B A, ...: no order favoured
                gc.collect()
                dist.barrier()
                start = time.perf_counter()
                training = build(name)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                seconds[name].append(float(elapsed.item()))
                del training
    finally:
        Llama.init_weights, training_module.SHARD_CACHE = original, default_cache
    return {"seconds": seconds, "drawn": drawn, "shard_inits": restores}


def _span(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", choices=["init", "cache"], default="init")
    args = parser.parse_args()
    a_name, b_name = ("before", "after") if args.mode == "init" else ("draw", "restore")
    from fsdp_runtime import config_to_dict, default_config
    from profiles import load_model_source

    print(
        f"llama8b width, sharded builds on gloo ranks ({args.mode}), {args.repeats} per init, alternating;"
        " seconds: slowest rank"
    )
    print(
        f"{'blocks':>6s} {'params':>7s} {'world':>5s} {'drawn/rank A':>13s} {'drawn/rank B':>13s}"
        f" {f'A {a_name} s (min-max)':>22s} {f'B {b_name} s (min-max)':>22s} {'B/A':>6s}  B/A min-max"
    )
    for blocks in args.blocks:
        model = {**LLAMA8B_WIDTH, "num_layers": blocks}
        source = load_model_source(model)
        config = config_to_dict(default_config(list(source.block_names)))
        for world in args.worlds:
            out = run_rank0(
                "sharded_build:rank_main",
                world_size=world,
                kwargs={"model": model, "config": config, "repeats": args.repeats, "mode": args.mode},
            )
            a, b = out["seconds"][a_name], out["seconds"][b_name]
            ratios = [y / x for x, y in zip(a, b)]
            print(
                f"{blocks:6d} {source.get_num_params() / 1e9:6.2f}B {world:5d} {out['drawn'][a_name] / 1e9:12.3f}B"
                f" {out['drawn'][b_name] / 1e9:12.3f}B {_span(a):>22s} {_span(b):>22s}"
                f" {statistics.median(ratios):6.3f}  {min(ratios):.3f}-{max(ratios):.3f}",
                flush=True,
            )
            if args.mode == "cache":
                print(f"{'':19s} [drawn, restored] parameters per build on rank 0: {out['shard_inits']}", flush=True)


if __name__ == "__main__":
    main()
