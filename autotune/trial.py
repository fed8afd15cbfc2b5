"""One trial: run a config on N ranks, measure it, and write a self-describing trial dir.

    from autotune.trial import TrialSpec, run_trial
    result = run_trial(TrialSpec(model="small", config=cfg, world_size=2, out_dir=Path("runs/t0")))
    result.status, result.step_ms, result.peak_memory_bytes

A trial dir holds (every file written atomically: temp file + rename)::

    metrics.json          schema_version 1, kind "trial_metrics": status, reason, per-rank and
                          per-step unprofiled step times, their median, peak memory per rank,
                          losses, link-emulation totals, and ``trace_metrics`` (the output of
                          ``autotune.analysis.summarize_traces`` over the traces)
    config.toml           the runtime config the trial ran
    env.json              torch version, backend, world size, host, python, CPU count, CUDA
                          device name, link emulation used
    trace_rank{r}.json.gz one chrome trace per rank (openable in Perfetto / chrome://tracing)

A failure is data: :func:`run_trial` returns a :class:`TrialResult` with status
``timeout``, ``crash`` (reason: the failing rank's last stderr line), ``oom`` or
``invalid_config`` and still writes ``metrics.json`` with that status and reason. It only
raises :class:`TrialSpecError` for a spec that cannot describe a trial at all (e.g. zero
measured steps, a pool of the wrong size). What the ranks run and measure is described in
[Note: what a trial measures] in :mod:`autotune.trial_rank`; several nodes run it under
torchrun (see that module).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import platform
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

from fsdp_runtime import RuntimeConfig, config_from_dict, config_to_dict, save_config, validate_for_world
from fsdp_runtime.errors import AutotuneError

if TYPE_CHECKING:
    from autotune.pool import RankPool

METRICS_SCHEMA_VERSION = 1
TrialStatus = Literal["ok", "pruned", "timeout", "crash", "oom", "invalid_config"]
DEFAULT_RANK_PROGRAM = "autotune.trial_rank:run_trial_rank"
_STALE_FILES = ("metrics.json", "env.json", "config.toml")


class TrialSpecError(AutotuneError):
    """A trial spec that cannot describe a trial (bad counts, backend, pool mismatch)."""


def _default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


@dataclass(kw_only=True)
class TrialSpec:
    """What to run in one trial, and where to write it."""

    model: str | dict[str, Any]
    """Model profile name/path, or ``{"name": ..., **shape/seq_len/batch_size overrides}``."""
    config: RuntimeConfig
    """The FSDP2 runtime config under test."""
    world_size: int
    out_dir: Path
    """The trial dir (created; a previous trial's files in it are replaced)."""
    num_warmup: int = 2
    """Unmeasured steps first (allocator, gloo connections, autograd caches)."""
    num_measured: int = 5
    """Unprofiled, timed steps: the step-time figures."""
    num_profiled: int = 2
    """Steps recorded in the traces (after one profiler warm-up step)."""
    seed: int = 0
    timeout_s: float = 120.0
    """Wall-clock limit for the whole trial, start-up included; then every rank is killed."""
    backend: str = field(default_factory=_default_backend)
    """``gloo`` (CPU) or ``nccl`` (CUDA); default: ``nccl`` when CUDA is available."""
    cluster: str | None = None
    """Cluster profile whose emulated links hold the collectives (autotune.linkemu); None: real links."""
    profile: bool = True
    """Run the profiled window and write traces."""
    prune_if_slower_than_ms: float | None = None
    """Stop after the first measured steps (status ``pruned``) if their median is above this."""
    rank_program: str = DEFAULT_RANK_PROGRAM
    """``module:function`` each rank runs as ``fn(rank, world_size, spec=dict)``; replace it to
    trial a custom workload that returns the same measurements."""

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        checks = [
            (self.world_size >= 1, f"world_size must be >= 1, got {self.world_size}"),
            (self.num_warmup >= 0, f"num_warmup must be >= 0, got {self.num_warmup}"),
            (self.num_measured >= 1, f"num_measured must be >= 1, got {self.num_measured}"),
            (not self.profile or self.num_profiled >= 1, f"num_profiled must be >= 1 when profiling, got {self.num_profiled}"),
            (self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}"),
            (self.backend in ("gloo", "nccl"), f"backend must be 'gloo' or 'nccl', got {self.backend!r}"),
            (":" in self.rank_program, f"rank_program must be 'module:function', got {self.rank_program!r}"),
        ]
        for ok, problem in checks:
            if not ok:
                raise TrialSpecError(f"trial spec: {problem}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (what ranks receive, and ``--write-spec`` writes for torchrun)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**data, "config": config_to_dict(self.config), "out_dir": str(self.out_dir)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrialSpec":
        return cls(**{**data, "config": config_from_dict(data["config"], source="trial spec"), "out_dir": Path(data["out_dir"])})


@dataclass(kw_only=True)
class TrialResult:
    """Outcome of one trial; ``metrics`` is the trial dir's ``metrics.json``."""

    status: TrialStatus
    reason: str = ""
    out_dir: Path
    metrics: dict[str, Any] | None = None
    wall_s: float = 0.0
    rank_pids: list[int] = field(default_factory=list)
    """Process ids of the ranks that ran it (process-group leaders), for leak checks."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def step_ms(self) -> float | None:
        """Median unprofiled step time (slowest rank per step), or None without measurements."""
        return (self.metrics or {}).get("step_ms")

    @property
    def peak_memory_bytes(self) -> int | None:
        """Largest peak memory over ranks (see ``metrics["memory_source"]`` for its meaning)."""
        return (self.metrics or {}).get("peak_memory_bytes")

    @classmethod
    def load(cls, out_dir: str | Path) -> "TrialResult":
        """Read a finished trial dir back."""
        out_dir = Path(out_dir)
        try:
            metrics = json.loads((out_dir / "metrics.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise AutotuneError(f"{out_dir}: not a trial dir ({e})") from None
        return cls(status=metrics["status"], reason=metrics.get("reason", ""), out_dir=out_dir, metrics=metrics, wall_s=metrics.get("wall_s", 0.0))


def load_trial_config(config_path: str | Path | None, model: str | dict[str, Any]) -> RuntimeConfig:
    """The config file's runtime config, or FSDP2 defaults for the model's units when no file is given."""
    from autotune.train import resolve_profile
    from fsdp_runtime import default_config, load_config

    if config_path is not None:
        return load_config(config_path)
    return default_config(resolve_profile(model).unit_names)


def load_rank_program(target: str) -> Callable[..., dict[str, Any]]:
    module_name, fn_name = target.split(":")
    return getattr(importlib.import_module(module_name), fn_name)


def run_trial(spec: TrialSpec, *, pool: "RankPool | None" = None) -> TrialResult:
    """Run one trial (fresh ranks, or ``pool``'s) and write its trial dir; never raises for what a rank does."""
    start = time.monotonic()
    if pool is not None and (pool.world_size != spec.world_size or pool.backend != spec.backend):
        raise TrialSpecError(f"trial spec: world {spec.world_size}/{spec.backend} does not match the pool's {pool.world_size}/{pool.backend}")
    try:
        prepare_trial_dir(spec)
    except AutotuneError as e:
        return write_trial_dir(spec, status="invalid_config", reason=str(e), rank_results=[], wall_s=time.monotonic() - start)
    kwargs = {"spec": spec.to_dict()}
    if pool is not None:
        run = pool.run(spec.rank_program, kwargs, timeout_s=spec.timeout_s)
    else:
        from autotune.launch import run_ranks

        run = run_ranks(spec.rank_program, world_size=spec.world_size, kwargs=kwargs, timeout_s=spec.timeout_s, backend=spec.backend)
    if run.ok:
        status = "pruned" if any(r["pruned"] for r in run.results) else "ok"
        result = write_trial_dir(spec, status=status, reason="", rank_results=run.results, wall_s=time.monotonic() - start)
    else:
        result = write_trial_dir(spec, status=run.status, reason=run.reason, rank_results=[], wall_s=time.monotonic() - start)
    result.rank_pids = list(run.pids)
    return result


def check_trial_spec(spec: TrialSpec) -> None:
    """Checks that need no ranks: the profile exists, the mesh fits the world size, the cluster loads."""
    from autotune.train import resolve_profile
    from profiles import load_cluster_profile

    resolve_profile(spec.model)
    validate_for_world(spec.config, spec.world_size)
    if spec.cluster is not None:
        load_cluster_profile(spec.cluster)


def prepare_trial_dir(spec: TrialSpec, *, check: bool = True) -> None:
    """Create the trial dir, remove a previous trial's files, check the spec, write config.toml."""
    out_dir = spec.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*_STALE_FILES, *(p.name for p in out_dir.glob("trace_rank*.json.gz"))]:
        (out_dir / stale).unlink(missing_ok=True)
    if check:
        check_trial_spec(spec)
    save_config(spec.config, out_dir / "config.toml")


def write_trial_dir(spec: TrialSpec, *, status: TrialStatus, reason: str, rank_results: list[dict[str, Any]], wall_s: float) -> TrialResult:
    """Write ``metrics.json`` and ``env.json`` for a finished (or failed) trial; returns its result."""
    traces = [spec.out_dir / r["trace"] for r in rank_results if r.get("trace")]
    trace_metrics, analysis_error = _analyze(traces) if traces and status == "ok" else (None, None)
    metrics = get_trial_metrics(spec, status=status, reason=reason, rank_results=rank_results, wall_s=wall_s)
    metrics |= {"trace_metrics": trace_metrics, "analysis_error": analysis_error}
    write_json_atomic(spec.out_dir / "env.json", _get_env(spec, rank_results))
    write_json_atomic(spec.out_dir / "metrics.json", metrics)
    return TrialResult(status=status, reason=reason, out_dir=spec.out_dir, metrics=metrics, wall_s=wall_s)


def get_trial_metrics(spec: TrialSpec, *, status: TrialStatus, reason: str, rank_results: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """The ``metrics.json`` body (without trace metrics) from the ranks' results."""
    per_step = [max(steps) for steps in zip(*(r["step_ms"] for r in rank_results))] if rank_results else []
    peaks = [r["memory"]["peak_bytes"] for r in rank_results]
    return {
        "schema_version": METRICS_SCHEMA_VERSION,
        "kind": "trial_metrics",
        "status": status,
        "reason": reason,
        "model": spec.model,
        "world_size": spec.world_size,
        "backend": spec.backend,
        "cluster": spec.cluster,
        "mesh": config_to_dict(spec.config)["mesh"],
        "num_warmup": spec.num_warmup,
        "num_measured": spec.num_measured,
        "num_profiled": spec.num_profiled if spec.profile else 0,
        "step_ms": statistics.median(per_step) if per_step else None,
        "step_ms_per_step": per_step,
        "peak_memory_bytes": max(peaks) if peaks else None,
        "memory_source": rank_results[0]["memory"]["source"] if rank_results else None,
        "ranks": [
            {
                "rank": r["rank"],
                "step_ms": r["step_ms"],
                "profiled_step_ms": r["profiled_step_ms"],
                "losses": r["losses"],
                "peak_memory_bytes": r["memory"]["peak_bytes"],
                "baseline_memory_bytes": r["memory"]["baseline_bytes"],
                "trace": r["trace"],
                "link_emulation": r["link_emulation"],
            }
            for r in rank_results
        ],
        "traces": [r["trace"] for r in rank_results if r.get("trace")],
        "wall_s": wall_s,
    }


def _analyze(traces: list[Path]) -> tuple[dict[str, Any] | None, str | None]:
    """``autotune.analysis.summarize_traces`` over the traces; a failure becomes an error string."""
    try:
        from autotune.analysis import summarize_traces
    except (ImportError, AttributeError) as e:
        return None, f"trace analysis unavailable: {e}"
    try:
        summary = summarize_traces([str(p) for p in traces])
        json.dumps(summary)
    except Exception as e:  # a bad trace or analysis bug is recorded; the trial's timings stand
        return None, f"{type(e).__name__}: {e}"[:500]
    return summary, None


def _get_env(spec: TrialSpec, rank_results: list[dict[str, Any]]) -> dict[str, Any]:
    rank_env = rank_results[0]["env"] if rank_results else {}
    link_emulation = None
    if spec.cluster is not None:
        from profiles import load_cluster_profile

        cluster = load_cluster_profile(spec.cluster)
        links = {name: dataclasses.asdict(link) for name, link in cluster.links.items() if link.emulated}
        link_emulation = {"cluster": cluster.name, "ranks_per_node": cluster.ranks_per_node, "links": links} if links else None
    import torch

    return {
        "schema_version": METRICS_SCHEMA_VERSION,
        "kind": "trial_env",
        "torch_version": rank_env.get("torch_version", torch.__version__),
        "backend": spec.backend,
        "world_size": spec.world_size,
        "host": rank_env.get("host", socket.gethostname()),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "num_threads_per_rank": rank_env.get("num_threads"),
        "device": rank_env.get("device"),
        "cuda_device_name": rank_env.get("cuda_device_name"),
        "link_emulation": link_emulation,
    }


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON via a temp file and rename: readers never see a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
