"""Every use of FSDP2 internals lives here; where torch releases differ, through :mod:`fsdp_runtime._torch_compat`.

[Note: async unshard on CPU]
On CUDA, FSDP2 overlaps all-gathers with compute by issuing them on a separate stream.
On CPU the "streams" are dummies, so an all-gather issued with ``async_op=False`` blocks
the training thread until it completes, and explicit prefetch only *reorders* blocking
calls. ``FSDPModule._set_unshard_async_op(True)`` (private; torch 2.6 to 2.14 at least, see
[Note: torch versions]) issues the all-gather with ``async_op=True``; the wait moves into
``FSDP::all_gather_copy_out`` when the unit is actually needed. That is what makes prefetch
real on CPU/gloo (measured on a 2-core CPU box, torch 2.13.0+cpu, a 55M-parameter Llama with a
150 ms sleep per block standing in for an accelerator that waits: a step takes 2683 ms with
async + prefetch 1 against 3175 ms blocking). On GPU it has a different meaning (all-gather
allocations on the default stream) and is left off by default.

[Note: concat deferral]
facebookresearch/fairscale#1180 (FSDP1): every parameter of a unit is a view of one flat parameter, so
autograd's ``SplitWithSizesBackward`` *concatenated* the per-parameter gradients into a
fresh flat gradient on every microbatch and added it to ``flat_param.grad``; the PR
deferred that cat() to the last microbatch, accumulating per-parameter gradients until
then (+15% e2e in the seed).

FSDP2 has no flat parameter. Per unit and microbatch it does:
  1. autograd accumulates each parameter's gradient into ``unsharded_param.grad``
     (in place after the first microbatch);
  2. with a reduce dtype wider than the param dtype, up-casts it into an fp32
     accumulation buffer (``to_accumulated_grad_if_needed`` /
     ``accumulate_unsharded_grad_if_needed``) every microbatch;
  3. on a microbatch that reduces, packs all gradients into one reduce-scatter input
     (``chunk_cat``: the FSDP2 concat) and reduce-scatters it.
So on a microbatch that does *not* reduce (``sync = "last"``), FSDP2 already defers the
concat: step 3 happens once, at the sync microbatch. That is ``defer_concat = True``.

``defer_concat = False`` reproduces FSDP1's eager behaviour as a per-unit knob: on every
non-sync microbatch, right after the unit's post-backward, the unit's gradients are
concatenated into a flat accumulator (``flat += cat(grads)``, one new flat tensor per
microbatch, per-parameter grads freed), and on the sync microbatch the last gradients are
added from the flat accumulator before FSDP packs and reduces. Each element receives the
same additions in the same order ((g1 + g2) + g3 ...; IEEE addition is commutative),
so losses are bitwise equal; only the copies differ. Step 2 (the up-cast) is not
deferrable without changing the numerics (accumulating in bf16), so both modes keep it.
The concat and the restore run under ``FSDP::eager_concat (unit)`` and
``FSDP::eager_restore (unit)`` labels, named like FSDP2's own, so a trace shows their cost
apart (the simulator's calibration reads it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.profiler import record_function
from torch.distributed.fsdp import FSDPModule

from fsdp_runtime import _torch_compat


def get_fsdp_state(module: FSDPModule) -> Any:
    """The unit's FSDP state: one object for all the modules of one ``fully_shard`` call."""
    return module._get_fsdp_state()


def get_mp_policy(module: FSDPModule) -> Any:
    """The ``MixedPrecisionPolicy`` the unit was sharded with: its FSDP state's ``_mp_policy``
    (torch 2.11 to 2.15; 2.15's param groups no longer hold one, they resolve it per parameter)."""
    return get_fsdp_state(module)._mp_policy


def get_param_groups(module: FSDPModule) -> list[Any]:
    """The unit's ``FSDPParamGroup``s, in either torch layout ([Note: torch versions])."""
    return _torch_compat.get_param_groups(get_fsdp_state(module))


