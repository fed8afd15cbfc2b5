"""Prints the profiler's overhead per search config, profiler setting and allocator: profiled vs unprofiled steps.

    .venv/bin/python studies/profiler_overhead.py [--workloads small,wide] [--configs defaults,async_prefetch,nosync_all,raf_false]
        [--variants plain,today,shapes,stack,itt] [--extended defaults] [--allocators glibc,trial] [--rounds 4] [--trial-rounds 2] [--block 2]

Runtime: ``--workloads small --rounds 3``: ~40 minutes at load 6-10 on 2 cores (8 launches,
16 trials); ``wide`` steps are ~3 s quiet, 11-14 s at load 5.

What it runs. Per workload (``small``: the small profile; ``wide``: small with dim 1024,
16/8 heads, ffn 2816, seq 64, batch 1: a wide, shallow, communication-heavy model), per config
that a search trials (built with ``SearchSpace.build_config``, world 2, 4 microbatches,
CPU) and per allocator setting of the ranks (``glibc``: its defaults; ``trial``: what a trial
does, ``tune_heap`` and ``prefault_heap`` in ``autotune/trials/rank_memory.py``; ``notrim``: only
the thresholds, trim 16 GiB and mmap 32 MiB, through ``GLIBC_TUNABLES``; ``thp``:
``glibc.malloc.hugetlb=1``), one launch of 2 ranks (allocators in ABBA order over configs):
after warm-up steps, every *round* runs one block of each variant, in an order rotated by
round. A profiled block is exactly a trial's window (``_profiled_window`` in
``autotune/trials/program.py``): ``schedule(wait=0, warmup=W, active=--block)``, then
``on_trace_ready`` export; an unprofiled block is ``--block`` steps. Steps are timed as in
a trial (barrier, ``perf_counter``, slowest rank); each rank also records its training
thread's CPU time (``time.thread_time``: the profiler's work on that thread, far less
disturbed than wall time by other load), its minor page faults and glibc's heap state,
and its peak RSS over build and warm-up sampled as a trial does.

Variants: ``today`` (a trial's settings: CPU activity, no shapes/stacks/memory, warm-up 1,
gzipped export), ``shapes`` (+ record_shapes), ``stack`` (+ with_stack), ``itt``
(``emit_itt``: the RecordFunction callbacks on every op, nothing recorded); on the
``--extended`` configs also ``no_warmup``, ``shapes_stack`` and ``trace_only``
(``_ExperimentalConfig(trace_only=True)``).

What it prints.
1. Per-op costs of each profiler setting and the cost of a page fault (one process).
2. Per workload x config x allocator x variant: wall and CPU ratio (median over rounds of
   profiled/unprofiled medians, min-max; CPU summed over ranks), the first round alone (a
   trial has one window), ops per step on the training thread, page faults per step
   (unprofiled -> profiled), extra CPU per op, stop and export cost, load at launch.
3. Where ``today``'s overhead goes: extra wall and CPU per step vs what per-op recording
   (ops x c_op) and the extra page faults (x c_fault) predict.
4. Trace figures vs the unprofiled step: the trace's compute scaled uniformly to the
   unprofiled step (what the report shows) or reduced by the extra time, against a CPU-time
   estimate of the unprofiled compute.
5. Allocators: unprofiled step wall and CPU (and against the first allocator), page faults,
   today's overhead, the trial-like peak RSS and the RSS after the last block.
6. Real trials (``--trial-rounds``, ``small``): each config paired with the defaults and
   profiled once, per allocator, as a search runs it; ``metrics.json``'s overhead figures
   (``studies/_profiler_trials.py``). A trial's only window grows a fresh heap: its page
   faults are the first window's, which the probe's repeated windows no longer show.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _profiler_probe import measure_unit_costs  # noqa: E402
from _profiler_trials import print_real_trials, run_real_trials  # noqa: E402

from autotune.search import SearchSpace  # noqa: E402
from autotune.trials import resolve_profile, run_ranks  # noqa: E402
from fsdp_runtime import config_to_dict  # noqa: E402

WORLD = 2
MICROBATCHES = 4
WORKLOADS: dict[str, Any] = {
    "small": "small",
    "wide": {
        "name": "small",
        "dim": 1024,
        "num_heads": 16,
        "num_kv_heads": 8,
        "ffn_hidden_dim": 2816,
        "seq_len": 64,
        "batch_size": 1,
    },
}
CONFIG_CHANGES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "async_prefetch": {"unshard_async": "on", "forward_prefetch": "depth1", "backward_prefetch": "depth1"},
    "nosync_all": {"nosync_blocks": "all", "nosync_level_fsdp": "last", "keep_unsharded": False, "defer_concat": True},
    "raf_false": {"reshard_after_forward": "false"},
    "combined": {
        "unshard_async": "on",
        "forward_prefetch": "depth1",
        "backward_prefetch": "depth1",
        "nosync_blocks": "all",
        "nosync_level_fsdp": "last",
        "keep_unsharded": False,
        "defer_concat": True,
        "reshard_after_forward": "false",
    },
}
TODAY = {"kind": "kineto", "warmup": 1, "export": "gz"}
VARIANTS: dict[str, dict[str, Any]] = {  # no trace needed where the ops are today's: export None
    "plain": {"kind": "plain"},
    "today": TODAY,
    "shapes": {**TODAY, "profile_kwargs": {"record_shapes": True}, "export": None},
    "stack": {**TODAY, "profile_kwargs": {"with_stack": True}, "export": None},
    "itt": {"kind": "itt"},
    "no_warmup": {**TODAY, "warmup": 0, "export": None},
    "shapes_stack": {**TODAY, "profile_kwargs": {"record_shapes": True, "with_stack": True}, "export": None},
    "trace_only": {**TODAY, "experimental": {"trace_only": True}},
}
WHERE_FROM = ("plain", "today", "shapes", "stack", "itt")
"""Every config runs these: what each profiler setting adds (shapes, stacks, the callbacks alone)."""
ALLOCATORS: dict[str, tuple[str, dict[str, str]]] = {  # name -> (the probe's heap argument, the ranks' environment)
    "glibc": ("glibc", {}),  # glibc's defaults: dynamic mmap and trim thresholds
    "trial": ("trial", {}),  # what a trial does (autotune/trials/rank_memory.py tune_heap, prefault_heap)
    "notrim": (
        "glibc",
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=17179869184:glibc.malloc.mmap_threshold=33554432"},
    ),
    "thp": (
        "glibc",
        {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
    ),  # transparent huge pages for malloc'd memory (madvise)
}


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def get_config(model: Any, name: str) -> dict[str, Any]:
    profile = resolve_profile(model)
    space = SearchSpace(
        block_names=tuple(profile.block_names), world_size=WORLD, num_microbatches=MICROBATCHES, device_type="cpu"
    )
    return config_to_dict(space.build_config({**space.get_default_params(), **CONFIG_CHANGES[name]}))


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


# -- 2. runs ---------------------------------------------------------------------------


def run_launch(
    workload: str,
    config: str,
    variants: dict[str, dict[str, Any]],
    rounds: int,
    block: int,
    trace_dir: Path,
    allocator: str,
) -> dict[str, Any]:
    model = WORKLOADS[workload]
    load_before = load()
    start = time.monotonic()
    run = run_ranks(
        "_profiler_probe:alternate",
        world_size=WORLD,
        timeout_s=1500,
        env=ALLOCATORS[allocator][1],
        kwargs={
            "model": model,
            "config": get_config(model, config),
            "variants": variants,
            "rounds": rounds,
            "block": block,
            "warmup_steps": 2,
            "trace_dir": str(trace_dir),
            "tag": f"{workload}_{config}_{allocator}",
            "heap": ALLOCATORS[allocator][0],
        },
    )
    if not run.ok:
        raise SystemExit(
            f"{workload}/{config}/{allocator}: ranks failed: {run.status}: {run.reason}\n" + "\n".join(run.stderr_tails)
        )
    return {
        "workload": workload,
        "config": config,
        "allocator": allocator,
        "results": run.results,
        "load": load_before,
        "load_after": load(),
        "wall_s": time.monotonic() - start,
    }


def _blocks(launch: dict[str, Any]) -> dict[tuple[int, str], list[dict[str, Any]]]:
    """(round, variant) -> per rank block."""
    out: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for rank_result in launch["results"]:
        for b in rank_result["blocks"]:
            out.setdefault((b["round"], b["variant"]), []).append(b)
    return out


def _active(block: dict[str, Any]) -> list[dict[str, float]]:
    return [s for s in block["steps"] if s["phase"] == "active"]


def _combined(rank_blocks: list[dict[str, Any]], key: str, combine: Any) -> float:
    """Median over the block's active steps of the ranks combined (max: wall; sum: CPU)."""
    per_step = zip(*(_active(b) for b in rank_blocks))
    return statistics.median(combine(s[key] for s in steps) for steps in per_step)


