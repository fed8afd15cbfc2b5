"""The one writer of a trial dir (local launches and rank 0 under torchrun both call it).

A trial dir holds (every file written atomically)::

    metrics.json          :class:`~autotune.trials.metrics.TrialMetrics` (status, reason, per-rank
                          and per-step unprofiled step times, their median, process peaks,
                          losses, link-emulation totals, trace metrics)
    config.toml           the runtime config the trial ran
    env.json              torch version, backend, world size, host, python, CPU count, CUDA
                          device name, link emulation used, and the environment variables
                          that change overlap (``overlap_env``: CUDA_DEVICE_MAX_CONNECTIONS,
                          NCCL channels/algorithm/protocol; :data:`~autotune.trials.precision.OVERLAP_ENV`)
    trace_rank{r}.json.gz one chrome trace per rank (openable in Perfetto / chrome://tracing)
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import socket
from pathlib import Path
from typing import Any

from autotune.artifacts import write_artifact
from autotune.trials.metrics import RankMetrics, TrialMetrics, TrialResult, TrialStatus
from autotune.trials.precision import get_overlap_env
from autotune.trials.spec import TrialSpec
from fsdp_runtime import RuntimeConfig, config_to_dict, save_config, validate_for_world

INCOMPLETE_MARKER = "INCOMPLETE"
"""Present in a trial dir from the start of a trial until its ``metrics.json`` is written: a
dir that still has it belongs to a trial whose launcher was killed."""
ENV_KIND = "trial_env"
ENV_SCHEMA_VERSION = 3
"""v3: ``ranks``, each rank's host and node (a search across nodes names both: [Note: node pool]);
v2: ``overlap_env`` (the ranks' values of ``OVERLAP_ENV``)."""
_STALE_FILES = ("metrics.json", "env.json", "config.toml")
_STEP_COST_KEYS = (
    "own_step_ms",
    "step_cpu_ms",
    "step_page_faults",
    "profiled_cpu_ms",
    "profiled_page_faults",
    "settle_step_ms",
    "reference_settle_step_ms",
)


def check_trial_spec(spec: TrialSpec) -> None:
    """Checks that need no ranks: the profile exists, the mesh fits the world size, pipeline
    stages split the model's blocks (on a meta-device build), the cluster loads."""
    from autotune.trials.training import resolve_profile
    from fsdp_runtime import resolve_units, split_stages
    from profiles import load_cluster_profile

    source = resolve_profile(spec.model)
    validate_for_world(spec.config, spec.world_size)
    if spec.config.mesh.pp > 1:
        model = source.build(device="meta", seed=spec.seed)
        split_stages(model, resolve_units(model, spec.config))
    if spec.cluster is not None:
        load_cluster_profile(spec.cluster)


def prepare_trial_dir(spec: TrialSpec, *, check: bool = True) -> None:
    """Create the trial dir, remove a previous trial's files, check the spec, write config.toml."""
    out_dir = spec.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / INCOMPLETE_MARKER).write_text(
        "this trial did not finish: the process running it stopped before writing metrics.json\n"
    )
    for stale in [*_STALE_FILES, *(p.name for p in out_dir.glob("trace_rank*.json.gz"))]:
        (out_dir / stale).unlink(missing_ok=True)
    if check:
        check_trial_spec(spec)
    save_config(spec.config, out_dir / "config.toml")


def to_rank_metrics(result: dict[str, Any]) -> RankMetrics:
    """A rank program's return value (see :func:`autotune.trials.program.run_trial_rank`) as metrics."""
    memory = result["memory"]
    return RankMetrics(
        rank=result["rank"],
        step_ms=result["step_ms"],
        reference_step_ms=result.get("reference_step_ms", []),
        profiled_step_ms=result["profiled_step_ms"],
        losses=result["losses"],
        process_peak_bytes=memory["peak_bytes"],
        process_baseline_bytes=memory["baseline_bytes"],
        trial_peak_bytes=memory.get("trial_peak_bytes"),
        reserved_peak_bytes=memory.get("reserved_peak_bytes"),
        num_models=result.get("num_models"),
        num_builds=result.get("num_builds"),
        shard_inits=result.get("shard_inits", []),
        host_path_ms=result.get("host_path_ms"),
        trace=result["trace"],
        link_emulation=result["link_emulation"],
        pairs_first=result.get("pairs_first", "reference"),
        candidate_warmup=result.get("candidate_warmup"),
        **{k: result[k] for k in _STEP_COST_KEYS if k in result},
    )


