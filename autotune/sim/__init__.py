"""The FSDP2 step simulator behind ``autotune plan``.

Modules in data-flow order: :mod:`~autotune.sim.workload` (the model's FLOPs, bytes and
activation memory per microbatch, traced on fake tensors) -> :mod:`~autotune.sim.hardware`
(a cluster profile's prices: [Note: collective cost model]) -> :mod:`~autotune.sim.costs`
(per-unit durations and sizes under one mesh) -> :mod:`~autotune.sim.knobs` (a runtime
config indexed by unit) -> :mod:`~autotune.sim.timeline` (streams, links, host, memory
ledger) -> :mod:`~autotune.sim.schedule` ([Note: FSDP2 step schedule]) ->
:mod:`~autotune.sim.predict` (:func:`simulate`). Imports only ``fsdp_runtime``, ``profiles``
and torch: the search stage may import this one, never the reverse.
"""

from autotune.sim.hardware import Hardware, SimError
from autotune.sim.knobs import Knobs, resolve_knobs
from autotune.sim.predict import Simulator, StepPrediction, UnitPrediction, simulate
from autotune.sim.workload import ModelWork, get_model_work

__all__ = [
    "Hardware",
    "Knobs",
    "ModelWork",
    "SimError",
    "Simulator",
    "StepPrediction",
    "UnitPrediction",
    "get_model_work",
    "resolve_knobs",
    "simulate",
]
