"""Where the torch releases fsdp_runtime supports differ: each difference probed on the live objects.

[Note: torch versions]
Read from the ``torch/distributed/fsdp/_fully_shard/`` of the 2.11.0, 2.12.0, 2.13.0 and 2.14.1
wheels; only what this project touches:

- The param groups of an ``FSDPState``. 2.11: ``_fsdp_param_group``, one ``FSDPParamGroup`` or
  None. Since 2.12 (pytorch #173509, per-parameter meshes): ``_fsdp_param_groups``, a list;
  ``_fsdp_param_group`` is then a property that raises with more than one group, so the list is
  probed first and the property never read.
- The comm context's reduce-scatter state. 2.11: ``reduce_scatter_state``, one or None. Since
  2.12 (pytorch #177319): ``reduce_scatter_states``, a list; since 2.13 capped by
  ``reduce_scatter_max_input_buffers``. fsdp_runtime reads neither (only the knob that sets
  the cap), so no branch here needs them.
- ``FSDPModule.set_reduce_scatter_max_input_buffers``: 2.13 on (pytorch #186000; not in 2.12).
  Before it FSDP2 kept exactly one buffer, so a config asking for 1 is met on every release.
- ``FSDPModule._set_unshard_async_op``: every release read (added in 2.6, pytorch #135523);
  private, so probed like a setter that may go.
  (A knob's method, release and source are declared with the knob: ``method``, ``since`` and
  ``source`` in :mod:`fsdp_runtime.knobs`, which probes them: [Note: the knob registry].)
- ``FSDPParam.unsharded_accumulated_grad``: through 2.14 an attribute, the gradients accumulated
  in the reduce dtype when it is wider than the parameters' (set and cleared by FSDP2 and by
  eager concat); in 2.15 a read-only property returning the unsharded parameter's ``.grad``
  (FSDP2 keeps no buffer of its own for it). Probed on the class, as a property or not.
- The same in all four: ``_get_fsdp_state``, ``set_requires_gradient_sync`` /
  ``set_requires_all_reduce`` / ``set_reshard_after_backward`` (keyword ``recurse``),
  ``set_modules_to_{forward,backward}_prefetch``, ``fully_shard`` of a module list with an int
  ``reshard_after_forward``, ``FSDPState._states_to_{forward,backward}_prefetch``; per param group
  ``post_backward`` (called through the instance, so a per-instance wrapper takes effect),
  ``reduce_grads``, ``fsdp_params``, ``_with_fqn``; per ``FSDPParam`` ``_unsharded_param``.

2.15.0 has every other name above in the 2.14.1 layout (read from its wheel; found by running the
tests under it). CI runs the tests of the
paths a GPU run takes under 2.11.0, 2.14.1 and 2.15.0 besides the pinned 2.13.0 (``./dev torch``,
the ``torch_matrix`` marker), so pyproject's range is those releases. Nothing here parses a
version string: each branch is taken by what the object has, so a later release with either
layout takes its branch, and one with neither fails with one line naming the attribute.
"""

from __future__ import annotations

from typing import Any

import torch

MIN_TORCH = "2.11"
"""The oldest torch whose FSDP2 layout this module covers (pyproject's floor)."""
TESTED_TORCH = ("2.11.0", "2.13.0", "2.14.1", "2.15.0")
"""The releases CI runs the GPU run's paths under: the pinned CPU wheel's and ``.ci/run``'s matrix."""
BELOW_TORCH = "2.16"
"""pyproject's ceiling: the first release no test has run under."""


def get_param_groups(state: Any) -> list[Any]:
    """An ``FSDPState``'s ``FSDPParamGroup``s, in either layout ([Note: torch versions])."""
    if hasattr(state, "_fsdp_param_groups"):  # 2.12+: first, the singular property raises with several groups
        return list(state._fsdp_param_groups)
    if hasattr(state, "_fsdp_param_group"):  # 2.11: one optional group
        group = state._fsdp_param_group
        return [] if group is None else [group]
    raise RuntimeError(
        f"torch {torch.__version__}: {type(state).__name__} has neither _fsdp_param_groups (torch >= 2.12) "
        f"nor _fsdp_param_group (torch 2.11); fsdp_runtime reads FSDP2's param groups from one of them"
    )


def has_accumulated_grad_slot(fsdp_param: Any) -> bool:
    """Whether an ``FSDPParam`` keeps gradients accumulated in the reduce dtype apart from its
    parameter's ``.grad`` ([Note: torch versions]): an attribute through 2.14; since 2.15 a
    read-only property returning the unsharded parameter's ``.grad``, which must be neither read
    as a second slot nor set."""
    return not isinstance(getattr(type(fsdp_param), "unsharded_accumulated_grad", None), property)


RESET_ITER_STATE_SINCE = "2.13"


def can_reset_iter_state(module: Any) -> bool:
    """Whether FSDP2 recovers a root from a forward or backward aborted mid-flight
    (``FSDPModule.reset_iter_state``, public since 2.13; 2.11 has none)."""
    return hasattr(module, "reset_iter_state")


def get_default_store() -> Any | None:
    """The default process group's store (``distributed_c10d._get_default_store``, private; torch
    2.11 to 2.15), or None where there is no group or no such function."""
    import torch.distributed as dist

    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None or not dist.is_initialized():
        return None
    try:
        return getter()
    except (RuntimeError, ValueError):
        return None


def abort_process_group() -> bool:
    """Abort the default process group's communicators where the backend can (NCCL;
    ``distributed_c10d._abort_process_group``, private; torch 2.11 to 2.15): a collective waiting
    on a rank that will never join it then returns with an error. False where it cannot (gloo)."""
    import torch.distributed as dist

    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None or not dist.is_initialized() or "nccl" not in str(dist.get_backend()).lower():
        return False
    try:
        abort()
    except RuntimeError:
        return False
    return True
