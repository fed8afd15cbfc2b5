"""Prints how well the calibrated step simulator predicts measured CPU trials ([Note: calibration]).

For each workload x setting: calibrate on the defaults and calibration trials paired with
them (unshard_async on: the CPU share; with ``--fit-sync``, no gradient sync: the wait per
collective; on emulated links, the defaults on raw loopback too) and two read from their traces only (the defaults
replicated, HSDP Nx1: a shard group of one's plain copies; no gradient sync with
``defer_concat = false``: FSDP1-style concat's own labels), then measure a deterministic sample of configs across the search space (unprofiled, a few
steps each, on one rank pool) and compare with the simulator's predictions: median absolute
error and Spearman rank correlation, and the noise floor: how far the measured ratios stray by
their own pairs' noise, and the simulator's error net of it (:func:`get_noise_floor`). On the 2 nodes x 2 ranks cluster also: the mesh the
simulator picks over the whole space and the one a real search picks, and their tuned/default
step-time ratios.

Each workload/setting is *held out* or in the *fit set* ([Note: fit and held-out sets] in
``autotune/sim/fitted.py``): ``trace_costs.HOOK_QUANTILE`` was chosen by replaying recorded runs of
``small`` and ``wide`` on raw loopback, so those two settings are its fit set and their error is
printed apart; the accuracy figure is the held-out settings' (``results.json``: ``held_out`` and
``fit_set``, each the median over its settings' configs pooled). ``--from-results`` prints the
tables of a recorded ``results.json`` again, without running anything.

    .venv/bin/python benchmarks/sim_accuracy.py                         # everything (~45 min on 2 quiet cores)
    .venv/bin/python benchmarks/sim_accuracy.py --workloads small --settings raw --configs 10

Workloads: ``small`` (the profile) and ``wide`` (communication-heavy: dim 640, 3 blocks,
16 tokens, batch 1). Settings: ``raw`` (2 ranks, loopback gloo), ``emulated`` (2 ranks,
cpu-emulated-ib's 1 GB/s intra-node link), ``2x2`` (4 ranks as 2 nodes x 2 ranks of
cpu-emulated-ib: 0.25 GB/s between nodes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.search import SearchSettings, SearchSpace, SilentReporter, describe_params, run_search  # noqa: E402
from autotune.search.predictions import get_spearman as spearman  # noqa: E402
from autotune.search.ranking import iter_space_params, rank_space  # noqa: E402
from autotune.sim import Hardware, Simulator, get_model_work  # noqa: E402
from autotune.sim.calibrate import calibrate  # noqa: E402
from autotune.sim.calibration_trial import read_calibration_trial  # noqa: E402
from autotune.sim.fit_split import is_cpu_held_out  # noqa: E402
from autotune.trials import RankPool, TrialSpec, run_trial  # noqa: E402
from profiles import load_cluster_profile  # noqa: E402
from profiles.sources import load_model_source  # noqa: E402

WORKLOADS = {
    "small": "small",
    "wide": {
        "name": "small",
        "dim": 640,
        "num_layers": 3,
        "num_heads": 10,
        "num_kv_heads": 5,
        "ffn_hidden_dim": 1792,
        "seq_len": 16,
        "batch_size": 1,
    },
}
# The simulator far from its calibration points (docs/benchmarks.md): ``wide4``, the kind of workload
# it once mispriced (wide, shallow, batch 1; run it with --microbatches 4 --grouping --ladder),
# and ``deep``, held out: never run while the pricing was changed, only to check it afterwards.
WORKLOADS["wide4"] = {**WORKLOADS["wide"], "num_layers": 4}
WORKLOADS["deep"] = {
    "name": "small",
    "dim": 256,
    "num_layers": 8,
    "num_heads": 8,
    "num_kv_heads": 4,
    "ffn_hidden_dim": 768,
    "seq_len": 48,
    "batch_size": 2,
}
# The pipeline workload (docs/pipeline.md): 4 blocks for 2 pipeline stages x 2 data-parallel ranks on
# 2x2 (run it with --pp 1,2 --sample-pp 2 --microbatches 4: calibrated on the FSDP2 defaults,
# predicting pipeline configs).
WORKLOADS["pipe"] = str(Path(__file__).resolve().parent / "models" / "pipe.toml")
SETTINGS = {"raw": (2, None), "emulated": (2, "cpu-emulated-ib"), "2x2": (4, "cpu-emulated-ib")}
NUM_MICROBATCHES = 2


def get_ladder(space: SearchSpace) -> list[dict]:
    """The defaults, then one knob at a time towards a config far from the calibration points
    (replicated, no gradient sync on any block, every block in one unit) and their combinations:
    which part of the pricing breaks away shows as the rung where predicted and measured part."""
    world = space.world_size
    replicate = {"mesh": f"hsdp:{world}x1"}
    nosync = {"nosync_blocks": "all", "nosync_level": "last", "keep_unsharded": False, "defer_concat": True}
    group = {"blocks_per_unit": max(b for b in (1, 2, 4) if b <= len(space.block_names))}
    defaults = space.get_default_params()

    def rung(*changes: dict) -> dict:
        params = dict(defaults)
        for change in changes:
            params.update(change)
        if "hsdp" in params["mesh"]:  # a shard group of one: reshard choices of shard 1, the fsdp-suffixed sync level
            params.pop("reshard_after_forward", None)
            params[space._get_reshard_key(1)] = "true"
        return params

    return [
        defaults,
        rung(replicate),
        rung(nosync),
        rung(group),
        rung(nosync, {"keep_unsharded": True}),
        rung(replicate, nosync),
        rung(nosync, group),
        rung(replicate, group),
        rung(replicate, nosync, group),
    ]


def _spec(model, config, world, out, *, cluster, steps, warmup, profile, reference=None):
    return TrialSpec(
        model=model,
        config=config,
        world_size=world,
        out_dir=out,
        num_warmup=warmup,
        num_measured=steps,
        num_profiled=2,
        profile=profile,
        cluster=cluster,
        timeout_s=600.0,
        reference=reference,
    )


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def _calibration_params(space: SearchSpace) -> dict:
    return {**space.get_default_params(), "unshard_async": "on", "forward_prefetch": "depth1"}


def _nosync_params(space: SearchSpace) -> dict:
    """The calibration trial of the wait per collective ([Note: calibration]): the defaults without
    most of their collectives (no gradient sync before the last microbatch, blocks kept unsharded
    across microbatches and from forward to backward: ~10 collectives a step instead of ~28 on
    ``small`` with 2 microbatches), so the wait it saves stands out of the pairs' noise."""
    return {
        **space.get_default_params(),
        "nosync_blocks": "all",
        "nosync_level_fsdp": "last",
        "defer_concat": True,
        "keep_unsharded": True,
        "reshard_after_forward": "false",
    }


