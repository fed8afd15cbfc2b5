"""One trial's FSDP2 host time for the report, from its traces ([Note: host-bound steps] in
``autotune.analysis._host_analysis``): medians per step and per unit, and the verdict."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from autotune.analysis import HOST_BOUND_SHARE, FsdpTraceAnalysis
from autotune.report.formatting import fmt

__all__ = ["HostTime", "get_host_time"]


@dataclass(kw_only=True)
class HostTime:
    """One trial's FSDP host time: medians over its (rank, profiled step) rows, ms."""

    device: str
    num_steps: int
    step_ms: float
    hook_ms: float
    host_ms: float
    units: pd.DataFrame
    """``unit, forward_host_ms, backward_host_ms``: medians per unit, most host time first."""

    @property
    def num_units(self) -> int:
        """The FSDP units the traces show (each unit's labels name it)."""
        return len(self.units)

    @property
    def share(self) -> float:
        return self.host_ms / self.step_ms if self.step_ms > 0 else 0.0

    @property
    def threshold(self) -> float:
        return HOST_BOUND_SHARE[self.device]

    @property
    def host_bound(self) -> bool:
        return self.share >= self.threshold

    def describe(self) -> str:
        """``host-bound: FSDP's own host work is 8.9% of the step, the device idle meanwhile (from 5%)``."""
        where = "the device idle meanwhile" if self.device == "gpu" else "the training thread's ops inside the hooks"
        verdict = "host-bound" if self.host_bound else "not host-bound"
        return f"{verdict}: FSDP's own host work is {fmt(self.share, 'pct')} of the step, {where} (host-bound from {fmt(self.threshold, 'pct')})"


def get_host_time(analysis: FsdpTraceAnalysis) -> HostTime | None:
    """A trial's :class:`HostTime` from its traces; None where they hold no FSDP labels."""
    steps, units = analysis.get_host_metrics()
    if steps.empty or not (steps["hook_ms"] > 0).any():
        return None
    per_unit = units.groupby("unit", sort=False)[["forward_host_ms", "backward_host_ms"]].median().reset_index()
    order = (per_unit["forward_host_ms"] + per_unit["backward_host_ms"]).sort_values(ascending=False, kind="stable")
    return HostTime(
        device=analysis.device,
        num_steps=len(steps),
        step_ms=float(steps["step_ms"].median()),
        hook_ms=float(steps["hook_ms"].median()),
        host_ms=float(steps["host_ms"].median()),
        units=per_unit.loc[order.index].reset_index(drop=True),
    )
