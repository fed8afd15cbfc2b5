"""What the in-job tuner may try on this job: the moves the installed torch can set and switch,
and, before a move that raises memory, whether every rank has the headroom for it.

[Note: in-job memory]
A move of the tuner keeps more bytes live during a step than the best config does where it keeps
parameters or gradients unsharded longer, or more of them at once. :func:`get_extra_bytes` prices
that from the units' own sizes (each parameter's whole element count and the dtypes FSDP2
all-gathers and reduces it in, read from the sharded model), per knob, from config ``a`` to ``b``:

- ``reshard_after_forward`` True -> False on a unit: its unsharded parameters, kept from its
  forward to its backward;
- a deeper forward or backward prefetch: one more unit's unsharded parameters (the largest unit's)
  per step of depth;
- ``reshard_after_backward`` True -> False: the unit's unsharded parameters, kept across microbatches;
- ``sync`` -> ``"last"``: the unit's unsharded gradients, accumulated until the last microbatch;
- eager concat (``defer_concat`` True -> False): the largest unit's flat gradient copy;
- more reduce-scatter buffers in flight: the largest unit's gradients per extra buffer.

Async unshard and ``replica_last`` keep what they hold. The estimate is what the move adds, not
the step's peak: the headroom it is checked against (:func:`get_cuda_headroom`) is the memory the
job has not yet reached, ``free + reserved - peak allocated`` (the peak so far, since the process
started or the job last reset it: every step before ran the best config or a lighter one), and a
move is tried only where every rank's headroom is over the estimate by :data:`HEADROOM_MARGIN`.
On CPU there is no such figure: no check, unless the tuner is given a ``get_headroom``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from fsdp_runtime._fsdp_private import get_unsharded_sizes
from fsdp_runtime.apply import AppliedFsdp
from fsdp_runtime.config import ROOT_UNIT, RuntimeConfig, UnitConfig
from fsdp_runtime.errors import ConfigError
from fsdp_runtime.knob_checks import check_torch_supports
from fsdp_runtime.switch import get_structural_differences, resolve_reshard_after_forward
from fsdp_runtime.tuning.moves import Move

HEADROOM_MARGIN = 1.2
"""A move's estimate times this must fit every rank's headroom: the allocator's rounding and fragmentation."""


@dataclasses.dataclass(frozen=True)
class UnitBytes:
    """One unit's unsharded parameters and gradients, in bytes."""

    params: int
    grads: int


def get_unit_bytes(applied: AppliedFsdp) -> dict[str, UnitBytes]:
    """Each unit's unsharded parameter and gradient bytes, read from the sharded model."""
    sizes = {}
    for name, module in applied.units.items():
        rows = get_unsharded_sizes(module)
        params = sum(n * dtype.itemsize for n, dtype, _ in rows)
        grads = sum(n * reduce.itemsize for n, _, reduce in rows)
        sizes[name] = UnitBytes(params, grads)
    return sizes


def _depth(units: list[UnitConfig], field: str) -> int:
    """The deepest explicit prefetch list; FSDP2's own (None) prefetches one unit in backward, none in forward."""
    implicit = 1 if field == "backward_prefetch" else 0
    return max((implicit if getattr(u, field) is None else len(getattr(u, field)) for u in units), default=0)


def get_extra_bytes(sizes: dict[str, UnitBytes], a: RuntimeConfig, b: RuntimeConfig) -> int:
    """The bytes ``b`` keeps live during a step beyond what ``a`` does ([Note: in-job memory]);
    0 where ``b`` holds no more. Both resolved against the same model (same units)."""
    largest_params = max((s.params for n, s in sizes.items() if n != ROOT_UNIT), default=0)
    largest_grads = max((s.grads for n, s in sizes.items() if n != ROOT_UNIT), default=0)
    extra = 0
    for ua, ub in zip(a.units, b.units, strict=True):
        unit = sizes.get(ub.name, UnitBytes(0, 0))
        if resolve_reshard_after_forward(ua) and not resolve_reshard_after_forward(ub):
            extra += unit.params
        if ua.reshard_after_backward and not ub.reshard_after_backward:
            extra += unit.params
        if ua.sync != "last" and ub.sync == "last":
            extra += unit.grads
    for field in ("forward_prefetch", "backward_prefetch"):
        extra += max(0, _depth(b.units, field) - _depth(a.units, field)) * largest_params
    if any(u.defer_concat for u in a.units) and not all(u.defer_concat for u in b.units):
        extra += largest_grads
    buffers_a, buffers_b = a.reduce_scatter_max_input_buffers or 1, b.reduce_scatter_max_input_buffers or 1
    return extra + max(0, buffers_b - buffers_a) * largest_grads


def get_cuda_headroom() -> int:
    """Bytes this process can still allocate beyond the peak it reached ([Note: in-job memory])."""
    free, _ = torch.cuda.mem_get_info()
    return free + torch.cuda.memory_reserved() - torch.cuda.max_memory_allocated()


def get_default_headroom(device_type: str) -> Callable[[], int | None]:
    """The headroom probe for ``device_type``: CUDA's, else none (no check)."""
    return get_cuda_headroom if device_type == "cuda" else lambda: None


def get_refusals(applied: AppliedFsdp, moves: list[Move]) -> dict[str, str]:
    """The moves the tuner must not offer on this job, each with why, judged from the seed: a knob
    the installed torch cannot set, or a field this torch cannot switch in place on the model."""
    seed = applied.config
    refused = {}
    for move in moves:
        config = move.apply(seed)
        try:
            check_torch_supports(config)
        except ConfigError as e:
            refused[move.name] = e.problem
            continue
        structural = get_structural_differences(seed, config)
        if structural:
            refused[move.name] = f"{', '.join(structural)} cannot be switched in place with torch {torch.__version__}"
    return refused