CALIBRATION_DIRS = ("cal_defaults", "cal_async", "cal_nosync", "cal_local", "cal_concat", "cal_raw")
"""A setting's calibration trial dirs, in the order :func:`run_setting` runs them (the anchor first)."""


def calibrate_recorded(paths: list[Path], work, *, fit_sync: bool):
    """The profile of a setting's calibration trials (``paths``: the anchor, then the async trial, then
    the others). The anchor's step is the defaults as timed in alternation with the async trial (the
    profiled trial's own unprofiled steps run first, when the pool is least warm)."""
    anchor, *extra = [read_calibration_trial(path) for path in paths]
    return calibrate(work, anchor, extra=extra, anchor_step_s=extra[0].reference_step_s, fit_sync=fit_sync)


def run_setting(workload: str, setting: str, args: argparse.Namespace, out: Path) -> dict:
    world, cluster = SETTINGS[setting]
    model = WORKLOADS[workload]
    source = load_model_source(model)
    work = get_model_work(source, "float32")
    space = SearchSpace(
        block_names=work.block_names,
        world_size=world,
        num_microbatches=args.microbatches,
        device_type="cpu",
        grouping=args.grouping,
        pipeline_degrees=tuple(int(p) for p in args.pp.split(",")),
    )
    defaults = space.get_default_params()
    started = time.monotonic()
    with RankPool(world) as pool:
        run_trial(
            _spec(
                model,
                space.build_config(defaults),
                world,
                out / "warmup",
                cluster=cluster,
                steps=3,
                warmup=2,
                profile=False,
            ),
            pool=pool,
        )
        anchor_dir, async_dir, nosync_dir, raw_dir = (
            out / "cal_defaults",
            out / "cal_async",
            out / "cal_nosync",
            out / "cal_raw",
        )
        default_config = space.build_config(defaults)
        calibration = [
            (anchor_dir, defaults, cluster, None),
            (async_dir, _calibration_params(space), cluster, default_config),
        ]
        calibration += [(nosync_dir, _nosync_params(space), cluster, default_config)] if args.fit_sync else []
        # A shard group of one (replication) unshards and reduces by plain copies the FSDP anchor cannot show.
        calibration += (
            [(out / "cal_local", {**defaults, "mesh": f"hsdp:{world}x1"}, cluster, None)] if args.fit_local else []
        )
        # FSDP1-style eager concat, priced from fsdp_runtime's labels around it (not as memory traffic).
        concat = {**defaults, "nosync_blocks": "all", "nosync_level_fsdp": "last", "defer_concat": False}
        calibration += [(out / "cal_concat", concat, cluster, None)] if args.fit_concat else []
        calibration += [(raw_dir, defaults, None, None)] if cluster else []
        for path, params, links, reference in calibration:
            if args.reuse_calibration and (path / "metrics.json").exists():
                continue  # a previous run's calibration trial (same workload, setting and flags)
            steps = (
                args.calibration_pairs if reference is not None else args.steps
            )  # a fitted ratio: as many pairs as the noise asks
            spec = _spec(
                model,
                space.build_config(params),
                world,
                path,
                cluster=links,
                steps=steps,
                warmup=args.warmup,
                profile=True,
                reference=reference,
            )
            result = run_trial(spec, pool=pool)
            assert result.ok, f"calibration trial {path}: {result.status} {result.reason}"
        profile = calibrate_recorded([path for path, *_ in calibration], work, fit_sync=args.fit_sync)
        calibrate_s = time.monotonic() - started
        hardware = Hardware(load_cluster_profile(cluster or "cpu-gloo"), num_ranks=world, measured=profile)
        simulator = Simulator(work, hardware)
        points = [p for p in iter_space_params(space) if args.sample_pp is None or p.get("pp", 1) == args.sample_pp]
        first = get_ladder(space) if args.ladder else [defaults]
        sample = first + random.Random(args.seed).sample(
            [p for p in points if p not in first], max(0, min(args.configs - len(first), len(points) - len(first)))
        )
        # The ranking walk prices FSDP2 alone (``autotune plan`` ranks pipeline degrees its own way).
        ranked = (
            rank_space(space, simulator, world_size=world, device="cpu") if setting == "2x2" and args.pp == "1" else []
        )
        if ranked and ranked[0].params not in sample:
            sample.append(ranked[0].params)
        default_pred = simulator.simulate(default_config).step_s * 1e3
        rows, loads = [], [_load()]
        for i, params in enumerate(sample):
            config = space.build_config(params)
            spec = _spec(
                model,
                config,
                world,
                out / f"config_{i:03d}",
                cluster=cluster,
                steps=args.pairs,
                warmup=args.warmup,
                profile=False,
                reference=default_config,
            )
            result = run_trial(spec, pool=pool)
            prediction = simulator.simulate(config)
            predicted = prediction.step_s * 1e3
            paired = result.metrics.paired if result.metrics else {}
            rows.append(
                {
                    "params": params,
                    "config": describe_params(params),
                    "status": result.status,
                    "measured_ms": result.step_ms,
                    "predicted_ms": predicted,
                    "measured_ratio": paired.get("ratio"),
                    "predicted_ratio": predicted / default_pred,
                    "ratio_spread": paired.get("ratio_spread"),
                    "pair_ratios": paired.get("pair_ratios") or [],
                    # how the predicted step splits: work on the cores vs waiting on links (for the misses' analysis)
                    "predicted_compute_ms": prediction.compute_s * 1e3,
                    "predicted_exposed_comm_ms": prediction.exposed_comm_s * 1e3,
                    "reference_ms": statistics.median(result.metrics.reference_step_ms_per_step)
                    if result.metrics and result.metrics.reference_step_ms_per_step
                    else None,
                }
            )
            print(
                f"  [{workload}/{setting}] {i + 1}/{len(sample)} measured {result.step_ms or float('nan'):7.1f} ms ({paired.get('ratio') or float('nan'):.3f}x the defaults)"
                f"  predicted {predicted:7.1f} ms ({predicted / default_pred:.3f}x)  {describe_params(params)}",
                flush=True,
            )
        loads.append(_load())
    ok = [r for r in rows if r["status"] == "ok" and r["measured_ms"] and r["measured_ratio"]]
    errors = [r["predicted_ms"] / r["measured_ms"] - 1 for r in ok]
    ratio_errors = [r["predicted_ratio"] / r["measured_ratio"] - 1 for r in ok]
    anchor_ms = 1e3 * read_calibration_trial(anchor_dir).step_s
    summary = {
        "workload": workload,
        "setting": setting,
        "split": "held out" if is_cpu_held_out(workload, setting) else "fit set",
        "world_size": world,
        "cluster": cluster,
        "num_configs": len(ok),
        "num_points": len(points),
        "median_abs_error": _median_abs(errors),
        "p90_abs_error": _p90_abs(errors),
        "mean_error": statistics.fmean(errors) if errors else None,
        "spearman": spearman([r["predicted_ms"] for r in ok], [r["measured_ms"] for r in ok]) if len(ok) > 2 else None,
        "ratio_median_abs_error": _median_abs(ratio_errors),
        "ratio_p90_abs_error": _p90_abs(ratio_errors),
        "ratio_spearman": spearman([r["predicted_ratio"] for r in ok], [r["measured_ratio"] for r in ok])
        if len(ok) > 2
        else None,
        "measured_range_ms": [min(r["measured_ms"] for r in ok), max(r["measured_ms"] for r in ok)] if ok else None,
        "measured_ratio_range": [min(r["measured_ratio"] for r in ok), max(r["measured_ratio"] for r in ok)]
        if ok
        else None,
        "reference_ms": [
            min(r["reference_ms"] for r in ok),
            statistics.median(r["reference_ms"] for r in ok),
            max(r["reference_ms"] for r in ok),
        ]
        if ok
        else None,
        "anchor_ms": anchor_ms,
        "load": loads,
        # The measurement's own noise: the interquartile range of a config's pair ratios over their median. A
        # prediction cannot be checked closer than this, nor ranked where configs differ by less.
        "median_ratio_spread": statistics.median(r["ratio_spread"] for r in ok if r.get("ratio_spread") is not None)
        if ok
        else None,
        **_rank_ceiling(ok),
        **get_noise_floor(ok),
        "defaults_pair_ratio": next((r["measured_ratio"] for r in ok if r["params"] == defaults), None),
        "calibration": {
            "notes": profile.notes,
            "compute_scale": profile.compute_scale,
            "cpu_share": profile.cpu_share,
            "sync_s": profile.sync_s,
            "seconds": calibrate_s,
        },
        "wall_s": time.monotonic() - started,
        "rows": rows,
        "misses": _explain(ok),
    }
    if ranked:
        summary["sim_pick"] = _pick(ranked[0].params, rows)
        summary["measured_pick"] = _pick(min(ok, key=lambda r: r["measured_ms"])["params"], rows)
    return summary


