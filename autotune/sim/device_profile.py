"""A GPU measured on one trial: achieved rates per kind of work, to price any model on it.

[Note: device profile]
A CPU :class:`~autotune.sim.measured.MeasuredProfile` prices one workload (seconds per
segment of *that* model). A GPU :class:`DeviceProfile` prices the *device*: rates that hold
across models and configs of the same architecture family on the same GPU, torch and
precision, fitted by :mod:`autotune.sim.gpu_calibrate` from one trial's kernels
(:mod:`autotune.sim.kernel_costs`) against the work the simulator counts for that trial
(:mod:`autotune.sim.model_work`):

- ``gemm_tflops``: matmul FLOPs (torch's flop counter) per second of GEMM kernels.
- ``attention_forward_tflops`` / ``attention_backward_tflops`` at ``attention_head_dim``:
  causal FLOPs (half the square) per second of fused-attention kernels; another head dim is
  priced through [Note: attention and head dim] (``autotune.sim.hardware``).
- ``elementwise_gbps``: bytes the simulator counts for the memory-bound ops (each op's
  inputs read and outputs written once) per second of every other kernel the model's own
  forward and backward launch (elementwise, loss, the model's casts, memsets), apart for a
  block's forward, a block's backward and the root (embeddings, norm, output head, loss).
- ``copy_gbps``: bytes FSDP2's copies move as the simulator charges them (the cast at
  unshard, ``chunk_cat`` into the reduce input, the reduce output into the sharded grad) per
  second of the kernels its hooks launch.
- ``optimizer_ps_per_element``: the optimizer step's kernels per sharded parameter element.
- ``host_path_us`` (v2): the host's launch path per block pass, unprofiled ([Note: host path]
  in :mod:`autotune.sim.gpu_calibrate`): ``block_forward``, ``block_backward`` (a block's
  FSDP2 hooks included), ``checkpoint_forward`` and ``recompute_full`` (full activation
  checkpointing: its forward, and the forward it runs again in the backward),
  ``selective_forward`` and ``recompute_selective`` (the selective policy runs per op). A
  block pass ends no earlier than its launch path (``Timeline.compute``), so a host-bound
  step is the host's length, not the device's.
- ``host_floor_us``: device idle per call while the host launches (see
  ``AcceleratorSpec.host_floor_us``); with a host path, only ``microbatch`` and ``step``
  (the block passes' idle is the host path's).

Collective links are not in it (a world-1 trial has none): the cluster profile's links price
them. The profile records what it was measured on; ``autotune plan --device-profile`` says
which prices are measured and which come from the datasheet.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from fsdp_runtime import dumps_toml, write_atomic
from fsdp_runtime.errors import AutotuneError

ELEMENTWISE_KEYS = ("block_forward", "block_backward", "root")
HOST_FLOOR_KEYS = ("block_forward", "block_backward", "microbatch", "step")
HOST_PATH_KEYS = (
    "block_forward",
    "block_backward",
    "checkpoint_forward",
    "recompute_full",
    "selective_forward",
    "recompute_selective",
)


class DeviceProfileError(AutotuneError):
    """A device profile file that cannot be read (another kind, a newer version, a bad field)."""


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """Achieved rates of one GPU (see [Note: device profile])."""

    SCHEMA_VERSION: ClassVar[int] = 2
    """v2: ``host_path_us`` (a v1 profile reads with none: its block floors price the host) and
    ``allocator_fragmentation`` (a v1 profile reads without: the plan's default share)."""
    KIND: ClassVar[str] = "device_profile"

    device: str
    """The GPU's name, as the trace's ``deviceProperties`` give it."""
    torch: str
    measured_on: dict[str, Any]
    """What ran: model, config (precision, microbatches, mesh), world size, tokens per microbatch."""
    sources: list[str]
    gemm_tflops: float
    attention_forward_tflops: float
    attention_backward_tflops: float
    attention_head_dim: int
    elementwise_gbps: dict[str, float]
    copy_gbps: float
    optimizer_ps_per_element: float
    host_floor_us: dict[str, float] = field(default_factory=dict)
    host_path_us: dict[str, float] = field(default_factory=dict)
    allocator_fragmentation: float | None = None
    """v2: the largest ``reserved_peak_bytes / trial_peak_bytes - 1`` of the trials (None: none recorded
    both; the plan then takes ``ALLOCATOR_FRAGMENTATION``, [Note: memory margin])."""
    allocator_fragmentation_source: str = ""
    notes: list[str] = field(default_factory=list)
    """What was fitted from what (for the record)."""

    def replace(self, **changes: Any) -> DeviceProfile:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": self.SCHEMA_VERSION, "kind": self.KIND, **dataclasses.asdict(self)}

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        write_atomic(path, dumps_toml(self.to_dict()))
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "device profile") -> DeviceProfile:
        if data.get("kind") != cls.KIND:
            raise DeviceProfileError(
                f"{source}: kind {data.get('kind')!r} is not a {cls.KIND} (write one with `autotune calibrate`)"
            )
        version = data.get("schema_version")
        if not isinstance(version, int) or version > cls.SCHEMA_VERSION:
            raise DeviceProfileError(
                f"{source}: schema_version {version!r}: this autotune reads {cls.KIND} versions up to {cls.SCHEMA_VERSION}"
            )
        body = {k: v for k, v in data.items() if k not in ("schema_version", "kind")}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(body) - names)
        missing = sorted(
            f.name
            for f in dataclasses.fields(cls)
            if f.name not in body and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        if unknown or missing:
            raise DeviceProfileError(
                f"{source}: "
                + "; ".join([*(f"unknown field {k!r}" for k in unknown), *(f"missing field {k!r}" for k in missing)])
            )
        profile = cls(**body)
        profile.check(source)
        return profile

    def check(self, source: str) -> None:
        rates = {
            "gemm_tflops": self.gemm_tflops,
            "attention_forward_tflops": self.attention_forward_tflops,
            "attention_backward_tflops": self.attention_backward_tflops,
            "copy_gbps": self.copy_gbps,
            "optimizer_ps_per_element": self.optimizer_ps_per_element,
            **{f"elementwise_gbps.{k}": self.elementwise_gbps.get(k, 0.0) for k in ELEMENTWISE_KEYS},
        }
        for name, value in rates.items():
            if not isinstance(value, (int, float)) or value <= 0:
                raise DeviceProfileError(f"{source}: {name} = {value!r}: must be a positive number")
        for name, value in self.host_path_us.items():
            if name not in HOST_PATH_KEYS:
                raise DeviceProfileError(f"{source}: host_path_us.{name}: not one of {', '.join(HOST_PATH_KEYS)}")
            if not isinstance(value, (int, float)) or value < 0:
                raise DeviceProfileError(f"{source}: host_path_us.{name} = {value!r}: must be a number >= 0")
        fragmentation = self.allocator_fragmentation
        if fragmentation is not None and (not isinstance(fragmentation, (int, float)) or not 0 <= fragmentation < 1):
            raise DeviceProfileError(
                f"{source}: allocator_fragmentation = {fragmentation!r}: must be a share in [0, 1)"
            )
        if self.attention_head_dim <= 0:
            raise DeviceProfileError(f"{source}: attention_head_dim = {self.attention_head_dim!r}: must be positive")

    @classmethod
    def read(cls, path: str | Path) -> DeviceProfile:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise DeviceProfileError(f"{path}: no such device profile (write one with `autotune calibrate`)") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise DeviceProfileError(f"{path}: not a TOML device profile ({exc})") from None
        return cls.from_dict(data, source=str(path))
