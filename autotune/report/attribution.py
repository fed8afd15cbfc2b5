"""Where a GPU trial's step goes on the device: its kernels' time by class and by part of the step.

[Note: GPU step attribution]
A GPU trace's step is launch time on the host and kernels on the device; the report shows
the device side. Every kernel, memcpy and memset of a profiled step is counted once, by
:func:`autotune.sim.get_kernel_costs`: under its class ([Note: kernel classes] in
``autotune.analysis``: GEMM, attention forward and backward, copies and casts, ...) and under
the part of the step whose host span launched it (a key: ``block.forward``,
``unshard_local.block``, ``optimizer``, ...). The report groups those keys into parts
(:data:`PARTS`, :func:`get_part`): the model's forward (``head``/``block``/``tail.forward``;
``tail.forward`` also holds the loss's backward: the loss runs before the root's
pre-backward hook), its backward, FSDP2's unshard (``unshard*``, ``pre_hook``: copy-in and
all-gather copy-out), FSDP2's reduce (``reduce*``, ``post_hook``, FSDP1-style eager
``concat``/``restore``: gradient packing and reduce-scatter), the optimizer and the rest. Each
figure is a median per step over ranks and profiled steps; idle is the device's time in the
step with no kernel running, and the span runs from the step's first kernel to the next
step's. Kernels on several streams can run at once (NCCL under compute): their sum then
exceeds span - idle by :attr:`StepAttribution.overlap_ms`. The unit names come from the
trace's FSDP2 labels (no model is built): every unit but the root is a "block" (a unit of
several blocks counts once; embeddings or head split off as units of their own are taken for
the first and last block), and a "block x microbatch" is one of them in one microbatch, the
microbatches counted by the root's forwards. A trace without labels has only its classes,
every kernel under ``other``. Times are as traced, never scaled to the unprofiled step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.analysis import KERNEL_CLASSES
from autotune.sim import CalibrationError, get_kernel_costs
from fsdp_runtime import ROOT_UNIT

if TYPE_CHECKING:
    from autotune.analysis import FsdpTraceAnalysis

PARTS = {
    "forward": "model forward",
    "backward": "model backward",
    "unshard": "FSDP2 unshard",
    "reduce": "FSDP2 reduce",
    "optimizer": "optimizer",
    "other": "other",
}
"""Part of the step -> its title, in the order tables list them (see [Note: GPU step attribution])."""
CLASS_TITLES = {
    "gemm": "GEMM",
    "attention_forward": "attention forward",
    "attention_backward": "attention backward",
    "elementwise": "elementwise",
    "loss": "loss (softmax, NLL)",
    "copy": "copies and casts",
    "memset": "memset",
    "optimizer": "optimizer (foreach)",
    "communication": "communication (NCCL)",
}
"""Kernel class -> its title, in ``autotune.analysis.KERNEL_CLASSES`` order."""
CLASS_SHORT = {
    "gemm": "GEMM",
    "attention_forward": "attn fwd",
    "attention_backward": "attn bwd",
    "elementwise": "elementwise",
    "loss": "loss",
    "copy": "copy",
    "memset": "memset",
    "optimizer": "optimizer",
    "communication": "NCCL",
}
"""Kernel class -> a short name (where a table lists several in one cell)."""
_COMPUTE_SIDES = ("head", "block", "tail")
_HOOK_TITLES = {
    "unshard": "unshard {} (all-gather copy-out)",
    "unshard_local": "unshard {} (local copy)",
    "reduce": "reduce {} (reduce-scatter)",
    "reduce_local": "reduce {} (local copy)",
    "post_hook": "post-backward hook, {}",
    "concat": "eager concat, {}",
    "restore": "eager restore, {}",
}


def get_part(key: str) -> str:
    """The part of the step (a key of :data:`PARTS`) a kernel-cost key counts under."""
    head, _, tail = key.partition(".")
    if head in _COMPUTE_SIDES and tail in ("forward", "backward"):
        return tail
    if head.startswith("unshard") or head == "pre_hook":
        return "unshard"
    if head.startswith("reduce") or head in ("post_hook", "concat", "restore"):
        return "reduce"
    return "optimizer" if key == "optimizer" else "other"


@dataclass(kw_only=True)
class UnitCost:
    """One part of the step per call: a block's forward per block per microbatch, a hook per call."""

    title: str
    key: str
    part: str
    per: str
    """What one call is: ``block x microbatch``, ``microbatch``, ``call`` (a hook's label) or ``step``."""
    calls: float | None
    """Calls per step (None: unknown, the trace has no root labels to count microbatches by)."""
    ms: float
    """Device ms per step."""
    classes: dict[str, float]
    """Kernel class -> device ms per step, largest first."""

    @property
    def ms_per_call(self) -> float | None:
        return self.ms / self.calls if self.calls else None