def _rank_median(block: dict[str, Any], key: str) -> float:
    return statistics.median(s[key] for s in _active(block))


# -- traces ----------------------------------------------------------------------------


def analyze_window(paths: list[str]) -> dict[int, dict[str, float]]:
    """Per rank: medians over the window's steps of the trace figures and the op count."""
    from autotune.analysis import FsdpTraceAnalysis

    analysis = FsdpTraceAnalysis(paths)
    metrics = analysis.get_step_metrics()
    out: dict[int, dict[str, float]] = {}
    for rank, trace in analysis.traces.items():
        events = trace.events
        is_step = events["name"].astype(str).str.match(r"^ProfilerStep#\d+$")
        pid, tid = events[is_step].groupby(["pid", "tid"]).size().idxmax()  # the training thread
        main = events[(events["pid"] == pid) & (events["tid"] == tid)]
        steps = main[is_step[main.index]]
        ops = [
            int(((main["ts"] >= s.ts) & (main["ts"] < s.end) & main["cat"].isin(["cpu_op", "user_annotation"])).sum())
            - 1
            for s in steps.itertuples()
        ]  # not the step's own span
        others = [
            int(
                (
                    (events["ts"] >= s.ts) & (events["ts"] < s.end) & ~((events["pid"] == pid) & (events["tid"] == tid))
                ).sum()
            )
            for s in steps.itertuples()
        ]
        rows = metrics[metrics["rank"] == rank]
        out[rank] = {
            "ops": statistics.median(ops),
            "other_thread_events": statistics.median(others),
            "trace_step_ms": float((rows["step_ms"] - rows["barrier_ms"]).median()),
            "compute_ms": float(rows["compute_ms"].median()),
            "comm_ms": float(rows["comm_ms"].median()),
            "exposed_comm_ms": float(rows["exposed_comm_ms"].median()),
            "bytes": os.path.getsize(next(p for p in paths if p.endswith(f"rank{rank}.json.gz"))),
        }
    return out


