"""Prints the memory knobs' step and peak ratios, and a search under a memory budget against hand-written configs.

Activation checkpointing and unit grouping under a memory budget.

On a workload whose activations dominate the peak (the ``small`` shape at sequence
``--seq-len`` (512) x batch 4, 2 microbatches, 2 ranks):

1. Per knob, alone and in a few combinations: step time and process peak relative to FSDP2's
   defaults, each config paired with the defaults on the same ranks ([Note: paired
   measurement]) in ``--rounds`` interleaved rounds (every config once, then again), so a load
   that drifts touches every config alike.
2. A memory budget between the defaults' peak and the lowest peak of step 1
   (``--budget-frac`` of the way down), so that the defaults are infeasible.
3. ``autotune search`` under that budget (checkpointing, grouping and the root's knobs on).
4. The emitted config and every hand-written config that fits the budget, re-measured in
   interleaved rounds against the defaults: the emitted config's speedup against the fastest
   feasible hand-written one.

    .venv/bin/python benchmarks/memory_knobs.py --out runs/memory_knobs      # ~25 min on 2 cores

Step ratios are config / defaults (< 1: faster); peaks are each config's process peak RSS
(the Python/torch runtime included) over the defaults' (the A/A row).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.search import SearchSettings, SearchSpace, run_search  # noqa: E402
from autotune.sim import Hardware, Simulator, get_model_work  # noqa: E402
from autotune.trials import RankPool, TrialSpec, run_trial  # noqa: E402
from fsdp_runtime import ConfigError, RuntimeConfig, load_config  # noqa: E402
from profiles import load_cluster_profile  # noqa: E402
from profiles.sources import load_model_source  # noqa: E402

MODEL_TOML = """# small's shape with a longer sequence: activations dominate the peak
name = "actheavy"
description = "small shape, seq {seq_len} x batch 4"
seq_len = {seq_len}
batch_size = 4