def _rank_ceiling(rows: list[dict]) -> dict:
    """How well the measurements rank the configs themselves: the Spearman correlation between two
    single pairs of the same configs (pair i vs pair j, averaged over i < j), projected to the median
    of all n pairs by Spearman-Brown (n r / (1 + (n - 1) r): an approximation made for averages of
    Pearson-reliable measurements). No predictor can correlate with the measured ranking better than
    the measurement with itself; the simulator's Spearman against single pairs (``sim_pair_spearman``)
    is comparable to ``pair_spearman`` directly."""
    n = min((len(r["pair_ratios"]) for r in rows), default=0)
    if n < 2 or len(rows) < 3:
        return {}
    pairs = [
        spearman([r["pair_ratios"][i] for r in rows], [r["pair_ratios"][j] for r in rows])
        for i in range(n)
        for j in range(i + 1, n)
    ]
    single = statistics.fmean(pairs)
    sim = statistics.fmean(
        spearman([r["predicted_ratio"] for r in rows], [r["pair_ratios"][i] for r in rows]) for i in range(n)
    )
    return {
        "pair_spearman": single,
        "sim_pair_spearman": sim,
        "spearman_ceiling": n * single / (1 + (n - 1) * single) if single > 0 else single,
    }


def get_noise_floor(rows: list[dict], *, resamples: int = 400, seed: int = 0) -> dict:
    """How far the measured ratios themselves stray, and the simulator's error net of it.

    Each measured ratio is a trial's median ABBA block ratio over a few pairs ([Note: paired
    measurement]), so it carries the pairs' noise: on a noisy day a perfect predictor would show
    a median absolute error of several percent. Per config, the trial's figure (the median of
    blocks, a block the mean of two consecutive pair ratios) is recomputed on bootstrap resamples
    of its pair ratios; the median over configs and resamples of ``|resampled / measured - 1|`` is
    the *noise floor*. It sees only the noise inside a trial (not load that moves between trials)
    and a bootstrap of n pairs shrinks the variance by (n - 1) / n: a lower bound. With Gaussian
    errors a median absolute error is 0.674 sigma, and independent errors add in quadrature, so the
    simulator's own median absolute error is estimated as ``sqrt(observed^2 - floor^2)``.
    """
    rng = random.Random(seed)
    deviations = []
    for r in rows:
        pairs = r.get("pair_ratios") or []
        if len(pairs) < 2 or not r.get("measured_ratio"):
            continue
        for _ in range(resamples):
            sample = [rng.choice(pairs) for _ in pairs]
            blocks = [statistics.fmean(sample[k : k + 2]) for k in range(0, len(sample), 2)]
            deviations.append(abs(statistics.median(blocks) / r["measured_ratio"] - 1))
    if not deviations:
        return {}
    floor = statistics.median(deviations)
    observed = _median_abs([r["predicted_ratio"] / r["measured_ratio"] - 1 for r in rows if r.get("measured_ratio")])
    return {"noise_floor": floor, "net_ratio_error": max(0.0, observed**2 - floor**2) ** 0.5}


