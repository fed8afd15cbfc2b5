"""Classify one rank's events: steps, compute intervals, collectives and FSDP unit labels.

This is where the definitions of [Note: trace metrics] (``autotune/analysis/__init__.py``)
become code; the analyzers only slice what this module returns by step and unit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd

from autotune.analysis import _intervals as iv
from autotune.analysis._load import RankTrace
from fsdp_runtime import ROOT_UNIT

COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "other")
"""Collective kinds, in the order every table lists them."""
BARRIER = "barrier"
"""Kind of a barrier: a synchronization that moves no data, kept out of the communication figures."""

_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_LABEL_FOR = re.compile(r"^FSDP::(?P<phase>\w+) for (?P<unit>\S+)$")
_LABEL = re.compile(r"^FSDP::(?P<phase>\w+)(?: \((?P<unit>[^)]*)\))?$")
_NOT_COMPUTE_OP = re.compile(r"^(?:c10d::|_?c10d_functional::|gloo:|nccl:|record_param_comms)|wait", re.IGNORECASE)
_LINKEMU_HOLD = "linkemu::hold_"
"""Prefix of the spans link emulation records while it holds a collective (autotune/linkemu.py)."""
_MEMORY_KERNEL = re.compile(r"^(hip)?(Memcpy|Memset)")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
# What gloo runs for each c10d collective kind (it runs reduce-scatter as an all-reduce).
_GLOO_RUNS_AS = {"all_gather": "all_gather", "reduce_scatter": "all_reduce", "all_reduce": "all_reduce", "other": "other", BARRIER: BARRIER}


def get_collective_kind(name: str) -> str:
    """``all_gather``/``reduce_scatter``/``all_reduce``/``other`` (or ``barrier``) from a c10d op, gloo span or NCCL kernel name."""
    flat = name.lower().replace("_", "")
    if "barrier" in flat:
        return BARRIER
    for kind in ("allgather", "reducescatter", "allreduce"):
        if kind in flat:
            return {"allgather": "all_gather", "reducescatter": "reduce_scatter", "allreduce": "all_reduce"}[kind]
    return "other"


def get_label_unit(name: str) -> tuple[str, str] | None:
    """``(phase, unit)`` of an ``FSDP::`` label, or None. The root module's labels carry no FQN."""
    match = _LABEL_FOR.match(name) or _LABEL.match(name)
    if match is None:
        return None
    return match.group("phase"), match.group("unit") or ROOT_UNIT


@dataclass(kw_only=True)
class RankEvents:
    """One rank's trace reduced to what the metrics need; times in microseconds."""

    rank: int
    path: Path
    device: Literal["cpu", "gpu"]
    steps: pd.DataFrame
    """``step, start, end``: the ProfilerStep#N spans of the training thread."""
    compute: pd.DataFrame
    """``start, end, issue_ts``: compute intervals (CPU: already merged; GPU: one row per kernel)."""
    comm: pd.DataFrame
    """``start, end, issue_ts, kind, unit``: one row per collective (gloo span or NCCL kernel);
    ``unit`` is None when no FSDP label encloses the point where it was issued."""
    barriers: pd.DataFrame
    """``start, end, issue_ts``: barriers, split off ``comm`` (CPU: ``gloo:barrier`` spans)."""
    labels: pd.DataFrame
    """``start, end, phase, unit``: the FSDP:: labels of the training thread."""
    memory: pd.DataFrame
    units: list[str] = field(default_factory=list)
    """FSDP units in order of first appearance."""


def _training_thread(events: pd.DataFrame) -> tuple[object, object]:
    steps = events[events["name"].str.match(_STEP.pattern) & (events["cat"] != "gpu_user_annotation")]
    return steps.groupby(["pid", "tid"]).size().idxmax()


def _get_steps(main: pd.DataFrame) -> pd.DataFrame:
    spans = main[main["name"].str.match(_STEP.pattern)]
    steps = pd.DataFrame({"step": spans["name"].str.extract(_STEP.pattern)[0].astype(int), "start": spans["ts"], "end": spans["end"]})
    return steps.sort_values("start").reset_index(drop=True)


