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
from autotune.analysis._kernels import KERNEL_CLASSES, get_kernel_class
from autotune.analysis._load import RankTrace
from fsdp_runtime import ROOT_UNIT

COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "send_recv", "other")
"""Collective kinds, in the order every table lists them (``send_recv``: point-to-point send/recv)."""
BARRIER = "barrier"
"""Kind of a barrier: a synchronization that moves no data, kept out of the communication figures."""

_STEP = re.compile(r"^ProfilerStep#(\d+)$")
# A unit of several modules (``fully_shard([layers.0, layers.1])``) is labelled with their
# FQNs joined by ", " (``FSDPState._lazy_init``), so the unit is the rest of the label.
_LABEL_FOR = re.compile(r"^FSDP::(?P<phase>\w+) for (?P<unit>.+)$")
_LABEL = re.compile(r"^FSDP::(?P<phase>\w+)(?: \((?P<unit>[^)]*)\))?$")
_NOT_COMPUTE_OP = re.compile(r"^(?:c10d::|_?c10d_functional::|gloo:|nccl:|record_param_comms)|wait", re.IGNORECASE)
_LINKEMU_HOLD = "linkemu::hold_"
"""Prefix of the spans link emulation records while it holds a collective (autotune/trials/linkemu.py)."""
_HOLD_KINDS = {"p2p": "send_recv"}
"""Hold kinds that are not collective kinds: link emulation's ``p2p`` holds a pipeline send or receive."""
_STAGE_LABEL = re.compile(r"^PP:(\d+)")
"""torch's pipelining schedules with several stages per rank label each action ``PP:<stage><action><microbatch>``
(``PP:2F0``, ``PP:0RECV_B3``, ``PP:0UNSHARD``)."""
_HOLD_FOLLOWS_US = 1000.0
"""A hold starting this soon after a transfer's end follows it: the waiting thread was blocked on that transfer."""
_MEMORY_KERNEL = re.compile(r"^(hip)?(Memcpy|Memset)")
_NCCL_KERNEL = re.compile(r"^nccl")
_FSDP_LABEL = re.compile(r"^FSDP::")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_NO_DEVICE_OPS = pd.DataFrame({"start": [], "end": [], "issue_ts": [], "cls": []})
_NO_STAGE_LABELS = pd.DataFrame({"start": [], "end": [], "stage": pd.Series([], dtype=int)})
_NO_P2P = pd.DataFrame({"start": [], "end": [], "issue_ts": [], "stage": pd.Series([], dtype=object)})
# What gloo runs for each c10d collective kind (it runs reduce-scatter as an all-reduce).
_GLOO_RUNS_AS = {
    "all_gather": "all_gather",
    "reduce_scatter": "all_reduce",
    "all_reduce": "all_reduce",
    "send_recv": "send_recv",
    "other": "other",
    BARRIER: BARRIER,
}
_SEND_RECV = re.compile(r"send|recv", re.IGNORECASE)


def get_collective_kind(name: str) -> str:
    """``all_gather``/``reduce_scatter``/``all_reduce``/``send_recv``/``other`` (or ``barrier``)
    from a c10d op, gloo span or NCCL kernel name (``ncclDevKernel_SendRecv``, ``c10d::send``,
    ``gloo:recv``, ... are ``send_recv``)."""
    flat = name.lower().replace("_", "")
    if "barrier" in flat:
        return BARRIER
    for kind in ("allgather", "reducescatter", "allreduce"):
        if kind in flat:
            return {"allgather": "all_gather", "reducescatter": "reduce_scatter", "allreduce": "all_reduce"}[kind]
    return "send_recv" if _SEND_RECV.search(flat) else "other"


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
    stage_labels: pd.DataFrame = field(default_factory=lambda: _NO_STAGE_LABELS)
    """``start, end, stage``: the pipeline schedule's action labels (``PP:<stage>...``) of the training thread."""
    memory: pd.DataFrame
    units: list[str] = field(default_factory=list)
    """FSDP units in order of first appearance."""
    num_unlaunched_kernels: int = 0
    """GPU: kernels dropped because no host launch (``cuda_runtime``/``cuda_driver`` event with
    their ``correlation``) is in the trace, as HTA drops them (see [Note: trace metrics])."""
    device_ops: pd.DataFrame = field(default_factory=lambda: _NO_DEVICE_OPS)
    """GPU: ``start, end, issue_ts, cls``, every launched kernel, memcpy and memset with its class
    (``autotune.analysis._kernels``, [Note: kernel classes]); CPU: empty."""
    p2p: pd.DataFrame = field(default_factory=lambda: _NO_P2P)
    """``start, end, issue_ts, stage``: pipeline P2P transfers, split off ``comm`` by a pipeline
    layout (``_pipeline.assign_stages``, [Note: pipeline bubble]); empty without one."""
    stages: list[int] = field(default_factory=list)
    """The pipeline stages the rank holds (empty without a pipeline layout)."""
    unit_stages: dict[str, int | None] = field(default_factory=dict)
    """The stage of each of the rank's FSDP units (empty without a pipeline layout)."""
    cache: dict = field(default_factory=dict, repr=False, compare=False)
    """Per-step slices, computed once (``_steps.get_step_slices``)."""


