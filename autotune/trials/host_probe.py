"""The host's launch path per block pass, timed on an unprofiled step ([Note: host path probe]).

[Note: host path probe]
On a GPU the host launches a step's kernels ahead of the device, and the step is the longer of
the two ([Note: host path] in :mod:`autotune.sim.host_path`). A trace shows the host's time per
block only as the profiler slowed it, by a factor that varies from run to run (on one H200 the
profiled block forward of one config took 2.9 ms in one run and 4.1 ms in another), and a
device-bound step hides the host's path altogether: once the launch queue is full the host
waits for the device. So the trial times it directly, on its last warm-up step (not measured;
its loss, unchanged, stays in the record), on CUDA only: the device is synchronized before the
first microbatch's forward and again before its backward, so the launch queue is empty when each
starts, and the host's clock is read at each block's pre-forward hook and when each block's
output gradient arrives (the block's backward starting, on autograd's thread). The gaps between
consecutive blocks are the host's path per block pass, hooks included (FSDP2's pre-forward
unshard, post-forward reshard, pre- and post-backward): the median of the first
``NUM_INTERVALS``, which a launch queue of about a thousand kernels holds without blocking
(a Llama block's forward launches ~70). Where the host is the bound the device keeps pace and the
gaps are the host's; where the device is, the first blocks still run before the queue fills.
``metrics.json`` v9 ``host_path_ms`` records it; the calibration uses it in place of the
trace's spans and the profiler's factor. On CPU the host does the work itself (no probe).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fsdp_runtime import ConfigError, find_block_names

NUM_INTERVALS = 4


class HostProbe:
    """Hooks on a model's blocks that read the host's clock (used as a context manager around one step)."""

    def __init__(self, model: nn.Module, synchronize: Callable[[], None]) -> None:
        try:
            names = find_block_names(model)
        except ConfigError:  # a model without repeated blocks (its units listed by hand): nothing to time
            names = []
        self.blocks = [model.get_submodule(name) for name in names]
        self.synchronize = synchronize
        self.forward_times: list[float] = []
        self.backward_times: list[float] = []
        self.armed = False
        self._handles: list[Any] = []

    def __enter__(self) -> HostProbe:
        for block in self.blocks:
            self._handles.append(block.register_forward_pre_hook(self._pre_forward))
            self._handles.append(block.register_forward_hook(self._post_forward))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if self.armed:
            self.forward_times.append(time.perf_counter())

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.armed:  # a recompute under activation checkpointing runs the forward again
            return
        first = next((t for t in _tensors(output) if t.requires_grad), None)
        if first is not None:
            first.register_hook(self._on_grad)

    def _on_grad(self, grad: torch.Tensor) -> None:
        self.backward_times.append(time.perf_counter())

    def before_forward(self) -> None:
        self.synchronize()
        self.armed = True

    def before_backward(self) -> None:
        self.armed = False
        self.synchronize()

    def get_result(self) -> dict[str, float] | None:
        """Milliseconds per block pass (``block_forward``, ``block_backward``); None with fewer than two blocks
        (or none found)."""
        forward = _gaps(self.forward_times)
        backward = _gaps(self.backward_times)
        if not forward or not backward:
            return None
        return {"block_forward": 1e3 * statistics.median(forward), "block_backward": 1e3 * statistics.median(backward)}


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    return []


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])][:NUM_INTERVALS]


def probe_host_path(training: Any, step: int, device: torch.device) -> tuple[float, dict[str, float] | None]:
    """Step ``step`` of ``training`` with the probe (see [Note: host path probe]): its loss and the
    host's path per block pass in ms (None where the model has fewer than two blocks)."""

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with HostProbe(training.model, synchronize) as probe:
        loss = training.step(step, probe=probe)
    return loss, probe.get_result()
