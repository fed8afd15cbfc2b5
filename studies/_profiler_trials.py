"""Section 6 of ``studies/profiler_overhead.py`` (not run directly): real trials, as a search runs them.

Each trial is ``autotune.trials.run_trial`` on fresh ranks, the config paired with the defaults
(ABBA, :mod:`autotune.trials.paired`), then one profiled window: exactly a search trial, with
one window in a heap that has not seen the profiler yet (the probe's repeated windows hide
that first growth). The figures are what ``metrics.json`` records: ``profiler_overhead``
(wall), ``profiler_cpu_overhead``, page faults per step (ranks summed), each rank's
``trace_scale`` and the process peak.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.trials import TrialSpec, run_trial
from autotune.trials.rank_memory import NO_HEAP_TUNING_ENV
from fsdp_runtime import config_from_dict


def _environment(heap: str, env: dict[str, str]) -> dict[str, str]:
    return {**env, **({} if heap == "trial" else {NO_HEAP_TUNING_ENV: "default"})}


def run_real_trials(
    configs: list[str],
    allocators: dict[str, tuple[str, dict[str, str]]],
    rounds: int,
    get_config: Callable[[Any, str], dict],
    load: Callable[[], str],
) -> list[dict[str, Any]]:
    """Per round, config and allocator (ABBA over configs and rounds) one paired trial of ``small``."""
    out = Path(tempfile.mkdtemp(prefix="profiler-trials-"))
    defaults = config_from_dict(get_config("small", "defaults"))
    records = []
    names = list(allocators)
    for r in range(rounds):
        for i, config in enumerate(configs):
            for name in names if (r + i) % 2 == 0 else names[::-1]:
                env = _environment(*allocators[name])
                saved = {k: os.environ.get(k) for k in [*env, NO_HEAP_TUNING_ENV, "GLIBC_TUNABLES"]}
                for k in saved:
                    os.environ.pop(k, None)
                os.environ.update(env)
                spec = TrialSpec(
                    model="small",
                    config=config_from_dict(get_config("small", config)),
                    world_size=2,
                    out_dir=out / f"{config}_{name}_r{r}",
                    num_warmup=2,
                    num_measured=6,
                    num_profiled=2,
                    timeout_s=900,
                    backend="gloo",
                    reference=defaults,
                )
                before = load()
                try:
                    metrics = run_trial(spec).metrics
                finally:
                    for k, v in saved.items():
                        os.environ.pop(k, None)
                        if v is not None:
                            os.environ[k] = v
                if metrics is None or metrics.status != "ok":
                    raise SystemExit(
                        f"trial {config}/{name}: {metrics.status if metrics else 'no metrics'} {metrics.reason if metrics else ''}"
                    )
                records.append({"config": config, "allocator": name, "metrics": metrics, "load": before})
                print(
                    f"  trial {config}/{name} round {r}: overhead {metrics.profiler_overhead:.3f} wall, {metrics.profiler_cpu_overhead:.3f} CPU, load {before}",
                    flush=True,
                )
    return records


def _med(values: list[float], fmt: str = "{:.3f}") -> str:
    return (
        f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"
        if values
        else "-"
    )


def print_real_trials(records: list[dict[str, Any]]) -> None:
    print(
        "\n== 6. real trials (run_trial, fresh ranks, paired with the defaults, one profiled window): metrics.json's figures, median (min-max) over rounds"
    )
    print(
        f"{'config':15} {'alloc':7} {'step ms':>17} {'wall overhead':22} {'CPU overhead':22} {'faults/step p -> q (ranks summed)':>34} {'trace_scale':18} {'peak MiB':>8} load@start"
    )
    groups: dict[tuple[str, str], list[Any]] = {}
    for rec in records:
        groups.setdefault((rec["config"], rec["allocator"]), []).append(rec)
    for (config, name), recs in groups.items():
        ms = [r["metrics"] for r in recs]
        faults = [m.profiler["page_faults"] for m in ms]
        profiled = [m.profiler["profiled_page_faults"] for m in ms]
        scales = [s["trace_scale"] for m in ms for s in m.profiler["per_rank"]]
        print(
            f"{config:15} {name:7} {_med([m.step_ms for m in ms], '{:.0f}'):>17} {_med([m.profiler_overhead for m in ms]):22} {_med([m.profiler_cpu_overhead for m in ms]):22} "
            f"{statistics.median(faults):>16.0f} -> {statistics.median(profiled):<15.0f} {_med(scales, '{:.2f}'):18} {max(m.process_peak_bytes for m in ms) / 2**20:8.0f} "
            f"{'; '.join(r['load'] for r in recs)}"
        )