def _median_abs(errors: list[float]) -> float | None:
    return statistics.median(abs(e) for e in errors) if errors else None


def _p90_abs(errors: list[float]) -> float | None:
    return sorted(abs(e) for e in errors)[int(0.9 * (len(errors) - 1))] if errors else None


def _pick(params: dict, rows: list[dict]) -> dict:
    row = next(r for r in rows if r["params"] == params)
    return {
        "config": row["config"],
        "mesh": params["mesh"],
        "predicted_ms": row["predicted_ms"],
        "measured_ms": row["measured_ms"],
        "predicted_ratio": row["predicted_ratio"],
        "tuned_over_default": row["measured_ratio"],
    }


def _explain(rows: list[dict]) -> list[str]:
    """The knob values whose configs the simulator gets most wrong on average (signed, relative)."""
    groups: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        error = r["predicted_ratio"] / r["measured_ratio"] - 1
        for key, value in r["params"].items():
            groups.setdefault((key, str(value)), []).append(error)
    scored = sorted(
        ((statistics.fmean(v), k, len(v)) for k, v in groups.items() if len(v) >= 3), key=lambda t: -abs(t[0])
    )
    lines = [
        f"{key}={value}: mean ratio error {100 * mean:+.1f}% over {count} configs"
        for mean, (key, value), count in scored[:4]
    ]
    worst = sorted(rows, key=lambda r: -abs(r["predicted_ratio"] / r["measured_ratio"] - 1))[:3]
    lines += [
        f"worst: {r['config']}: predicted {r['predicted_ratio']:.3f}x ({r['predicted_ms']:.1f} ms), measured {r['measured_ratio']:.3f}x ({r['measured_ms']:.1f} ms)"
        for r in worst
    ]
    return lines


