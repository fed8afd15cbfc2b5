"""Profiler overhead per search config and profiler setting: profiled vs unprofiled steps, alternating.

    .venv/bin/python benchmarks/profiler_overhead.py [--workloads small,wide] [--configs defaults,async_prefetch,nosync_all,raf_false]
        [--rounds 4] [--wide-rounds 2] [--block 2] [--keep-traces DIR] [--with-mitigations] [--rank-env KEY=VALUE]

Runtime: ~7 minutes on a quiet 2-core box; 2-3x that at load 5 (a wide step is ~3 s
quiet, 11-14 s at load 5). ``--workloads small`` alone: ~3 minutes.

What it runs. Per workload (``small``: the small profile; ``wide``: small with dim 1024,
16/8 heads, ffn 2816, seq 64, batch 1, the wide shallow model of the issue) and per
config that a search trials (built with ``SearchSpace.build_config``, world 2, 4
microbatches, CPU), one launch of 2 ranks: after warm-up steps, every *round* runs one
block of each variant, in an order rotated by round (ABAB... with the position effect
spread over the variants). A profiled block is exactly a trial's window
(``autotune/trials/program.py::_profiled_window``): ``schedule(wait=0, warmup=W,
active=--block)``, then ``on_trace_ready`` export; an unprofiled block is ``--block``
steps. Steps are timed as in a trial (barrier, ``perf_counter``, slowest rank); each rank
also records its training thread's CPU time (``time.thread_time``: the profiler's work
on that thread, much less disturbed than wall time by other load on a shared box), its
minor page faults and glibc's heap state (``mallinfo2``).

Variants: ``today`` (a trial's settings: CPU activity, no shapes/stacks/memory, warm-up 1,
gzipped export; (b) "explicit with_stack/record_shapes/profile_memory=False" is the same
``ProfilerConfig``, those are the defaults), ``no_warmup`` (warm-up 0), ``shapes_stack``
(record_shapes + with_stack), ``trace_only`` (``_ExperimentalConfig(trace_only=True)``),
``itt`` (``emit_itt``: the RecordFunction callbacks on every op and label, nothing
recorded), and with ``--with-mitigations`` two glibc heap tricks (``notrim``,
``prefault``). The extended set runs on the defaults config of each workload; the
other configs run ``plain`` and ``today``.

What it prints.
1. Per-op and per-page-fault costs on this box (one process, no ranks).
2. Table: workload x config x variant -> wall ratio (median over rounds of
   median(profiled)/median(unprofiled), min-max), the same for training-thread CPU time
   (summed over ranks), the first round alone (a trial has one window, in a fresh heap),
   ops per step (events on the training thread per ``ProfilerStep``), page faults per
   step (unprofiled -> profiled), overhead per op, stop and export cost (outside the
   steps), and the load average at launch.
3. Where the overhead goes (per workload x config, from the ``today`` windows): measured
   extra wall and CPU per step, and what per-op recording (ops x c_op) and page faults
   (extra faults x c_fault) predict.
4. Trace figures vs the unprofiled step, raw and corrected: compute_ms from the trace
   (``autotune.analysis``), the unprofiled step, and two corrections (uniform scaling by
   the same trial's unprofiled/profiled step ratio; subtracting the step's extra time
   from compute), against a CPU-time estimate of the unprofiled compute.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from autotune.search import SearchSpace  # noqa: E402
from autotune.trials import resolve_profile, run_ranks  # noqa: E402
from fsdp_runtime import config_to_dict  # noqa: E402

WORLD = 2
MICROBATCHES = 4
WORKLOADS: dict[str, Any] = {
    "small": "small",
    "wide": {"name": "small", "dim": 1024, "num_heads": 16, "num_kv_heads": 8, "ffn_hidden_dim": 2816, "seq_len": 64, "batch_size": 1},
}
CONFIG_CHANGES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "async_prefetch": {"unshard_async": "on", "forward_prefetch": "depth1", "backward_prefetch": "depth1"},
    "nosync_all": {"nosync_blocks": "all", "nosync_level_fsdp": "last", "keep_unsharded": False, "defer_concat": True},
    "raf_false": {"reshard_after_forward": "false"},
    "combined": {
        "unshard_async": "on", "forward_prefetch": "depth1", "backward_prefetch": "depth1",
        "nosync_blocks": "all", "nosync_level_fsdp": "last", "keep_unsharded": False, "defer_concat": True, "reshard_after_forward": "false",
    },
}  # fmt: skip
TODAY = {"kind": "kineto", "warmup": 1, "export": "gz"}
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {"kind": "plain"},
    "today": TODAY,
    "no_warmup": {**TODAY, "warmup": 0, "export": None},  # no trace needed: same ops as today
    "shapes_stack": {**TODAY, "profile_kwargs": {"record_shapes": True, "with_stack": True}, "export": None},
    "trace_only": {**TODAY, "experimental": {"trace_only": True}},
    "itt": {"kind": "itt"},
}
MITIGATIONS: dict[str, dict[str, Any]] = {
    "notrim": {**TODAY, "prefault_mb": 0},
    "prefault": {**TODAY, "prefault_mb": 512},
}
BASIC = ("plain", "today")


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def get_config(model: Any, name: str) -> dict[str, Any]:
    profile = resolve_profile(model)
    space = SearchSpace(block_names=tuple(profile.block_names), world_size=WORLD, num_microbatches=MICROBATCHES, device_type="cpu")
    return config_to_dict(space.build_config({**space.get_default_params(), **CONFIG_CHANGES[name]}))


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


# -- 1. costs per op and per page fault, one process ----------------------------------


def measure_unit_costs(rounds: int = 15, num_ops: int = 4000) -> dict[str, float]:
    """c_op: extra training-thread CPU per recorded op (today's settings, shapes+stack, itt);
    c_fault: CPU per first touch of a fresh 4 KiB page (fresh vs reused tensor memory)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    x = torch.ones(8)

    def ops_us() -> float:
        start = time.thread_time()
        for _ in range(num_ops):
            torch.add(x, x)
        return (time.thread_time() - start) / num_ops * 1e6

    makers = {
        "plain": nullcontext,
        "today": lambda: profile(activities=[ProfilerActivity.CPU]),
        "shapes_stack": lambda: profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True),
        "itt": lambda: torch.autograd.profiler.emit_itt(),
    }
    per_op: dict[str, list[float]] = {k: [] for k in makers}
    for _ in range(rounds):
        for name, make in makers.items():
            with make():
                per_op[name].append(ops_us())
    nbytes = 64 * 2**20
    fresh, reused = [], []
    for _ in range(rounds):
        t = torch.empty(nbytes, dtype=torch.uint8)  # >= glibc's mmap threshold: fresh pages
        start = time.thread_time()
        t.fill_(1)
        fresh.append(time.thread_time() - start)
        start = time.thread_time()
        t.fill_(2)
        reused.append(time.thread_time() - start)
        del t
    pages = nbytes // 4096
    base = statistics.median(per_op["plain"])
    return {
        "plain_us_per_op": base,
        **{f"c_op_{k}": statistics.median(v) - base for k, v in per_op.items() if k != "plain"},
        "c_fault": (statistics.median(fresh) - statistics.median(reused)) / pages * 1e6,
    }


