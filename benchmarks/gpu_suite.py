"""Runs the GPU benchmarks in one time budget, each isolated and time-sliced; prints the environment and a summary.

    PYTHONPATH=. python benchmarks/gpu_suite.py --dry-run --out DIR           # anywhere, in under a minute
    PYTHONPATH=. python benchmarks/gpu_suite.py --wheels WHEELS --out DIR     # on a GPU box: --budget-s (540 s)

In one budget (``--budget-s``, default 540 s: a 15-minute GPU lease less the machine's start and
the copies back), from a source checkout with the machine's own torch:

1. *the environment*, first and at once (``OUT/environment.json``, and printed): the GPUs and
   their memory, the driver, CUDA, torch, NCCL, Python, and which of the packages the parts
   need import, with their versions; a probe of its own process, so that no CUDA context of the
   suite's holds GPU memory while the parts run.
2. *the parts*, in ``--parts`` order, which is their priority (default
   ``check,torchtitan,in_job,sim_accuracy``): ``gpu_check.py``, ``gpu_torchtitan.py``,
   ``gpu_in_job.py`` and ``gpu_sim_accuracy.py``, each with arguments that
   size it to a lease (:data:`PARTS`), each a subprocess in a process group of its own, writing
   into ``OUT/<part>/`` (its ``results.json`` as it writes it, its whole output in
   ``output.log``), unless the probe says it cannot run on this torch (below). Each gets a slice
   of what is left of the budget: its share by expected seconds against the parts still to run,
   but at least :data:`GRACE` times its expected seconds
   (when the budget is short, the later parts give way), the last part all that remains; a part
   that ends early leaves its remainder to those after it. When its slice ends, the part and
   every process under it are killed: its ranks start sessions of their own, out of its process
   group, so the suite kills the tree it finds under the part, not only the group. The suite
   writes ``OUT/<part>/part.json``: passed, failed (its exit code), timed out, crashed (a
   signal, or it would not start) or skipped (why), its seconds and slice, the command, the tail
   of its output.
   A part that fails, crashes or runs out of time takes nothing of the others.
3. *a summary*: one table (rich where it imports, plain text otherwise) and ``OUT/summary.json``.
   The exit code is 1 when any part did not pass (one skipped for a stated reason aside).

The default parts expect ~510 s on one H100/H200 (:data:`PARTS`, each figure's source beside it),
with the probe (:data:`PROBE_S`) and the reserve ~535 s: within the default budget, which
``tests/test_gpu_suite.py`` checks. ``check`` writes its numerics before its search and
``sim_accuracy`` each case as it is measured, so a part cut short keeps what it reached.
``--parts`` runs fewer, ``--part-args NAME=ARGS`` passes a part more arguments, after its own
(``sim_accuracy="--cases all"``: all ten cases, ~270 s, a lease of its own).

*torchtitan 0.3.0 and this torch*: 0.3.0 needs torch 2.12 or newer. Where the probe finds a torch
that cannot import it (the GPU machines' 2.11), the ``torchtitan`` part is not run: it is recorded
as ``skipped`` with that reason (its ``part.json``, the table, ``summary.json``'s ``skipped``, a
line after the table) and takes no share of the budget; a skipped part does not make the suite
fail. The ``in_job`` part then runs the in-job tuner in the project's own llama1b instead of a
torchtitan job, and says which it ran (its ``results.json``: ``job``, ``job_reason``).

What a GPU box without network access must be given (:data:`WHEELS`): beside torch (a CUDA build,
with triton) and the packages :data:`ON_THE_BOX` names, which a box with torch has, every part
runs a search or a trial, which import optuna (with SQLAlchemy, alembic and its Mako, colorlog),
``autotune.analysis`` (orjson; traceinsight, imported as ``hta``, with plotly, its narwhals, and
pydot), and the torchtitan part (and in_job's torchtitan job, where torch imports it) torchtitan
0.3.0 (spmd_types, tyro and its docstring_parser).
typer and rich are not needed (the scripts call the API, not the CLI). Found by following the
imports of the four scripts through ``autotune``, ``fsdp_runtime`` and ``profiles``, and checked
by importing what a search and torchtitan 0.3.0's registry load and listing the distributions
they loaded. ``--download-wheels DIR`` fetches them, pinned, as cp312 manylinux wheels, where pip
reaches an index; ``--wheels DIR`` on the GPU box unpacks them into ``DIR/site`` (a wheel is a
zip archive: no pip needed) and puts that first on the parts' ``PYTHONPATH``; the torchtitan part
then takes torchtitan 0.3.0 from there.

``--dry-run`` runs the environment without a CUDA call and every part's ``--dry-run``: the
whole suite on a CPU box, in about half a minute when its cores are free. ``--fail-part NAME``
runs NAME as a part that raises at once (a test hook: the others must still run and be recorded).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import importlib.util
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


@dataclasses.dataclass(frozen=True)
class Part:
    script: tuple[str, ...]
    """What follows ``python``: the script and its own arguments; the suite adds ``--out`` and ``--dry-run``."""
    expected_s: float
    """Its run on one H100/H200 with these arguments: its share of the budget (how each figure was
    found: the comment above it in :data:`PARTS`)."""
    what: str
    needs_torchtitan_030: bool = False
    """Runs torchtitan 0.3.0 or nothing: skipped, with the reason, on a torch that cannot import 0.3.0."""


PARTS: dict[str, Part] = {
    # The numerics and a 2-trial search (the defaults and one candidate, then the final round) on a
    # model at 60% of a GPU. Measured with 3 trials (one H200, torch 2.11.0+cu130, 2026-11-27):
    # numerics ~60 s (fresh NCCL ranks, 48 steps), warm-up ~65 s, paired trials 33-49 s each and the
    # final round, ~270 s in all; one trial fewer (~41 s, the middle of 33-49 s): ~230 s.
    "check": Part(
        (str(BENCHMARKS / "gpu_check.py"), "--trials", "2"), 230, "numerics; a 2-trial search at 60% of a GPU"
    ),
    # torchtitan 0.3.0's llama3 1B, 2 trials, one pair a finalist in the final rounds. Not yet run on a
    # GPU (0.3.0 needs torch >= 2.12; on the GPU machines' 2.11 the suite skips it): an estimate scaled
    # from check's H200 search (a paired trial there: two builds and ~6 s of steps, 33-49 s, for 1.9B
    # parameters): for 1.24B a warm-up of ~45 s, 2 trials at ~30 s, the final rounds against the
    # defaults and against torchtitan's recipe ~35 s: ~140 s.
    "torchtitan": Part(
        (str(BENCHMARKS / "gpu_torchtitan.py"), "--flavor", "1B", "--trials", "2", "--confirm-pairs", "1"),
        140,
        "torchtitan 0.3.0 llama3 1B searched",
        needs_torchtitan_030=True,
    ),
    # Two runs of 60 steps (a 40-step window), in a torchtitan 0.3.0 llama3 1B job where this torch
    # imports 0.3.0, else (torch 2.11) in the project's llama1b at seq 8192, one microbatch. Not yet
    # run on a GPU: an estimate from that llama1b step, 231.2 ms (gpu_sim_accuracy.py's "1 microbatch"
    # case; one H200, torch 2.11.0+cu130, 2026-11-27, tests/data/gpu_traces/README.md): 2 x 60 steps
    # ~28 s, ~35 s with the tuner's slower candidates; the NCCL pool's start ~10 s and two builds of
    # 1.24B parameters at ~15 s (the H200 search's builds): ~80 s.
    "in_job": Part(
        (str(BENCHMARKS / "gpu_in_job.py"), "--steps", "60", "--max-steps", "40"),
        80,
        "the in-job tuner in a torchtitan 0.3.0 job, or in the project's llama1b where 0.3.0 cannot import",
    ),
    # The calibration and one held-out case (seq 4096, which judges host_path.LAUNCH_US), fresh ranks
    # each: 20-29 s a case with --steps 4 (10 cases; one H200, torch 2.11.0+cu130, 2026-11-27): ~60 s.
    # All ten (~270 s) take a lease of their own: --parts sim_accuracy --part-args sim_accuracy="--cases all".
    "sim_accuracy": Part(
        (str(BENCHMARKS / "gpu_sim_accuracy.py"), "--steps", "4", "--cases", "0,7"),
        60,
        "calibrated simulator vs measured: the calibration and one held-out case",
    ),
}
"""The parts, in their default (priority) order, each with the arguments that size it to a lease,
and its expected seconds on one H100/H200: with :data:`PROBE_S` and :data:`RESERVE_S` they fit
the default budget (``tests/test_gpu_suite.py`` checks it)."""

WHEELS: dict[str, tuple[str, str]] = {
    "optuna==5.0.0": ("optuna", "the search's study (autotune.search)"),
    "SQLAlchemy==2.1.9": ("sqlalchemy", "optuna's storage; autotune.search"),
    "alembic==1.20.1": ("alembic", "optuna's RDB storage"),
    "Mako==1.4.3": ("mako", "alembic"),
    "colorlog==6.12.0": ("colorlog", "optuna's logging"),
    "orjson==3.13.0": ("orjson", "the trace parser (autotune.analysis)"),
    "traceinsight==0.6.1": ("hta.trace_analysis", "the overlap analysis (autotune.analysis)"),
    "plotly==7.1.0": ("plotly", "traceinsight"),
    "narwhals==2.29.0": ("narwhals", "plotly"),
    "pydot==4.0.1": ("pydot", "traceinsight"),
    "torchtitan==0.3.0": ("torchtitan.models.llama3", "the torchtitan part (its registry)"),
    "spmd_types==0.2.3": ("spmd_types", "torchtitan 0.3.0's model modules"),
    "tyro==1.0.17": ("tyro", "torchtitan.config"),
    "docstring_parser==0.18.0": ("docstring_parser", "tyro"),
}
"""The wheels a GPU box may lack, pinned to the versions the tests run, by requirement: the module
the parts import and who needs it (the docstring says how the list was found)."""
ON_THE_BOX = ("numpy", "pandas", "networkx", "yaml", "tqdm", "packaging", "markupsafe", "triton", "rich")
"""Imported too but expected on a GPU box with torch (rich: only for the summary's table)."""
TORCHTITAN_DEV = ROOT / ".venv" / "torchtitan-0.3.0"
"""Where ``./dev`` installs torchtitan 0.3.0 beside the venv's 0.2.2."""
WHEEL_PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_28_x86_64")
RESERVE_S = 15.0
"""Kept from the last slice: the kill's grace, the summary and writing it."""
BUDGET_S = 540.0
"""The default ``--budget-s``: a 15-minute GPU lease less the machine's start and the copies back."""
PROBE_S = 10.0
"""The environment's probe, expected: 6 s on a 2-core CPU box in a dry run (it imports torch and
every package the parts need; the same on a GPU box, and one device query)."""
ENVIRONMENT_S = 120.0
GRACE_S = 5.0
"""Between SIGTERM and SIGKILL when a slice ends."""
TAIL_LINES = 40


# -- the environment ---------------------------------------------------------------------------


def probe_environment(out: Path, *, dry_run: bool, torchtitan: Path | None) -> dict[str, Any]:
    """What the parts will run on; written to ``out`` before anything else. No CUDA call in a dry run."""
    env: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(), "dry_run": dry_run}
    env["driver"] = read_driver_version()
    try:
        import torch

        env |= {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": get_nccl_version(torch)}
        env["gpus"] = [] if dry_run else get_gpus(torch)
    except Exception as e:  # the probe reports; it does not stop the suite
        env["torch"] = f"error: {type(e).__name__}: {e}"
    env["torchtitan_030_refused"] = get_030_refusal()
    if torchtitan is not None and (torchtitan / "torchtitan").is_dir():
        sys.path.insert(0, str(torchtitan))
    env["packages"] = {module: import_version(module) for module, _ in WHEELS.values()}
    env["on_the_box"] = {module: import_version(module) for module in ON_THE_BOX}
    env["missing"] = sorted(req for req, (module, _) in WHEELS.items() if env["packages"][module].startswith("error"))
    out.write_text(json.dumps(env, indent=2) + "\n", encoding="utf-8")
    return env


def get_030_refusal() -> str | None:
    """Why this torch cannot import torchtitan 0.3.0 (2.11 among them), in one line; None where it can."""
    sys.path.insert(0, str(ROOT))
    try:
        from profiles.torchtitan import check_torch_for_030

        check_torch_for_030()
    except Exception as e:
        return str(e)
    return None


def read_driver_version() -> str | None:
    """The NVIDIA driver's version from ``/proc`` (no CUDA call), or None where there is none."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    words = text.split()
    return next((w for w in words if w[:1].isdigit() and w.count(".") >= 1), text.strip()[:80])


def get_nccl_version(torch: Any) -> str | None:
    try:
        version = torch.cuda.nccl.version()  # compiled in: no device is touched
    except Exception:
        return None  # a CPU build has none
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def get_gpus(torch: Any) -> list[dict[str, Any]]:
    return [
        {"name": torch.cuda.get_device_name(i), "memory_gib": torch.cuda.get_device_properties(i).total_memory / 2**30}
        for i in range(torch.cuda.device_count())
    ]


def import_version(module: str) -> str:
    """``module``'s distribution version once it imports, or why it does not."""
    import importlib
    from importlib.metadata import PackageNotFoundError, version

    try:
        if module.startswith("torchtitan"):
            # 0.3.0's registry as the parts load it (without the trainer; profiles/torchtitan.py)
            sys.path.insert(0, str(ROOT))
            from profiles.torchtitan import load_model_registry

            load_model_registry(module.split(".")[-1])
        else:
            importlib.import_module(module)
    except Exception as e:
        return f"error: {type(e).__name__}: {str(e)[:200]}"
    top = {"hta": "traceinsight", "yaml": "PyYAML"}.get(module.split(".")[0], module.split(".")[0])
    try:
        return version(top)
    except PackageNotFoundError:
        return "imported (no version)"


def format_environment(env: dict[str, Any]) -> list[str]:
    gpus = ", ".join(f"{g['name']} {g['memory_gib']:.0f} GiB" for g in env.get("gpus") or []) or "none queried"
    lines = [
        f"GPUs: {gpus}; driver {env.get('driver')}",
        f"torch {env.get('torch')}, CUDA {env.get('cuda')}, NCCL {env.get('nccl')}, Python {env.get('python')}",
        "packages: " + ", ".join(f"{m} {v}" for m, v in env.get("packages", {}).items() if not v.startswith("error")),
    ]
    if env.get("torchtitan_030_refused"):
        lines.append(f"torchtitan 0.3.0 cannot run here: {env['torchtitan_030_refused']}")
    if env.get("missing"):
        lines.append(f"missing (carry their wheels: --wheels): {', '.join(env['missing'])}")
    absent = [m for m, v in env.get("on_the_box", {}).items() if v.startswith("error")]
    if absent:
        lines.append(f"absent, expected on the box: {', '.join(absent)}")
    return lines


# -- processes -------------------------------------------------------------------------------


def load_killing() -> Any:
    """``autotune/trials/killing.py`` (standard library only) loaded from its file: importing it as
    ``autotune.trials.killing`` runs ``autotune.trials``'s ``__init__``, which imports torch and
    packages a GPU box gets only from ``--wheels`` (its ``site`` is on the parts' path, not the suite's)."""
    name = "autotune_trials_killing"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "autotune" / "trials" / "killing.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


KILLING = load_killing()
is_alive = KILLING.is_running
"""Whether a process has not exited (a zombie has: it holds no memory, GPU memory included)."""


def kill_part(proc: subprocess.Popen) -> None:
    """The part, its process group and every process under it ([Note: killing a process tree] in
    ``autotune/trials/killing.py``): SIGTERM, then SIGKILL after :data:`GRACE_S`; returns once none
    is alive, or after twice that (so the next part finds the GPU's memory free)."""
    KILLING.kill_tree(proc, grace_s=GRACE_S, wait_s=2 * GRACE_S)


def become_subreaper() -> None:
    """Let orphans of the parts (whose parent died first) be reparented here, not to init, so
    that :func:`kill_part` still finds them under this process (Linux; a no-op elsewhere)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def stream(proc: subprocess.Popen, log: Path, prefix: str) -> threading.Thread:
    """Copy the part's output to ``log`` and to this console as it comes (a killed part's stays)."""

    def copy() -> None:
        with log.open("w", encoding="utf-8", errors="replace") as f:
            for line in proc.stdout:
                f.write(line)
                f.flush()
                print(f"[{prefix}] {line}", end="", flush=True)

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


def run_process(command: list[str], *, out_dir: Path, name: str, slice_s: float, env: dict[str, str]) -> dict:
    """Run ``command`` in a process group of its own for at most ``slice_s``; what happened."""
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    record: dict[str, Any] = {"part": name, "command": shlex.join(command), "slice_s": round(slice_s, 1)}
    try:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own group: one signal reaches the part and what stays in its group
        )
    except OSError as e:
        return record | {"status": "crashed", "returncode": None, "seconds": 0.0, "reason": f"did not start: {e}"}
    reader = stream(proc, out_dir / "output.log", name)
    try:
        proc.wait(timeout=max(slice_s, 0.1))
        timed_out = False
    except subprocess.TimeoutExpired:
        kill_part(proc)
        timed_out = True
    except BaseException:  # Ctrl-C, or the suite itself killed: take the part down with it
        kill_part(proc)
        raise
    reader.join(timeout=GRACE_S)  # a process that escaped may hold the pipe open: do not wait on it
    record["seconds"] = round(time.monotonic() - started, 1)
    record["returncode"] = proc.returncode
    tail = read_tail(out_dir / "output.log")
    record["status"], record["reason"] = describe_exit(proc.returncode, timed_out, slice_s, tail)
    record["tail"] = tail
    results = out_dir / "results.json"
    record["results"] = str(results) if results.exists() else None
    return record


def describe_exit(returncode: int, timed_out: bool, slice_s: float, tail: list[str]) -> tuple[str, str | None]:
    if timed_out:
        return "timed out", f"killed with its process tree after its slice of {slice_s:.0f} s"
    if returncode == 0:
        return "passed", None
    if returncode < 0:
        try:
            return "crashed", f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return "crashed", f"killed by signal {-returncode}"
    last = next((line for line in reversed(tail) if line.strip()), "no output")
    return "failed", f"exit code {returncode}: {last.strip()[:300]}"


def read_tail(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()[-TAIL_LINES:]
    except OSError:
        return []


# -- the suite -------------------------------------------------------------------------------


GRACE = 1.3
"""A part may run this much past its expected seconds before a later part's time is taken for it."""