# -- 3. analysis -----------------------------------------------------------------------


def summarize_launch(launch: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """(table rows per variant, per-round records of the today windows, the launch's allocator figures)."""
    blocks = _blocks(launch)
    rounds = sorted({r for r, _ in blocks})
    variants = [v for v in dict.fromkeys(v for _, v in blocks) if v != "plain"]
    key = {
        "workload": launch["workload"],
        "config": launch["config"],
        "allocator": launch["allocator"],
        "load": launch["load"],
    }
    ops_today: dict[int, float] = {}
    rows, windows = [], []
    for variant in ["today", *(v for v in variants if v != "today")] if "today" in variants else variants:
        wall, cpu, first_wall, first_cpu, ops, faults_p, faults_q, per_op_cpu, stop, export, size = (
            [] for _ in range(11)
        )
        for r in rounds:
            plain, prof = blocks[(r, "plain")], blocks[(r, variant)]
            wp, wq = _combined(plain, "wall", max), _combined(prof, "wall", max)
            cp, cq = _combined(plain, "thread_cpu", sum), _combined(prof, "thread_cpu", sum)
            wall.append(wq / wp)
            cpu.append(cq / cp)
            if r == rounds[0]:
                first_wall.append(wq / wp)
                first_cpu.append(cq / cp)
            faults_p.append(statistics.median(_rank_median(b, "minflt") for b in plain))
            faults_q.append(statistics.median(_rank_median(b, "minflt") for b in prof))
            stop += [b["stop_ms"] for b in prof if "stop_ms" in b]
            export += [b["export_ms"] for b in prof if "export_ms" in b]
            paths = [b["trace"] for b in prof if b.get("trace")]
            per_rank = analyze_window(sorted(paths)) if len(paths) == WORLD else {}
            if per_rank:
                ops.append(statistics.median(v["ops"] for v in per_rank.values()))
                size += [v["bytes"] for v in per_rank.values()]
                if variant == "today":
                    ops_today[r] = ops[-1]
            n = ops[-1] if per_rank else ops_today.get(r)  # shapes/stack record today's ops, traced or not
            if n:
                per_op_cpu.append((cq - cp) / WORLD / n * 1e3)
            if variant == "today" and per_rank:
                for rank, (pb, qb) in enumerate(zip(plain, prof)):  # results are in rank order
                    windows.append(
                        {
                            "round": r,
                            "rank": rank,
                            "wall_p": _rank_median(pb, "wall"),
                            "wall_q": _rank_median(qb, "wall"),
                            "cpu_p": _rank_median(pb, "thread_cpu"),
                            "cpu_q": _rank_median(qb, "thread_cpu"),
                            "faults_p": _rank_median(pb, "minflt"),
                            "faults_q": _rank_median(qb, "minflt"),
                            **per_rank[rank],
                        }
                    )
        rows.append(
            {
                **key,
                "variant": variant,
                "wall": wall,
                "cpu": cpu,
                "first_wall": first_wall,
                "first_cpu": first_cpu,
                "ops": ops,
                "faults_p": faults_p,
                "faults_q": faults_q,
                "per_op_cpu_us": per_op_cpu,
                "stop_ms": stop,
                "export_ms": export,
                "trace_mb": [s / 2**20 for s in size],
            }
        )
    plain = [blocks[(r, "plain")] for r in rounds]
    allocator = {
        **key,
        "wall_ms": statistics.median(_combined(b, "wall", max) for b in plain),
        "cpu_ms": statistics.median(_combined(b, "thread_cpu", sum) for b in plain),
        "peak_rss": max(r["peak_rss"] for r in launch["results"]),
        "end_rss": max(r["blocks"][-1]["after_block"]["rss"] for r in launch["results"]),
        "today": next((row for row in rows if row["variant"] == "today"), None),
    }
    return rows, windows, allocator


def _median_of(row: dict[str, Any], key: str, fmt: str = "{:.0f}") -> str:
    return fmt.format(statistics.median(row[key])) if row[key] else "-"


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "\n== 2. profiled / unprofiled step, per workload x config x allocator x variant (median over rounds (min-max))"
    )
    print(
        "   CPU: training threads' CPU time, summed over ranks (what the profiler adds; wall is also what other load adds)"
    )
    print(
        f"{'workload':8} {'config':15} {'alloc':7} {'variant':12} {'wall ratio':22} {'CPU ratio':22} {'1st wall':>8} {'1st CPU':>8} {'ops/step':>8} {'faults/step p->q':>17} {'us/op CPU':>10} {'stop ms':>8} {'export ms':>9} {'MiB':>5} load@start"
    )
    for row in rows:
        first_w = f"{row['first_wall'][0]:.3f}" if row["first_wall"] else "-"
        first_c = f"{row['first_cpu'][0]:.3f}" if row["first_cpu"] else "-"
        print(
            f"{row['workload']:8} {row['config']:15} {row['allocator']:7} {row['variant']:12} {spread(row['wall']):22} {spread(row['cpu']):22} {first_w:>8} {first_c:>8} "
            f"{_median_of(row, 'ops'):>8} {_median_of(row, 'faults_p') + '->' + _median_of(row, 'faults_q'):>17} "
            f"{_median_of(row, 'per_op_cpu_us', '{:.2f}'):>10} {_median_of(row, 'stop_ms'):>8} {_median_of(row, 'export_ms'):>9} {_median_of(row, 'trace_mb', '{:.1f}'):>5} {row['load']}"
        )


