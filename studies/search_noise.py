"""Prints whether background load changes what the search emits: three searches, their configs re-measured.

Runs the same search three times on one workload: quiet (seed 0), and with a busy loop
loading one core (seeds 1 and 2). Then re-measures each emitted config and a few
hand-written configs against FSDP2's defaults, paired on the same ranks (see [Note: paired
measurement]), in ``--rounds`` interleaved rounds (config A, B, C ..., then again) so a
load that drifts during the re-measurement touches every config alike, and prints per
config the speedup over the defaults (median and interquartile range of all its pairs),
the emitted knobs of each search, and whether the emitted speedups agree within 5%.

Each speedup over the defaults carries the noise of two configs' steps, so comparing two
of them adds the noise of four. A head-to-head phase then measures each emitted config
directly against the fastest hand-written ones (``--head-to-head-top``) and against the quiet
search's, paired on the same ranks in the same interleaved rounds, and prints those ratios
with their spread.

    python studies/search_noise.py --trials 12 --out runs/search_noise
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.pipeline import search_and_report  # noqa: E402
from autotune.search import SearchSettings, SearchSpace  # noqa: E402
from autotune.search.loop import get_config_hash  # noqa: E402
from autotune.trials import RankPool, TrialSpec, run_trial  # noqa: E402
from fsdp_runtime import load_config  # noqa: E402
from profiles import load_model_profile  # noqa: E402

_NOSYNC = {"nosync_blocks": "all", "nosync_level_fsdp": "last", "defer_concat": True}
# On 2 ranks HSDP 2x1 is plain replication (DDP-like: no all-gather, one all-reduce):
# the mesh every search of this benchmark picked, so the hand-written bar includes it.
_REPLICATE_NOSYNC = {"mesh": "hsdp:2x1", "nosync_blocks": "all", "nosync_level_hsdp": "last", "defer_concat": True}
HAND_WRITTEN = {
    "no sync on non-final microbatches (all blocks)": {**_NOSYNC, "keep_unsharded": False},
    "no sync + keep unsharded": {**_NOSYNC, "keep_unsharded": True},
    "async unshard + prefetch depth 1": {
        "unshard_async": "on",
        "forward_prefetch": "depth1",
        "backward_prefetch": "depth1",
    },
    "no reshard after forward": {"reshard_after_forward": "false"},
    "no sync + keep unsharded + no reshard after forward": {
        **_NOSYNC,
        "keep_unsharded": True,
        "reshard_after_forward": "false",
    },
    "replicate (HSDP 2x1) + no sync": _REPLICATE_NOSYNC,
    "replicate (HSDP 2x1) + no sync + keep unsharded, no reshard": {
        **_REPLICATE_NOSYNC,
        "keep_unsharded": True,
        "reshard_after_forward": "false",
    },
    # The same with the root's knobs (searched since config schema 2): the root unit skips sync and stays unsharded too.
    "replicate + no sync + keep unsharded, no reshard, root too": {
        **_REPLICATE_NOSYNC,
        "keep_unsharded": True,
        "reshard_after_forward": "false",
        "root_reshard_after_forward": "false",
        "root_sync_hsdp": "last",
        "root_keep_unsharded": True,
    },
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
        settings = SearchSettings(
            model=args.model,
            world_size=2,
            num_trials=args.trials,
            num_microbatches=args.microbatches,
            out_dir=out,
            seed=seed,
            patience=None,
        )
        start = time.monotonic()
        summary = search_and_report(settings)
        conf = summary.record.confirmation or {}
        print(
            f"search seed={seed} loaded={loaded}: {time.monotonic() - start:.0f} s, {len(summary.rows)} trials, emitted {conf.get('emitted')} "
            f"(final round speedup {conf.get('speedup_median')})",
            flush=True,
        )
        winner = conf.get(
            "winner", (json.loads((summary.out_dir / "search.json").read_text()).get("best") or {}).get("number")
        )
        row = next((r for r in summary.rows if r.number == winner), None)
        if row is not None:
            print(
                f"  emitted trial {winner}{f' ({row.refined_from})' if row.refined_from else ''}: {row.params}",
                flush=True,
            )
        return summary.out_dir / "best.toml"
    finally:
        if busy:
            busy.terminate()


def _measure(pool: RankPool, pairs: dict, out_dir: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """Pair ratios (config / reference) per name, ``args.pairs`` per round in ``args.rounds`` interleaved rounds."""
    ratios: dict[str, list[float]] = {name: [] for name in pairs}
    for r in range(args.rounds):
        for name, (config, reference) in pairs.items():
            out = out_dir / f"round{r}" / re.sub(r"[^A-Za-z0-9.-]+", "_", name)
            spec = TrialSpec(
                model=args.model,
                config=config,
                world_size=2,
                out_dir=out,
                num_warmup=2,
                num_measured=args.pairs,
                profile=False,
                reference=reference,
                timeout_s=600,
                backend="gloo",
            )
            result = run_trial(spec, pool=pool)
            ratios[name] += result.metrics.paired.get("block_ratios", []) if result.ok else []
    return ratios


def _head_to_head(
    pool: RankPool, emitted: dict, configs: dict, hands: list[str], out_dir: Path, args: argparse.Namespace
) -> None:
    """Each emitted config against the given hand-written ones and against the quiet search's, directly paired."""
    quiet = next(iter(emitted))
    pairs = {}
    for name in emitted:
        for other in (*hands, quiet):
            if other == name:
                continue
            if get_config_hash(configs[name]) == get_config_hash(configs[other]):
                print(f"{name} vs {other}: the same effective config")
                continue
            pairs[f"{name} vs {other}"] = (configs[name], configs[other])
    ratios = _measure(pool, pairs, out_dir / "head_to_head", args)
    print(
        f"\n{'head to head':80} {'speed':>6} {'IQR':>13}  (other / emitted step time, {args.pairs * args.rounds} pairs in {args.rounds} interleaved rounds)"
    )
    for name, values in ratios.items():
        if len(values) < 2:
            print(f"{name:80} failed")
            continue
        q25, _, q75 = statistics.quantiles(values, n=4, method="inclusive")
        print(f"{name:80} {1 / statistics.median(values):6.3f} {1 / q75:6.3f}-{1 / q25:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=4, help="pairs per config per round of the final re-measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the final re-measurement")
    parser.add_argument("--out", type=Path, default=Path("runs/search_noise"))
    parser.add_argument(
        "--no-head-to-head",
        dest="head_to_head",
        action="store_false",
        help="skip the direct comparisons of the emitted configs",
    )
    parser.add_argument(
        "--head-to-head-top",
        type=int,
        default=3,
        help="how many of the fastest hand-written configs each emitted one meets head to head",
    )
    parser.add_argument(
        "--against",
        default=None,
        help="with --remeasure-only: skip the comparison with the defaults; meet the hand-written configs whose names hold this text",
    )
    parser.add_argument(
        "--remeasure-only", action="store_true", help="reuse the three searches already in --out; only re-measure"
    )
    parser.add_argument(
        "--searches",
        default="quiet,loaded1,loaded2",
        help="which searches to run (again); the others are reused from --out",
    )
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()}", flush=True)
    runs = {
        "search quiet, seed 0": ("quiet", 0, False),
        "search loaded, seed 1": ("loaded1", 1, True),
        "search loaded, seed 2": ("loaded2", 2, True),
    }
    chosen = set() if args.remeasure_only else set(args.searches.split(","))
    if chosen - {sub for sub, _, _ in runs.values()}:
        parser.error(
            f"--searches: unknown {sorted(chosen - {sub for sub, _, _ in runs.values()})}; choose from quiet, loaded1, loaded2"
        )
    emitted = {
        name: _search(args.out / sub, seed=seed, loaded=loaded, args=args)
        if sub in chosen
        else args.out / sub / "best.toml"
        for name, (sub, seed, loaded) in runs.items()
    }
    blocks = tuple(load_model_profile(args.model).block_names)
    space = SearchSpace(block_names=blocks, world_size=2, num_microbatches=args.microbatches)
    defaults = space.build_config(space.get_default_params())
    configs = {name: load_config(path) for name, path in emitted.items()}
    configs |= {
        name: space.build_config({**space.get_default_params(), **params}) for name, params in HAND_WRITTEN.items()
    }
    print(f"load before re-measuring: {os.getloadavg()}", flush=True)
    remeasure_dir = args.out / time.strftime("remeasure-%Y%m%d-%H%M%S")
    with RankPool(2) as pool:
        if args.against:  # only the head-to-head, against the hand-written configs whose names hold this text
            hands = [name for name in HAND_WRITTEN if args.against in name]
            _head_to_head(pool, emitted, configs, hands, remeasure_dir, args)
            print(f"load after: {os.getloadavg()}")
            return
        versus_defaults = {name: (config, defaults) for name, config in configs.items()}
        ratios = _measure(pool, versus_defaults, remeasure_dir, args)
        n = args.pairs * args.rounds
        print(
            f"\n{'config':48} {'speedup':>8} {'IQR':>15}  (defaults / config, {n} pairs in {args.rounds} interleaved rounds)"
        )
        speedups = {}
        for name, values in ratios.items():
            if len(values) < 2:
                print(f"{name:48} failed")
                continue
            q25, _, q75 = statistics.quantiles(values, n=4, method="inclusive")
            speedups[name] = 1 / statistics.median(values)
            print(f"{name:48} {speedups[name]:8.3f} {1 / q75:7.3f}-{1 / q25:.3f}")
        searched = [speedups[name] for name in emitted if name in speedups]
        ranked_hands = sorted((name for name in HAND_WRITTEN if name in speedups), key=lambda name: -speedups[name])
        hand = ranked_hands[0] if ranked_hands else None
        if searched:
            spread = max(searched) / min(searched) - 1
            print(f"\nemitted speedups agree within {100 * spread:.1f}% (target 5%)")
            if hand is not None:
                print(
                    f"slowest emitted / best hand-written: {min(searched) / speedups[hand]:.3f} (>= 1: every search at least as fast)"
                )
        if hand is not None and args.head_to_head:
            _head_to_head(pool, emitted, configs, ranked_hands[: args.head_to_head_top], remeasure_dir, args)
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