@dataclass(kw_only=True)
class StepAttribution:
    """One GPU trial's device time per step by kernel class and part (see [Note: GPU step attribution])."""

    ms: dict[tuple[str, str], float] = field(default_factory=dict)
    """``(kernel-cost key, kernel class)`` -> device ms per step (median over ranks and profiled steps)."""
    calls: dict[str, float] = field(default_factory=dict)
    """Hook key -> labels per step."""
    span_ms: float = 0.0
    idle_ms: float = 0.0
    num_steps: int = 0
    """Profiled steps over all ranks the medians are over."""
    num_ranks: int = 0
    blocks: list[str] = field(default_factory=list)
    """The FSDP units other than the root, in forward order (from the trace's labels)."""
    num_microbatches: int | None = None
    """Root forwards per step in the trace (None: no root labels)."""
    local: bool = False
    """The shard group is one rank: FSDP2 copies instead of gathering and reducing."""
    error: str | None = None
    """Why there is no attribution (the traces' steps hold no kernels); the rest is then empty."""

    def by_class(self) -> dict[str, float]:
        """Kernel class -> ms per step, every class of ``KERNEL_CLASSES`` in its order (0 where none ran)."""
        out = dict.fromkeys(KERNEL_CLASSES, 0.0)
        for (_, cls), ms in self.ms.items():
            out[cls] = out.get(cls, 0.0) + ms
        return out

    def by_part(self) -> dict[str, float]:
        """Part of the step (:data:`PARTS`) -> ms per step, in :data:`PARTS` order."""
        out = dict.fromkeys(PARTS, 0.0)
        for (key, _), ms in self.ms.items():
            out[get_part(key)] += ms
        return out

    def by_part_class(self) -> dict[tuple[str, str], float]:
        """``(part, class)`` -> ms per step (only the pairs that ran)."""
        out: dict[tuple[str, str], float] = {}
        for (key, cls), ms in self.ms.items():
            out[get_part(key), cls] = out.get((get_part(key), cls), 0.0) + ms
        return out

    @property
    def kernel_ms(self) -> float:
        """The classes' sum: device ms per step in kernels (overlapping kernels counted each)."""
        return sum(self.ms.values())

    @property
    def overlap_ms(self) -> float:
        """How much longer the kernels' sum is than the busy time (span - idle): kernels running at once."""
        return self.kernel_ms - (self.span_ms - self.idle_ms)

    def get_unit_costs(self) -> list[UnitCost]:
        """Every key with device time, per call: ``block.*`` per block per microbatch, ``head``/``tail``
        per microbatch, hooks per label, the optimizer per step; in :data:`PARTS` order, largest first."""
        keys: dict[str, dict[str, float]] = {}
        for (key, cls), ms in self.ms.items():
            keys.setdefault(key, {})[cls] = ms
        rows = [
            UnitCost(
                title=self._title(key),
                key=key,
                part=get_part(key),
                per=self._per(key),
                calls=self._calls(key),
                ms=sum(classes.values()),
                classes=dict(sorted(classes.items(), key=lambda kv: -kv[1])),
            )
            for key, classes in keys.items()
            if sum(classes.values()) > 0
        ]
        order = list(PARTS)
        return sorted(rows, key=lambda r: (order.index(r.part), -r.ms))

    def _calls(self, key: str) -> float | None:
        head, _, tail = key.partition(".")
        mb = self.num_microbatches
        if head in _COMPUTE_SIDES and tail in ("forward", "backward"):
            return (mb * max(len(self.blocks), 1) if head == "block" else mb) if mb else None
        if key == "optimizer":
            return 1.0
        return self.calls.get(key) or None

    def _title(self, key: str) -> str:
        head, _, tail = key.partition(".")
        if head in _COMPUTE_SIDES and tail in ("forward", "backward"):
            what = {"head": "embeddings", "tail": "norm, output" + (", loss fwd+bwd" if tail == "forward" else "")}
            return f"{head} {tail}" + (f" ({what[head]})" if head in what else "")
        if head == "pre_hook":
            what = "pre-backward hook" if self.local else "pre-forward/backward hook"
            return f"{what}, {tail}"
        if head in _HOOK_TITLES:
            return _HOOK_TITLES[head].format(tail)
        return {"optimizer": "optimizer step", "microbatch": "between labels"}.get(key, key)

    def _per(self, key: str) -> str:
        head, _, tail = key.partition(".")
        if head in _COMPUTE_SIDES and tail in ("forward", "backward"):
            return "block x microbatch" if head == "block" else "microbatch"
        return "step" if key in ("optimizer", "microbatch") else "call"


def count_microbatches(events_by_rank: dict[int, Any]) -> int | None:
    """Root forwards per profiled step (the median over ranks and steps), from the traces' FSDP2 labels."""
    counts = []
    for events in events_by_rank.values():
        labels = events.labels
        if labels.empty:
            continue
        roots = labels[(labels["unit"] == ROOT_UNIT) & (labels["phase"] == "pre_forward")]
        counts += [
            int(((roots["start"] >= step.start) & (roots["end"] <= step.end)).sum())
            for step in events.steps.itertuples(index=False)
        ]
    middle = round(statistics.median(counts)) if counts else 0
    return middle or None


def get_step_attribution(analysis: FsdpTraceAnalysis, *, shard_size: int | None = None) -> StepAttribution | None:
    """One trial's attribution from its parsed traces; None for CPU traces (no device kernels).

    ``shard_size``: ranks per shard group (the trial's mesh); None: one group of every traced rank."""
    if analysis.device != "gpu":
        return None
    events = analysis.events
    blocks = [u for u in next(iter(events.values())).units if u != ROOT_UNIT]
    local = (shard_size if shard_size is not None else len(events)) == 1
    base = StepAttribution(blocks=blocks, num_ranks=len(events), local=local)
    try:
        costs = get_kernel_costs(events, block_names=tuple(blocks) or ("",), local=local)
    except CalibrationError as e:
        base.error = str(e)
        return base
    base.ms = {k: 1e3 * s for k, s in costs.seconds.items()}
    base.calls = dict(costs.calls)
    base.span_ms, base.idle_ms, base.num_steps = 1e3 * costs.span_s, 1e3 * costs.idle_s, costs.num_steps
    base.num_microbatches = count_microbatches(events)
    return base
