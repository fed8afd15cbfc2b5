"""Does background load change what the search emits? (issue: trustworthy measurement)

Runs the same search three times on one workload: quiet (seed 0), and with a busy loop
loading one core (seeds 1 and 2). Then re-measures each emitted config and a few
hand-written configs against FSDP2's defaults, paired on the same ranks in one quiet
pass (see [Note: paired measurement]), and prints per config the speedup over the
defaults (median and interquartile range of the pairs).

    python benchmarks/search_noise.py --trials 10 --out runs/search_noise
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.pipeline import search_and_report  # noqa: E402
from autotune.search import SearchSettings, SearchSpace  # noqa: E402
from autotune.trials import RankPool, TrialSpec, run_trial  # noqa: E402
from fsdp_runtime import load_config  # noqa: E402
from profiles import load_model_profile  # noqa: E402

HAND_WRITTEN = {
    "no sync on non-final microbatches (all blocks)": {"nosync_blocks": "all", "nosync_level_fsdp": "last", "defer_concat": True, "keep_unsharded": False},
    "no sync + keep unsharded": {"nosync_blocks": "all", "nosync_level_fsdp": "last", "defer_concat": True, "keep_unsharded": True},
    "async unshard + prefetch depth 1": {"unshard_async": "on", "forward_prefetch": "depth1", "backward_prefetch": "depth1"},
    "no reshard after forward": {"reshard_after_forward": "false"},
}


def _busy() -> None:
    while True:
        pass


def _search(out: Path, *, seed: int, loaded: bool, args: argparse.Namespace) -> Path:
    shutil.rmtree(out, ignore_errors=True)
    busy = multiprocessing.Process(target=_busy, daemon=True) if loaded else None
    if busy:
        busy.start()
    try:
        settings = SearchSettings(model=args.model, world_size=2, num_trials=args.trials, num_microbatches=args.microbatches, out_dir=out, seed=seed, patience=None)
        start = time.monotonic()
        summary = search_and_report(settings)
        print(f"search seed={seed} loaded={loaded}: {time.monotonic() - start:.0f} s, emitted {summary.record.confirmation and summary.record.confirmation.get('emitted')}", flush=True)
        return summary.out_dir / "best.toml"
    finally:
        if busy:
            busy.terminate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=8, help="pairs per config in the final quiet re-measurement")
    parser.add_argument("--out", type=Path, default=Path("runs/search_noise"))
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()}", flush=True)
    emitted = {
        "search quiet, seed 0": _search(args.out / "quiet", seed=0, loaded=False, args=args),
        "search loaded, seed 1": _search(args.out / "loaded1", seed=1, loaded=True, args=args),
        "search loaded, seed 2": _search(args.out / "loaded2", seed=2, loaded=True, args=args),
    }
    blocks = tuple(load_model_profile(args.model).block_names)
    space = SearchSpace(block_names=blocks, world_size=2, num_microbatches=args.microbatches)
    defaults = space.build_config(space.get_default_params())
    configs = {name: load_config(path) for name, path in emitted.items()}
    configs |= {name: space.build_config({**space.get_default_params(), **params}) for name, params in HAND_WRITTEN.items()}
    print(f"load before re-measuring: {os.getloadavg()}", flush=True)
    rows = []
    with RankPool(2) as pool:
        for name, config in configs.items():
            spec = TrialSpec(model=args.model, config=config, world_size=2, out_dir=args.out / "remeasure" / name.replace(" ", "_"), num_warmup=2,
                             num_measured=args.pairs, profile=False, reference=defaults, timeout_s=600, backend="gloo")  # fmt: skip
            result = run_trial(spec, pool=pool)
            p = result.metrics.paired if result.ok else {}
            rows.append((name, p))
    print(f"\n{'config':48} {'speedup':>8} {'IQR':>15}  (defaults / config, {args.pairs} pairs, quiet)")
    for name, p in rows:
        if not p:
            print(f"{name:48} failed")
            continue
        print(f"{name:48} {1 / p['ratio']:8.3f} {1 / p['ratio_q75']:7.3f}-{1 / p['ratio_q25']:.3f}")
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
