"""Trace costs: what one trial's traces say, per microbatch and unit (the first step of
:mod:`autotune.sim.calibrate`; see [Note: calibration] there): model compute per segment,
FSDP2's hook work, the optimizer, and every collective's span, read from the training
thread's ``FSDP::`` labels between communication.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from autotune.sim.fitted import CPU_STEP, Fitted
from autotune.sim.measured import HOOK_KEYS, OPTIONAL_HOOK_KEYS, SEGMENT_KEYS
from fsdp_runtime import ROOT_UNIT
from fsdp_runtime.errors import AutotuneError

_COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
_US = 1e-6


class CalibrationError(AutotuneError):
    """Trials that cannot calibrate the simulator (no traces, a failed trial, another model)."""


@dataclass(kw_only=True)
class TraceCosts:
    """What one trial's traces say, per microbatch and unit (segments: medians over ranks and steps; hooks: the lower quartile of their calls)."""

    segments: dict[str, float]
    hooks: dict[str, float]
    microbatch_s: float
    optimizer_s: float
    collectives: list[tuple[str, str, float]]
    """(kind, unit, seconds) of every traced collective."""


def _unit_kind(unit: str) -> str:
    return "root" if unit == ROOT_UNIT else "block"


def get_gap_key(prev: Any, first_block: str, last_block: str, last_callback: bool) -> str:
    """Whose compute the time after label ``prev`` (None: the step's start) is; see [Note: calibration]."""
    if prev is None:
        return "microbatch"
    phase, unit = prev.phase, prev.unit
    root = unit == ROOT_UNIT
    if phase == "pre_forward":
        return "head.forward" if root else "block.forward"
    if phase == "post_forward":
        return "tail.forward" if root or unit == last_block else "block.forward"
    if phase == "pre_backward":
        return "tail.backward" if root else "block.backward"
    if (phase.startswith("post_backward") or phase in EAGER_PHASES) and not root:
        return "head.backward" if unit == first_block else "block.backward"
    if phase == "root_post_backward_callback":
        return "optimizer" if last_callback else "microbatch"
    return "microbatch"


ALL_HOOK_KEYS = (*HOOK_KEYS, *OPTIONAL_HOOK_KEYS)
EAGER_PHASES = {"eager_concat": "concat", "eager_restore": "restore"}
"""``fsdp_runtime``'s labels around FSDP1-style eager concat (``defer_concat = false``)."""


def get_label_key(label: Any, copies_out: bool, local: bool) -> str:
    """The key a top-level label's own time counts under; ``local``: a trace on a shard group of
    one, whose pre-forward hooks unshard by a plain copy (no copy-out label to tell them by) and
    whose reduces copy instead of reduce-scattering (``LOCAL_HOOK_KEYS``)."""
    kind = _unit_kind(label.unit)
    if label.phase in EAGER_PHASES:
        return f"{EAGER_PHASES[label.phase]}.{kind}"
    if local and label.phase == "pre_forward":
        return f"unshard_local.{kind}"
    if local and label.phase in ("post_backward_reduce", "root_post_backward_callback"):
        return f"reduce_local.{kind}"
    match label.phase:
        case "pre_forward" | "pre_backward":
            return f"{'unshard' if copies_out else 'pre_hook'}.{kind}"
        case "post_forward":
            return "tail.forward" if kind == "root" else "block.forward"
        case "post_backward_accumulate" | "post_backward_reshard" | "post_backward_rs_wait":
            return f"post_hook.{kind}"
        case "post_backward_reduce":
            return f"reduce.{kind}"
        case "root_post_backward_callback":
            return "reduce.root"
    return "microbatch"


def _comm_intervals(events: Any) -> list[tuple[float, float]]:
    spans = sorted(
        [*zip(events.comm["start"], events.comm["end"]), *zip(events.barriers["start"], events.barriers["end"])]
    )
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _busy(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals if b > start and a < end)