def get_dp_meshes(module: FSDPModule) -> list[tuple[Any, int | None, int | None]]:
    """Each of the unit's param groups' data-parallel mesh as FSDP2 holds it, with its shard and
    replicate dims (None: not there): the group's ``mesh_info`` (``FSDPMeshInfo``, ``HSDPMeshInfo``
    or ``DDPMeshInfo``, with ``mesh``, ``shard_mesh_dim`` and ``replicate_mesh_dim`` from torch 2.11
    to 2.15). Not a parameter's ``DTensor.device_mesh``: with tensor parallelism that is FSDP2's
    concatenation of this mesh and the TP mesh."""
    meshes = []
    for group in get_param_groups(module):
        info = group.mesh_info
        meshes.append((info.mesh, getattr(info, "shard_mesh_dim", None), getattr(info, "replicate_mesh_dim", None)))
    return meshes


def get_sharded_params(module: FSDPModule) -> list[nn.Parameter]:
    """The unit's sharded parameters, the ``DTensor`` s an optimizer holds (``FSDPParam.sharded_param``),
    also while the unit is unsharded (FSDP2 then registers the unsharded ones on the modules)."""
    return [fsdp_param.sharded_param for group in get_param_groups(module) for fsdp_param in group.fsdp_params]


def _grad_slots(param_group: Any) -> list[tuple[Any, torch.Tensor, str]]:
    """The (fsdp_param, gradient, slot) triples holding this unit's unsharded grads."""
    slots = []
    for fsdp_param in param_group.fsdp_params:
        if _torch_compat.has_accumulated_grad_slot(fsdp_param) and fsdp_param.unsharded_accumulated_grad is not None:
            slots.append((fsdp_param, fsdp_param.unsharded_accumulated_grad, "accumulated"))
        elif hasattr(fsdp_param, "_unsharded_param") and fsdp_param._unsharded_param.grad is not None:
            slots.append((fsdp_param, fsdp_param._unsharded_param.grad, "grad"))
    return slots


def _label(group: Any, phase: str) -> str:
    """``FSDP::phase (fqn)`` as FSDP2 names its own labels (``FSDPParamGroup._with_fqn``)."""
    with_fqn = getattr(group, "_with_fqn", None)
    return with_fqn(f"FSDP::{phase}") if callable(with_fqn) else f"FSDP::{phase}"


class EagerConcat:
    """FSDP1-style eager concat for one unit: see [Note: concat deferral]."""

    def __init__(self, module: FSDPModule) -> None:
        self.flat: torch.Tensor | None = None
        self.num_eager_concats = 0
        self._groups = get_param_groups(module)
        for group in self._groups:
            group.post_backward = functools.partial(self._post_backward, group, group.post_backward)

    def remove(self) -> None:
        """Give the unit FSDP2's own post-backward back (between steps: nothing accumulated)."""
        if self.flat is not None:
            raise RuntimeError("eager concat: removed with gradients accumulated; switch between optimizer steps")
        for group in self._groups:
            del group.post_backward  # the per-instance wrapper: the class's method shows again

    def _post_backward(self, group: Any, original: Callable[..., Any], *args: Any) -> Any:
        if group.reduce_grads:
            if self.flat is not None:
                with record_function(_label(group, "eager_restore")):
                    self._restore(group)
            return original(*args)
        result = original(*args)
        if _grad_slots(group):
            with record_function(_label(group, "eager_concat")):
                self._concat(group)
        return result

    def _concat(self, group: Any) -> None:
        slots = _grad_slots(group)
        if not slots:
            return
        flat = torch.cat([grad.reshape(-1) for _, grad, _ in slots])
        if self.flat is None:
            self.flat = flat
        else:
            self.flat += flat
        self.num_eager_concats += 1
        for fsdp_param, _, slot in slots:
            if slot == "accumulated":
                fsdp_param.unsharded_accumulated_grad = None
            else:
                fsdp_param._unsharded_param.grad = None

    def _restore(self, group: Any) -> None:
        if self.flat is None:
            return
        offset = 0
        for fsdp_param, grad, _ in _grad_slots(group):
            numel = grad.numel()
            earlier = self.flat[offset : offset + numel].view(grad.shape)
            offset += numel
            if earlier.dtype == grad.dtype:
                grad.add_(earlier)
            elif _torch_compat.has_accumulated_grad_slot(fsdp_param):
                # Reduce dtype wider than the grads: accumulate in the wider dtype, as FSDP2 does.
                fsdp_param.unsharded_accumulated_grad = earlier + grad
                fsdp_param._unsharded_param.grad = None
            else:  # 2.15: the wider gradient is the parameter's own .grad (its grad_dtype left open for it)
                fsdp_param._unsharded_param.grad = earlier + grad
        if offset != self.flat.numel():
            raise RuntimeError(
                "eager concat: the sync microbatch produced gradients for a different set of "
                "parameters than earlier microbatches; use defer_concat = true for this unit"
            )
        self.flat = None


