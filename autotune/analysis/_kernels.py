"""What each GPU kernel is: the classes a step's device time is told apart by.

[Note: kernel classes]
A kernel's class comes from its name (the CUDA symbol, or the profiler's ``Memcpy``/
``Memset`` names), checked in this order, first match wins:

- ``communication``: NCCL kernels (``nccl*``).
- ``attention_forward`` / ``attention_backward``: fused attention (cuDNN's SDPA
  ``fprop``/``bprop``, flash, memory-efficient ``fmha``); backward where the name says
  ``bprop``/``bwd``/``backward``, or is one of cuDNN's helpers around the backward
  (``dot_do_o``, ``convert_dq``).
- ``gemm``: matmuls (cuBLAS's ``nvjet``, ``gemm``, CUTLASS, ``xmma``/``wgmma`` kernels).
- ``optimizer``: torch's ``multi_tensor_apply`` kernels (the ``_foreach_*`` ops of a
  foreach optimizer; FSDP2's own copies are not foreach ops).
- ``copy``: copies and casts: ``Memcpy``, ``copy_kernel`` (``.to(dtype)``, ``copy_``),
  ``chunk_cat``, ``cat``/``CatArrayBatchedCopy``, ``split_with_sizes_copy``.
- ``loss``: softmax and NLL kernels (cross-entropy and its backward).
- ``memset``: ``Memset`` and fills (zeroing buffers).
- ``elementwise``: everything else (norms, activations, adds, reductions, RoPE, embedding).

Which part of the step a kernel serves (a unit's forward, FSDP2's unshard, the optimizer)
is not in its name: the simulator's calibration tells it from where the host launched it
(``autotune.sim.kernel_costs``).
"""

from __future__ import annotations

import re

KERNEL_CLASSES = (
    "gemm",
    "attention_forward",
    "attention_backward",
    "elementwise",
    "loss",
    "copy",
    "memset",
    "optimizer",
    "communication",
)
"""Every class, in the order tables list them."""

_RULES = (
    ("communication", re.compile(r"^nccl", re.IGNORECASE)),
    ("attention_backward", re.compile(r"(sdpa|flash|fmha|attention).*(bprop|bwd|backward)|dot_do_o|convert_dq", re.I)),
    ("attention_forward", re.compile(r"sdpa|flash|fmha|attention", re.IGNORECASE)),
    ("gemm", re.compile(r"nvjet|gemm|cutlass|xmma|wgmma|cublas", re.IGNORECASE)),
    ("optimizer", re.compile(r"multi_tensor_apply")),
    ("copy", re.compile(r"^Memcpy|copy_kernel|chunk_cat|CatArray|cat_|split_with_sizes|_copy", re.IGNORECASE)),
    ("loss", re.compile(r"softmax|nll_loss|cross_entropy", re.IGNORECASE)),
    ("memset", re.compile(r"^Memset|FillFunctor", re.IGNORECASE)),
)


def get_kernel_class(name: str) -> str:
    """The class of a kernel named ``name`` (see [Note: kernel classes])."""
    for cls, pattern in _RULES:
        if pattern.search(name):
            return cls
    return "elementwise"
