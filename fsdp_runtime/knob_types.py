"""The types of the knob registry (:mod:`fsdp_runtime.knobs`, [Note: the knob registry] there):
what a knob declares and what the search asks of it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from fsdp_runtime.config import RuntimeConfig

__all__ = ["Knob", "Scope", "SearchChoice"]

Scope = Literal["unit", "config", "world"]
"""``unit``: a value per unit; ``config``: one for the config; ``world``: one for the config that
also needs the process group set up for it, so a run measures it in a world started for it (never
switched in place)."""


@dataclass(frozen=True, kw_only=True)
class SearchChoice:
    """What the search asks of a method knob: the Optuna parameter, its choices, the defaults
    trial's answer and the config value each answer sets."""

    param: str
    """The Optuna parameter (its name in studies already written: kept as it was)."""
    choices: tuple[Any, ...]
    default: Any
    """The defaults trial's answer: FSDP2's default."""
    to_field: Callable[[Any], Any] = lambda value: value
    """The config field's value for an answer."""
    devices: tuple[str, ...] = ("cpu", "cuda")
    """The device types on which the search asks it."""
    when: Callable[[dict[str, Any]], bool] | None = None
    """Asked only where the trial's earlier answers make it matter (None: always), e.g. a knob of the
    split-off embeddings unit only where ``root_split`` splits it: no trial answers a question its
    config would ignore."""


@dataclass(frozen=True, kw_only=True)
class Knob:
    """One runtime knob ([Note: the knob registry])."""

    name: str
    """The config field (``RuntimeConfig`` for scope ``config``, ``UnitConfig`` for ``unit``)."""
    scope: Scope
    values: str
    """Its values, in words (what ``autotune validate`` and the docs say)."""
    default: Any
    """The config's default, which leaves FSDP2's own behaviour."""
    sets: str
    """The FSDP2 method or ``fully_shard`` argument that sets it."""
    in_place: bool
    """A sharded model switches it between optimizer steps ([Note: knobs switched in place])."""
    keeps_sum_order: bool
    """It changes when and where sums run, not their order: losses bitwise on CPU."""
    short: str
    """The terminal's name for it."""
    params: tuple[str, ...] = ()
    """The search parameters that ask it (each printed as ``short``)."""
    method: str | None = None
    """The ``FSDPModule`` method only some torch releases have: whether the class has it is the probe."""
    since: str | None = None
    """The first torch release with ``method``."""
    source: str | None = None
    """Where ``since`` comes from."""
    asks: Callable[[RuntimeConfig], bool] | None = None
    """Whether a config asks for what only ``method`` gives (else this torch meets it as it is)."""
    value: Callable[[RuntimeConfig, str], Any] | None = None
    """A method knob: the value set on every unit, from the config and the device type."""
    fsdp_default: Any = None
    """A method knob: FSDP2's own value, which needs no call (a torch without the method has it)."""
    setter: Callable[[Any, Any], None] | None = None
    """A method knob: set ``value`` on one unit's module (not its children)."""
    moves: tuple[Any, ...] = ()
    """The field values the in-job tuner tries, in order."""
    move_devices: tuple[str, ...] = ("cpu", "cuda")
    """The device types on which the in-job tuner tries them."""
    search: SearchChoice | None = None
    devices: tuple[str, ...] = ("cpu", "cuda")
    """The device types ``apply_fsdp`` sets it on; on another one a config asking for it is refused
    in one line (:func:`check_device_supports`)."""
    excludes: tuple[str, ...] = ()
    """Knobs a config may not ask for together with this one (FSDP2 refuses the pair)."""
    sim: str | None = None
    """The simulator's field this knob is priced through (``autotune.sim.knobs.Knobs``); None for a
    method knob of schema 4 on: the simulator reads its value by name (``Knobs.method_values``)."""
    priced: bool = True
    """The simulator prices it (through ``sim`` or by name): ``autotune plan`` and the presearch walk its
    choices; where not, they leave it at FSDP2's default and only the measured search asks it."""
    schema: int = 3
    """The config schema version that added the field; a config leaving every field of a later
    version at its default is written in the earlier one ([Note: the knob registry])."""
    notes: tuple[str, ...] = field(default=())

    def get_reason(self) -> str:
        """Why this torch cannot set it (for a knob with ``method``)."""
        return f"needs torch >= {self.since} ({self.source}); torch {torch.__version__} has no FSDPModule.{self.method}"

    def require(self, module: Any) -> None:
        """``RuntimeError`` naming the field and the release it needs where ``module`` lacks ``method``."""
        if not hasattr(module, self.method):
            raise RuntimeError(f"{self.name}: {self.get_reason()}")
