"""The search's questions of the registry's method knobs ([Note: the knob registry] in :mod:`fsdp_runtime.knobs`).

A method knob (one ``FSDPModule`` method sets it on every unit) carries its own question: the
Optuna parameter, its choices, the defaults trial's answer, the devices it is asked on and the
config value each answer sets. The space asks it where this torch can set it (``unsupported``: the
fields ``fsdp_runtime.get_unsupported_knobs`` names); ``SearchSpace.notes`` says which were not.
"""

from __future__ import annotations

from typing import Any

import optuna

from fsdp_runtime import KNOBS, Knob

__all__ = ["ask", "get_default_answers", "get_method_fields", "get_notes", "is_asked"]


def is_asked(knob: Knob, device_type: str, unsupported: set[str], params: dict[str, Any] | None = None) -> bool:
    """``knob``'s question is asked: it has one, on this device, this torch can set it, and the
    trial's earlier answers ``params`` make it matter (``SearchChoice.when``; None: not checked)."""
    if knob.search is None or device_type not in knob.search.devices or knob.name in unsupported:
        return False
    return params is None or knob.search.when is None or knob.search.when(params)


def get_default_answers(knob: Knob, device_type: str, unsupported: set[str], params: dict[str, Any]) -> dict[str, Any]:
    """The defaults trial's answer to ``knob``'s question, where it is asked (FSDP2's default)."""
    return {knob.search.param: knob.search.default} if is_asked(knob, device_type, unsupported, params) else {}


def ask(
    trial: optuna.Trial, knob: Knob, device_type: str, unsupported: set[str], params: dict[str, Any]
) -> dict[str, Any]:
    """``knob``'s answer in ``trial``, where it is asked after the answers ``params``."""
    if not is_asked(knob, device_type, unsupported, params):
        return {}
    return {knob.search.param: trial.suggest_categorical(knob.search.param, list(knob.search.choices))}


def get_method_fields(params: dict[str, Any]) -> dict[str, Any]:
    """The config fields the method knobs' answers in ``params`` set (one not asked keeps the config's default)."""
    return {k.name: k.search.to_field(params[k.search.param]) for k in KNOBS if k.search and k.search.param in params}


def get_notes(device_type: str, unsupported: set[str]) -> list[str]:
    """The FSDP2 methods the space asks on ``device_type``, then one line per knob asked on other
    devices only, then the registry's notes of those asked on it (``unsupported``: the fields this
    torch cannot set, said elsewhere)."""
    asked = [k.name for k in KNOBS if k.method and is_asked(k, device_type, unsupported)]
    lines = [f"FSDP2 methods searched: {', '.join(asked) or 'none'}"]
    for knob in KNOBS:
        if knob.search is None or knob.name in unsupported:
            continue
        if device_type not in knob.search.devices:
            lines.append(f"{knob.name} not searched: asked on {' and '.join(knob.search.devices)} only")
        else:
            lines += [f"{knob.name}: {note}" for note in knob.notes]
    return lines