# -- 2. runs ---------------------------------------------------------------------------


def run_launch(workload: str, config: str, variants: dict[str, dict[str, Any]], rounds: int, block: int, trace_dir: Path, env: dict[str, str]) -> dict[str, Any]:
    model = WORKLOADS[workload]
    load_before = load()
    start = time.monotonic()
    run = run_ranks(
        "_profiler_probe:alternate",
        world_size=WORLD,
        timeout_s=1500,
        env=env,
        kwargs={
            "model": model, "config": get_config(model, config), "variants": variants, "rounds": rounds, "block": block,
            "warmup_steps": 2, "trace_dir": str(trace_dir), "tag": f"{workload}_{config}",
        },
    )  # fmt: skip
    if not run.ok:
        raise SystemExit(f"{workload}/{config}: ranks failed: {run.status}: {run.reason}\n" + "\n".join(run.stderr_tails))
    return {"workload": workload, "config": config, "results": run.results, "load": load_before, "load_after": load(), "wall_s": time.monotonic() - start}


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
        ops = [int(((main["ts"] >= s.ts) & (main["ts"] < s.end) & main["cat"].isin(["cpu_op", "user_annotation"])).sum()) - 1 for s in steps.itertuples()]  # not the step's own span
        others = [int(((events["ts"] >= s.ts) & (events["ts"] < s.end) & ~((events["pid"] == pid) & (events["tid"] == tid))).sum()) for s in steps.itertuples()]
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