def write_trial_dir(
    spec: TrialSpec,
    *,
    status: TrialStatus,
    reason: str,
    rank_results: list[dict[str, Any]],
    wall_s: float,
    placement: list[dict[str, Any]] | None = None,
    kept_traces: list[dict[str, Any]] | None = None,
) -> TrialResult:
    """Write ``metrics.json`` and ``env.json`` for a finished (or failed) trial; returns its result.
    ``placement``: where a launcher put the ranks of a trial that returned no results (env.json's ``ranks``);
    ``kept_traces``: the traces left on their nodes ([Note: node-local files] in :mod:`autotune.trials.gather`)."""
    ranks = [to_rank_metrics(r) for r in rank_results]
    metrics = TrialMetrics.from_ranks(
        ranks,
        status=status,
        reason=reason,
        model=spec.model,
        world_size=spec.world_size,
        backend=spec.backend,
        cluster=spec.cluster,
        mesh=config_to_dict(spec.config)["mesh"],
        num_warmup=spec.num_warmup,
        num_measured=spec.num_measured,
        num_profiled=spec.num_profiled if spec.profile else 0,
        memory_source=rank_results[0]["memory"]["source"] if rank_results else None,
        wall_s=wall_s,
        stopping=spec.stopping,
        stopped=rank_results[0].get("stopped") if rank_results else None,
        kept_traces=kept_traces or [],
    )
    if metrics.traces and status == "ok":
        metrics.trace_metrics, metrics.analysis_error = _analyze(
            [spec.out_dir / t for t in metrics.traces], spec.config
        )
    spec.out_dir.mkdir(parents=True, exist_ok=True)
    write_artifact(spec.out_dir / "env.json", _get_env(spec, rank_results, placement))
    metrics.write(spec.out_dir / "metrics.json")
    (spec.out_dir / INCOMPLETE_MARKER).unlink(missing_ok=True)
    return TrialResult(status=status, reason=reason, out_dir=spec.out_dir, metrics=metrics, wall_s=wall_s)


def _analyze(traces: list[Path], config: RuntimeConfig) -> tuple[dict[str, Any] | None, str | None]:
    """``autotune.analysis.summarize_traces`` over the traces (with the config's pipeline layout);
    a failure becomes an error string."""
    from autotune.analysis import PipelineLayout, summarize_traces

    try:
        summary = summarize_traces([str(p) for p in traces], pipeline=PipelineLayout.from_config(config))
        json.dumps(summary)
    except Exception as e:  # a bad trace or analysis bug is recorded; the trial's timings stand
        return None, f"{type(e).__name__}: {e}"[:500]
    return summary, None


def _get_env(
    spec: TrialSpec, rank_results: list[dict[str, Any]], placement: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    rank_env = rank_results[0]["env"] if rank_results else {}
    link_emulation = None
    if spec.cluster is not None:
        from profiles import load_cluster_profile

        cluster = load_cluster_profile(spec.cluster)
        links = {name: dataclasses.asdict(link) for name, link in cluster.links.items() if link.emulated}
        link_emulation = (
            {"cluster": cluster.name, "ranks_per_node": cluster.ranks_per_node, "links": links} if links else None
        )
    import torch

    return {
        "schema_version": ENV_SCHEMA_VERSION,
        "kind": ENV_KIND,
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
        "overlap_env": rank_env.get("overlap_env", get_overlap_env()),
        "ranks": [
            {"rank": r, "host": result["env"].get("host"), "node": result["env"].get("node", 0)}
            for r, result in enumerate(rank_results)
        ]
        or [{"rank": p["rank"], "host": p["host"], "node": p["node"]} for p in placement or []],
    }