def run_search_2x2(args: argparse.Namespace, out: Path) -> dict:
    """A real (paired, TPE) search on the 2 x 2 emulated cluster: the mesh it emits and its confirmed speedup."""
    settings = SearchSettings(
        model="small",
        world_size=4,
        num_trials=args.search_trials,
        num_microbatches=NUM_MICROBATCHES,
        out_dir=out,
        cluster="cpu-emulated-ib",
        num_warmup=1,
        num_measured=3,
        num_profiled=1,
        patience=None,
        num_confirm_pairs=2,
        trial_timeout_s=600.0,
    )
    started = time.monotonic()
    summary = run_search(settings, reporter=SilentReporter())
    best = summary.best
    conf = summary.confirmation or {}
    return {
        "trials": len(summary.rows),
        "best": describe_params(best.params) if best else None,
        "mesh": best.params.get("mesh") if best else None,
        "best_ratio": best.ratio if best else None,
        "emitted": conf.get("emitted"),
        "confirmed_speedup": conf.get("speedup_median"),
        "wall_s": time.monotonic() - started,
    }


def summarize_split(results: list[dict], part: str) -> dict:
    """The ratio error over every measured config of the settings in one split (``held out``, ``fit set``)."""
    chosen = [r for r in results if r.get("split", _split(r)) == part]
    ok = [
        row
        for r in chosen
        for row in r["rows"]
        if row["status"] == "ok" and row["measured_ms"] and row["measured_ratio"] and row.get("predicted_ratio")
    ]
    errors = [row["predicted_ratio"] / row["measured_ratio"] - 1 for row in ok]
    return {
        "settings": [f"{r['workload']}/{r['setting']}" for r in chosen],
        "num_configs": len(ok),
        "ratio_median_abs_error": _median_abs(errors),
        "ratio_p90_abs_error": _p90_abs(errors),
    }