def summarize_launch(launch: dict[str, Any], costs: dict[str, float]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(table rows per variant, per-round records of the today windows for the correction study)."""
    blocks = _blocks(launch)
    rounds = sorted({r for r, _ in blocks})
    variants = [v for v in dict.fromkeys(v for _, v in blocks) if v != "plain"]
    rows, windows = [], []
    for variant in variants:
        wall, cpu, first_wall, first_cpu, warm_wall, ops, faults_p, faults_q, per_op_wall, per_op_cpu, stop, export, size = ([] for _ in range(13))
        for r in rounds:
            plain, prof = blocks[(r, "plain")], blocks[(r, variant)]
            wp, wq = _combined(plain, "wall", max), _combined(prof, "wall", max)
            cp, cq = _combined(plain, "thread_cpu", sum), _combined(prof, "thread_cpu", sum)
            wall.append(wq / wp)
            cpu.append(cq / cp)
            if r == rounds[0]:
                first_wall.append(wq / wp)
                first_cpu.append(cq / cp)
            warm = [s for b in prof for s in b["steps"] if s["phase"] == "warmup"]
            if warm:
                warm_wall.append(statistics.median(s["wall"] for s in warm) / wp)
            faults_p.append(statistics.median(_rank_median(b, "minflt") for b in plain))
            faults_q.append(statistics.median(_rank_median(b, "minflt") for b in prof))
            stop += [b["stop_ms"] for b in prof if "stop_ms" in b]
            export += [b["export_ms"] for b in prof if "export_ms" in b]
            paths = [b["trace"] for b in prof if b.get("trace")]
            if len(paths) == WORLD:
                per_rank = analyze_window(sorted(paths))
                ops.append(statistics.median(v["ops"] for v in per_rank.values()))
                size += [v["bytes"] for v in per_rank.values()]
                n = ops[-1]
                per_op_wall.append((wq - wp) / n * 1e3)
                per_op_cpu.append((cq - cp) / WORLD / n * 1e3)
                if variant == "today":
                    for rank, (pb, qb) in enumerate(zip(plain, prof)):  # results are in rank order
                        windows.append({
                            "round": r, "rank": rank,
                            "wall_p": _rank_median(pb, "wall"), "wall_q": _rank_median(qb, "wall"),
                            "cpu_p": _rank_median(pb, "thread_cpu"), "cpu_q": _rank_median(qb, "thread_cpu"),
                            "faults_p": _rank_median(pb, "minflt"), "faults_q": _rank_median(qb, "minflt"),
                            **per_rank[rank],
                        })  # fmt: skip
        rows.append({
            "workload": launch["workload"], "config": launch["config"], "variant": variant, "load": launch["load"],
            "wall": wall, "cpu": cpu, "first_wall": first_wall, "first_cpu": first_cpu, "warm_wall": warm_wall,
            "ops": ops, "faults_p": faults_p, "faults_q": faults_q, "per_op_wall_us": per_op_wall, "per_op_cpu_us": per_op_cpu,
            "stop_ms": stop, "export_ms": export, "trace_mb": [s / 2**20 for s in size],
        })  # fmt: skip
    return rows, windows


def _median_of(row: dict[str, Any], key: str, fmt: str = "{:.0f}") -> str:
    return fmt.format(statistics.median(row[key])) if row[key] else "-"


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\n== 2. profiled / unprofiled step, per workload x config x variant (median over rounds (min-max))")
    header = f"{'workload':8} {'config':15} {'variant':12} {'wall ratio':22} {'CPU ratio':22} {'1st wall':>8} {'1st CPU':>8} {'warm-up':>8} {'ops/step':>8} {'faults/step p->q':>17} {'us/op wall':>11} {'us/op CPU':>10} {'stop ms':>8} {'export ms':>9} {'MiB':>5} load@start"
    print(header)
    for row in rows:
        first_w = f"{row['first_wall'][0]:.3f}" if row["first_wall"] else "-"
        first_c = f"{row['first_cpu'][0]:.3f}" if row["first_cpu"] else "-"
        warm = f"{statistics.median(row['warm_wall']):.3f}" if row["warm_wall"] else "-"
        print(
            f"{row['workload']:8} {row['config']:15} {row['variant']:12} {spread(row['wall']):22} {spread(row['cpu']):22} {first_w:>8} {first_c:>8} {warm:>8} "
            f"{_median_of(row, 'ops'):>8} {_median_of(row, 'faults_p') + '->' + _median_of(row, 'faults_q'):>17} "
            f"{_median_of(row, 'per_op_wall_us', '{:.1f}'):>11} {_median_of(row, 'per_op_cpu_us', '{:.1f}'):>10} "
            f"{_median_of(row, 'stop_ms'):>8} {_median_of(row, 'export_ms'):>9} {_median_of(row, 'trace_mb', '{:.1f}'):>5} {row['load']}"
        )


def print_attribution(windows_by_launch: dict[tuple[str, str], list[dict[str, Any]]], costs: dict[str, float]) -> None:
    print("\n== 3. where the overhead goes (today's settings; per rank and round, medians (min-max); ms per step)")
    print(f"c_op = {costs['c_op_today']:.2f} us per recorded op, c_fault = {costs['c_fault']:.2f} us per fresh page (section 1)")
    print(f"{'workload':8} {'config':15} {'extra wall':20} {'extra CPU':20} {'ops x c_op':>10} {'extra faults':>12} {'faults x c_fault':>16} {'model/CPU':>10}")
    for (workload, config), ws in windows_by_launch.items():
        extra_wall = [w["wall_q"] - w["wall_p"] for w in ws]
        extra_cpu = [w["cpu_q"] - w["cpu_p"] for w in ws]
        op_cost = statistics.median(w["ops"] * costs["c_op_today"] / 1e3 for w in ws)
        extra_faults = statistics.median(w["faults_q"] - w["faults_p"] for w in ws)
        fault_cost = extra_faults * costs["c_fault"] / 1e3
        model = op_cost + fault_cost
        ratio = model / statistics.median(extra_cpu) if statistics.median(extra_cpu) > 0 else float("nan")
        print(f"{workload:8} {config:15} {spread(extra_wall, '{:.0f}'):20} {spread(extra_cpu, '{:.0f}'):20} {op_cost:10.0f} {extra_faults:12.0f} {fault_cost:16.0f} {ratio:10.2f}")


def print_correction(windows_by_launch: dict[tuple[str, str], list[dict[str, Any]]]) -> None:
    print("\n== 4. trace figures vs the unprofiled step (today's settings; per rank and round, medians; ms)")
    print("   uniform: x * unprofiled/profiled step (same rank, same trial); subtract: compute - (profiled - unprofiled step);")
    print("   reference: compute - (profiled - unprofiled training-thread CPU), the CPU-time estimate of the unprofiled compute.")
    print("   error = corrected - reference, in % of the unprofiled step; 'compute>step' counts raw compute above the unprofiled step.")
    print(f"{'workload':8} {'config':15} {'unprof step':>11} {'prof step':>9} {'compute':>8} {'exposed':>8} {'compute>step':>12} {'uniform err %':18} {'subtract err %':18} {'uniform exposed shift %':>23}")
    for (workload, config), ws in windows_by_launch.items():
        uniform_err, subtract_err, exposed_shift = [], [], []
        above = 0
        for w in ws:
            scale = w["wall_p"] / w["wall_q"]
            reference = w["compute_ms"] - (w["cpu_q"] - w["cpu_p"])
            uniform = w["compute_ms"] * scale
            subtract = w["compute_ms"] - (w["wall_q"] - w["wall_p"])
            uniform_err.append((uniform - reference) / w["wall_p"] * 100)
            subtract_err.append((subtract - reference) / w["wall_p"] * 100)
            exposed_shift.append((scale - 1) * w["exposed_comm_ms"] / w["wall_p"] * 100)
            above += w["compute_ms"] > w["wall_p"]
        med = {key: statistics.median(w[key] for w in ws) for key in ("wall_p", "wall_q", "compute_ms", "exposed_comm_ms")}
        print(
            f"{workload:8} {config:15} {med['wall_p']:11.0f} {med['wall_q']:9.0f} {med['compute_ms']:8.0f} {med['exposed_comm_ms']:8.0f} {f'{above}/{len(ws)}':>12} "
            f"{spread(uniform_err, '{:+.1f}'):18} {spread(subtract_err, '{:+.1f}'):18} {statistics.median(exposed_shift):+23.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="small,wide")
    parser.add_argument("--configs", default="defaults,async_prefetch,nosync_all,raf_false")
    parser.add_argument("--extended", default="defaults", help="configs that run every variant (the others: plain and today)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--wide-rounds", type=int, default=2)
    parser.add_argument("--block", type=int, default=2, help="profiled (active) steps per window, as a trial's num_profiled")
    parser.add_argument("--wide-variants", default="plain,today,itt", help="variants of the extended wide launch (steps are ~3 s there)")
    parser.add_argument("--with-mitigations", action="store_true")
    parser.add_argument("--keep-traces", default=None)
    parser.add_argument("--rank-env", action="append", default=[], metavar="KEY=VALUE", help="environment of the ranks, e.g. GLIBC_TUNABLES=glibc.malloc.hugetlb=1")
    args = parser.parse_args()
    t0 = time.monotonic()
    print(f"load average at start {load()} on {os.cpu_count()} cores; world {WORLD}, {MICROBATCHES} microbatches, block {args.block}")
    costs = measure_unit_costs()
    print(f"\n== 1. unit costs (one process, 1 thread; load {load()})")
    print(
        f"unprofiled torch.add {costs['plain_us_per_op']:.2f} us; extra per recorded op: today's settings {costs['c_op_today']:.2f} us, "
        f"shapes+stack {costs['c_op_shapes_stack']:.2f} us, itt (callbacks only) {costs['c_op_itt']:.2f} us; first touch of a fresh page {costs['c_fault']:.2f} us"
    )
    trace_dir = Path(args.keep_traces or tempfile.mkdtemp(prefix="profiler-overhead-"))
    trace_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    windows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    try:
        for workload in args.workloads.split(","):
            for config in args.configs.split(","):
                if config in args.extended.split(","):
                    names = args.wide_variants.split(",") if workload == "wide" else list(VARIANTS)
                    variants = {k: VARIANTS[k] for k in names}
                    if args.with_mitigations:
                        variants.update(MITIGATIONS)
                else:
                    variants = {k: VARIANTS[k] for k in BASIC}
                rounds = args.wide_rounds if workload == "wide" else args.rounds
                launch = run_launch(workload, config, variants, rounds, args.block, trace_dir, dict(kv.split("=", 1) for kv in args.rank_env))
                print(f"  ran {workload}/{config}: {len(variants)} variants x {rounds} rounds in {launch['wall_s']:.0f}s, load {launch['load']} -> {launch['load_after']}", flush=True)
                launch_rows, launch_windows = summarize_launch(launch, costs)
                rows += launch_rows
                windows[(workload, config)] = launch_windows
    finally:
        if args.keep_traces is None:
            shutil.rmtree(trace_dir, ignore_errors=True)
    print_table(rows)
    print_attribution(windows, costs)
    print_correction(windows)
    print(f"\ntotal {time.monotonic() - t0:.0f}s, load average at end {load()}")


if __name__ == "__main__":
    main()
