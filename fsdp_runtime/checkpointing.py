"""Activation checkpointing of one module, applied before ``fully_shard``, module paths unchanged.

[Note: activation checkpointing under FSDP2]
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` (what torchtitan uses)
replaces a block by a wrapper holding it as ``_checkpoint_wrapped_module``: every module
and parameter path inside the block changes (``layers.0._checkpoint_wrapped_module.attention.wq.weight``),
so unit names, FSDP2's trace labels and optimizer-state keys would no longer be the paths
the user sees. Here the module itself stays where it is: its ``forward`` becomes an
instance attribute (:class:`CheckpointedForward`) that runs the class's forward under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.

Order of events with FSDP2 (``fully_shard`` is applied after this, so its hooks run in the
module's ``__call__`` around the checkpointed forward): pre-forward all-gathers the unit;
the checkpointed forward runs and keeps only what the policy saves; post-forward reshards
and registers the pre-backward hook on the outputs. In backward that hook all-gathers the
unit again *before* autograd reaches the block's first node, and the recomputation (which
calls the class's forward directly, not ``__call__``, so no FSDP hook runs twice) sees the
unsharded parameters. The root and units that hold other units are not checkpointed
(``validate_config``): their recomputation would run the inner units' hooks again.

``full`` saves only the module's inputs. ``selective`` (op-level, as torchtitan's per-op
policy): outputs of matmuls and attention are saved, everything else (element-wise ops,
norms, RoPE, activations) is recomputed, through ``create_selective_checkpoint_contexts``.
Recomputation runs the same CPU kernels on the same inputs, and the checkpoint restores the
RNG state, so losses are bitwise equal to no checkpointing (tested multi-rank).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, noop_context_fn

_aten = torch.ops.aten
SAVED_OP_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
"""The aten ops whose outputs ``selective`` checkpointing saves, by name (the simulator prices the same)."""
SAVED_OPS = frozenset(getattr(_aten, name).default for name in SAVED_OP_NAMES if hasattr(_aten, name))
"""Ops whose outputs ``selective`` checkpointing saves (those this torch build has)."""


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_selective_policy)


class CheckpointedForward:
    """A module's checkpointed ``forward`` (see [Note: activation checkpointing under FSDP2]).

    A callable object rather than a closure, so that ``copy.deepcopy`` of the module before
    sharding points the copy's forward at the copy. ``num_forwards`` / ``num_runs`` count
    calls and executions of the wrapped forward: ``num_runs - num_forwards`` recomputations.
    """

    def __init__(self, module: nn.Module, kind: str) -> None:
        if kind not in ("selective", "full"):
            raise ValueError(f"activation checkpointing kind {kind!r}: expected 'selective' or 'full'")
        self.module = module
        self.kind = kind
        self.inner = module.__dict__.get("forward")  # an instance forward set by someone else, kept
        self.num_forwards = 0
        self.num_runs = 0

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        self.num_runs += 1
        return self._forward(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self._forward(*args, **kwargs)  # nothing is saved without autograd
        self.num_forwards += 1
        context_fn = _selective_contexts if self.kind == "selective" else noop_context_fn
        return checkpoint(self._run, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    @property
    def num_recomputes(self) -> int:
        return self.num_runs - self.num_forwards


def apply_checkpointing(module: nn.Module, kind: str) -> CheckpointedForward | None:
    """Checkpoint ``module``'s forward (``kind``: ``none``, ``selective``, ``full``); its module
    and parameter paths stay as they are. Returns the installed forward (None for ``none``)."""
    if kind == "none":
        return None
    if isinstance(module.__dict__.get("forward"), CheckpointedForward):
        raise ValueError(f"{type(module).__name__} is already checkpointed (apply_fsdp was called twice on one model?)")
    forward = CheckpointedForward(module, kind)
    module.forward = forward  # type: ignore[method-assign]
    return forward