def _split(result: dict) -> str:
    return "held out" if is_cpu_held_out(result["workload"], result["setting"]) else "fit set"


def _print_rows(results: list[dict]) -> None:
    print(
        f"{'workload':<8} {'setting':<9} {'ranks':>5} {'configs':>7} {'step ms':>11} {'ratio':>11} | {'step: med|err|':>14} {'rho':>6} | {'ratio: med|err|':>15} {'p90':>6} {'rho':>6} | {'noise':>6} {'min':>4} {'load':>14}"
    )
    for r in results:
        lo, hi = r["measured_range_ms"] or (0, 0)
        rlo, rhi = r["measured_ratio_range"] or (0, 0)
        print(
            f"{r['workload']:<8} {r['setting']:<9} {r['world_size']:>5} {r['num_configs']:>7} {f'{lo:.0f}-{hi:.0f}':>11} {f'{rlo:.2f}-{rhi:.2f}':>11} | "
            f"{100 * r['median_abs_error']:>13.1f}% {r['spearman']:>6.3f} | {100 * r['ratio_median_abs_error']:>14.1f}% {100 * r['ratio_p90_abs_error']:>5.1f}% "
            f"{r['ratio_spearman']:>6.3f} | {100 * (r.get('median_ratio_spread') or float('nan')):>5.1f}% {r['wall_s'] / 60:>4.1f} {r['load'][0]:>14}"
        )


def print_table(results: list[dict]) -> None:
    print(
        "\npredicted vs measured (error = predicted / measured - 1). step: median unprofiled step time; ratio: a config's step over the"
    )
    print(
        "defaults' step, measured in alternating pairs on the same ranks (load cancels), predicted as sim(config) / sim(defaults);"
    )
    print("noise: the median over configs of the interquartile range of a config's pair ratios over their median")
    for part, title in (
        ("held out", "held out: settings no fitted constant was read off (the accuracy figure)"),
        ("fit set", "fit set (set constants): settings whose recorded runs chose trace_costs.HOOK_QUANTILE"),
    ):
        chosen = [r for r in results if r.get("split", _split(r)) == part]
        summary = summarize_split(results, part)
        median = summary["ratio_median_abs_error"]
        print(
            f"\n{title}: ratio median |error| {'-' if median is None else f'{100 * median:.1f}%'} over "
            f"{summary['num_configs']} configs of {', '.join(summary['settings']) or 'no setting of this run'}"
        )
        if chosen:
            _print_rows(chosen)
    for r in results:
        ref = r["reference_ms"]
        print(
            f"\n{r['workload']}/{r['setting']}: the defaults measured {ref[0]:.0f}/{ref[1]:.0f}/{ref[2]:.0f} ms (min/median/max over the trials' pairs; "
            f"the anchor trial: {r['anchor_ms']:.0f} ms); load average before/after {r['load'][0]} / {r['load'][1]}"
        )
        print("  calibration: " + "; ".join(r["calibration"]["notes"]))
        if "noise_floor" in r:
            print(
                f"  noise floor: the measured ratios stray {100 * r['noise_floor']:.1f}% (median, bootstrap of each trial's pairs: "
                f"a lower bound); the simulator's own ratio error net of it: {100 * r['net_ratio_error']:.1f}% "
                f"(observed {100 * r['ratio_median_abs_error']:.1f}%)"
            )
        if "pair_spearman" in r:
            print(
                f"  rank reliability of the measurements: one pair vs another of the same configs rho {r['pair_spearman']:.2f} "
                f"(the simulator vs one pair: {r['sim_pair_spearman']:.2f}); projected to the median of all pairs: {r['spearman_ceiling']:.2f} "
                f"(the ceiling of any predictor's rho, against the simulator's {r['ratio_spearman']:.2f})"
            )
        for line in r["misses"]:
            print(f"  {line}")
        for key in ("sim_pick", "measured_pick"):
            if key in r:
                p = r[key]
                print(
                    f"  {key.replace('_', ' ')}: {p['config']}: predicted {p['predicted_ratio']:.3f}x the defaults ({p['predicted_ms']:.1f} ms), "
                    f"measured {p['tuned_over_default']:.3f}x ({p['measured_ms']:.1f} ms)"
                )