def print_attribution(
    windows_by_launch: dict[tuple[str, str, str], list[dict[str, Any]]], costs: dict[str, float]
) -> None:
    print("\n== 3. where the overhead goes (today's settings; per rank and round, medians (min-max); ms per step)")
    print(
        f"c_op = {costs['c_op_today']:.2f} us per recorded op, c_fault = {costs['c_fault']:.2f} us per fresh page (section 1)"
    )
    print(
        f"{'workload':8} {'config':15} {'alloc':7} {'unprof ms':>9} {'extra wall':20} {'extra CPU':20} {'ops x c_op':>10} {'extra faults':>12} {'faults x c_fault':>16} {'model/CPU':>10}"
    )
    for (workload, config, allocator), ws in windows_by_launch.items():
        extra_cpu = [w["cpu_q"] - w["cpu_p"] for w in ws]
        op_cost = statistics.median(w["ops"] * costs["c_op_today"] / 1e3 for w in ws)
        extra_faults = statistics.median(w["faults_q"] - w["faults_p"] for w in ws)
        fault_cost = extra_faults * costs["c_fault"] / 1e3
        ratio = (
            (op_cost + fault_cost) / statistics.median(extra_cpu) if statistics.median(extra_cpu) > 0 else float("nan")
        )
        print(
            f"{workload:8} {config:15} {allocator:7} {statistics.median(w['wall_p'] for w in ws):9.0f} {spread([w['wall_q'] - w['wall_p'] for w in ws], '{:.0f}'):20} "
            f"{spread(extra_cpu, '{:.0f}'):20} {op_cost:10.0f} {extra_faults:12.0f} {fault_cost:16.0f} {ratio:10.2f}"
        )


