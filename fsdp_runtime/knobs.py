"""The knob registry: one declaration per runtime knob, from which the rest of the project reads it.

[Note: the knob registry]
Each :class:`Knob` says once what a knob is: the config field (:mod:`fsdp_runtime.config`), its
scope (per unit, per config, or per world: one that needs the process group set up for it), its values and FSDP2's default, the
FSDP2 method or ``fully_shard`` argument that sets it, whether a sharded model switches it in
place, the first torch release that has its method (probed on ``FSDPModule``, never parsed from a
version string), whether it keeps the order of floating-point sums (losses bitwise on CPU), the
terminal's short name for its search parameters, and, for a knob set by a plain ``FSDPModule``
method on every unit, how to set it and what the search and the in-job tuner try.

Read from it:

- the refusals, each in one line: a knob this torch lacks, naming the release that has it
  (:func:`get_unsupported_knobs`; ``fsdp_runtime.knob_checks``, ``autotune validate`` too), and
  one this device cannot have or two FSDP2 refuses together (``fsdp_runtime.knob_checks``);
- which knobs switch in place (``fsdp_runtime.switch``'s ``UNIT_KNOBS_IN_PLACE`` and
  ``CONFIG_KNOBS_IN_PLACE``), and the setters ``apply_fsdp`` and ``switch_config`` call for the
  method knobs (:func:`set_method_knobs`);
- the in-job tuner's moves of the method knobs (``fsdp_runtime.tuning.moves``);
- the search's questions of the method knobs, their defaults-trial answers and the fields they
  set (``autotune.search.space``), and the short names the terminal prints
  (``autotune.search.patterns``);
- the simulator's price of a method knob, through the hook the knob names (``sim``: the name of
  a field of ``autotune.sim.knobs.Knobs``), or for one added since schema 4 its value by name
  (:func:`get_sim_values`), which the simulator's schedule reads;
- the config schema: the fields schema 4 added are written only when set (``schema``), so a
  config that uses none of them stays in the version before, byte for byte.

Adding a method knob: its field in :mod:`fsdp_runtime.config`, its declaration here (with its
setter, its question and its moves), and its price in ``autotune/sim/schedule.py``; what the
simulator or the tuner leaves out goes in its ``notes``.

The unit knobs FSDP2 sets per unit from lists, gradient-sync state or wrappers (prefetch, reshard
after forward and backward, the sync level, concat deferral) and the structural ones (mesh, units,
checkpointing, precision) are declared here for what they are; their code stays where their
mechanics are (:mod:`fsdp_runtime.apply`, :mod:`fsdp_runtime.accumulation`,
:mod:`fsdp_runtime.switch`), since each is set its own way.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.fsdp import FSDPModule

from fsdp_runtime import _fsdp_private
from fsdp_runtime.config import RuntimeConfig
from fsdp_runtime.knob_types import Knob, SearchChoice

__all__ = [
    "KNOBS",
    "Knob",
    "SearchChoice",
    "get_added_knobs",
    "get_knob",
    "get_method_knobs",
    "get_sim_values",
    "get_unsupported_knobs",
    "require_method",
    "set_method_knobs",
    "set_reduce_scatter_max_input_buffers",
    "set_unshard_async",
    "use_unshard_async",
]


def set_unshard_async(module: Any, enabled: bool) -> None:
    """``_set_unshard_async_op`` on ``module`` and its FSDP children; see [Note: async unshard on CPU]."""
    require_method(module, "unshard_async")
    module._set_unshard_async_op(enabled)


def set_reduce_scatter_max_input_buffers(module: Any, num_buffers: int) -> None:
    """Cap this unit's reduce-scatter input buffers in flight (not its children's).

    Without the setter (torch < 2.13) FSDP2 keeps one buffer, so ``1`` is met as it is."""
    if num_buffers == 1 and not hasattr(module, _BY_NAME["reduce_scatter_max_input_buffers"].method):
        return  # before the setter FSDP2 kept exactly one buffer
    require_method(module, "reduce_scatter_max_input_buffers")
    module.set_reduce_scatter_max_input_buffers(num_buffers, recurse=False)


def set_process_group_comm_buffers(module: Any, enable: bool) -> None:
    """Staging buffers from the process group's allocator on this unit, with sum-only reductions
    (NCCL's zero-copy needs them). ``False`` needs no call: the knob is never switched in place,
    and a model other code sharded (``adopt_fsdp`` sets every knob) keeps its own reductions and
    comms (torchtitan turns sum-only reductions on itself, which gloo needs for its divide factor)."""
    if not enable:
        return
    require_method(module, "process_group_comm_buffers")
    module.set_force_sum_reduction_for_comms(True)
    module.set_allocate_memory_from_process_group_for_comm(True)


def set_symmetric_memory(module: Any, enable: bool) -> None:
    """Staging buffers in NCCL symmetric memory on this unit, sum-only reductions first so that its
    reduce-scatter uses them too (FSDP2 picks the symmetric reduce-scatter only for sums). FSDP2
    has no off switch: ``False`` is FSDP2's own state and needs no call."""
    if not enable:
        return
    require_method(module, "symmetric_memory")
    module.set_force_sum_reduction_for_comms(True)
    module.set_symm_mem_for_comm("NCCL")


def use_unshard_async(config: RuntimeConfig, device_type: str) -> bool:
    """Whether ``config`` issues all-gathers async on ``device_type``: "auto" is on for CPU where this torch has the setter ([Note: async unshard on CPU])."""
    can_async = hasattr(FSDPModule, _BY_NAME["unshard_async"].method)
    return config.unshard_async == "on" or (config.unshard_async == "auto" and device_type == "cpu" and can_async)


KNOBS: tuple[Knob, ...] = (
    Knob(
        name="reshard_after_forward",
        scope="unit",
        values="true, false, an int (a group of that many ranks), or none (auto)",
        default=None,
        sets="fully_shard(reshard_after_forward=...); FSDPModule.set_reshard_after_forward",
        in_place=True,  # as a bool or None; an int is structural
        keeps_sum_order=True,
        short="raf",
        params=("reshard_after_forward",),
        sim="reshard_after_forward",
    ),
    Knob(
        name="forward_prefetch",
        scope="unit",
        values="unit names, or none for FSDP2's own",
        default=None,
        sets="FSDPModule.set_modules_to_forward_prefetch",
        in_place=True,
        keeps_sum_order=True,
        short="fwd",
        params=("forward_prefetch",),
        sim="forward_prefetch",
    ),
    Knob(
        name="backward_prefetch",
        scope="unit",
        values="unit names, or none for FSDP2's own",
        default=None,
        sets="FSDPModule.set_modules_to_backward_prefetch",
        in_place=True,
        keeps_sum_order=True,
        short="bwd",
        params=("backward_prefetch",),
        sim="backward_prefetch",
    ),
    Knob(
        name="unshard_async",
        scope="config",
        values="auto (on for CPU), on, off",
        default="auto",
        sets="FSDPModule._set_unshard_async_op",
        in_place=True,
        keeps_sum_order=True,
        short="async",
        params=("unshard_async",),
        method="_set_unshard_async_op",
        since="2.6",
        source="pytorch #135523",
        asks=lambda config: config.unshard_async == "on",
        value=use_unshard_async,
        fsdp_default=False,
        setter=set_unshard_async,
        moves=("on", "off"),
        move_devices=("cuda",),
        search=SearchChoice(param="unshard_async", choices=("off", "on"), default="off", devices=("cpu",)),
        sim="unshard_async",
    ),
    Knob(
        name="reduce_scatter_max_input_buffers",
        scope="config",
        values="an int >= 1, or none (FSDP2's 1)",
        default=None,
        sets="FSDPModule.set_reduce_scatter_max_input_buffers",
        in_place=True,
        keeps_sum_order=True,
        short="rsbuf",
        params=("reduce_scatter_buffers",),
        method="set_reduce_scatter_max_input_buffers",
        since="2.13",
        source="pytorch #186000",
        asks=lambda config: config.reduce_scatter_max_input_buffers not in (None, 1),  # 1: every torch
        value=lambda config, device_type: config.reduce_scatter_max_input_buffers or 1,
        fsdp_default=1,
        setter=set_reduce_scatter_max_input_buffers,
        moves=(2, None),
        search=SearchChoice(
            param="reduce_scatter_buffers",
            choices=(1, 2),
            default=1,
            to_field=lambda buffers: None if buffers == 1 else buffers,
        ),
        sim="max_rs_buffers",
    ),
    Knob(
        name="separate_reduce_scatter_group",
        scope="config",
        values="true, false (FSDP2's: the all-gather's group)",
        default=False,
        sets="FSDPModule.set_separate_reduce_scatter_group",
        in_place=True,
        keeps_sum_order=True,  # the same reduce-scatter over the same ranks, on another communicator
        short="rsgroup",
        params=("separate_reduce_scatter_group",),
        method="set_separate_reduce_scatter_group",
        since="2.13",
        source="pytorch #186335",
        asks=lambda config: config.separate_reduce_scatter_group,
        value=lambda config, device_type: config.separate_reduce_scatter_group,
        fsdp_default=False,
        setter=_fsdp_private.set_separate_reduce_scatter_group,
        moves=(True, False),
        search=SearchChoice(param="separate_reduce_scatter_group", choices=(False, True), default=False),
        schema=4,
    ),
    Knob(
        name="unshard_in_backward",
        scope="config",
        values="true (FSDP2's), false: units holding only untied embeddings skip their backward all-gather",
        default=True,
        sets="FSDPModule.set_unshard_in_backward, on the units holding only untied nn.Embedding modules",
        in_place=True,
        keeps_sum_order=True,  # the same gradient from the same indices; only the all-gather goes
        short="embag",
        params=("unshard_in_backward",),
        method="set_unshard_in_backward",
        since="2.6",
        source="pytorch #137922",
        asks=lambda config: not config.unshard_in_backward,
        value=lambda config, device_type: config.unshard_in_backward,
        fsdp_default=True,
        setter=_fsdp_private.set_unshard_in_backward,
        search=SearchChoice(
            param="unshard_in_backward",
            choices=(True, False),
            default=True,
            when=lambda params: params.get("root_split") == "split",  # else no unit holds only embeddings
        ),
        schema=4,
        priced=False,
        notes=("not moved by the in-job tuner, not priced by the simulator (it models no split-off embeddings)",),
    ),
    Knob(
        name="process_group_comm_buffers",
        scope="world",
        values="true, false (FSDP2's: buffers from the caching allocator)",
        default=False,
        sets="FSDPModule.set_allocate_memory_from_process_group_for_comm + set_force_sum_reduction_for_comms",
        in_place=False,
        keeps_sum_order=False,  # sum-only: the gradient's divide runs outside the collective
        short="pgmem",
        params=("process_group_comm_buffers",),
        method="set_allocate_memory_from_process_group_for_comm",
        since="2.8",
        source="pytorch #150564",
        asks=lambda config: config.process_group_comm_buffers,
        value=lambda config, device_type: config.process_group_comm_buffers,
        fsdp_default=False,
        setter=set_process_group_comm_buffers,
        search=SearchChoice(
            param="process_group_comm_buffers", choices=(False, True), default=False, devices=("cuda",)
        ),
        devices=("cuda",),
        excludes=("symmetric_memory",),
        priced=False,  # the simulator has no model of NCCL's buffers
        schema=4,
    ),
    Knob(
        name="symmetric_memory",
        scope="world",
        values="true, false (FSDP2's; no off switch once set)",
        default=False,
        sets="FSDPModule.set_symm_mem_for_comm + set_force_sum_reduction_for_comms",
        in_place=False,
        keeps_sum_order=False,  # sum-only reductions
        short="symm",
        params=("symmetric_memory",),
        method="set_symm_mem_for_comm",
        since="2.12",
        source="pytorch #176613",
        asks=lambda config: config.symmetric_memory,
        value=lambda config, device_type: config.symmetric_memory,
        fsdp_default=False,
        setter=set_symmetric_memory,
        search=SearchChoice(
            param="symmetric_memory",
            choices=(False, True),
            default=False,
            devices=("cuda",),
            when=lambda params: not params.get("process_group_comm_buffers"),  # FSDP2 refuses the pair
        ),
        devices=("cuda",),
        excludes=("process_group_comm_buffers",),
        priced=False,  # the simulator has no model of NCCL's buffers
        schema=4,
    ),
    Knob(
        name="mixed_precision.reduce_dtype",
        scope="config",
        values="float32, bfloat16, float16, float64, or none (the params' dtype)",
        default=None,
        sets="fully_shard(mp_policy=MixedPrecisionPolicy(reduce_dtype=...))",
        in_place=False,
        keeps_sum_order=False,
        short="reduce",
        params=("reduce_dtype",),
        sim="reduce_dtype",
    ),
    Knob(
        name="sync",
        scope="unit",
        values="every, replica_last (HSDP), last",
        default="every",
        sets="FSDPModule.set_requires_gradient_sync / set_requires_all_reduce, per microbatch",
        in_place=True,
        keeps_sum_order=False,  # a gradient summed over microbatches before its reduce-scatter
        short="nosync",
        params=("nosync_blocks",),
        sim="sync",
    ),
    Knob(
        name="reshard_after_backward",
        scope="unit",
        values="true, false (keep the unsharded parameters between microbatches)",
        default=True,
        sets="FSDPModule.set_reshard_after_backward, per microbatch",
        in_place=True,
        keeps_sum_order=True,
        short="keep",
        params=("keep_unsharded",),
        sim="reshard_after_backward",
    ),
    Knob(
        name="defer_concat",
        scope="unit",
        values="true (FSDP2's), false (concat each microbatch's gradients eagerly)",
        default=True,
        sets="fsdp_runtime's EagerConcat around the param groups' post_backward",
        in_place=True,
        keeps_sum_order=True,
        short="defer",
        params=("defer_concat",),
        sim="defer_concat",
    ),
    Knob(
        name="modules",
        scope="unit",
        values="the blocks one fully_shard call holds",
        default=None,
        sets="fully_shard([modules])",
        in_place=False,
        keeps_sum_order=True,
        short="group",
        params=("blocks_per_unit",),
        sim="unit_blocks",
    ),
    Knob(
        name="activation_checkpointing",
        scope="unit",
        values="none, selective, full",
        default="none",
        sets="torch.utils.checkpoint around the unit's modules, before fully_shard",
        in_place=False,
        keeps_sum_order=True,
        short="ac",
        params=("ac_units",),
        sim="checkpointing",
    ),
    Knob(
        name="mesh",
        scope="config",
        values="fsdp, or hsdp with replicate x shard",
        default="fsdp",
        sets="fully_shard(mesh=init_device_mesh(...))",
        in_place=False,
        keeps_sum_order=False,  # other reduction groups
        short="mesh",
        sim="hsdp",
    ),
)
"""Every knob; the method knobs in the order the in-job tuner tries their moves (the search asks
the parameters of those it had before the registry where it always has: studies already written
keep their sequences)."""
_BY_NAME = {knob.name: knob for knob in KNOBS}


def get_knob(name: str) -> Knob:
    """The knob of config field ``name`` (``KeyError`` where none)."""
    return _BY_NAME[name]


def get_method_knobs() -> list[Knob]:
    """The knobs a plain ``FSDPModule`` method sets on every unit (with ``setter``), in order."""
    return [knob for knob in KNOBS if knob.setter is not None]


def get_added_knobs(version: int) -> list[Knob]:
    """The knobs whose fields schema ``version`` added."""
    return [knob for knob in KNOBS if knob.schema == version]


def get_sim_values(config: RuntimeConfig, device_type: str) -> tuple[tuple[str, Any], ...]:
    """The values of the method knobs the simulator reads by name (those with no field of their own there)."""
    return tuple((k.name, k.value(config, device_type)) for k in get_method_knobs() if k.sim is None)


def get_unsupported_knobs(fsdp_module_class: type = FSDPModule) -> dict[str, str]:
    """The config fields this torch cannot set, each with one line saying why (empty: all of them work)."""
    return {k.name: k.get_reason() for k in KNOBS if k.method is not None and not hasattr(fsdp_module_class, k.method)}


def require_method(module: Any, name: str) -> None:
    """``RuntimeError`` naming the field and the release it needs where ``module`` lacks knob ``name``'s method."""
    _BY_NAME[name].require(module)


def set_method_knobs(
    module: Any, config: RuntimeConfig, device_type: str, *, before: RuntimeConfig | None = None, every: bool = False
) -> None:
    """Set every method knob of ``config`` on one unit's ``module``: those not at FSDP2's own value
    (``apply_fsdp``); switching from ``before``, those either config sets (``switch_config``: a knob
    both leave at FSDP2's value is never called, so a torch without its method is never asked);
    ``every``, each one this torch can set, FSDP2's value included (``adopt_fsdp``: a model other
    code sharded may have any)."""
    for knob in get_method_knobs():
        value = knob.value(config, device_type)
        was = knob.fsdp_default if before is None else knob.value(before, device_type)
        can = knob.method is None or hasattr(module, knob.method)
        if value != knob.fsdp_default or was != knob.fsdp_default or (every and can):
            knob.setter(module, value)