def get_slice(remaining_s: float, names: list[str], index: int) -> float:
    """Part ``index``'s slice of ``remaining_s``: its share by expected seconds against the parts
    left, but at least ``GRACE`` times its expected seconds (parts run in priority order: when the
    budget is short, the later ones give way); the last part gets whatever remains."""
    remaining_s = max(remaining_s, 0.0)
    expected = [PARTS[n].expected_s for n in names[index:]]
    if len(expected) == 1:
        return remaining_s
    return min(remaining_s, max(remaining_s * expected[0] / sum(expected), GRACE * expected[0]))


def part_command(name: str, args: argparse.Namespace, out_dir: Path) -> list[str]:
    if name == args.fail_part:
        message = f"{name}: made to fail by --fail-part"
        return [sys.executable, "-c", f"raise RuntimeError({message!r})"]
    command = [sys.executable, *PARTS[name].script, "--out", str(out_dir)]
    if args.dry_run:
        command.append("--dry-run")
    if name in ("torchtitan", "in_job") and args.torchtitan is not None:
        command += ["--torchtitan", str(args.torchtitan)]
    return command + shlex.split(args.part_args.get(name, ""))


def part_env(site: Path | None) -> dict[str, str]:
    """This environment with the repository (and the unpacked wheels) first on ``PYTHONPATH``."""
    paths = [str(site) if site else "", str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1"}


def probe_command(args: argparse.Namespace) -> list[str]:
    """The environment's probe: this script in a process of its own (its CUDA context ends with it)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--probe-environment", "--out", str(args.out)]
    if args.dry_run:
        command.append("--dry-run")
    return command + (["--torchtitan", str(args.torchtitan)] if args.torchtitan is not None else [])


def run_environment(args: argparse.Namespace, env: dict[str, str], deadline: float) -> dict[str, Any]:
    """The probe, within a quarter of the budget at most; ``environment.json`` printed at once."""
    slice_s = min(ENVIRONMENT_S, max(deadline - time.monotonic(), 0.0) / 4)
    out_dir = args.out / "environment"
    record = run_process(probe_command(args), out_dir=out_dir, name="environment", slice_s=slice_s, env=env)
    path = args.out / "environment.json"
    if path.exists():
        print("\n".join(format_environment(json.loads(path.read_text()))), flush=True)
    else:
        print(f"environment: {record['status']}: {record['reason']}", flush=True)
    return record


def get_skip_reason(name: str, environment: dict[str, Any]) -> str | None:
    """Why part ``name`` cannot run on this box, from the probe's ``environment``; None where it can
    (or where the probe said nothing: the part then runs and says for itself)."""
    refused = environment.get("torchtitan_030_refused")
    if PARTS[name].needs_torchtitan_030 and refused:
        return f"skipped, not run: {refused}"
    return None


def run_suite(args: argparse.Namespace) -> list[dict[str, Any]]:
    started = time.monotonic()
    deadline = started + args.budget_s - RESERVE_S
    env = part_env(args.site)
    records = [run_environment(args, env, deadline)]
    path = args.out / "environment.json"
    environment = json.loads(path.read_text()) if path.exists() else {}
    skips = {name: get_skip_reason(name, environment) for name in args.parts if name != args.fail_part}
    runnable = [name for name in args.parts if not skips.get(name)]  # a skipped part takes no share
    for name in args.parts:
        out_dir = args.out / name
        skipped = skips.get(name)
        if skipped:
            out_dir.mkdir(parents=True, exist_ok=True)
            record = {"part": name, "command": None, "slice_s": 0.0, "seconds": 0.0, "returncode": None}
            record |= {"status": "skipped", "reason": skipped, "tail": [], "results": None}
            print(f"== {name}: {PARTS[name].what}; {skipped}", flush=True)
        else:
            slice_s = get_slice(deadline - time.monotonic(), runnable, runnable.index(name))
            print(f"== {name}: {PARTS[name].what}; slice {slice_s:.0f} s", flush=True)
            command = part_command(name, args, out_dir)
            record = run_process(command, out_dir=out_dir, name=name, slice_s=slice_s, env=env)
            print(
                f"== {name}: {record['status']} in {record['seconds']:.0f} s"
                + (f" ({record['reason']})" if record["reason"] else ""),
                flush=True,
            )
        (out_dir / "part.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        records.append(record)
    return records


def print_summary(records: list[dict[str, Any]]) -> None:
    header = ("part", "status", "seconds", "slice", "results.json", "reason")
    rows = [
        (
            r["part"],
            r["status"],
            f"{r['seconds']:.0f}",
            f"{r['slice_s']:.0f}",
            "yes" if r.get("results") else "-",
            r.get("reason") or "",
        )
        for r in records
    ]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
        for row in (header, *rows):
            print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())
        return
    table = Table(*header, title="GPU suite")
    for row in rows:
        table.add_row(*row)
    Console().print(table)


# -- wheels ----------------------------------------------------------------------------------


def download_wheels(dest: Path, python_version: str) -> int:
    """``pip download`` of :data:`WHEELS` for a Linux x86-64 CPython ``python_version`` (no dependencies: the list is whole)."""
    platforms = [arg for p in WHEEL_PLATFORMS for arg in ("--platform", p)]
    command = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--no-deps"]
    command += ["--python-version", python_version, *platforms, "-d", str(dest), *WHEELS]
    print(shlex.join(command), flush=True)
    return subprocess.call(command)


def unpack_wheels(wheels: Path) -> Path:
    """Every wheel in ``wheels`` unpacked into ``wheels/site`` (what ``pip install --no-deps --target``
    leaves for these pure and binary wheels; no pip or index needed); that directory."""
    site = wheels / "site"
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise SystemExit(f"--wheels {wheels}: no .whl files there (download them with --download-wheels)")
    for wheel in found:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
    print(f"wheels: {len(found)} unpacked into {site}", flush=True)
    return site


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="every part's --dry-run; the environment without CUDA")
    parser.add_argument("--out", type=Path, default=None, help="where everything is written (default: runs/gpu_suite)")
    parser.add_argument(
        "--budget-s", type=float, default=BUDGET_S, help=f"the whole suite's seconds (default {BUDGET_S:.0f})"
    )
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which parts, in order (default {','.join(PARTS)})")
    parser.add_argument(
        "--part-args", action="append", default=[], metavar="NAME=ARGS", help="more arguments for a part"
    )
    parser.add_argument(
        "--torchtitan",
        type=Path,
        default=None,
        help="a directory holding torchtitan 0.3.0 (default: --wheels', or ./dev's)",
    )
    parser.add_argument(
        "--wheels", type=Path, default=None, help="a directory of the wheels the box lacks: unpacked and used"
    )
    parser.add_argument(
        "--download-wheels", type=Path, default=None, metavar="DIR", help="fetch the wheels into DIR and exit"
    )
    parser.add_argument(
        "--wheels-python", default="3.12", help="--download-wheels: the GPU box's Python (default 3.12)"
    )
    parser.add_argument("--fail-part", default=None, metavar="NAME", help="test hook: NAME raises at once")
    parser.add_argument("--probe-environment", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in [*args.parts, *([args.fail_part] if args.fail_part else [])] if p not in PARTS]
    if unknown or not args.parts:
        parser.error(f"--parts: unknown {', '.join(unknown) or '(none given)'}; the parts are {', '.join(PARTS)}")
    args.part_args = dict(a.split("=", 1) for a in args.part_args if "=" in a)
    args.out = (args.out or ROOT / "runs" / "gpu_suite").resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.download_wheels is not None:
        return download_wheels(args.download_wheels, args.wheels_python)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.probe_environment:
        probe_environment(args.out / "environment.json", dry_run=args.dry_run, torchtitan=args.torchtitan)
        return 0
    args.site = unpack_wheels(args.wheels.resolve()) if args.wheels is not None else None
    if args.torchtitan is None:  # the unpacked wheels' torchtitan, else where ./dev installs 0.3.0
        found = [d for d in (args.site, TORCHTITAN_DEV) if d is not None and (d / "torchtitan").is_dir()]
        args.torchtitan = found[0] if found else None
    started = time.monotonic()
    records = run_suite(args)
    print_summary(records)
    summary = {
        "budget_s": args.budget_s,
        "seconds": round(time.monotonic() - started, 1),
        "dry_run": args.dry_run,
        # the probe only reports; a part skipped for a stated reason (this torch) did not fail, nor run
        "passed": all(r["status"] in ("passed", "skipped") for r in records if r["part"] in PARTS),
        "skipped": {r["part"]: r["reason"] for r in records if r["status"] == "skipped"},
        "environment": str(args.out / "environment.json"),
        "parts": [{k: v for k, v in r.items() if k != "tail"} for r in records],
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    for name, reason in summary["skipped"].items():
        print(f"{name}: {reason}")
    print(f"written: {args.out / 'summary.json'} ({summary['seconds']:.0f} s of {args.budget_s:.0f})")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    become_subreaper()
    # Stopped from outside (a lease's end, a timeout): take the running part's tree down too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main())