def _get_labels(main: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for name, start, end in main.loc[main["name"].str.startswith("FSDP::"), ["name", "ts", "end"]].itertuples(index=False):
        parsed = get_label_unit(name)
        if parsed is not None:
            rows.append((start, end, *parsed))
    return pd.DataFrame.from_records(rows, columns=["start", "end", "phase", "unit"]).sort_values("start", kind="stable").reset_index(drop=True)


def _assign_units(issue_ts: np.ndarray, labels: pd.DataFrame) -> list[str | None]:
    """The innermost (latest-starting) label that contains each issue time."""
    starts, ends, units = labels["start"].to_numpy(), labels["end"].to_numpy(), labels["unit"].to_numpy()
    out: list[str | None] = []
    for t in issue_ts:
        inside = np.flatnonzero((starts <= t) & (t < ends))
        out.append(units[inside[np.argmax(starts[inside])]] if len(inside) else None)
    return out


def _cpu_compute(main: pd.DataFrame) -> pd.DataFrame:
    ops = main[main["cat"] == "cpu_op"]
    excluded = ops["name"].str.contains(_NOT_COMPUTE_OP.pattern, flags=re.IGNORECASE)
    busy = iv.subtract(iv.union(ops[["ts", "end"]].to_numpy()), iv.union(ops.loc[excluded, ["ts", "end"]].to_numpy()))
    return pd.DataFrame({"start": busy[:, 0], "end": busy[:, 1], "issue_ts": busy[:, 0]})


def _match_gloo_to_enqueue(spans: pd.DataFrame, enqueues: pd.DataFrame) -> tuple[list[str], np.ndarray]:
    """Pair each gloo span with the c10d op that enqueued it: per executed kind, first in first out.

    Returns each span's kind (from its c10d op; from the gloo name when unmatched) and
    issue time (the c10d op's start; the span's own start when unmatched).
    """
    queues: dict[str, list[tuple[float, str]]] = {}
    for name, ts in enqueues[["name", "ts"]].itertuples(index=False):
        kind = get_collective_kind(name)
        queues.setdefault(_GLOO_RUNS_AS[kind], []).append((ts, kind))
    heads = {k: 0 for k in queues}
    kinds, issue = [], []
    for name, ts in spans[["name", "ts"]].itertuples(index=False):
        executed = get_collective_kind(name)
        queue, head = queues.get(executed, []), heads.get(executed, 0)
        if head < len(queue) and queue[head][0] <= ts:
            kinds.append(queue[head][1])
            issue.append(queue[head][0])
            heads[executed] = head + 1
        else:
            kinds.append(executed)
            issue.append(ts)
    return kinds, np.array(issue, dtype=float)


def _cpu_comm(events: pd.DataFrame, main_mask: pd.Series) -> pd.DataFrame:
    spans = events[events["name"].str.startswith("gloo:") & ~main_mask].sort_values("ts", kind="stable")
    is_enqueue = events["name"].str.startswith("c10d::") & ~events["name"].str.contains("wait", case=False)
    enqueues = events[is_enqueue & main_mask].sort_values("ts", kind="stable")
    kinds, issue = _match_gloo_to_enqueue(spans, enqueues)
    gloo = pd.DataFrame({"start": spans["ts"].to_numpy(), "end": spans["end"].to_numpy(), "issue_ts": issue, "kind": kinds})
    holds = events[events["name"].str.startswith(_LINKEMU_HOLD) & main_mask]
    if holds.empty:
        return gloo
    emulated = pd.DataFrame({
        "start": holds["ts"].to_numpy(), "end": holds["end"].to_numpy(), "issue_ts": holds["ts"].to_numpy(),
        "kind": [name.removeprefix(_LINKEMU_HOLD) if name.removeprefix(_LINKEMU_HOLD) in COMM_KINDS else "other" for name in holds["name"]],
    })  # fmt: skip
    return pd.concat([gloo, emulated], ignore_index=True).sort_values("start", kind="stable").reset_index(drop=True)


def _gpu_kernels(events: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(compute, comm) kernels; each kernel's issue time is its launch's start on the host."""
    launches = events[events["cat"].isin(_LAUNCH_CATS) & (events["correlation"] >= 0)]
    launch_ts = dict(zip(launches["correlation"], launches["ts"]))
    kernels = events[events["cat"] == "kernel"]
    issue = np.array([launch_ts.get(c, ts) for c, ts in zip(kernels["correlation"], kernels["ts"])], dtype=float)
    frame = pd.DataFrame({"start": kernels["ts"].to_numpy(), "end": kernels["end"].to_numpy(), "issue_ts": issue, "name": kernels["name"].to_numpy()})
    is_comm = frame["name"].str.startswith("nccl")
    compute = frame[~is_comm & ~frame["name"].str.match(_MEMORY_KERNEL.pattern)][["start", "end", "issue_ts"]]
    comm = frame[is_comm].assign(kind=[get_collective_kind(n) for n in frame.loc[is_comm, "name"]])
    return compute.reset_index(drop=True), comm[["start", "end", "issue_ts", "kind"]].reset_index(drop=True)


def classify_events(trace: RankTrace) -> RankEvents:
    """Reduce a loaded trace to steps, compute, collectives and FSDP labels (see [Note: trace metrics])."""
    events = trace.events
    pid, tid = _training_thread(events)
    main_mask = (events["pid"] == pid) & (events["tid"] == tid) & (events["cat"] != "gpu_user_annotation")
    main = events[main_mask]
    labels = _get_labels(main)
    if trace.device == "gpu":
        compute, comm = _gpu_kernels(events)
    else:
        compute, comm = _cpu_compute(main), _cpu_comm(events, main_mask)
    is_barrier = comm["kind"] == BARRIER
    barriers = comm[is_barrier][["start", "end", "issue_ts"]].reset_index(drop=True)
    comm = comm[~is_barrier].sort_values("start", kind="stable").reset_index(drop=True)
    comm["unit"] = _assign_units(comm["issue_ts"].to_numpy(), labels)
    return RankEvents(
        rank=trace.rank,
        path=trace.path,
        device=trace.device,
        steps=_get_steps(main),
        compute=compute,
        comm=comm,
        barriers=barriers,
        labels=labels,
        memory=trace.memory,
        units=list(dict.fromkeys(labels["unit"])),
    )


def get_step_compute(events: RankEvents, start: float, end: float) -> np.ndarray:
    """Merged compute intervals of the step ``[start, end)``.

    CPU: the training thread's compute, clipped to the step. GPU: the kernels launched
    during the step (kernels run behind their launches, so they are not clipped).
    """
    compute = events.compute
    if events.device == "cpu":
        return iv.clip(compute[["start", "end"]].to_numpy(), start, end)
    issued = compute[(compute["issue_ts"] >= start) & (compute["issue_ts"] < end)]
    return iv.union(issued[["start", "end"]].to_numpy())


def get_step_comm(events: RankEvents, start: float, end: float, *, barriers: bool = False) -> pd.DataFrame:
    """The collectives (or barriers) issued during the step ``[start, end)``: a collective belongs to the step that issued it."""
    comm = events.barriers if barriers else events.comm
    return comm[(comm["issue_ts"] >= start) & (comm["issue_ts"] < end)]