def print_correction(windows_by_launch: dict[tuple[str, str, str], list[dict[str, Any]]]) -> None:
    print("\n== 4. trace figures vs the unprofiled step (today's settings; per rank and round, medians; ms)")
    print(
        "   uniform: x * unprofiled/profiled step (same rank, same trial: what the report shows); subtract: compute - (profiled - unprofiled step);"
    )
    print(
        "   reference: compute - (profiled - unprofiled training-thread CPU), the CPU-time estimate of the unprofiled compute."
    )
    print(
        "   error = corrected - reference, in % of the unprofiled step; 'compute>step' counts raw compute above the unprofiled step."
    )
    print(
        f"{'workload':8} {'config':15} {'alloc':7} {'unprof step':>11} {'prof step':>9} {'compute':>8} {'exposed':>8} {'compute>step':>12} {'uniform err %':18} {'subtract err %':18}"
    )
    for (workload, config, allocator), ws in windows_by_launch.items():
        uniform_err, subtract_err = [], []
        for w in ws:
            reference = w["compute_ms"] - (w["cpu_q"] - w["cpu_p"])
            uniform_err.append((w["compute_ms"] * w["wall_p"] / w["wall_q"] - reference) / w["wall_p"] * 100)
            subtract_err.append((w["compute_ms"] - (w["wall_q"] - w["wall_p"]) - reference) / w["wall_p"] * 100)
        above = sum(w["compute_ms"] > w["wall_p"] for w in ws)
        med = {
            key: statistics.median(w[key] for w in ws) for key in ("wall_p", "wall_q", "compute_ms", "exposed_comm_ms")
        }
        print(
            f"{workload:8} {config:15} {allocator:7} {med['wall_p']:11.0f} {med['wall_q']:9.0f} {med['compute_ms']:8.0f} {med['exposed_comm_ms']:8.0f} "
            f"{f'{above}/{len(ws)}':>12} {spread(uniform_err, '{:+.1f}'):18} {spread(subtract_err, '{:+.1f}'):18}"
        )


