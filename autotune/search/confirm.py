"""Side-by-side confirmation: re-measure the search's best and the defaults in alternation."""

from __future__ import annotations

from typing import Any

from autotune.search.context import SearchContext
from autotune.trials import median_or_none, run_trial
from fsdp_runtime import RuntimeConfig


def confirm(ctx: SearchContext, best: RuntimeConfig, default: RuntimeConfig) -> dict[str, Any]:
    """Re-measure defaults and best alternately (ABBA order cancels drift); speedup = default / best per pair."""
    pairs = []
    for i in range(ctx.settings.num_confirm_pairs):
        times = {}
        order = (("default", default), ("best", best)) if i % 2 == 0 else (("best", best), ("default", default))
        for name, config in order:
            spec = ctx.trial_spec(config, ctx.write_dir / "confirm" / f"pair{i}_{name}", profile=False)
            result = run_trial(spec, pool=ctx.pool)
            times[name] = result.step_ms if result.ok else None
        pairs.append({"default": times["default"], "best": times["best"]})
    speedups = [p["default"] / p["best"] for p in pairs if p["default"] and p["best"]]
    return {
        "pairs": pairs,
        "speedups": speedups,
        "speedup_median": median_or_none(speedups),
        "speedup_min": min(speedups) if speedups else None,
        "speedup_max": max(speedups) if speedups else None,
    }

