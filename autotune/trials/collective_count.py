"""Counts the collectives a process issues while a :class:`CollectiveCounter` is active, by kind.

[Note: counting collectives]
FSDP2 reaches its all-gathers and reduce-scatters through ``torch.distributed``'s functions,
``ProcessGroup`` methods or functional collectives, depending on the torch version and the
knob; every one of those paths ends in a c10d op of torch's dispatcher (``c10d::_allgather_base_``,
``c10d::reduce_scatter_tensor_coalesced_``, ``_c10d_functional::all_gather_into_tensor``, ...),
on gloo and on NCCL alike. A ``TorchDispatchMode`` sees every op dispatched while it is active,
so counting those ops counts what the process group was asked to run, however FSDP2 asked it.
Not ``CommDebugMode``: its module tracker's hooks keep every model it saw alive. A mode passes
each op on unchanged (``func(*args, **kwargs)``); the tests' harness counts the same way and
checks its counts against a patch of the ``torch.distributed`` functions FSDP2 calls.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["COLLECTIVE_KINDS", "CollectiveCounter"]

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
"""The kinds counted by name; any other c10d op is counted under its op name."""


_OPS = {
    "all_gather": (
        "_allgather_base_",
        "allgather_",
        "allgather_into_tensor_coalesced_",
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
    ),
    "reduce_scatter": (
        "_reduce_scatter_base_",
        "reduce_scatter_",
        "reduce_scatter_tensor_coalesced_",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
    ),
    "all_reduce": ("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_coalesced"),
}
"""Op names by kind: c10d's in-place ops (``_`` at the end) and the functional collectives."""
_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


def _get_kinds() -> dict[Any, str]:
    """The op packets of c10d's collectives -> their kind, for every one this torch has."""
    kinds = {}
    for kind, names in _OPS.items():
        for namespace in _NAMESPACES:
            for name in names:
                try:  # an op a torch version lacks is one it cannot issue
                    kinds[getattr(getattr(torch.ops, namespace), name)] = kind
                except (AttributeError, RuntimeError):
                    continue
    return kinds


class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter() as counter: ...`` -> ``counter.counts``: how many collectives of
    each kind ran inside, on any process group ([Note: counting collectives])."""

    def __init__(self) -> None:
        super().__init__()
        self.kinds = _get_kinds()
        self.counts: dict[str, int] = dict.fromkeys(COLLECTIVE_KINDS, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet in self.kinds or str(packet).startswith(tuple(f"{n}." for n in _NAMESPACES)):
            kind = self.kinds.get(packet, str(packet))
            self.counts[kind] = self.counts.get(kind, 0) + 1
        return func(*args, **(kwargs or {}))