def print_allocators(records: list[dict[str, Any]]) -> None:
    print("\n== 5. allocator settings of the ranks (unprofiled steps, and today's window against them)")
    print(
        "   unprof wall / CPU: median unprofiled step (slowest rank / CPU summed over ranks); vs first: the same over the first allocator's launch;"
    )
    print(
        "   peak RSS: sampled over build + warm-up as a trial does (largest rank); end RSS: after the last block (largest rank)"
    )
    print(
        f"{'workload':8} {'config':15} {'alloc':7} {'unprof wall':>11} {'vs first':>8} {'unprof CPU':>10} {'vs first':>8} {'faults p->q':>13} {'wall ratio':22} {'CPU ratio':22} {'peak RSS MiB':>12} {'end RSS MiB':>11} load@start"
    )
    first: dict[tuple[str, str], dict[str, Any]] = {}
    for rec in records:
        base = first.setdefault((rec["workload"], rec["config"]), rec)
        today = rec["today"] or {"wall": [], "cpu": [], "faults_p": [], "faults_q": []}
        print(
            f"{rec['workload']:8} {rec['config']:15} {rec['allocator']:7} {rec['wall_ms']:11.0f} {rec['wall_ms'] / base['wall_ms']:8.3f} {rec['cpu_ms']:10.0f} {rec['cpu_ms'] / base['cpu_ms']:8.3f} "
            f"{_median_of(today, 'faults_p') + '->' + _median_of(today, 'faults_q'):>13} {spread(today['wall']):22} {spread(today['cpu']):22} "
            f"{rec['peak_rss'] / 2**20:12.0f} {rec['end_rss'] / 2**20:11.0f} {rec['load']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="small,wide")
    parser.add_argument("--configs", default="defaults,async_prefetch,nosync_all,raf_false")
    parser.add_argument("--variants", default=",".join(WHERE_FROM), help="variants every config runs")
    parser.add_argument(
        "--extended", default="defaults", help="configs that also run no_warmup, shapes_stack and trace_only"
    )
    parser.add_argument(
        "--allocators",
        default="glibc,trial",
        help=f"rank allocator settings, one launch each per config: {', '.join(ALLOCATORS)}",
    )
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each probe launch (0: no probe launches)")
    parser.add_argument(
        "--trial-rounds",
        type=int,
        default=2,
        help="rounds of real trials per config and allocator (section 6; small only)",
    )
    parser.add_argument("--wide-rounds", type=int, default=2)
    parser.add_argument(
        "--block", type=int, default=2, help="profiled (active) steps per window, as a trial's num_profiled"
    )
    parser.add_argument(
        "--wide-variants", default="plain,today,itt", help="variants of the wide launches (steps are ~3 s there)"
    )
    parser.add_argument("--keep-traces", default=None)
    args = parser.parse_args()
    t0 = time.monotonic()
    print(
        f"load average at start {load()} on {os.cpu_count()} cores; world {WORLD}, {MICROBATCHES} microbatches, block {args.block}"
    )
    costs = measure_unit_costs()
    print(f"\n== 1. unit costs (one process, 1 thread; load {load()})")
    print(
        f"unprofiled torch.add {costs['plain_us_per_op']:.2f} us; extra per recorded op: today's settings {costs['c_op_today']:.2f} us, record_shapes {costs['c_op_shapes']:.2f} us, "
        f"with_stack {costs['c_op_stack']:.2f} us, both {costs['c_op_shapes_stack']:.2f} us, itt (callbacks only) {costs['c_op_itt']:.2f} us; first touch of a fresh page {costs['c_fault']:.2f} us"
    )
    trace_dir = Path(args.keep_traces or tempfile.mkdtemp(prefix="profiler-overhead-"))
    trace_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    windows: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    allocators: list[dict[str, Any]] = []
    launch_index = 0
    try:
        for workload in args.workloads.split(","):
            for config in args.configs.split(","):
                names = args.wide_variants.split(",") if workload == "wide" else args.variants.split(",")
                if config in args.extended.split(",") and workload != "wide":
                    names += ["no_warmup", "shapes_stack", "trace_only"]
                variants = {k: VARIANTS[k] for k in dict.fromkeys(["plain", *names])}
                rounds = args.wide_rounds if workload == "wide" else args.rounds
                if rounds == 0:
                    continue
                order = args.allocators.split(",")
                for allocator in order if launch_index % 2 == 0 else order[::-1]:  # ABBA over configs
                    launch = run_launch(workload, config, variants, rounds, args.block, trace_dir, allocator)
                    print(
                        f"  ran {workload}/{config}/{allocator}: {len(variants)} variants x {rounds} rounds in {launch['wall_s']:.0f}s, load {launch['load']} -> {launch['load_after']}",
                        flush=True,
                    )
                    launch_rows, launch_windows, allocator_record = summarize_launch(launch)
                    rows += launch_rows
                    windows[(workload, config, allocator)] = launch_windows
                    allocators.append(allocator_record)
                launch_index += 1
    finally:
        if args.keep_traces is None:
            shutil.rmtree(trace_dir, ignore_errors=True)
    key = {name: i for i, name in enumerate(args.allocators.split(","))}
    rows.sort(key=lambda r: (r["workload"], args.configs.split(",").index(r["config"]), key[r["allocator"]]))
    allocators.sort(key=lambda r: (r["workload"], args.configs.split(",").index(r["config"]), key[r["allocator"]]))
    print_table(rows)
    print_attribution(windows, costs)
    print_correction(windows)
    print_allocators(allocators)
    if args.trial_rounds:
        allocator_settings = {name: ALLOCATORS[name] for name in args.allocators.split(",")}
        print_real_trials(
            run_real_trials(args.configs.split(","), allocator_settings, args.trial_rounds, get_config, load)
        )
    print(f"\ntotal {time.monotonic() - t0:.0f}s, load average at end {load()}")


if __name__ == "__main__":
    main()
