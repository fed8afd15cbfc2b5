"""Consolidate an FSDP2-sharded model and optimizer into one full state on rank 0.

    from fsdp_runtime import consolidate_state, save_consolidated_checkpoint
    model_sd, optim_sd = consolidate_state(model, optimizer, method="all_gather")
    save_consolidated_checkpoint("ckpt/step100.pt", model, optimizer)

The full state has the layout of ``torch.distributed.checkpoint.state_dict`` with
``full_state_dict=True``: the model state dict maps FQNs to full tensors; the optimizer
state dict is ``{"state": {fqn: {"step": ..., "exp_avg": ..., ...}}, "param_groups":
[{..., "params": [fqn, ...]}]}``. Three methods produce it (``CheckpointConfig.consolidation``):

- ``all_gather``: every sharded tensor is packed into a few flat buffers and gathered with
  one ``all_gather_into_tensor`` per buffer. See [Note: all_gather consolidation] in
  ``_all_gather.py``.
- ``broadcast``: the baseline, one broadcast per tensor per source rank (``_broadcast.py``).
- ``dcp``: ``torch.distributed.checkpoint.state_dict``, the reference (``_dcp.py``).

Modules: ``_leaves`` (the state's leaves and their shard layout), one module per method,
``_state`` (:func:`consolidate_state`), ``_files`` (checkpoint files, written atomically).
"""

from fsdp_runtime.consolidate._all_gather import DEFAULT_BUCKET_BYTES
from fsdp_runtime.consolidate._files import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    CheckpointError,
    load_consolidated_checkpoint,
    save_consolidated_checkpoint,
)
from fsdp_runtime.consolidate._state import METHODS, Method, check_method, consolidate_state, get_optimizer_state_by_fqn

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_VERSION",
    "DEFAULT_BUCKET_BYTES",
    "METHODS",
    "CheckpointError",
    "Method",
    "check_method",
    "consolidate_state",
    "get_optimizer_state_by_fqn",
    "load_consolidated_checkpoint",
    "save_consolidated_checkpoint",
]