def get_name_mask(names: pd.Series, pattern: re.Pattern[str]) -> np.ndarray:
    """``pattern.search`` of each event's name: once per distinct name when ``names`` is categorical."""
    if isinstance(names.dtype, pd.CategoricalDtype):
        hits = np.array([pattern.search(str(c)) is not None for c in names.cat.categories] + [False], dtype=bool)
        return hits[names.cat.codes.to_numpy()]  # code -1 (missing) picks the trailing False
    return np.array([pattern.search(str(n)) is not None for n in names], dtype=bool)


def _training_thread(events: pd.DataFrame) -> tuple[object, object]:
    is_step = get_name_mask(events["name"], _STEP) & (events["cat"] != "gpu_user_annotation").to_numpy()
    return events.loc[is_step, ["pid", "tid"]].groupby(["pid", "tid"], observed=True).size().idxmax()


def _get_steps(events: pd.DataFrame, main_mask: np.ndarray) -> pd.DataFrame:
    spans = events.loc[main_mask & get_name_mask(events["name"], _STEP), ["name", "ts", "end"]]
    numbers = [int(_STEP.match(str(n)).group(1)) for n in spans["name"]]
    steps = pd.DataFrame(
        {"step": np.array(numbers, dtype=int), "start": spans["ts"].to_numpy(), "end": spans["end"].to_numpy()}
    )
    return steps.sort_values("start", kind="stable").reset_index(drop=True)


def _get_labels(main: pd.DataFrame) -> pd.DataFrame:
    spans = main.loc[get_name_mask(main["name"], _FSDP_LABEL), ["name", "ts", "end"]]
    parsed = {name: get_label_unit(str(name)) for name in pd.unique(spans["name"])}
    labelled = [parsed[name] for name in spans["name"]]
    keep = np.array([p is not None for p in labelled], dtype=bool)
    kept = [p for p in labelled if p is not None]
    frame = pd.DataFrame(
        {
            "start": spans["ts"].to_numpy()[keep],
            "end": spans["end"].to_numpy()[keep],
            "phase": pd.Series([p[0] for p in kept], dtype=object),
            "unit": pd.Series([p[1] for p in kept], dtype=object),
        }
    )
    return frame.sort_values("start", kind="stable").reset_index(drop=True)


def _get_stage_labels(main: pd.DataFrame) -> pd.DataFrame:
    spans = main.loc[get_name_mask(main["name"], _STAGE_LABEL), ["name", "ts", "end"]]
    stages = [int(_STAGE_LABEL.match(str(n)).group(1)) for n in spans["name"]]
    frame = pd.DataFrame(
        {"start": spans["ts"].to_numpy(), "end": spans["end"].to_numpy(), "stage": np.array(stages, dtype=int)}
    )
    return frame.sort_values("start", kind="stable").reset_index(drop=True)


def _assign_units(issue_ts: np.ndarray, labels: pd.DataFrame) -> list[str | None]:
    """The innermost label that contains each issue time: the latest-starting one (of those
    starting together, the shortest).

    Labels sorted by (start, -end); for a time t the candidate is the last label starting at
    or before t (``searchsorted``). A candidate that ended by t hands over to the nearest
    earlier label that ends later than it does (``_previous_longer``): the labels in between
    end earlier still, so none of them contains t. Nested labels make that chain the
    parents, so the loop runs once per nesting level, vectorized over all times.
    """
    issue_ts = np.asarray(issue_ts, dtype=float)
    if len(labels) == 0 or len(issue_ts) == 0:
        return [None] * len(issue_ts)
    order = np.lexsort((-labels["end"].to_numpy(), labels["start"].to_numpy()))
    starts, ends = labels["start"].to_numpy()[order], labels["end"].to_numpy()[order]
    units = labels["unit"].to_numpy()[order]
    previous = _previous_longer(ends)
    at = np.searchsorted(starts, issue_ts, side="right") - 1
    while True:
        ended = (at >= 0) & (ends[np.maximum(at, 0)] <= issue_ts)
        if not ended.any():
            break
        at[ended] = previous[at[ended]]
    return [units[i] if i >= 0 else None for i in at]


def _previous_longer(ends: np.ndarray) -> np.ndarray:
    """For each label, the nearest earlier one that ends strictly later (-1 if none): a monotonic stack."""
    previous = np.full(len(ends), -1, dtype=np.int64)
    stack: list[int] = []
    for i, end in enumerate(ends.tolist()):
        while stack and ends[stack[-1]] <= end:
            stack.pop()
        previous[i] = stack[-1] if stack else -1
        stack.append(i)
    return previous


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