def _get_step_sums(
    events: Any, step: Any, comm: list[tuple[float, float]], first_block: str, last_block: str, local: bool
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Seconds per key over one profiled step of one rank, and the own seconds of each call a hook key counts."""
    inside = events.labels[(events.labels["start"] >= step.start) & (events.labels["end"] <= step.end)]
    labels = sorted(inside.itertuples(index=False), key=lambda r: (r.start, -r.end))
    top, nested, cur_end = [], [], -math.inf
    for label in labels:
        (top if label.start >= cur_end else nested).append(label)
        if label.start >= cur_end:
            cur_end = label.end
    copy_outs = [(n.start, n.unit) for n in nested if n.phase == "all_gather_copy_out"]
    eager = [n for n in nested if n.phase in EAGER_PHASES]  # the root's, inside its post-backward callback
    callbacks = [i for i, label in enumerate(top) if label.phase == "root_post_backward_callback"]
    sums: dict[str, float] = {}
    calls: dict[str, list[float]] = {}

    def add(key: str, start: float, end: float, sign: float = 1.0) -> float:
        seconds = max(0.0, (end - start) - _busy(comm, start, end)) * _US
        sums[key] = sums.get(key, 0.0) + sign * seconds
        return seconds

    def count(key: str, label: Any, seconds: float) -> None:
        if key in ALL_HOOK_KEYS and label.phase != "post_backward_reshard" and label.phase != "post_backward_rs_wait":
            calls.setdefault(key, []).append(seconds)

    t, prev = step.start, None
    for i, label in enumerate(top):
        add(get_gap_key(prev, first_block, last_block, bool(callbacks) and i - 1 == callbacks[-1]), t, label.start)
        copies_out = any(label.start <= s <= label.end and u == label.unit for s, u in copy_outs)
        key = get_label_key(label, copies_out, local)
        count(key, label, add(key, label.start, label.end))
        for inner in (
            e for e in eager if label.start <= e.start and e.end <= label.end
        ):  # counted apart, not as the outer hook's
            add(key, inner.start, inner.end, -1.0)
            inner_key = get_label_key(inner, False, local)
            count(inner_key, inner, add(inner_key, inner.start, inner.end))
        t, prev = label.end, label
    add(get_gap_key(prev, first_block, last_block, bool(callbacks) and len(top) - 1 == callbacks[-1]), t, step.end)
    return sums, calls


def _spread_calls(total: float, calls: list[float]) -> list[float]:
    """A step's calls of one hook key, each with an even share of what the key holds beyond them (the
    uncounted reshard and reduce-scatter waits, eager concat counted apart): their mean is ``total / len``."""
    share = (total - sum(calls)) / len(calls)
    return [c + share for c in calls]


HOOK_QUANTILE = 0.25
"""The calls' quantile a hook is priced at ([Note: calibration]: page-fault storms in the profiled window)."""
HOOK_QUANTILE_FIT = Fitted(
    name="trace_costs.HOOK_QUANTILE",
    value=HOOK_QUANTILE,
    fit_on=("small/raw", "wide/raw"),
    how="chosen over the median call by replaying recorded sim_accuracy.py runs of small and wide on raw "
    "loopback, 2 ranks (studies/sim_replay.py; docs/studies.md, sim replay)",
    figure=CPU_STEP,
)


def _get_hook_price(calls: list[float]) -> float:
    """A hook's seconds per call: the ``HOOK_QUANTILE`` of its calls over every rank and profiled step."""
    if len(calls) < 2:
        return calls[0] if calls else 0.0
    return statistics.quantiles(calls, n=100, method="inclusive")[round(100 * HOOK_QUANTILE) - 1]


def get_trace_costs(
    events_by_rank: dict[int, Any], *, block_names: tuple[str, ...], num_microbatches: int, local: bool = False
) -> TraceCosts:
    """Per-microbatch segment, hook, optimizer and collective seconds of one trial (see [Note: calibration]);
    ``local``: the trial ran on a shard group of one (its hooks count under ``LOCAL_HOOK_KEYS``)."""
    n, m = len(block_names), num_microbatches
    per_block = {"block.forward": n * m, "block.backward": n * m}
    rows: list[dict[str, float]] = []
    hook_calls: dict[str, list[float]] = {}
    collectives: list[tuple[str, str, float]] = []
    for events in events_by_rank.values():
        comm = _comm_intervals(events)
        for step in events.steps.itertuples(index=False):
            sums, calls = _get_step_sums(events, step, comm, block_names[0], block_names[-1], local)
            row = {key: sums.get(key, 0.0) / per_block.get(key, m) for key in (*SEGMENT_KEYS, "microbatch")}
            row["optimizer"] = sums.get("optimizer", 0.0)
            rows.append(row)
            for key in ALL_HOOK_KEYS:
                if calls.get(key):
                    hook_calls.setdefault(key, []).extend(_spread_calls(sums.get(key, 0.0), calls[key]))
            in_step = events.comm[(events.comm["issue_ts"] >= step.start) & (events.comm["issue_ts"] < step.end)]
            collectives += [
                (c.kind, c.unit or "", (c.end - c.start) * _US)
                for c in in_step.itertuples(index=False)
                if c.kind in _COMM_KINDS
            ]
    if not rows:
        raise CalibrationError("the traces hold no profiled step")

    def price(key: str) -> float:
        if key in ALL_HOOK_KEYS:
            return _get_hook_price(hook_calls.get(key, []))
        values = [r[key] for r in rows if key in r]
        return statistics.median(values) if values else 0.0

    return TraceCosts(
        segments={key: price(key) for key in SEGMENT_KEYS},
        hooks={key: price(key) for key in HOOK_KEYS}
        | {key: price(key) for key in OPTIONAL_HOOK_KEYS if key in hook_calls},
        microbatch_s=price("microbatch"),
        optimizer_s=price("optimizer"),
        collectives=collectives,
    )
