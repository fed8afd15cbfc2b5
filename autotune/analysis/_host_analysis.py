"""HostAnalyzer: per rank, profiled step and FSDP unit, the time FSDP2's own hooks keep the host busy.

[Note: host-bound steps]
FSDP2 runs Python hooks around every unit (``FSDP::pre_forward``, ``post_forward``,
``pre_backward``, ``post_backward_*``, the root's ``root_pre_forward`` and its callback): they
copy parameters in and out of the all-gather buffers, issue collectives and keep their state.
A step whose time goes there is *host-bound*: no communication schedule helps it, fewer and
larger units (``blocks_per_unit``) or fewer small units do (pytorch #173680: ``pre_forward`` at
half of a CPU-bound step, 18% faster with tiny modules not sharded). The figure:

- ``hook_ms``: the union of the training thread's ``FSDP::`` labels in the step (the hooks and
  what they nest: all-gather issue, copy-out, the reduce-scatter's wait);
- ``host_ms``: the part of it that is FSDP's own work holding the step up. CPU traces: the hooks
  intersected with the step's compute (the training thread's ops, so neither a wait on a
  collective nor a thread blocked in gloo counts). GPU traces: the hooks while the device runs
  nothing (no kernel, memcpy or memset of the rank in flight): the device waits for the host;
- ``forward_host_ms``, ``backward_host_ms``: ``host_ms`` of the hooks (the labels no other one
  encloses) whose phase names a backward (``pre_backward``, ``post_backward_*``,
  ``backward_prefetch``, the root's callback) or not, per unit.

A step is named host-bound where ``host_ms`` is at least :data:`HOST_BOUND_SHARE` of it: on a
GPU 5% of the step with the device idle while the host is in FSDP's hooks (time no schedule
hides); on CPU a fifth of the step in FSDP's own work, where compute is the host's anyway and a
share that size is FSDP's overhead rather than the model's. On the recorded H200 trials
(``tests/data/gpu_traces``, torch 2.11, 2026-11-27): Llama 1B with selective checkpointing 8.9%
and with full checkpointing 8.2% (the trials ``autotune.sim.host_path`` calls host-bound), the
defaults 1.3%, Llama 8B (4 layers) 0.3%; the 2-rank CPU ``tiny`` trial in ``tests/data`` 10-21%.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from autotune.analysis import _intervals as iv
from autotune.analysis._comm_metrics import US_PER_MS
from autotune.analysis._events import RankEvents
from autotune.analysis._steps import get_step_slices

HOST_BOUND_SHARE = {"cpu": 0.20, "gpu": 0.05}
"""The share of a step in FSDP's own host work from which the step is host-bound ([Note: host-bound steps])."""
HOST_COLUMNS = ["rank", "step", "step_ms", "hook_ms", "host_ms", "forward_host_ms", "backward_host_ms"]
UNIT_HOST_COLUMNS = ["rank", "step", "unit", "forward_host_ms", "backward_host_ms"]


def is_backward_phase(phase: str) -> bool:
    """An ``FSDP::`` label of backward (``pre_backward``, ``post_backward_reduce``, ``backward_prefetch``, ...)."""
    return "backward" in phase


def get_top_labels(labels: pd.DataFrame) -> pd.DataFrame:
    """The labels no other label encloses (a hook; what it nests, such as the all-gather it issues, is
    its), in time order: each is counted once, in the phase of the hook it belongs to."""
    ordered = labels.sort_values(["start", "end"], ascending=[True, False], kind="stable")
    ends = ordered["end"].to_numpy(dtype=float)
    reach = np.maximum.accumulate(np.concatenate([[-np.inf], ends[:-1]])) if len(ends) else ends
    return ordered[ordered["start"].to_numpy(dtype=float) >= reach]


class HostAnalyzer:
    """One row per (rank, profiled step), and one per (rank, profiled step, FSDP unit)."""

    @staticmethod
    def _host_spans(device_busy: np.ndarray | None, labels: pd.DataFrame, s) -> np.ndarray:
        """The hooks ``labels`` in step ``s`` while the device is idle (GPU: ``device_busy``), or
        while the training thread computes (CPU: ``device_busy`` None)."""
        hooks = iv.clip(iv.union(labels[["start", "end"]].to_numpy(dtype=float)), s.start, s.end)
        return iv.subtract(hooks, device_busy) if device_busy is not None else iv.intersect(hooks, s.compute)

    @classmethod
    def get_host_metrics(cls, events: RankEvents) -> tuple[pd.DataFrame, pd.DataFrame]:
        """``(steps, units)``: columns :data:`HOST_COLUMNS` and :data:`UNIT_HOST_COLUMNS`, ms."""
        labels = get_top_labels(events.labels)
        backward = labels["phase"].map(is_backward_phase).astype(bool) if len(labels) else pd.Series([], dtype=bool)
        busy = iv.union(events.device_ops[["start", "end"]].to_numpy(dtype=float)) if events.device == "gpu" else None
        steps, units = [], []
        for s in get_step_slices(events):
            hooks = iv.clip(iv.union(labels[["start", "end"]].to_numpy(dtype=float)), s.start, s.end)
            fwd = iv.total(cls._host_spans(busy, labels[~backward], s)) / US_PER_MS
            bwd = iv.total(cls._host_spans(busy, labels[backward], s)) / US_PER_MS
            host = iv.total(cls._host_spans(busy, labels, s)) / US_PER_MS
            step = (s.end - s.start) / US_PER_MS
            steps.append([events.rank, s.step, step, iv.total(hooks) / US_PER_MS, host, fwd, bwd])
            for unit in events.units:
                mine = (labels["unit"] == unit).to_numpy()
                units.append(
                    [
                        events.rank,
                        s.step,
                        unit,
                        iv.total(cls._host_spans(busy, labels[mine & ~backward.to_numpy()], s)) / US_PER_MS,
                        iv.total(cls._host_spans(busy, labels[mine & backward.to_numpy()], s)) / US_PER_MS,
                    ]
                )
        return pd.DataFrame(steps, columns=HOST_COLUMNS), pd.DataFrame(units, columns=UNIT_HOST_COLUMNS)