def _cpu_p2p(main_gloo: pd.DataFrame) -> pd.DataFrame:
    """gloo's send/recv spans on the training thread: gloo runs point-to-point there, each span from the
    ``c10d::send``/``recv_`` op that posts it to the transfer's completion (its own start is its issue)."""
    is_p2p = np.array([get_collective_kind(str(n)) == "send_recv" for n in main_gloo["name"]], dtype=bool)
    spans = main_gloo[is_p2p]
    start = spans["ts"].to_numpy()
    return pd.DataFrame({"start": start, "end": spans["end"].to_numpy(), "issue_ts": start, "kind": "send_recv"})


def _cpu_comm(events: pd.DataFrame, main_mask: pd.Series) -> pd.DataFrame:
    is_gloo = events["name"].str.startswith("gloo:")
    spans = events[is_gloo & ~main_mask].sort_values("ts", kind="stable")
    is_enqueue = events["name"].str.startswith("c10d::") & ~events["name"].str.contains("wait", case=False)
    enqueues = events[is_enqueue & main_mask].sort_values("ts", kind="stable")
    kinds, issue = _match_gloo_to_enqueue(spans, enqueues)
    gloo = pd.DataFrame(
        {"start": spans["ts"].to_numpy(), "end": spans["end"].to_numpy(), "issue_ts": issue, "kind": kinds}
    )
    p2p = _cpu_p2p(events[is_gloo & main_mask])
    if len(p2p):
        gloo = pd.concat([gloo, p2p], ignore_index=True).sort_values("start", kind="stable").reset_index(drop=True)
    holds = events[events["name"].str.startswith(_LINKEMU_HOLD) & main_mask].sort_values("ts", kind="stable")
    if holds.empty:
        return gloo
    return _attach_holds(gloo, holds, _get_labels(events[main_mask]))


def _attach_holds(gloo: pd.DataFrame, holds: pd.DataFrame, labels: pd.DataFrame) -> pd.DataFrame:
    """Extend each emulated collective to the end of its ``linkemu::hold_<kind>`` span
    (the "Emulated links" item of [Note: trace metrics]: the pairing rules are there).

    ``gloo``: the collectives (``start, end, issue_ts, kind``); ``holds``: the hold spans,
    in start order; ``labels``: the training thread's FSDP labels. Returns ``gloo`` with
    each held collective's ``end`` moved to its hold's end, plus a row per unpaired hold.
    Once a hold is paired, the unpaired collectives of its kind issued before its own are
    retired: they were waited for earlier, without a hold.
    """
    gloo = gloo.reset_index(drop=True)
    issue, kinds, transfer_end = gloo["issue_ts"].to_numpy(), gloo["kind"].to_numpy(), gloo["end"].to_numpy()
    ends = transfer_end.astype(float)
    units = np.array(_assign_units(issue, labels), dtype=object)
    hold_units = _assign_units(holds["ts"].to_numpy(), labels)
    waiting = np.ones(len(gloo), dtype=bool)
    own = []
    for (name, hold_start, hold_end), hold_unit in zip(
        holds[["name", "ts", "end"]].itertuples(index=False), hold_units
    ):
        kind = name.removeprefix(_LINKEMU_HOLD)
        kind = _HOLD_KINDS.get(kind, kind if kind in COMM_KINDS else "other")
        candidates = np.flatnonzero(
            waiting & (kinds == kind) & (issue <= hold_start) & (transfer_end <= hold_start + _HOLD_FOLLOWS_US)
        )
        if len(candidates) == 0:
            own.append((hold_start, hold_end, hold_start, kind))
            continue
        same_unit = candidates[units[candidates] == hold_unit] if hold_unit is not None else candidates[:0]
        follows = candidates[transfer_end[candidates] >= hold_start - _HOLD_FOLLOWS_US]
        if len(same_unit):
            chosen = same_unit[np.argmax(issue[same_unit])]
        elif len(follows):
            chosen = follows[np.argmax(transfer_end[follows])]
        else:
            chosen = candidates[np.argmin(issue[candidates])]
        ends[chosen] = max(ends[chosen], hold_end)
        waiting[candidates[issue[candidates] <= issue[chosen]]] = False
    out = gloo.assign(end=ends)
    if own:
        out = pd.concat([out, pd.DataFrame.from_records(own, columns=list(gloo.columns))], ignore_index=True)
    return out.sort_values("start", kind="stable").reset_index(drop=True)


