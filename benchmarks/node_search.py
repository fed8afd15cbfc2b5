"""Prints which mesh a search emits across two nodes and on one host, and the speedup each claims.

    .venv/bin/python benchmarks/node_search.py                  # small, 6 trials, 2 rounds
    .venv/bin/python benchmarks/node_search.py --quick          # tiny, 3 trials, 1 round: the path, not the numbers

Each round runs the same search twice, in alternating order:

- ``two-node``: ``autotune search --workers`` with its 2 ranks started by two torchrun agents on
  loopback, one rank each (the search across nodes: ``autotune/trials/nodes.py``), collectives
  held to ``cpu-emulated-2node`` (0.25 GB/s between the "nodes", 1 GB/s inside one);
- ``one-host``: the same search on this host's own 2 ranks under ``cpu-emulated-ib`` (both ranks on
  one node: 1 GB/s).

Per search it prints the emitted config's mesh (in words of nodes), its speedup over FSDP2's
defaults with the 90% interval of its verdict window, and the wall time; per setting the
speedups' median and spread over rounds. Load (``os.getloadavg``) before and after each search.
Every process has a hard limit and is killed with its tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.search.nodes import describe_mesh_nodes  # noqa: E402
from autotune.trials.loopback import get_agent_command, get_free_port, kill_tree  # noqa: E402
from autotune.trials.wire import SECRET_ENV, new_secret  # noqa: E402
from fsdp_runtime import load_config  # noqa: E402

SETTINGS = {"two-node": ("cpu-emulated-2node", 1), "one-host": ("cpu-emulated-ib", 2)}
"""Each search's cluster profile and ranks per node."""


def run_search(name: str, args: argparse.Namespace, out: Path) -> dict:
    """One search (with its agents where ``two-node``); its emitted mesh, speedup and wall time."""
    cluster, per_node = SETTINGS[name]
    command = [sys.executable, "-c", "import cli; cli.main()", "search", "--model", args.model]
    command += ["--trials", str(args.trials), "--cluster", cluster, "--out", str(out), "--json"]
    extra: list[list[str]] = []
    if name == "two-node":
        address = f"127.0.0.1:{get_free_port()}"
        command += ["--workers", address]
        rdzv = f"127.0.0.1:{get_free_port()}"
        agent = get_agent_command(address, rdzv=rdzv, run_id="node-search", log_dir=out.parent / f"{out.name}-torchrun")
        extra = [agent, agent]  # two agents of one rank each: two "nodes"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env.setdefault(SECRET_ENV, new_secret().hex())  # the driver's and its workers' ([Note: signed messages])
    out.parent.mkdir(parents=True, exist_ok=True)
    start, load = time.monotonic(), os.getloadavg()[0]
    with open(out.parent / f"{out.name}.log", "w") as log:
        procs = [
            subprocess.Popen(c, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            for c in [command, *extra]
        ]
        try:
            procs[0].wait(timeout=args.limit_s)
        finally:
            for proc in procs:
                kill_tree(proc.pid)
                proc.wait()
    if procs[0].returncode != 0:
        sys.exit(f"{name}: the search failed (exit {procs[0].returncode}); see {out.parent / f'{out.name}.log'}")
    record = json.loads((out / "search.json").read_text())["confirmation"]
    mesh = load_config(out / "best.toml").mesh
    mesh_name = "fsdp" if mesh.kind == "fsdp" else f"hsdp:{mesh.replicate}x{mesh.shard or 2 // mesh.replicate}"
    return {
        "mesh": describe_mesh_nodes(mesh_name, 2, per_node),
        "speedup": record.get("speedup_median"),
        "low": record.get("speedup_low"),
        "high": record.get("speedup_high"),
        "wall_s": time.monotonic() - start,
        "load": f"{load:.1f} -> {os.getloadavg()[0]:.1f}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/node_search"))
    parser.add_argument("--limit-s", type=float, default=1800.0, help="one search's hard wall-clock limit")
    parser.add_argument("--quick", action="store_true", help="tiny, 3 trials, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.model, args.trials, args.rounds = "tiny", 3, 1
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        for name in list(SETTINGS) if r % 2 == 0 else list(SETTINGS)[::-1]:
            run = run_search(name, args, args.out / f"round{r + 1}-{name}")
            results[name].append(run)
            interval = f"(90% interval {run['low']:.3f}-{run['high']:.3f}x)" if run["low"] else ""
            print(
                f"round {r + 1} {name:<8} {run['mesh']}; {run['speedup'] or float('nan'):.3f}x the defaults {interval}; "
                f"{run['wall_s']:.0f} s (load {run['load']})",
                flush=True,
            )
    for name, runs in results.items():
        speedups = [r["speedup"] for r in runs if r["speedup"]]
        if speedups:
            print(
                f"{name:<8} speedup median {statistics.median(speedups):.3f} ({min(speedups):.3f}-{max(speedups):.3f}); meshes: {[r['mesh'] for r in runs]}"
            )
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
