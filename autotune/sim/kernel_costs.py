"""Kernel costs: where a GPU trial's device time goes, per part of the step and kernel class.

The GPU counterpart of :mod:`autotune.sim.trace_costs`. On a GPU the host's time between
FSDP2's labels is launch time, not work; the work is the kernels. Each kernel (memcpy and
memset included) is attributed to the part of the step whose host span *launched* it (the
launch with the kernel's ``correlation``): the same keys as the host spans of
[Note: calibration] (``block.forward``, ``tail.backward``, ``unshard_local.block``,
``reduce.root``, ``optimizer``, ``microbatch``, ...), and to its class by name
([Note: kernel classes] in ``autotune.analysis``). Idle is the device's time in the step
with no kernel running: the step's device span runs from its first kernel to the next
step's first kernel (the last step: to its last kernel's end).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autotune.sim.trace_costs import EAGER_PHASES, CalibrationError, get_gap_key, get_label_key

_US = 1e-6


@dataclass(kw_only=True)
class KernelCosts:
    """One GPU trial's device time per step (medians over ranks and profiled steps)."""

    seconds: dict[tuple[str, str], float]
    """``(key, kernel class)`` -> device seconds per step."""
    calls: dict[str, float]
    """Hook key -> labels per step (how many calls its seconds are over)."""
    idle_s: float
    """Device time per step with no kernel running."""
    idle_by_key: dict[str, float] = field(default_factory=dict)
    """That idle time by the key whose launch ended each gap (see ``_get_idle_by_key``)."""
    span_s: float
    """The step's device span."""
    host_by_key: dict[str, float] = field(default_factory=dict)
    """The host's time per step by key (the spans of ``get_host_spans``, profiled)."""
    launches_by_key: dict[str, float] = field(default_factory=dict)
    """Device ops (kernels, copies) per step by the key of the host span that launched them."""
    num_steps: int = 0
    notes: list[str] = field(default_factory=list)

    def get(self, key: str, classes: tuple[str, ...] | None = None) -> float:
        """Seconds per step under ``key`` (a prefix ending in ``.`` matches every key that starts with it)."""
        return sum(
            s
            for (k, c), s in self.seconds.items()
            if (k == key or (key.endswith(".") and k.startswith(key))) and (classes is None or c in classes)
        )

    def by_class(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for (_, cls), s in self.seconds.items():
            out[cls] += s
        return dict(out)

    def by_key(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for (key, _), s in self.seconds.items():
            out[key] += s
        return dict(out)


def get_host_spans(
    events: Any, step: Any, block_names: tuple[str, ...], *, local: bool
) -> list[tuple[float, float, str]]:
    """``(start, end, key)`` of the step's host time, in order: each top-level FSDP label and the
    gap before it, keyed as [Note: calibration] keys them; nested eager-concat labels cut their own span."""
    inside = events.labels[(events.labels["start"] >= step.start) & (events.labels["end"] <= step.end)]
    labels = sorted(inside.itertuples(index=False), key=lambda r: (r.start, -r.end))
    top, nested, cur_end = [], [], -math.inf
    for label in labels:
        (top if label.start >= cur_end else nested).append(label)
        cur_end = max(cur_end, label.end) if label.start >= cur_end else cur_end
    copy_outs = [(n.start, n.unit) for n in nested if n.phase == "all_gather_copy_out"]
    callbacks = [i for i, label in enumerate(top) if label.phase == "root_post_backward_callback"]
    spans, t, prev = [], step.start, None
    for i, label in enumerate(top):
        spans.append((t, label.start, get_gap_key(prev, block_names[0], block_names[-1], _after_last(callbacks, i))))
        copies_out = any(label.start <= s <= label.end and u == label.unit for s, u in copy_outs)
        spans.append((label.start, label.end, get_label_key(label, copies_out, local)))
        t, prev = label.end, label
    spans.append((t, step.end, get_gap_key(prev, block_names[0], block_names[-1], _after_last(callbacks, len(top)))))
    for inner in (n for n in nested if n.phase in EAGER_PHASES):
        spans = _cut(spans, inner.start, inner.end, get_label_key(inner, False, local))
    return spans


def _after_last(callbacks: list[int], i: int) -> bool:
    return bool(callbacks) and i - 1 == callbacks[-1]


def _cut(spans: list[tuple[float, float, str]], start: float, end: float, key: str) -> list[tuple[float, float, str]]:
    out = []
    for a, b, k in spans:
        if b <= start or a >= end:
            out.append((a, b, k))
            continue
        out += [(a, start, k)] if a < start else []
        out.append((max(a, start), min(b, end), key))
        out += [(end, b, k)] if b > end else []
    return out


def _union_seconds(starts: np.ndarray, ends: np.ndarray, lo: float, hi: float) -> float:
    busy, cur_a, cur_b = 0.0, None, None
    for a, b in sorted(zip(np.clip(starts, lo, hi), np.clip(ends, lo, hi))):
        if cur_b is None or a > cur_b:
            busy += (cur_b - cur_a) if cur_b is not None else 0.0
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    busy += (cur_b - cur_a) if cur_b is not None else 0.0
    return busy


def _get_step_rows(events: Any, block_names: tuple[str, ...], local: bool) -> list[dict[str, Any]]:
    ops = events.device_ops
    steps = list(events.steps.itertuples(index=False))
    rows = []
    for i, step in enumerate(steps):
        mine = ops[(ops["issue_ts"] >= step.start) & (ops["issue_ts"] < step.end)]
        if mine.empty:
            continue
        spans = get_host_spans(events, step, block_names, local=local)
        starts = np.array([a for a, _, _ in spans])
        at = np.clip(np.searchsorted(starts, mine["issue_ts"].to_numpy(), side="right") - 1, 0, len(spans) - 1)
        seconds: dict[tuple[str, str], float] = defaultdict(float)
        launches: dict[str, float] = defaultdict(float)
        for j, cls, dur in zip(at, mine["cls"].astype(str), (mine["end"] - mine["start"]).to_numpy()):
            seconds[spans[j][2], cls] += dur * _US
            launches[spans[j][2]] += 1
        nxt = ops[ops["issue_ts"] >= step.end]["start"] if i + 1 < len(steps) else None
        lo = float(mine["start"].min())
        hi = float(nxt.min()) if nxt is not None and len(nxt) else float(mine["end"].max())
        busy = _union_seconds(ops["start"].to_numpy(), ops["end"].to_numpy(), lo, hi)
        calls: dict[str, float] = defaultdict(float)
        host: dict[str, float] = defaultdict(float)
        for a, b, key in spans:
            host[key] += (b - a) * _US
            if "." in key and key.split(".")[0] not in ("head", "block", "tail"):
                calls[key] += 1
        rows.append(
            {
                "seconds": dict(seconds),
                "calls": dict(calls),
                "span": (hi - lo) * _US,
                "idle": (hi - lo - busy) * _US,
                "idle_by_key": _get_idle_by_key(mine, [spans[j][2] for j in at], hi),
                "host_by_key": dict(host),
                "launches_by_key": dict(launches),
            }
        )
    return rows


def _get_idle_by_key(ops: Any, keys: list[str], hi: float) -> dict[str, float]:
    """Each device gap, charged to the key whose host span launched the kernel that ends it (the
    launch came late); the gap after the step's last kernel to ``microbatch`` (the next step's start)."""
    idle: dict[str, float] = defaultdict(float)
    order = np.argsort(ops["start"].to_numpy(), kind="stable")
    starts, ends = ops["start"].to_numpy()[order], ops["end"].to_numpy()[order]
    end = starts[0]
    for j, start, stop in zip(order, starts, ends):
        if start > end:
            idle[keys[j]] += (start - end) * _US
        end = max(end, stop)
    if hi > end:
        idle["microbatch"] += (hi - end) * _US
    return dict(idle)


def _keys(rows: list[dict[str, Any]], name: str) -> set[str]:
    return {k for r in rows for k in r[name]}


def get_kernel_costs(events_by_rank: dict[int, Any], *, block_names: tuple[str, ...], local: bool) -> KernelCosts:
    """Device seconds per step by ``(key, class)`` of one GPU trial (see the module's docstring)."""
    rows = [row for events in events_by_rank.values() for row in _get_step_rows(events, block_names, local)]
    if not rows:
        raise CalibrationError("the traces hold no profiled step with device kernels (a CPU trial?)")
    keys = {k for r in rows for k in r["seconds"]}
    hooks = {k for r in rows for k in r["calls"]}
    return KernelCosts(
        seconds={k: statistics.median(r["seconds"].get(k, 0.0) for r in rows) for k in keys},
        calls={k: statistics.median(r["calls"].get(k, 0.0) for r in rows) for k in hooks},
        idle_s=statistics.median(r["idle"] for r in rows),
        idle_by_key={
            k: statistics.median(r["idle_by_key"].get(k, 0.0) for r in rows) for k in _keys(rows, "idle_by_key")
        },
        span_s=statistics.median(r["span"] for r in rows),
        host_by_key={
            k: statistics.median(r["host_by_key"].get(k, 0.0) for r in rows) for k in _keys(rows, "host_by_key")
        },
        launches_by_key={
            k: statistics.median(r["launches_by_key"].get(k, 0.0) for r in rows) for k in _keys(rows, "launches_by_key")
        },
        num_steps=len(rows),
    )