[shape]
dim = 256
num_layers = 4
num_heads = 8
num_kv_heads = 4
ffn_hidden_dim = 768
vocab_size = 2048
"""
BLOCKS = tuple(f"layers.{i}" for i in range(4))
MICROBATCHES = 2

HAND_WRITTEN = {
    "AC selective, all blocks": {"ac_units": "all", "ac_kind": "selective"},
    "AC full, all blocks": {"ac_units": "all", "ac_kind": "full"},
    "AC full, all but the last": {"ac_units": "all_but_last", "ac_kind": "full"},
    "AC full, every 2nd block": {"ac_units": "every_2nd", "ac_kind": "full"},
    "2 blocks per unit": {"blocks_per_unit": 2},
    "4 blocks per unit": {"blocks_per_unit": 4},
    "root: no sync + keep unsharded": {"root_sync_fsdp": "last", "root_keep_unsharded": True},
    "embeddings + head as units": {"root_split": "split"},
    "2 per unit + AC full": {"blocks_per_unit": 2, "ac_units": "all", "ac_kind": "full"},
    "AC full + no sync (blocks, root)": {
        "ac_units": "all",
        "ac_kind": "full",
        "nosync_blocks": "all",
        "nosync_level_fsdp": "last",
        "defer_concat": True,
        "root_sync_fsdp": "last",
    },
    "AC selective + no sync + prefetch 1": {
        "ac_units": "all",
        "ac_kind": "selective",
        "nosync_blocks": "all",
        "nosync_level_fsdp": "last",
        "defer_concat": True,
        "unshard_async": "on",
        "forward_prefetch": "depth1",
        "backward_prefetch": "depth1",
    },
}


def _space() -> SearchSpace:
    return SearchSpace(
        block_names=BLOCKS,
        world_size=2,
        num_microbatches=MICROBATCHES,
        grouping=True,
        checkpointing=True,
        root_knobs=True,
        embedding_names=("tok_embeddings",),
        head_names=("norm", "output"),
    )


def _measure(
    pool: RankPool,
    model: str,
    configs: dict[str, RuntimeConfig],
    defaults: RuntimeConfig,
    *,
    rounds: int,
    pairs: int,
    out: Path,
) -> dict[str, dict]:
    """Per config: its pair ratios (config / defaults) and its process peaks (sampled before the defaults' build), over interleaved rounds."""
    got: dict[str, dict] = {name: {"ratios": [], "peaks": []} for name in configs}
    for r in range(rounds):
        for name, config in configs.items():
            spec = TrialSpec(
                model=model,
                config=config,
                world_size=2,
                out_dir=out / f"round{r}" / re.sub(r"[^A-Za-z0-9.-]+", "_", name),
                num_warmup=1,
                num_measured=pairs,
                profile=False,
                reference=defaults,
                timeout_s=600,
                backend="gloo",
            )
            result = run_trial(spec, pool=pool)
            if not result.ok:
                print(f"  {name}: {result.status} {result.reason[:200] if result.reason else ''}", flush=True)
                continue
            paired = result.metrics.paired
            got[name]["ratios"] += paired.get("block_ratios", [])
            got[name]["peaks"].append(result.metrics.process_peak_bytes)
    return got


def _measure_warmed(
    pool: RankPool,
    model: str,
    configs: dict[str, RuntimeConfig],
    defaults: RuntimeConfig,
    args: argparse.Namespace,
    *,
    out: str,
) -> dict[str, dict]:
    """:func:`_measure` into ``args.out / out``, after one warm-up trial of the defaults: a fresh pool's
    first trial starts from a smaller resident set (~300 vs ~370 MiB here), so warm it first, as the
    search's pool is, and no config is measured on a younger process."""
    _measure(pool, model, {"warm-up": defaults}, defaults, rounds=1, pairs=1, out=args.out / f"{out}_warmup")
    return _measure(pool, model, configs, defaults, rounds=args.rounds, pairs=args.pairs, out=args.out / out)


def _predict_peaks(model: Path, configs: dict[str, RuntimeConfig]) -> dict[str, float]:
    """The simulator's peak tensor memory per rank for each config (float32, 2 ranks); a config it cannot simulate is left out.
    Memory does not depend on the device's speeds: any profile with an accelerator table serves (its times are ignored)."""
    simulator = Simulator(
        get_model_work(load_model_source(str(model)), "float32"),
        Hardware(load_cluster_profile("h100-node"), num_ranks=2),
    )
    peaks = {}
    for name, config in configs.items():
        try:
            peaks[name] = simulator.simulate(config).peak_memory_bytes
        except ConfigError as exc:  # the embeddings + head split: not modelled
            print(f"  (no prediction for {name!r}: {exc})")
    return peaks


def _print_table(
    got: dict[str, dict], default_peak: float, budget: int | None = None, predicted: dict[str, float] | None = None
) -> dict[str, tuple[float, float]]:
    """The process peak includes the runtime (~constant across configs); the simulator predicts tensor memory, so the
    comparable figures are differences from the defaults: measured peak - defaults' peak vs predicted - predicted defaults'."""
    predicted = predicted or {}
    base = predicted.get("defaults (A/A)")
    print(
        f"{'config':40} {'step/defaults':>13} {'IQR':>13} {'peak MiB':>9} {'peak/defaults':>13}"
        + ("  fits" if budget else "")
        + (f" {'delta MiB':>9} {'sim delta':>9}" if base is not None else "")
    )
    out = {}
    for name, g in got.items():
        if len(g["ratios"]) < 2 or not g["peaks"]:
            print(f"{name:40} failed")
            continue
        q25, median, q75 = statistics.quantiles(g["ratios"], n=4, method="inclusive")
        peak = max(g["peaks"])
        out[name] = (median, peak)
        fits = f"  {'yes' if peak <= budget else 'no'}" if budget else ""
        deltas = ""
        if base is not None:
            sim = f"{(predicted[name] - base) / 2**20:+9.1f}" if name in predicted else f"{'-':>9}"
            deltas = f" {(peak - default_peak) / 2**20:+9.1f} {sim}"
        print(
            f"{name:40} {median:13.3f} {q25:6.3f}-{q75:.3f} {peak / 2**20:9.1f} {peak / default_peak:13.3f}{fits}{deltas}"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=12, help="trials of the search under the budget")
    parser.add_argument("--pairs", type=int, default=3, help="pairs per config per round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    parser.add_argument(
        "--budget-frac",
        type=float,
        default=0.5,
        help="budget: this far from the defaults' peak down to the lowest peak measured",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=512,
        help="sequence length: at 512 checkpointing saves ~3x the spread of one config's peak",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/memory_knobs"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / "actheavy.toml"
    model.write_text(MODEL_TOML.format(seq_len=args.seq_len))
    space = _space()
    defaults = space.build_config(space.get_default_params())
    hand = {name: space.build_config({**space.get_default_params(), **params}) for name, params in HAND_WRITTEN.items()}
    started = time.monotonic()
    print(f"load before: {os.getloadavg()}", flush=True)

    with RankPool(2) as pool:
        print(f"\n1. each knob vs FSDP2's defaults ({args.pairs} pairs x {args.rounds} interleaved rounds)", flush=True)
        got = _measure_warmed(pool, str(model), {"defaults (A/A)": defaults, **hand}, defaults, args, out="knobs")
        default_peak = max(got["defaults (A/A)"]["peaks"])
        knob_table = _print_table(
            got, default_peak, predicted=_predict_peaks(model, {"defaults (A/A)": defaults, **hand})
        )
        lowest = min(peak for _, peak in knob_table.values())
        budget = int(default_peak - args.budget_frac * (default_peak - lowest))
        print(
            f"\n2. memory budget {budget / 2**20:.1f} MiB (defaults {default_peak / 2**20:.1f} MiB, lowest {lowest / 2**20:.1f} MiB)",
            flush=True,
        )

    print(
        f"\n3. autotune search under the budget ({args.trials} trials; checkpointing, grouping, root knobs)", flush=True
    )
    settings = SearchSettings(
        model=str(model),
        world_size=2,
        num_trials=args.trials,
        num_microbatches=MICROBATCHES,
        out_dir=args.out / "search",
        memory_budget_bytes=budget,
        seed=0,
        patience=None,
        trial_timeout_s=600,
    )
    summary = run_search(settings)
    for row in summary.rows:
        peak = f"{row.process_peak_bytes / 2**20:7.1f} MiB" if row.process_peak_bytes else "       -"
        ratio = f"{row.ratio:.3f}" if row.ratio is not None else "-"
        print(
            f"  trial {row.number:2d} {row.status:8} ratio {ratio:>6} peak {peak} {'fits' if row.feasible else 'OVER'}  {row.params}",
            flush=True,
        )
    if summary.best_config_path is None:
        print("the search emitted nothing")
        return
    emitted = load_config(summary.best_config_path)
    conf = summary.record.confirmation or {}
    print(
        f"  search's best trial {summary.best.number}: {summary.best.params}; emitted: {conf.get('emitted')} (final-round winner: {conf.get('winner')})",
        flush=True,
    )

    feasible = {name: hand[name] for name, (_, peak) in knob_table.items() if name in hand and peak <= budget}
    with RankPool(2) as pool:
        print(
            f"\n4. the emitted config and the {len(feasible)} feasible hand-written configs vs the defaults ({args.pairs} pairs x {args.rounds} rounds)",
            flush=True,
        )
        final = _measure_warmed(
            pool, str(model), {"search under the budget": emitted, **feasible}, defaults, args, out="final"
        )
        final_table = _print_table(final, default_peak, budget)
    if "search under the budget" in final_table:
        ratio, peak = final_table["search under the budget"]
        fitting = {n: r for n, (r, p) in final_table.items() if n != "search under the budget" and p <= budget}
        if fitting:
            best_name = min(fitting, key=fitting.get)
            print(
                f"\nemitted: {ratio:.3f} of the defaults' step, peak {peak / 2**20:.1f} MiB ({'fits' if peak <= budget else 'OVER the budget'}); "
                f"fastest feasible hand-written: {best_name!r} at {fitting[best_name]:.3f}; emitted / hand-written step: {ratio / fitting[best_name]:.3f} (<= 1: the search is at least as fast)"
            )
    print(f"load after: {os.getloadavg()}; {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
