"""The refusals the knob registry (:mod:`fsdp_runtime.knobs`) makes of a config before it is applied,
each in one line naming the field: a knob the installed torch lacks (with the release that has it),
one the device cannot have, two that FSDP2 refuses together."""

from __future__ import annotations

from fsdp_runtime.config import RuntimeConfig
from fsdp_runtime.errors import ConfigError
from fsdp_runtime.knobs import KNOBS, get_knob, get_unsupported_knobs

__all__ = ["check_device_supports", "check_torch_supports"]


def check_torch_supports(config: RuntimeConfig, *, source: str | None = None) -> None:
    """Refuse a knob this torch cannot set, naming the field and the torch it needs (never a silent
    no-op); ``source``: the file ``config`` came from, named in the error."""
    for name, reason in get_unsupported_knobs().items():
        knob = get_knob(name)
        if knob.asks is not None and knob.asks(config):
            raise ConfigError(name, reason, fix="unset it, or upgrade torch", source=source)


def check_device_supports(config: RuntimeConfig, device_type: str) -> None:
    """Refuse a knob ``config`` asks for that ``device_type`` cannot have (a CUDA/NCCL-only one on CPU
    and gloo), and two knobs FSDP2 refuses together, each in one line naming the field."""
    asked = [k for k in KNOBS if k.asks is not None and k.asks(config)]
    for knob in asked:
        if device_type not in knob.devices:
            raise ConfigError(
                knob.name,
                f"{knob.sets} needs a {' or '.join(knob.devices)} device; this model is on {device_type}",
                fix="unset it on this device",
            )
        clash = next((k.name for k in asked if k.name in knob.excludes), None)
        if clash is not None:
            raise ConfigError(
                knob.name, f"cannot be set together with {clash} (FSDP2 refuses the pair)", fix="unset one"
            )