def _write_results(out: Path, results: list[dict], search: dict | None) -> None:
    data = {
        "results": results,
        "search": search,
        "held_out": summarize_split(results, "held out"),  # the accuracy figure
        "fit_set": summarize_split(results, "fit set"),
    }
    (out / "results.json").write_text(json.dumps(data, indent=1, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="small,wide")
    parser.add_argument("--settings", default="raw,emulated,2x2")
    parser.add_argument(
        "--configs", type=int, default=30, help="configs measured per workload and setting (the defaults included)"
    )
    parser.add_argument("--pairs", type=int, default=3, help="measured pairs (config, defaults) per config")
    parser.add_argument(
        "--steps",
        type=int,
        default=4,
        help="measured steps (pairs) of each calibration trial (then a profiled window of 2)",
    )
    parser.add_argument(
        "--calibration-pairs",
        type=int,
        default=10,
        help="measured pairs of the calibration trials paired with the defaults",
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=NUM_MICROBATCHES)
    parser.add_argument("--grouping", action="store_true", help="search blocks per unit too (schema-2 grouping)")
    parser.add_argument(
        "--ladder",
        action="store_true",
        help="measure get_ladder's configs (one knob at a time towards replicated + no sync + grouped) first, then a sample up to --configs",
    )
    parser.add_argument(
        "--fit-sync",
        action="store_true",
        help="also fit the wait per collective from a paired no-sync trial (off by default: see [Note: calibration])",
    )
    parser.add_argument(
        "--no-fit-local",
        dest="fit_local",
        action="store_false",
        help="calibrate without the replicated (HSDP Nx1) trial: a shard group of one priced like the anchor's hooks",
    )
    parser.add_argument(
        "--no-fit-concat",
        dest="fit_concat",
        action="store_false",
        help="calibrate without the eager-concat trial: FSDP1-style concat priced as memory traffic",
    )
    parser.add_argument(
        "--pp",
        default="1",
        help="pipeline degrees in the space, e.g. 1,2 (the calibration runs the defaults: the least)",
    )
    parser.add_argument(
        "--sample-pp", type=int, default=None, help="sample only configs of this pipeline degree (the defaults aside)"
    )
    parser.add_argument(
        "--reuse-calibration",
        action="store_true",
        help="keep calibration trials already in --out (a run that stopped after calibrating)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--search-trials", type=int, default=8, help="trials of the real search on the 2x2 cluster (small); 0: none"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="where trial dirs and results.json go (default: a temp dir)"
    )
    parser.add_argument(
        "--from-results",
        type=Path,
        default=None,
        help="print the tables of a recorded results.json (or its dir) again; run nothing",
    )
    args = parser.parse_args()
    if args.from_results is not None:
        path = args.from_results / "results.json" if args.from_results.is_dir() else args.from_results
        print_table(json.loads(path.read_text())["results"])
        return
    signal.signal(
        signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt())
    )  # close the rank pools on a kill
    out = args.out or Path(tempfile.mkdtemp(prefix="sim_accuracy_"))
    started = time.monotonic()
    results = []
    for workload in args.workloads.split(","):
        for setting in args.settings.split(","):
            print(f"{workload} / {setting}", flush=True)
            results.append(run_setting(workload, setting, args, out / f"{workload}_{setting}"))
            _write_results(out, results, None)  # what has run is kept if a later setting stops
    search = run_search_2x2(args, out / "search_2x2") if args.search_trials and "2x2" in args.settings else None
    print_table(results)
    if search:
        print(
            f"\nreal search on 2x2 (small, {search['trials']} trials, {search['wall_s'] / 60:.1f} min): best {search['best']} (mesh {search['mesh']}), "
            f"ratio {search['best_ratio']}, emitted {search['emitted']}, confirmed speedup {search['confirmed_speedup']}"
        )
    _write_results(out, results, search)
    print(f"\ntotal {(time.monotonic() - started) / 60:.1f} min; details in {out / 'results.json'}")


if __name__ == "__main__":
    main()