def _gpu_kernels(events: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, int, pd.DataFrame]:
    """(compute, comm, number dropped, device ops): kernels with their launch's start on the host
    as issue time; kernels whose launch is not in the trace are dropped (as HTA does). Device
    ops are every launched kernel, memcpy and memset with its class ([Note: kernel classes])."""
    launches = events.loc[
        events["cat"].isin(_LAUNCH_CATS).to_numpy() & (events["correlation"].to_numpy() >= 0), ["correlation", "ts"]
    ]
    order = np.argsort(launches["correlation"].to_numpy(), kind="stable")
    launch_corr, launch_ts = launches["correlation"].to_numpy()[order], launches["ts"].to_numpy()[order]
    device_ops = _get_device_ops(events, launch_corr, launch_ts)
    kernels = events[(events["cat"] == "kernel").to_numpy()]
    corr = kernels["correlation"].to_numpy()
    at = np.searchsorted(launch_corr, corr, side="right") - 1  # the last launch with that correlation
    launched = (
        (at >= 0) & (launch_corr[np.maximum(at, 0)] == corr) if len(launch_corr) else np.zeros(len(corr), dtype=bool)
    )
    kernels = kernels[launched]
    frame = pd.DataFrame(
        {"start": kernels["ts"].to_numpy(), "end": kernels["end"].to_numpy(), "issue_ts": launch_ts[at[launched]]}
    )
    is_comm = get_name_mask(kernels["name"], _NCCL_KERNEL)
    is_compute = ~is_comm & ~get_name_mask(kernels["name"], _MEMORY_KERNEL)
    comm = frame[is_comm].assign(kind=[get_collective_kind(str(n)) for n in kernels["name"].to_numpy()[is_comm]])
    return frame[is_compute].reset_index(drop=True), comm.reset_index(drop=True), int((~launched).sum()), device_ops


def _get_device_ops(events: pd.DataFrame, launch_corr: np.ndarray, launch_ts: np.ndarray) -> pd.DataFrame:
    """``start, end, issue_ts, cls``: every kernel, memcpy and memset whose launch is in the trace."""
    ops = events[events["cat"].isin(_DEVICE_CATS).to_numpy()]
    corr = ops["correlation"].to_numpy()
    at = np.searchsorted(launch_corr, corr, side="right") - 1
    launched = (
        (at >= 0) & (launch_corr[np.maximum(at, 0)] == corr) if len(launch_corr) else np.zeros(len(corr), dtype=bool)
    )
    ops = ops[launched]
    classes = {name: get_kernel_class(str(name)) for name in pd.unique(ops["name"])}
    return (
        pd.DataFrame(
            {
                "start": ops["ts"].to_numpy(),
                "end": ops["end"].to_numpy(),
                "issue_ts": launch_ts[at[launched]],
                "cls": pd.Categorical([classes[n] for n in ops["name"]], categories=KERNEL_CLASSES),
            }
        )
        .sort_values("start", kind="stable")
        .reset_index(drop=True)
    )


def classify_events(trace: RankTrace) -> RankEvents:
    """Reduce a loaded trace to steps, compute, collectives and FSDP labels (see [Note: trace metrics])."""
    events = trace.events
    pid, tid = _training_thread(events)
    main_mask = ((events["pid"] == pid) & (events["tid"] == tid) & (events["cat"] != "gpu_user_annotation")).to_numpy()
    # On a GPU the backward's hooks run on autograd's device thread, not the training thread:
    # FSDP labels are read from every host thread there (the training thread waits in
    # ``backward()`` meanwhile, so the two threads' labels do not interleave).
    host = (events["cat"] != "gpu_user_annotation").to_numpy()
    labels = _get_labels(events[host] if trace.device == "gpu" else events[main_mask])
    num_unlaunched, device_ops = 0, _NO_DEVICE_OPS
    if trace.device == "gpu":
        compute, comm, num_unlaunched, device_ops = _gpu_kernels(events)
    else:
        compute, comm = _cpu_compute(events[main_mask]), _cpu_comm(events, pd.Series(main_mask, index=events.index))
    is_barrier = (comm["kind"] == BARRIER).to_numpy()
    barriers = comm[is_barrier][["start", "end", "issue_ts"]].reset_index(drop=True)
    comm = comm[~is_barrier].sort_values("start", kind="stable").reset_index(drop=True)
    comm["unit"] = pd.Series(_assign_units(comm["issue_ts"].to_numpy(), labels), dtype=object)
    return RankEvents(
        rank=trace.rank,
        path=trace.path,
        device=trace.device,
        steps=_get_steps(events, main_mask),
        compute=compute,
        comm=comm[["start", "end", "issue_ts", "kind", "unit"]],
        barriers=barriers,
        labels=labels,
        stage_labels=_get_stage_labels(events[main_mask]),
        memory=trace.memory,
        units=list(dict.fromkeys(labels["unit"])),
        num_unlaunched_kernels=num_unlaunched,
        device_ops=device_ops,
    )