def iter_fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def run_pending_post_backwards(module: nn.Module) -> int:
    """Run the post-backward (the reduce-scatter) of every unit under ``module`` whose backward
    left it pending; returns how many ran.

    torch 2.15's pipeline stages put FSDP2 under manual backward finalization: a unit whose
    post-backward hook did not fire in a microbatch's backward (a stage's root, whose inputs need
    no gradient) is marked pending and reduced only at the step's ``finalize_backward``, whatever
    its sync level. Running the pending ones after each microbatch's backward, as
    ``finalize_backward`` itself does at the end, keeps a unit that syncs every microbatch
    syncing every microbatch. Before 2.15 nothing is ever pending (no such attribute)."""
    ran = 0
    for fsdp_module in iter_fsdp_modules(module):
        for group in get_param_groups(fsdp_module):
            if getattr(group, "_post_backward_pending", False) and group.reduce_grads:
                group.post_backward()
                ran += 1
    return ran


def get_unsharded_sizes(module: FSDPModule) -> list[tuple[int, torch.dtype, torch.dtype]]:
    """Per parameter of the unit: its unsharded element count, the dtype it is all-gathered in
    and the dtype its gradient is reduced in (the mixed-precision policy's, else the parameter's own).
    Read from each ``FSDPParam``'s sharded parameter (a ``DTensor``, whose ``numel`` is the whole
    tensor's) and the unit's policy, so it holds before the first forward resolves FSDP2's dtypes."""
    policy = get_mp_policy(module)
    sizes = []
    for group in get_param_groups(module):
        for fsdp_param in group.fsdp_params:
            param = fsdp_param.sharded_param
            param_dtype = policy.param_dtype or param.dtype
            sizes.append((param.numel(), param_dtype, policy.reduce_dtype or param_dtype))
    return sizes


_RS_GROUPS: dict[str, Any] = {"world": None, "groups": {}}
"""The reduce-scatter process groups this process made (:func:`set_separate_reduce_scatter_group`),
by shard ranks, for the default process group they were made in (held, so that a new world is
told apart from the old one: its groups are made again)."""


def set_separate_reduce_scatter_group(module: FSDPModule, enable: bool) -> None:
    """Give this unit's reduce-scatter a process group of its own (or back the shared one).

    FSDP2's setter (``set_separate_reduce_scatter_group``, torch 2.13) keeps the groups it makes
    only for the length of one call, so every enable after a disable, and every unit set on its
    own, makes another ``dist.new_group``; a warm pool that builds and switches models for hours
    would make one per build and switch. Here each param group's
    ``_set_separate_reduce_scatter_group`` is handed one cache per world instead: one group per
    set of shard ranks in this process, reused by every unit, build and switch."""
    import torch.distributed as dist

    world = dist.distributed_c10d._get_default_group()
    if _RS_GROUPS["world"] is not world:
        _RS_GROUPS.update(world=world, groups={})
    for group in get_param_groups(module):
        group._set_separate_reduce_scatter_group(enable, _RS_GROUPS["groups"])


def count_separate_reduce_scatter_groups() -> int:
    """How many reduce-scatter groups this process has made in its world (tests and benchmarks)."""
    return len(_RS_GROUPS["groups"])


def holds_only_untied_embeddings(module: FSDPModule) -> bool:
    """Every parameter of this unit (not its children) belongs to an ``nn.Embedding`` and to no
    other module: backward never reads them, so the unit need not all-gather them in backward
    (a weight tied to a head is read by the head's backward)."""
    params = [p for group in get_param_groups(module) for p in group.fsdp_params]
    return bool(params) and all(
        isinstance(p._module_info.module, nn.Embedding) and not p._module_info.shared_modules for p in params
    )


def set_unshard_in_backward(module: FSDPModule, enable: bool) -> None:
    """``FSDPModule.set_unshard_in_backward(enable)`` on a unit that holds only untied embeddings
    (:func:`holds_only_untied_embeddings`); every other unit is left as it is (FSDP2's True)."""
    if holds_only_untied_embeddings(module):
        module.set_unshard_in_backward(enable)
